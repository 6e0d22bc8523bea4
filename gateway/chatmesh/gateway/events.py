"""TurnEvent (gRPC) -> server-sent event frames.

Each frame is `id: <sequence>`, `event: turn.<kind>`, `data: <one-line JSON>`. The id is the TurnEvent's
sequence number, so a client that reconnects with `Last-Event-ID: N` resumes through AttachTurn with
after_sequence=N. Deltas are the hot path (one per engine step per stream): their frame is built from a constant
prefix and one `json.dumps` of the text, nothing else per token.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, assert_never

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


def usage_json(usage: common_pb2.Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "cached_prompt_tokens": usage.cached_prompt_tokens,
        "output_tokens": usage.output_tokens,
    }


def data_of(event: chat_pb2.TurnEvent, kind: SseEvent) -> dict[str, Any]:
    match kind:
        case SseEvent.STARTED:
            return {"turn_id": event.started.turn_id, "replayed": event.started.replayed}
        case SseEvent.DELTA:
            return {"text": event.delta.text}
        case SseEvent.TOOL_CALL:
            call = event.tool_call.call
            return {"index": event.tool_call.index, "id": call.id, "name": call.name, "arguments": call.arguments}
        case SseEvent.COMPLETED:
            return {"usage": usage_json(event.completed.usage), "replica_id": event.completed.replica_id}
        case SseEvent.STOPPED:
            return {"usage": usage_json(event.stopped.usage)}
        case SseEvent.FAILED:
            return {"message": event.failed.message, "retryable": event.failed.retryable}
        case SseEvent.BLOCKED:
            return {"stage": event.blocked.stage, "category": event.blocked.category, "reason": event.blocked.reason}
        case _:
            assert_never(kind)


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
