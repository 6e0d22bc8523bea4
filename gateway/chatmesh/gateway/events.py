"""TurnEvent (gRPC) -> reply events (domain values) -> server-sent event frames.

`reply_event` is where a turn stream's protobuf ends: the relay (chatmesh.gateway.relay) turns each TurnEvent
but a delta (the hot path: its sequence and text are passed as they are) into one of the frozen reply events
below, and every framing, chatmesh's own and the OpenAI surface's, works on those. `ReplyEvent` is the closed
set, matched exhaustively.

Each frame is `id: <sequence>`, `event: turn.<kind>`, `data: <one-line JSON>`. The id is the TurnEvent's
sequence number, so a client that reconnects with `Last-Event-ID: N` resumes through AttachTurn with
after_sequence=N. Deltas are the hot path (one per engine step per stream): their frame is built from a constant
prefix and one `json.dumps` of the text, nothing else per token.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, ClassVar, assert_never

from chatmesh.model.tools import ToolCall
from chatmesh.v1 import chat_pb2, common_pb2


class SseEvent(enum.Enum):
    """The TurnEvent oneof `kind`, as a closed set the type checker can match exhaustively."""

    STARTED = "started"
    DELTA = "delta"
    TOOL_CALL = "tool_call"  # the reply called a tool (after its text; only turns offered tools have them)
    COMPLETED = "completed"
    STOPPED = "stopped"
    FAILED = "failed"
    BLOCKED = "blocked"

    @property
    def sse_name(self) -> str:
        return "turn." + self.value

    @property
    def is_final(self) -> bool:
        match self:
            case SseEvent.STARTED | SseEvent.DELTA | SseEvent.TOOL_CALL:
                return False
            case SseEvent.COMPLETED | SseEvent.STOPPED | SseEvent.FAILED | SseEvent.BLOCKED:
                return True
            case _:
                assert_never(self)


def kind_of(event: chat_pb2.TurnEvent) -> SseEvent:
    which = event.WhichOneof("kind")
    if which is None:
        raise ValueError(f"TurnEvent {event.sequence} has no kind")
    return SseEvent(which)


@dataclass(frozen=True, slots=True)
class Usage:
    """A turn's token counts: the whole prompt, the part of it served from the prefix cache, the reply."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0

    @staticmethod
    def of(usage: common_pb2.Usage) -> Usage:
        return Usage(usage.prompt_tokens, usage.cached_prompt_tokens, usage.output_tokens)


@dataclass(frozen=True, slots=True)
class ReplyStarted:
    kind: ClassVar[SseEvent] = SseEvent.STARTED
    sequence: int
    turn_id: str
    replayed: bool  # the stream replays a stored turn or attaches to a running one
    prompt_tokens: int | None  # the prompt's size, when chat reported it


@dataclass(frozen=True, slots=True)
class ReplyDelta:
    kind: ClassVar[SseEvent] = SseEvent.DELTA
    sequence: int
    text: str


@dataclass(frozen=True, slots=True)
class ReplyToolCall:
    kind: ClassVar[SseEvent] = SseEvent.TOOL_CALL
    sequence: int
    index: int  # the call's position among the reply's calls, from 0
    call: ToolCall


@dataclass(frozen=True, slots=True)
class ReplyCompleted:
    kind: ClassVar[SseEvent] = SseEvent.COMPLETED
    sequence: int
    usage: Usage
    replica_id: str = ""
    finish_reason: str = ""  # as chat stated it ("stop", "length", "tool_calls"); "" from older chat services


@dataclass(frozen=True, slots=True)
class ReplyStopped:
    kind: ClassVar[SseEvent] = SseEvent.STOPPED
    sequence: int
    usage: Usage


@dataclass(frozen=True, slots=True)
class ReplyFailed:
    kind: ClassVar[SseEvent] = SseEvent.FAILED
    sequence: int
    message: str
    retryable: bool


@dataclass(frozen=True, slots=True)
class ReplyBlocked:
    kind: ClassVar[SseEvent] = SseEvent.BLOCKED
    sequence: int
    stage: str  # "input" or "output"
    category: str = ""
    reason: str = ""


ReplyEnd = ReplyCompleted | ReplyStopped | ReplyFailed | ReplyBlocked
ReplyEvent = ReplyStarted | ReplyDelta | ReplyToolCall | ReplyEnd


