"""One turn's reply, relayed as it streams (through the edge's own SSE relay, with a framing of the API's) or
collected whole for a non-streaming request. Both hold the owner's stream slot until the turn ends and charge its
prompt tokens, as chatmesh's own routes do. A non-streaming request keeps the turn going if its client goes away
(so the SDK's retry attaches to it instead of generating again); a stream is the client's, as on chatmesh's own
routes: when its client goes away the turn stops and the partial reply is kept (or, when none of it had reached
the client, the turn is released for the SDK's retry to generate)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import grpc

from chatmesh.gateway import events
from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.identity import Principal, Via
from chatmesh.gateway.openai.surface import Surface
from chatmesh.gateway.routes import StreamSlot
from chatmesh.gateway.openai.turns import Ask, Opened, owner_token
from chatmesh.gateway.sanitise import Sanitiser
from chatmesh.gateway.openai.tool_wire import call_of
from chatmesh.gateway.sse import Framing, TurnRelay, next_event
from chatmesh.model.tools import ToolCall
from chatmesh.mesh import ids, logs
from chatmesh.v1 import chat_pb2, common_pb2

log = logs.get("chatmesh.gateway.openai")
After = Callable[[events.Outcome], Awaitable[None]]


@dataclass(frozen=True)
class Reply:
    text: str  # as the client receives it (sanitised)
    kind: events.SseEvent
    usage: common_pb2.Usage
    finish_reason: str  # "stop", "length", "tool_calls" or "content_filter"; "" when failed
    failure: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


async def start(surface: Surface, ask: Ask) -> tuple[StreamSlot, Opened]:
    """Takes the owner's stream slot and prompt-token reservation, then opens the turn with that allowance."""
    slot = await surface.edge.take_stream(ask.owner, new_turn=True)
    try:
        return slot, await surface.turns.open(replace(ask, allowance=slot.allowance))
    except BaseException as exc:
        raise await surface.edge.refuse(slot, exc) from None


def finish_reason(kind: events.SseEvent, usage: common_pb2.Usage, stated: str, cap: int) -> str:
    """OpenAI's finish_reason of a final turn event. Older chat services do not state it on completed turns: a
    reply that used its whole token cap then reads as `length`."""
    match kind:
        case events.SseEvent.BLOCKED:
            return "content_filter"
        case events.SseEvent.COMPLETED:
            return stated or ("length" if cap and usage.output_tokens >= cap else "stop")
        case events.SseEvent.STOPPED:
            return "stop"
        case events.SseEvent.FAILED | events.SseEvent.STARTED | events.SseEvent.DELTA | events.SseEvent.TOOL_CALL:
            return ""


def usage_of(event: chat_pb2.TurnEvent) -> common_pb2.Usage:
    match event.WhichOneof("kind"):
        case "completed":
            return event.completed.usage
        case "stopped":
            return event.stopped.usage
        case _:
            return common_pb2.Usage()


async def collect(surface: Surface, slot: StreamSlot, opened: Opened, cap: int, after: After | None = None
                  ) -> Reply:
    """The whole reply of a turn; the slot is metered as a relayed stream's is (chatmesh.gateway.metering)."""
    sanitiser = Sanitiser(surface.edge.allowlist)
    parts: list[str] = []
    calls: list[ToolCall] = []
    event = opened.first
    outcome = events.Outcome(None, 0)
    started: chat_pb2.TurnStarted | None = None
    try:
        while True:
            kind = events.kind_of(event)
            if kind is events.SseEvent.STARTED and started is None:
                started = event.started
                await slot.started(started.replayed,
                                   started.prompt_tokens if started.HasField("prompt_tokens") else None)
            if kind is events.SseEvent.DELTA:
                parts.append(sanitiser.feed(event.delta.text))
            elif kind is events.SseEvent.TOOL_CALL:
                calls.append(call_of(event.tool_call.call))
            elif kind.is_final:
                parts.append(sanitiser.flush())
                usage = usage_of(event)
                outcome = events.Outcome(kind, usage.prompt_tokens, blocked_stage=event.blocked.stage
                                         if kind is events.SseEvent.BLOCKED else "")
                stated = event.completed.finish_reason if kind is events.SseEvent.COMPLETED else ""
                failure = event.failed.message if kind is events.SseEvent.FAILED else ""
                return Reply("".join(parts), kind, usage, finish_reason(kind, usage, stated, cap), failure,
                             tuple(calls))
            nxt = await next_event(opened.call)
            if nxt is None:
                return Reply("".join(parts), events.SseEvent.FAILED, common_pb2.Usage(), "",
                             "the turn stream ended without an outcome")
            event = nxt
    except grpc.aio.AioRpcError as err:
        raise ApiError.from_rpc(err) from None
    finally:
        opened.call.cancel()  # no-op once the stream finished
        if started is not None:
            outcome = replace(outcome, replayed=started.replayed, started_prompt_tokens=started.prompt_tokens
                              if started.HasField("prompt_tokens") else None)
        await surface.edge.ended(slot, outcome)
        if after is not None:
            await after(outcome)


def relay(surface: Surface, slot: StreamSlot, opened: Opened, framing: Framing, after: After | None = None
          ) -> TurnRelay:
    async def on_end(outcome: events.Outcome) -> None:
        await surface.edge.ended(slot, outcome)
        if after is not None:
            await after(outcome)

    # A stream cut before any text reached its client (the SDK retries it at once) releases the turn (sse.py).
    release = surface.edge.releaser(Principal(slot.owner, Via.API_KEY), opened.point.conversation,
                                    opened.point.turn)
    return TurnRelay(opened.call, opened.first, Sanitiser(surface.edge.allowlist), surface.edge.heartbeat_s,
                     surface.edge.relays, on_end, slot.started, framing, release=release)


def discard(surface: Surface, owner: ids.OwnerId, opened: Opened) -> After:
    """A throwaway conversation (store=false, a front-end's background task) is deleted once its turn ends."""
    async def after(outcome: events.Outcome) -> None:
        try:
            await surface.edge.chat.DeleteConversation(chat_pb2.DeleteConversationRequest(
                owner_id=owner, conversation_id=opened.point.conversation), timeout=surface.edge.deadline_s,
                metadata=owner_token(surface.edge, owner, opened.point.conversation))
        except Exception as exc:
            log.warning("throwaway_delete_failed", error=type(exc).__name__)
    return after
