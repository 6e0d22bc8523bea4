"""The SSE relay: one gRPC turn stream (SendTurn, AttachTurn or RegenerateTurn) -> one text/event-stream response.

How it works. `open_relay` starts the gRPC call and awaits its FIRST event before any HTTP header is sent, so an
error the chat service raises up front (unknown conversation, reused turn id, bad argument) is still answered as
a JSON error with its proper status. Then `TurnRelay` (a raw ASGI response) runs two tasks per stream:

- the pump reads one TurnEvent at a time and awaits `send` for each, so a slow client back-pressures the gRPC
  stream instead of growing a buffer; deltas go through the output sanitiser; a final event ends the stream;
- the watcher awaits the client's `http.disconnect` and, while the model is silent for `heartbeat_s`, writes an
  SSE comment so proxies and browsers keep the connection open.

Whichever ends first ends the other. On disconnect the gRPC call is cancelled, which cancels the turn in the chat
service (I5: the partial reply is stored as stopped), except when this relay wrote none of the reply's text to
its client (the stream was cut at the response headers, the SDK's retry is coming): then the relay of the
stream a new turn is generated for (its `turn.started` not a replay) first asks chat to release the turn (`release`: StopTurn with release), so nothing is stored for it and the
retry generates it (or, if the retry is already following it, it goes on for that retry) instead of replaying an
empty stopped reply. Each ASGI `send` writes one whole frame, so the two tasks never interleave bytes. On gateway
shutdown `Relays.drain` gives open streams `grace_s` to finish, then ends them the same way.

Framing: what each event becomes on the wire is a `Framing` (chatmesh's own `turn.*` events by default; the
OpenAI-compatible surface passes its own, `chat.completion.chunk` or `response.*` events), so both surfaces share
one relay, its back-pressure, disconnect handling, heartbeats, drain and metering.

Resume: the SSE id is the TurnEvent sequence. The sanitiser may hold back the start of a Markdown construct (a `[`
that could open a link) at the end of a delta; a client that reconnects right there loses that held text, never
receives an unsanitised image or link.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol

import grpc
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from chatmesh.gateway import events
from chatmesh.gateway.errors import ApiError, http_for_grpc
from chatmesh.gateway.sanitise import Sanitiser
from chatmesh.gateway.observe import START_KEY
from chatmesh.mesh import logs, metrics
from chatmesh.mesh.errors import PROMPT_TOKENS_TRAILER
from chatmesh.v1 import chat_pb2

log = logs.get("chatmesh.gateway.sse")

# Headers that stop proxies (nginx's X-Accel-Buffering) and intermediaries (no-transform) from buffering or
# compressing the stream, and browsers from caching it.
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache, no-store, no-transform"),
    (b"x-accel-buffering", b"no"),
]


# What the three turn streams yield; each wraps one TurnEvent.
_STREAM_MESSAGES = (chat_pb2.SendTurnResponse, chat_pb2.AttachTurnResponse, chat_pb2.RegenerateTurnResponse)


TurnCall = grpc.aio.UnaryStreamCall[Any, Any]
OnEnd = Callable[[events.Outcome], Awaitable[None]]
OnStarted = Callable[[bool, int | None], Awaitable[None]]  # (replayed, the prompt's size if reported)
Release = Callable[[], Awaitable[object]]  # asks chat to release the relay's turn (its client saw none of it)
RELEASE_TIMEOUT_S = 2.0


class PromptOverAllowance(ApiError):
    """Chat refused the turn's prompt as larger than its allowance (RESOURCE_EXHAUSTED with the
    `chatmesh-prompt-tokens` trailer); the edge turns it into the limit's answer (chatmesh.gateway.metering)."""

    def __init__(self, prompt_tokens: int, message: str) -> None:
        super().__init__(429, "rate_limited", message)
        self.prompt_tokens = prompt_tokens


def _prompt_tokens_trailer(err: grpc.aio.AioRpcError) -> int | None:
    # grpc.aio hands a Metadata of (key, value) pairs (its stubs claim objects with .key and .value)
    metadata: Any = err.trailing_metadata()
    for key, value in metadata or ():
        if key == PROMPT_TOKENS_TRAILER:
            text = value.decode() if isinstance(value, bytes) else str(value)
            return int(text) if text.isdigit() else None
    return None


async def _noop_started(replayed: bool, prompt_tokens: int | None) -> None:
    return None


class Framing(Protocol):
    """How turn events are written as SSE bytes. `delta` is the hot path (one call per relayed delta)."""

    def delta(self, sequence: int, text: str) -> bytes: ...

    async def event(self, event: chat_pb2.TurnEvent, kind: events.SseEvent) -> bytes:
        """Any event but a delta (started and the final ones); may await work its bytes depend on."""
        ...

    def failed(self, sequence: int, message: str, retryable: bool) -> bytes:
        """The stream broke without a final event (the turn failed)."""
        ...

    async def end(self, outcome: events.Outcome) -> bytes:
        """Bytes to write after the final event (b"" for none); may await work that must precede them."""
        ...


