"""One turn's reply, relayed as it streams (through the edge's own SSE relay, with a framing of the API's) or
collected whole for a non-streaming request. Both hold the owner's stream slot until the turn ends and charge its
prompt tokens, as chatmesh's own routes do. A non-streaming request keeps the turn going if its client goes away
(so the SDK's retry attaches to it instead of generating again); a stream is the client's, as on chatmesh's own
routes: when its client goes away the turn stops and the partial reply is kept (or, when none of it had reached
the client, the turn is released for the SDK's retry to generate)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import assert_never

import grpc

from chatmesh.gateway import events
from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.identity import Principal, Via
from chatmesh.gateway.openai.surface import Surface
from chatmesh.gateway.relay import Framing, Relay
from chatmesh.gateway.routes import StreamSlot
from chatmesh.gateway.openai.stored import delete_conversation
from chatmesh.gateway.openai.turns import Ask, Opened
from chatmesh.gateway.sanitise import Sanitiser
from chatmesh.gateway.sse import TurnRelay
from chatmesh.model.tools import ToolCall
from chatmesh.mesh import ids, logs

log = logs.get("chatmesh.gateway.openai")
After = Callable[[events.Outcome], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole reply: its text as the client receives it (sanitised), its calls, and the event that ended it
    (None: the stream ended without one, `failure` says how)."""

    text: str
    end: events.ReplyEnd | None
    finish_reason: str  # "stop", "length", "tool_calls" or "content_filter"; "" when failed
    failure: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def kind(self) -> events.SseEvent:
        return self.end.kind if self.end is not None else events.SseEvent.FAILED

    @property
    def usage(self) -> events.Usage:
        return events.usage_of(self.end) if self.end is not None else events.Usage()


async def start(surface: Surface, ask: Ask) -> tuple[StreamSlot, Opened]:
    """Takes the owner's stream slot and prompt-token reservation, then opens the turn with that allowance."""
    slot = await surface.edge.take_stream(ask.owner, new_turn=True)
    try:
        return slot, await surface.turns.open(replace(ask, allowance=slot.allowance))
    except BaseException as exc:
        raise await surface.edge.refuse(slot, exc) from None


def finish_reason(end: events.ReplyEnd, cap: int) -> str:
    """OpenAI's finish_reason of a final turn event. Older chat services do not state it on completed turns: a
    reply that used its whole token cap then reads as `length`."""
    match end:
        case events.ReplyBlocked():
            return "content_filter"
        case events.ReplyCompleted():
            return end.finish_reason or ("length" if cap and end.usage.output_tokens >= cap else "stop")
        case events.ReplyStopped():
            return "stop"
        case events.ReplyFailed():
            return ""
        case _:
            assert_never(end)


def _relay(surface: Surface, slot: StreamSlot, opened: Opened, after: After | None) -> Relay:
    """The turn's reader, metered as every relayed stream is: the slot's reservation settled at turn.started
    and at the end, the slot released (chatmesh.gateway.metering); then `after`."""
    async def on_end(outcome: events.Outcome) -> None:
        await surface.edge.ended(slot, outcome)
        if after is not None:
            await after(outcome)
    return Relay(opened.call, opened.first, Sanitiser(surface.edge.allowlist), slot.started, on_end)


class _Kept:
    """A framing that keeps the reply's pieces and writes nothing (a non-streaming reply)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.calls: list[ToolCall] = []
        self.final: events.ReplyEnd | None = None
        self.failure = ""

    def delta(self, sequence: int, text: str) -> bytes:
        self.parts.append(text)
        return b""

    async def event(self, event: events.ReplyEvent) -> bytes:
        if isinstance(event, events.ReplyToolCall):
            self.calls.append(event.call)
        elif isinstance(event, events.ReplyEnd):
            self.final = event
            if isinstance(event, events.ReplyFailed):
                self.failure = event.message
        return b""

    def failed(self, sequence: int, message: str, retryable: bool) -> bytes:
        self.failure = message
        return b""

    async def end(self, outcome: events.Outcome) -> bytes:
        return b""

    def reply(self, cap: int) -> Reply:
        end = self.final
        return Reply("".join(self.parts), end, finish_reason(end, cap) if end is not None else "", self.failure,
                     tuple(self.calls))


async def _nowhere(chunk: bytes) -> None:
    return None


async def collect(surface: Surface, slot: StreamSlot, opened: Opened, cap: int, after: After | None = None
                  ) -> Reply:
    """The whole reply of a turn, read by the one relay (chatmesh.gateway.relay) as a stream's is, so it is
    metered alike; a gRPC error is answered as the request's error."""
    relay, kept = _relay(surface, slot, opened, after), _Kept()
    try:
        await relay.pump(kept, _nowhere)
    except grpc.aio.AioRpcError as err:
        raise ApiError.from_rpc(err) from None
    finally:
        await relay.finish()
    return kept.reply(cap)


def relay(surface: Surface, slot: StreamSlot, opened: Opened, framing: Framing, after: After | None = None
          ) -> TurnRelay:
    """The turn relayed to its client as a text/event-stream in `framing`."""
    # A stream cut before any text reached its client (the SDK retries it at once) releases the turn (sse.py).
    release = surface.edge.releaser(Principal(slot.owner, Via.API_KEY), opened.point.conversation,
                                    opened.point.turn)
    return TurnRelay(_relay(surface, slot, opened, after), surface.edge.heartbeat_s, surface.edge.relays, framing,
                     release=release)


def discard(surface: Surface, owner: ids.OwnerId, opened: Opened) -> After:
    """A throwaway conversation (store=false, a front-end's background task) is deleted once its turn ends."""
    async def after(outcome: events.Outcome) -> None:
        try:
            await delete_conversation(surface.edge, owner, opened.point.conversation, surface.edge.deadline_s)
        except Exception as exc:
            log.warning("throwaway_delete_failed", error=type(exc).__name__)
    return after
