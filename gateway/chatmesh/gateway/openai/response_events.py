"""The `response.*` event stream of one response, as Open Responses orders it:

    response.created, response.in_progress, response.output_item.added, response.content_part.added,
    response.output_text.delta ..., response.output_text.done, response.content_part.done,
    response.output_item.done, then exactly one of response.completed / response.incomplete / response.failed
    (a failure: an `error` event, then response.failed), then the literal `data: [DONE]`.

The message item is opened with the reply's first text (or at the end, empty, when the reply has neither text
nor calls). A tool call (after all the text) closes it and is an item of its own at the next output_index:
response.output_item.added (function_call, in_progress, no arguments yet), response.function_call_arguments.delta
(the whole arguments: a call is published complete), response.function_call_arguments.done,
response.output_item.done; so a reply that is only a call has its function_call at output_index 0, as OpenAI's.

Each event carries `sequence_number`, from 0, one more per event; `event:` names its `type`, and no `id:` is sent.

Resuming (background responses, `GET /responses/{id}?stream=true&starting_after=N`). The events are a pure
function of the response's recorded object, its reply text (sanitised, `chatmesh.gateway.sanitise`: the output
never depends on where deltas were cut) and how it ended, so any gateway can rebuild them from the turn's stored
progress: it attaches to the turn from its start, frames every event, and writes only those after N. What makes
the deltas reproducible is `Aligned`: a delta ends where the text says, not where the engine's 25 ms flush fell:
just before a whitespace that follows non-whitespace, or after `ALIGN_MAX` characters without one (so text with
no spaces, such as Chinese, still streams). A boundary depends only on the text before it, so the deltas of a
reply so far are always a prefix of the deltas of the whole reply. A foreground stream is the client's own and
never resumed: its deltas are the sanitiser's output as it comes (`Immediate`, nothing held back).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, assert_never

from chatmesh.gateway import events
from chatmesh.gateway.openai.response_object import Shape
from chatmesh.gateway.openai.tool_wire import function_call_item
from chatmesh.model.tools import ToolCall

ALIGN_MAX = 8
DONE = b"data: [DONE]\n\n"


class Chunker(Protocol):
    def feed(self, text: str) -> list[str]: ...

    def flush(self) -> list[str]: ...


class Immediate:
    def feed(self, text: str) -> list[str]:
        return [text] if text else []

    def flush(self) -> list[str]:
        return []


class Aligned:
    """Deltas cut at boundaries the text alone decides (see the module docstring)."""

    def __init__(self, max_chars: int = ALIGN_MAX):
        self._max = max_chars
        self._held = ""

    def feed(self, text: str) -> list[str]:
        buf = self._held + text
        out: list[str] = []
        start = 0
        for i in range(1, len(buf)):
            if (buf[i].isspace() and not buf[i - 1].isspace()) or i - start >= self._max:
                out.append(buf[start:i])
                start = i
        self._held = buf[start:]
        return out

    def flush(self) -> list[str]:
        held, self._held = self._held, ""
        return [held] if held else []


@dataclass(frozen=True)
class Outcome:
    """How the response ended, as its final events say it."""

    status: str
    reason: str | None
    completed_at: int | None


# Decides the outcome of a final turn event but a failure (and records it, where this stream is the one that does).
Ending = Callable[[events.ReplyEnd], Awaitable[Outcome]]


class EventFraming:
    """A `chatmesh.gateway.relay.Framing` writing `response.*` events (module docstring). Events numbered up to
    `starting_after` are framed (so the numbers match) but not written."""

    def __init__(self, shape: Shape, ending: Ending, chunker: Chunker, starting_after: int = -1):
        self._shape = shape
        self._ending = ending
        self._chunker = chunker
        self._after = starting_after
        self._sequence = 0
        self._parts: list[str] = []
        self._message = False  # the message item is open
        self._next_index = 0  # the output_index of the next item
        self._calls: list[ToolCall] = []
        self._delta_head = json.dumps({"type": "response.output_text.delta", "item_id": shape.item_id,
                                       "output_index": 0, "content_index": 0, "logprobs": []},
                                      separators=(",", ":"))[:-1].encode()

    def _event(self, kind: str, **fields: Any) -> bytes:
        number = self._sequence
        self._sequence += 1
        if number <= self._after:
            return b""
        body = json.dumps({"type": kind, "sequence_number": number, **fields}, separators=(",", ":"),
                          ensure_ascii=False)
        return f"event: {kind}\ndata: {body}\n\n".encode()

    def _open_message(self) -> bytes:
        if self._message or self._next_index:
            return b""
        self._message, self._next_index = True, 1
        s = self._shape
        return (self._event("response.output_item.added", output_index=0,
                            item={**s.item("", "in_progress"), "content": []})
                + self._event("response.content_part.added", item_id=s.item_id, output_index=0,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                     "logprobs": []}))

    def _close_message(self, status: str) -> bytes:
        if not self._message:
            return b""
        self._message = False
        s, text = self._shape, "".join(self._parts)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return (self._event("response.output_text.done", item_id=s.item_id, output_index=0, content_index=0,
                            text=text, logprobs=[])
                + self._event("response.content_part.done", item_id=s.item_id, output_index=0, content_index=0,
                              part=part)
                + self._event("response.output_item.done", output_index=0, item=s.item(text, status)))

    def _call(self, call: ToolCall) -> bytes:
        self._calls.append(call)
        out = self._deltas(self._chunker.flush()) + self._close_message("completed")
        index, self._next_index = self._next_index, self._next_index + 1
        item = function_call_item(call, "in_progress")
        return (out + self._event("response.output_item.added", output_index=index, item=item)
                + self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=call.arguments)
                + self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=call.name, arguments=call.arguments)
                + self._event("response.output_item.done", output_index=index,
                              item=function_call_item(call, "completed")))

    def _deltas(self, pieces: list[str]) -> bytes:
        out = self._open_message() if pieces else b""
        for text in pieces:
            self._parts.append(text)
            number = self._sequence
            self._sequence += 1
            if number > self._after:
                out += b"event: response.output_text.delta\ndata: " + self._delta_head + \
                    b',"sequence_number":%d,"delta":%s}\n\n' % (number, json.dumps(text, ensure_ascii=False).encode())
        return out

    def delta(self, sequence: int, text: str) -> bytes:
        return self._deltas(self._chunker.feed(text))

    async def event(self, event: events.ReplyEvent) -> bytes:
        s = self._shape
        match event:
            case events.ReplyStarted():
                running = s.body("in_progress", None, None)
                return (self._event("response.created", response=running)
                        + self._event("response.in_progress", response=running))
            case events.ReplyToolCall():
                return self._call(event.call)
            case events.ReplyFailed():
                return self.failed(event.sequence, event.message, event.retryable)
            case events.ReplyDelta():  # the relay hands deltas to `delta`
                return self.delta(event.sequence, event.text)
            case events.ReplyCompleted() | events.ReplyStopped() | events.ReplyBlocked():
                return await self._ended(event)
            case _:
                assert_never(event)

    async def _ended(self, end: events.ReplyEnd) -> bytes:
        s = self._shape
        out = self._deltas(self._chunker.flush())
        text = "".join(self._parts)
        usage = events.usage_of(end)
        ended = await self._ending(end)
        final = s.body(ended.status, text, usage, reason=ended.reason, completed_at=ended.completed_at,
                       calls=self._calls)
        item_status = "completed" if ended.status == "completed" else "incomplete"
        return (out + self._open_message() + self._close_message(item_status)
                + self._event("response.completed" if ended.status == "completed" else "response.incomplete",
                              response=final))

    def failed(self, sequence: int, message: str, retryable: bool) -> bytes:
        error = {"code": "server_error", "message": message or "the turn failed"}
        return (self._event("error", error={"type": "server_error", "code": "server_error",
                                            "message": error["message"], "param": None})
                + self._event("response.failed", response=self._shape.body("failed", "".join(self._parts), None,
                                                                           error=error, calls=self._calls)))

    async def end(self, outcome: events.Outcome) -> bytes:
        return DONE
