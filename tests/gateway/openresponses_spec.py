"""What the Open Responses specification (openresponses.org, schema version 2026-04-24) requires of the objects
and events a server sends, written here from its text and its schema's `required` lists as JSON Schemas of our
own, so a test can hold everything chatmesh's Responses API sends against them (`check_response`,
`check_stream`, `check_error`).

From the specification: streamed responses are `text/event-stream`; each event's `event:` field matches its
`type`; servers should not send `id:`; the terminal event is the literal `[DONE]`; `sequence_number` orders the
events; an item is added (`response.output_item.added`) before its content part is added, deltas come between
`content_part.added` and `output_text.done`, the part is closed before the item, and the response's final state
event comes last; an error while streaming is followed by `response.failed`. Errors are `{"error": {"message",
"type", "param", "code"}}`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jsonschema

NULLABLE_STRING = {"type": ["string", "null"]}
NULLABLE_INT = {"type": ["integer", "null"]}

USAGE = {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens", "input_tokens_details",
                                         "output_tokens_details"],
         "properties": {"input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
                        "total_tokens": {"type": "integer"},
                        "input_tokens_details": {"type": "object", "required": ["cached_tokens"],
                                                 "properties": {"cached_tokens": {"type": "integer"}}},
                        "output_tokens_details": {"type": "object", "required": ["reasoning_tokens"],
                                                  "properties": {"reasoning_tokens": {"type": "integer"}}}}}

OUTPUT_TEXT = {"type": "object", "required": ["type", "text", "annotations", "logprobs"],
               "properties": {"type": {"const": "output_text"}, "text": {"type": "string"},
                              "annotations": {"type": "array"}, "logprobs": {"type": "array"}}}

ITEM_STATUS = {"enum": ["in_progress", "completed", "incomplete"]}
MESSAGE: dict[str, Any] = {"type": "object", "required": ["type", "id", "status", "role", "content"],
           "properties": {"type": {"const": "message"}, "id": {"type": "string"}, "status": ITEM_STATUS,
                          "role": {"enum": ["user", "assistant", "system", "developer"]},
                          "content": {"type": "array", "items": OUTPUT_TEXT},
                          "phase": {"enum": ["commentary", "final_answer"]}}}
FUNCTION_CALL = {"type": "object", "required": ["type", "id", "call_id", "name", "arguments", "status"],
                 "properties": {"type": {"const": "function_call"}, "arguments": {"type": "string"},
                                "status": ITEM_STATUS}}
ITEM = {"oneOf": [MESSAGE, FUNCTION_CALL]}

RESPONSE_REQUIRED = [
    "id", "object", "created_at", "completed_at", "status", "incomplete_details", "model", "previous_response_id",
    "instructions", "output", "error", "tools", "tool_choice", "truncation", "parallel_tool_calls", "text", "top_p",
    "presence_penalty", "frequency_penalty", "top_logprobs", "temperature", "reasoning", "user", "usage",
    "max_output_tokens", "max_tool_calls", "store", "background", "service_tier", "metadata", "safety_identifier",
    "prompt_cache_key"]
RESPONSE = {
    "type": "object", "required": RESPONSE_REQUIRED,
    "properties": {
        "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
        "completed_at": NULLABLE_INT,
        "status": {"enum": ["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]},
        "incomplete_details": {"oneOf": [{"type": "null"}, {"type": "object", "required": ["reason"],
                                                            "properties": {"reason": {"type": "string"}}}]},
        "model": {"type": "string"}, "previous_response_id": NULLABLE_STRING, "instructions": NULLABLE_STRING,
        "output": {"type": "array", "items": ITEM},
        "error": {"oneOf": [{"type": "null"}, {"type": "object", "required": ["code", "message"],
                                               "properties": {"code": {"type": "string"},
                                                              "message": {"type": "string"}}}]},
        "tools": {"type": "array"}, "tool_choice": {"type": ["string", "object"]},
        "truncation": {"enum": ["auto", "disabled"]}, "parallel_tool_calls": {"type": "boolean"},
        "text": {"type": "object"},
        # numbers: never null
        "top_p": {"type": "number"}, "temperature": {"type": "number"}, "presence_penalty": {"type": "number"},
        "frequency_penalty": {"type": "number"}, "top_logprobs": {"type": "integer"},
        "reasoning": {"type": ["object", "null"]}, "user": NULLABLE_STRING,
        "usage": {"oneOf": [{"type": "null"}, USAGE]},
        "max_output_tokens": NULLABLE_INT, "max_tool_calls": NULLABLE_INT, "store": {"type": "boolean"},
        "background": {"type": "boolean"}, "service_tier": {"type": "string"}, "metadata": {"type": "object"},
        "safety_identifier": NULLABLE_STRING, "prompt_cache_key": NULLABLE_STRING,
        "conversation": {"oneOf": [{"type": "null"}, {"type": "object", "required": ["id"]}]}}}

PART = {"oneOf": [OUTPUT_TEXT]}


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": "object", "required": ["type", "sequence_number", *fields],
            "properties": {"type": {"const": kind}, "sequence_number": {"type": "integer"}, **fields}}


_IDX = {"type": "integer"}
EVENTS: dict[str, dict[str, Any]] = {
    **{kind: _event(kind, response=RESPONSE) for kind in (
        "response.created", "response.queued", "response.in_progress", "response.completed", "response.failed",
        "response.incomplete")},
    "response.output_item.added": _event("response.output_item.added", output_index=_IDX, item=ITEM),
    "response.output_item.done": _event("response.output_item.done", output_index=_IDX, item=ITEM),
    "response.content_part.added": _event("response.content_part.added", item_id={"type": "string"},
                                          output_index=_IDX, content_index=_IDX, part=PART),
    "response.content_part.done": _event("response.content_part.done", item_id={"type": "string"},
                                         output_index=_IDX, content_index=_IDX, part=PART),
    "response.output_text.delta": _event("response.output_text.delta", item_id={"type": "string"},
                                         output_index=_IDX, content_index=_IDX, delta={"type": "string"},
                                         logprobs={"type": "array"}),
    "response.output_text.done": _event("response.output_text.done", item_id={"type": "string"},
                                        output_index=_IDX, content_index=_IDX, text={"type": "string"}),
    "response.function_call_arguments.delta": _event("response.function_call_arguments.delta",
                                                     item_id={"type": "string"}, output_index=_IDX,
                                                     delta={"type": "string"}),
    "response.function_call_arguments.done": _event("response.function_call_arguments.done",
                                                    item_id={"type": "string"}, output_index=_IDX,
                                                    arguments={"type": "string"}),
    "error": _event("error", error={"type": "object", "required": ["type", "code", "message", "param"],
                                    "properties": {"type": {"type": "string"}, "code": NULLABLE_STRING,
                                                   "message": {"type": "string"}, "param": NULLABLE_STRING}}),
}

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": NULLABLE_STRING,
                   "code": NULLABLE_STRING}}}}

COMPACTION = {"type": "object", "required": ["type", "id", "encrypted_content"],
              "properties": {"type": {"const": "compaction"}, "id": {"type": "string"},
                             "encrypted_content": {"type": "string"}}}
COMPACTED = {"type": "object", "required": ["id", "object", "output", "created_at", "usage"],
             "properties": {"id": {"type": "string"}, "object": {"const": "response.compaction"},
                            "created_at": {"type": "integer"}, "usage": USAGE,
                            "output": {"type": "array", "items": {"oneOf": [
                                {**MESSAGE, "properties": {**MESSAGE["properties"], "content": {"type": "array"}}},
                                COMPACTION]}}}}

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def check_response(body: Any) -> None:
    jsonschema.validate(body, RESPONSE)
    for item in body["output"]:
        if item["type"] == "message" and item["status"] == "incomplete":
            assert item is body["output"][-1], "an incomplete item is the last one"


def check_error(body: Any) -> None:
    jsonschema.validate(body, ERROR)


def check_compacted(body: Any) -> None:
    jsonschema.validate(body, COMPACTED)


@dataclass(frozen=True)
class Frame:
    event: str | None
    data: str
    has_id: bool


def frames(raw: str) -> list[Frame]:
    """The SSE frames of a whole stream body (comments skipped)."""
    out: list[Frame] = []
    for block in raw.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        event = next((line[6:].strip() for line in lines if line.startswith("event:")), None)
        data = "\n".join(line[5:].lstrip() for line in lines if line.startswith("data:"))
        out.append(Frame(event, data, any(line.startswith("id:") for line in lines)))
    return out


def check_stream(raw: str, *, first_sequence: int = 0, done: bool = True) -> list[dict[str, Any]]:
    """Every frame of a Responses stream against the specification; returns the events (without [DONE]).
    `first_sequence`: the number the stream starts at (a resumed stream starts after the last event seen)."""
    got = frames(raw)
    if done:
        assert got and got[-1].data == "[DONE]", "the terminal event is the literal [DONE]"
        got = got[:-1]
    events: list[dict[str, Any]] = []
    for frame in got:
        assert not frame.has_id, "servers should not use id"
        event = json.loads(frame.data)
        assert frame.event == event["type"], "the event field matches the type"
        schema = EVENTS.get(event["type"])
        assert schema is not None, f"an event type of the specification: {event['type']}"
        jsonschema.validate(event, schema)
        if "response" in event:
            check_response(event["response"])
        events.append(event)
    numbers = [e["sequence_number"] for e in events]
    assert numbers == list(range(first_sequence, first_sequence + len(events))), numbers
    if first_sequence == 0 and done:
        check_order([e["type"] for e in events])
    return events


def check_order(kinds: Iterable[str]) -> None:
    """The order the specification gives output items' events: each item added, its content, then done, one item
    after another; a message's content part opened, its text deltas, its text done, the part closed; a function
    call's arguments deltas, then their done."""
    kinds = list(kinds)
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds[:2]
    terminal = [k for k in kinds if k in TERMINAL]
    assert len(terminal) == 1 and kinds[-1] == terminal[0], "exactly one final state event, last"
    if terminal[0] == "response.failed":
        assert "error" in kinds and kinds.index("error") < kinds.index("response.failed")
        return
    body = kinds[2:-1]
    while body:
        assert body[0] == "response.output_item.added", body
        end = body.index("response.output_item.done")
        inner, body = body[1:end], body[end + 1:]
        if inner and inner[0].startswith("response.function_call_arguments"):
            assert inner[-1] == "response.function_call_arguments.done"
            assert set(inner[:-1]) <= {"response.function_call_arguments.delta"}
        elif inner:
            assert inner[0] == "response.content_part.added" and inner[-1] == "response.content_part.done"
            assert inner[-2] == "response.output_text.done"
            assert set(inner[1:-2]) <= {"response.output_text.delta"}
