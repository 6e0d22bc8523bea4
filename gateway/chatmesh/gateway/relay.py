"""The one reader of a turn stream, that every surface relaying or collecting a reply consumes.

A turn stream (SendTurn, AttachTurn or RegenerateTurn) whose first event has arrived is read to its end by
`Relay.pump`, one event at a time, each handed to a `Framing` whose bytes are written (and awaited, so a slow
client back-pressures the gRPC stream) before the next is read:

- a delta's text goes through the output sanitiser (chatmesh.gateway.sanitise); what it holds back is flushed
  before a tool call (a call follows all of the text) and before the final event. A delta stays a (sequence,
  text) pair: it is the hot path, one per engine flush per stream;
- every other event becomes a reply event (chatmesh.gateway.events.reply_event): past here no protobuf;
- the bookkeeping metering needs (chatmesh.gateway.metering) is kept here only: the first turn.started is passed
  to `on_started` (the reservation settles to the prompt's size, or to 0 for a replay), the final event decides
  the Outcome, and `finish`, once the stream is over whichever way (final event, client gone, error, shutdown),
  cancels the call (a no-op once it finished; otherwise it stops the turn), completes the Outcome with what
  turn.started said and calls `on_end` (the stream slot's release and the settlement) exactly once.

A stream that ends without a final event is written as `Framing.failed`; a gRPC error propagates to the consumer,
which knows what its client should see. Consumers: `sse.TurnRelay` (an HTTP text/event-stream response:
chatmesh's own `turn.*` events, or the OpenAI surface's framings) and `openai.replies.collect` (a non-streaming
reply: a framing that keeps the pieces and writes nothing).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol

import grpc

from chatmesh.gateway import events
from chatmesh.gateway.sanitise import Sanitiser
from chatmesh.v1 import chat_pb2

# What the three turn streams yield; each wraps one TurnEvent.
STREAM_MESSAGES = (chat_pb2.SendTurnResponse, chat_pb2.AttachTurnResponse, chat_pb2.RegenerateTurnResponse)
NO_OUTCOME = "the turn stream ended without an outcome"

TurnCall = grpc.aio.UnaryStreamCall[Any, Any]
OnEnd = Callable[[events.Outcome], Awaitable[None]]
OnStarted = Callable[[bool, int | None], Awaitable[None]]  # (replayed, the prompt's size if reported)
Write = Callable[[bytes], Awaitable[None]]


class Framing(Protocol):
    """What each relayed piece of a reply becomes as bytes. `delta` is the hot path (one call per delta)."""

    def delta(self, sequence: int, text: str) -> bytes: ...

    async def event(self, event: events.ReplyEvent) -> bytes:
        """Any event but a delta (started, tool calls and the final ones); may await work its bytes depend on."""
        ...

    def failed(self, sequence: int, message: str, retryable: bool) -> bytes:
        """The stream broke without a final event (the turn failed)."""
        ...

    async def end(self, outcome: events.Outcome) -> bytes:
        """Bytes to write after the final event (b"" for none); may await work that must precede them."""
        ...


async def noop_started(replayed: bool, prompt_tokens: int | None) -> None:
    return None


async def _noop_end(outcome: events.Outcome) -> None:
    return None


class Relay:
    """One turn stream read to its end (module docstring)."""

    def __init__(self, call: TurnCall, first: chat_pb2.TurnEvent, sanitiser: Sanitiser,
                 on_started: OnStarted = noop_started, on_end: OnEnd = _noop_end) -> None:
        self.call = call
        self.first = first
        self._sanitiser = sanitiser
        self._on_started = on_started
        self._on_end = on_end
        self._started: events.ReplyStarted | None = None
        self._finished = False
        self.outcome = events.Outcome(None, 0)
        self.final_written = False  # the final event's bytes were written
        self.last_sequence = 0  # of the last event read before the current one

    @property
    def generates(self) -> bool:
        """Whether this stream is the one its turn is generated for (not a retry's attach, not a replay)."""
        first = self.first
        return first.WhichOneof("kind") == "started" and not first.started.replayed

    async def pump(self, framing: Framing, write: Write, on_text: Callable[[], None] | None = None) -> None:
        """Reads the stream to its final event (or its end), writing what `framing` makes of each piece;
        `on_text` is called after each delta's text is written (not after a held-back tail). gRPC errors propagate."""
        pb = self.first
        while True:
            if pb.WhichOneof("kind") == "delta":
                text = self._sanitiser.feed(pb.delta.text)
                if text:
                    await write(framing.delta(pb.sequence, text))
                    if on_text is not None:
                        on_text()
            else:
                event = events.reply_event(pb)
                if isinstance(event, events.ReplyStarted) and self._started is None:
                    self._started = event
                    await self._on_started(event.replayed, event.prompt_tokens)
                final = event.kind.is_final
                if final or isinstance(event, events.ReplyToolCall):  # a call follows all of the text
                    tail = self._sanitiser.flush()
                    if tail:
                        await write(framing.delta(self.last_sequence, tail))
                if isinstance(event, events.ReplyEnd):
                    self.outcome = events.outcome_of(event)
                    await write(await framing.event(event))
                    self.final_written = True
                    return
                await write(await framing.event(event))
            self.last_sequence = pb.sequence
            message: object = await self.call.read()
            if not isinstance(message, STREAM_MESSAGES):
                await write(framing.failed(self.last_sequence, NO_OUTCOME, True))
                return
            pb = message.event

    async def finish(self) -> events.Outcome:
        """Ends the stream (module docstring) and reports its Outcome to `on_end`, once."""
        self.call.cancel()
        started = self._started
        if started is not None:
            self.outcome = replace(self.outcome, replayed=started.replayed,
                                   started_prompt_tokens=started.prompt_tokens)
        if not self._finished:
            self._finished = True
            await self._on_end(self.outcome)
        return self.outcome
