"""The Response object (Open Responses' `ResponseResource`, OpenAI's `Response`), every required field present.

A response is a chatmesh turn. Its object has two halves:
- the request side (`Shape.fixed`): id, created_at, model, instructions, the sampling values it ran with (a number
  always: the request's, else the service default chat generates with, CHATMESH_TEMPERATURE / CHATMESH_TOP_P), the
  token cap, store, background, truncation, metadata, user, safety_identifier, prompt_cache_key, and the fields
  chatmesh fixes (no penalties, no logprobs, no reasoning, service tier `default`). It is recorded at create
  (`records.py`), so retrieve and a resumed stream on any gateway rebuild the same object;
- the outcome: status, output, usage, error, incomplete_details, completed_at, from the turn.

Status (`status_of`): completed; incomplete with reason max_output_tokens (the reply used its whole cap) or
content_filter (moderation blocked it); cancelled (stopped: the partial reply is kept); failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chatmesh.gateway import events
from chatmesh.gateway.openai import ids
from chatmesh.gateway.openai.history import Point
from chatmesh.gateway.openai.tool_wire import NO_TOOLS, Tools, function_call_item
from chatmesh.model.tools import ToolCall

TERMINAL = ("completed", "incomplete", "cancelled", "failed")


def usage_json(u: events.Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "output_tokens": u.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.output_tokens}


def status_of(kind: events.SseEvent, finish: str) -> tuple[str, str | None]:
    """A final turn event (and OpenAI's finish reason of it) as a response status and its incomplete reason."""
    match kind:
        case events.SseEvent.COMPLETED:
            return ("incomplete", "max_output_tokens") if finish == "length" else ("completed", None)
        case events.SseEvent.STOPPED:
            return "cancelled", None
        case events.SseEvent.BLOCKED:
            return "incomplete", "content_filter"
        case events.SseEvent.FAILED | events.SseEvent.STARTED | events.SseEvent.DELTA | events.SseEvent.TOOL_CALL:
            return "failed", None


@dataclass(frozen=True)
class Sampling:
    """What chat generates with when a request leaves a value unset (CHATMESH_TEMPERATURE, CHATMESH_TOP_P)."""

    temperature: float = 0.0
    top_p: float = 1.0


def request_fields(*, model: str, created_at: int, instructions: str | None, previous_response_id: str | None,
                   max_output_tokens: int | None, temperature: float, top_p: float, store: bool, background: bool,
                   truncation: str, metadata: dict[str, str], user: str | None, safety_identifier: str | None,
                   prompt_cache_key: str | None, tools: Tools = NO_TOOLS) -> dict[str, Any]:
    """The request side of a Response object (see the module docstring); `tools`, `tool_choice` and
    `parallel_tool_calls` as the request sent them (tool_wire.Tools)."""
    return {
        "object": "response", "created_at": created_at, "model": model, "instructions": instructions,
        "previous_response_id": previous_response_id, "max_output_tokens": max_output_tokens,
        "max_tool_calls": None, "temperature": temperature, "top_p": top_p, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "top_logprobs": 0, "reasoning": None, "store": store, "background": background,
        **tools.response_fields(), "text": {"format": {"type": "text"}},
        "truncation": truncation, "metadata": metadata, "user": user, "service_tier": "default",
        "safety_identifier": safety_identifier, "prompt_cache_key": prompt_cache_key}


class Shape:
    """One response's object: its recorded request side, and the outcome filled in per event or read."""

    def __init__(self, point: Point, fixed: dict[str, Any]):
        self.point = point
        self.id = ids.response_id(point.conversation, point.turn)
        self.item_id = ids.message_id(point.turn, "assistant")
        self.fixed = {"id": self.id, **fixed,
                      "conversation": {"id": ids.conversation_id(point.conversation)}}

    @property
    def recorded(self) -> dict[str, Any]:
        """What `records.py` keeps of it (the id and conversation derive from the point)."""
        return {k: v for k, v in self.fixed.items() if k not in ("id", "conversation")}

    def item(self, text: str, status: str) -> dict[str, Any]:
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def output(self, text: str | None, calls: Sequence[ToolCall], item_status: str) -> list[dict[str, Any]]:
        """The output items: the message (when there is text, or nothing else), then a function_call per call
        (complete: a call is published whole)."""
        message = [] if text is None or (not text and calls) else [self.item(text, item_status)]
        return message + [function_call_item(c, "completed") for c in calls]

    def body(self, status: str, text: str | None, usage: events.Usage | None, *, reason: str | None = None,
             error: dict[str, str] | None = None, completed_at: int | None = None,
             calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
        item_status = "in_progress" if status in ("in_progress", "queued") else \
            "completed" if status == "completed" else "incomplete"
        return {**self.fixed, "status": status, "completed_at": completed_at if status == "completed" else None,
                "error": error, "incomplete_details": {"reason": reason} if reason else None,
                "output": self.output(text, calls, item_status),
                "usage": usage_json(usage) if usage is not None else None}