def reply_event(event: chat_pb2.TurnEvent) -> ReplyEvent:
    """A TurnEvent as its reply event (ValueError for one without a kind)."""
    n = event.sequence
    match kind_of(event):
        case SseEvent.STARTED:
            s = event.started
            return ReplyStarted(n, s.turn_id, s.replayed, s.prompt_tokens if s.HasField("prompt_tokens") else None)
        case SseEvent.DELTA:
            return ReplyDelta(n, event.delta.text)
        case SseEvent.TOOL_CALL:
            c = event.tool_call.call
            return ReplyToolCall(n, event.tool_call.index, ToolCall(c.id, c.name, c.arguments))
        case SseEvent.COMPLETED:
            d = event.completed
            return ReplyCompleted(n, Usage.of(d.usage), d.replica_id, d.finish_reason)
        case SseEvent.STOPPED:
            return ReplyStopped(n, Usage.of(event.stopped.usage))
        case SseEvent.FAILED:
            return ReplyFailed(n, event.failed.message, event.failed.retryable)
        case SseEvent.BLOCKED:
            b = event.blocked
            return ReplyBlocked(n, b.stage, b.category, b.reason)
        case unknown:
            assert_never(unknown)


def usage_of(end: ReplyEnd) -> Usage:
    """The usage a final event reports (none for a failed or blocked turn)."""
    match end:
        case ReplyCompleted() | ReplyStopped():
            return end.usage
        case ReplyFailed() | ReplyBlocked():
            return Usage()
        case _:
            assert_never(end)


def outcome_of(end: ReplyEnd) -> Outcome:
    """How a stream that ended with `end` is metered (chatmesh.gateway.metering)."""
    match end:
        case ReplyCompleted() | ReplyStopped():
            return Outcome(end.kind, end.usage.prompt_tokens)
        case ReplyBlocked():
            return Outcome(end.kind, 0, blocked_stage=end.stage)
        case ReplyFailed():
            return Outcome(end.kind, 0)
        case _:
            assert_never(end)


def usage_json(usage: Usage | common_pb2.Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "cached_prompt_tokens": usage.cached_prompt_tokens,
        "output_tokens": usage.output_tokens,
    }


def data_of(event: ReplyEvent) -> dict[str, Any]:
    match event:
        case ReplyStarted():
            return {"turn_id": event.turn_id, "replayed": event.replayed}
        case ReplyDelta():
            return {"text": event.text}
        case ReplyToolCall():
            call = event.call
            return {"index": event.index, "id": call.id, "name": call.name, "arguments": call.arguments}
        case ReplyCompleted():
            return {"usage": usage_json(event.usage), "replica_id": event.replica_id}
        case ReplyStopped():
            return {"usage": usage_json(event.usage)}
        case ReplyFailed():
            return {"message": event.message, "retryable": event.retryable}
        case ReplyBlocked():
            return {"stage": event.stage, "category": event.category, "reason": event.reason}
        case _:
            assert_never(event)


def frame(sequence: int, kind: SseEvent, data: dict[str, Any]) -> bytes:
    body = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"id: {sequence}\nevent: {kind.sse_name}\ndata: {body}\n\n".encode()


def delta_frame(sequence: int, text: str) -> bytes:
    return b"id: %d\nevent: turn.delta\ndata: {\"text\":%s}\n\n" % (
        sequence, json.dumps(text, ensure_ascii=False).encode())


def failed_frame(sequence: int, message: str, retryable: bool) -> bytes:
    return frame(sequence, SseEvent.FAILED, {"message": message, "retryable": retryable})


@dataclass(frozen=True)
class Outcome:
    """How a relayed stream ended, for metering (chatmesh.gateway.metering)."""

    kind: SseEvent | None  # the final event; None: the stream ended without one (client gone, shutdown)
    prompt_tokens: int  # the usage's prompt tokens of a completed or stopped turn
    replayed: bool = False  # turn.started said the stream replays a stored turn or attaches to one
    started_prompt_tokens: int | None = None  # the prompt's size turn.started reported, if it did
    blocked_stage: str = ""  # "input" or "output" for a blocked turn


HEARTBEAT = b": keepalive\n\n"