class ChatmeshFraming:
    """chatmesh's own events: `id: <sequence>`, `event: turn.<kind>`, `data: <JSON>` (chatmesh.gateway.events).
    `turn.completed` also carries `ttft_ms`, the time to first text as this edge saw it (the web page shows it)."""

    def __init__(self) -> None:
        self.ttft_s: float | None = None  # set by the relay when it writes the first text

    def delta(self, sequence: int, text: str) -> bytes:
        return events.delta_frame(sequence, text)

    async def event(self, event: chat_pb2.TurnEvent, kind: events.SseEvent) -> bytes:
        data = events.data_of(event, kind)
        if kind is events.SseEvent.COMPLETED and self.ttft_s is not None:
            data["ttft_ms"] = round(self.ttft_s * 1000, 1)
        return events.frame(event.sequence, kind, data)

    def failed(self, sequence: int, message: str, retryable: bool) -> bytes:
        return events.failed_frame(sequence, message, retryable)

    async def end(self, outcome: events.Outcome) -> bytes:
        return b""


class Open(Protocol):
    """Something streaming a turn that shutdown ends: a relay, or a turn followed for nobody in particular (the
    OpenAI surface's background responses)."""

    def end(self) -> None: ...


class Relays:
    """The open relays of one gateway process, so shutdown can end them."""

    def __init__(self) -> None:
        self.open: set[Open] = set()

    async def drain(self, grace_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.open and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for relay in list(self.open):
            relay.end()


async def first_event(call: TurnCall) -> chat_pb2.TurnEvent:
    """Awaits the first event of `call`; a gRPC error before it is raised as an ApiError (nothing was sent)."""
    try:
        first: object = await call.read()
    except grpc.aio.AioRpcError as err:
        if err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and (size := _prompt_tokens_trailer(err)) is not None:
            raise PromptOverAllowance(size, err.details() or "prompt over its allowance") from None
        raise ApiError.from_rpc(err) from None
    if not isinstance(first, _STREAM_MESSAGES):
        raise ApiError(503, "unavailable", "the chat service ended the turn stream without an event")
    return first.event


async def next_event(call: TurnCall) -> chat_pb2.TurnEvent | None:
    """The next event of a turn stream, None when it ended without one (gRPC errors propagate)."""
    message: object = await call.read()
    return message.event if isinstance(message, _STREAM_MESSAGES) else None


async def open_relay(call: TurnCall, *, sanitiser: Sanitiser, heartbeat_s: float, relays: Relays,
                     on_end: OnEnd, on_started: OnStarted = _noop_started,
                     ttft: metrics.HistogramChild | None = None, release: Release | None = None) -> TurnRelay:
    """Awaits the first event of `call` (see `first_event`), then relays the stream in chatmesh's own events."""
    return TurnRelay(call, await first_event(call), sanitiser, heartbeat_s, relays, on_end, on_started, ttft=ttft,
                     release=release)


class TurnRelay(Response):
    """A raw ASGI response relaying one turn stream; see the module docstring. (A Response subclass only so
    routes can return it; it writes its own headers and body.)"""

    def __init__(self, call: TurnCall, first: chat_pb2.TurnEvent, sanitiser: Sanitiser, heartbeat_s: float,
                 relays: Relays, on_end: OnEnd, on_started: OnStarted = _noop_started,
                 framing: Framing | None = None, ttft: metrics.HistogramChild | None = None,
                 release: Release | None = None):
        super().__init__(status_code=200, media_type="text/event-stream")
        self._release = release  # a new turn's: asked when its client goes having been shown no text
        self._ending = False  # `end()` was called
        self._framing: Framing = framing or ChatmeshFraming()
        self._ttft = ttft  # where a new turn's time to first text is observed (None: not measured, an attach)
        self._arrived = time.perf_counter()  # replaced by the request's arrival time (observe.Observe) when known
        self._ttft_s: float | None = None
        self._on_started = on_started
        self._started: chat_pb2.TurnStarted | None = None
        self._call = call
        self._first = first
        self._sanitiser = sanitiser
        self._heartbeat_s = heartbeat_s
        self._relays = relays
        self._on_end = on_end
        self._last_send = 0.0
        self._outcome = events.Outcome(None, 0)
        self._final_written = False
        self._tasks: list[asyncio.Task[None]] = []

    def end(self) -> None:
        """Ends the stream (shutdown, past the grace) as its client going away would: a turn it showed none of
        is released first, any other stopped where its client was."""
        self._ending = True
        if self._tasks:
            self._tasks[1].cancel()  # the watcher: the pump goes on until the release, if any, is sent

    def _stop_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._relays.open.add(self)
        self._arrived = scope.get(START_KEY, self._arrived)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            self._last_send = asyncio.get_running_loop().time()
            self._tasks = [asyncio.create_task(self._pump(send)), asyncio.create_task(self._watch(receive, send))]
            if self._ending:
                self._tasks[1].cancel()
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            if self._final_written and not self._tasks[1].done():  # the client is still there
                closing = await self._framing.end(self._outcome)
                if closing:
                    await self._write(send, closing)
        except OSError:  # the client went away before the headers were written
            pass
        finally:
            self._relays.open.discard(self)
            cut = not self._final_written and not (self._tasks and self._tasks[0].done())  # the turn still runs
            if cut and self._ttft_s is None and self._release is not None and self._generates():
                await self._released()  # before the pump is ended: cancelling its read cancels the call
            self._stop_tasks()
            self._call.cancel()  # no-op once the stream finished; otherwise cancels the turn (client gone)
            await asyncio.gather(*self._tasks, return_exceptions=True)
            try:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass
            started = self._started
            if started is not None:
                self._outcome = replace(
                    self._outcome, replayed=started.replayed,
                    started_prompt_tokens=started.prompt_tokens if started.HasField("prompt_tokens") else None)
            await self._on_end(self._outcome)

    def _generates(self) -> bool:
        """Whether this stream is the one its turn is generated for (not a retry's attach, not a replay: those
        have no turn of their own to release)."""
        first = self._first
        return first.WhichOneof("kind") == "started" and not first.started.replayed

    async def _released(self) -> None:
        """Asks chat to release the turn before the call is cancelled (module header); a failure leaves the
        cancel to stop it, as before."""
        assert self._release is not None
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                await self._release()
        except (TimeoutError, grpc.aio.AioRpcError) as err:
            log.info("turn_release_failed", error=type(err).__name__)

    def _first_text(self) -> None:
        self._ttft_s = time.perf_counter() - self._arrived
        if self._ttft is not None:
            self._ttft.observe(self._ttft_s)
        if isinstance(self._framing, ChatmeshFraming):
            self._framing.ttft_s = self._ttft_s

    async def _write(self, send: Send, chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        self._last_send = asyncio.get_running_loop().time()

    async def _pump(self, send: Send) -> None:
        event = self._first
        last_sequence = 0
        try:
            while True:
                kind = events.kind_of(event)
                if kind is events.SseEvent.DELTA:
                    text = self._sanitiser.feed(event.delta.text)
                    if text:
                        await self._write(send, self._framing.delta(event.sequence, text))
                        if self._ttft_s is None:
                            self._first_text()
                else:
                    if kind is events.SseEvent.STARTED and self._started is None:
                        self._started = event.started
                        await self._on_started(event.started.replayed, event.started.prompt_tokens
                                               if event.started.HasField("prompt_tokens") else None)
                    if kind.is_final or kind is events.SseEvent.TOOL_CALL:  # a call follows all of the text
                        tail = self._sanitiser.flush()
                        if tail:
                            await self._write(send, self._framing.delta(last_sequence, tail))
                    if kind.is_final:
                        self._outcome = _outcome_of(event, kind)
                        await self._write(send, await self._framing.event(event, kind))
                        self._final_written = True
                        return
                    await self._write(send, await self._framing.event(event, kind))
                last_sequence = event.sequence
                message: object = await self._call.read()
                if not isinstance(message, _STREAM_MESSAGES):
                    await self._write(send, self._framing.failed(
                        last_sequence, "the turn stream ended without an outcome", True))
                    return
                event = message.event
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.CANCELLED:
                return
            mapped = http_for_grpc(err.code())
            log.warning("turn_stream_failed", grpc_code=err.code().name)
            try:
                await self._write(send, self._framing.failed(last_sequence, err.details() or mapped.code,
                                                             mapped.status == 503))
            except OSError:
                pass
        except OSError:  # the client went away mid-write: the watcher sees the disconnect too
            pass

    async def _watch(self, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the cancellation `end()`
                # sends when it races a message that is already there, and the relay then never finishes.
                async with asyncio.timeout(self._heartbeat_s):
                    message = await receive()
            except TimeoutError:
                if loop.time() - self._last_send >= self._heartbeat_s * 0.9:
                    try:
                        await self._write(send, events.HEARTBEAT)
                    except OSError:
                        return
                continue
            if message["type"] == "http.disconnect":
                return


def _outcome_of(event: chat_pb2.TurnEvent, kind: events.SseEvent) -> events.Outcome:
    match kind:
        case events.SseEvent.COMPLETED:
            return events.Outcome(kind, event.completed.usage.prompt_tokens)
        case events.SseEvent.STOPPED:
            return events.Outcome(kind, event.stopped.usage.prompt_tokens)
        case events.SseEvent.BLOCKED:
            return events.Outcome(kind, 0, blocked_stage=event.blocked.stage)
        case _:
            return events.Outcome(kind, 0)
