"""POST /chat/completions: a `chat.completion`, or a stream of `chat.completion.chunk` events ending in
`data: [DONE]` (with `stream_options.include_usage`, a last chunk with no choices carries the usage).

Usage: `prompt_tokens` is the whole prompt chatmesh sent (its system prompt and the stored history included),
`prompt_tokens_details.cached_tokens` the part of it the engine served from its prefix cache. After the reply the
client's history is recorded (`history.py`), before the stream's `[DONE]`, so the client's next request, which
resends it, continues this conversation.
"""

from __future__ import annotations

import json
import time
from typing import Any, assert_never

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatmesh.gateway import bodies, events
from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.openai import ids, replies, wire
from chatmesh.gateway.openai.history import Point
from chatmesh.gateway.openai.stored import options_key
from chatmesh.gateway.openai.surface import (
    CHAT_HEADERS, TASK_HEADER, TURN_KEY_HEADERS, Surface, header, owner_of, retry_count, surface_of,
)
from chatmesh.gateway.openai.tool_wire import chunk_call, completion_calls
from chatmesh.gateway.openai.turns import Ask, Opened
from chatmesh.model.tools import ToolCall
from chatmesh.mesh import logs
from chatmesh.mesh.ids import OwnerId

log = logs.get("chatmesh.gateway.openai")


def usage_json(u: events.Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.output_tokens,
            "total_tokens": u.prompt_tokens + u.output_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                          "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}


class _Recorder:
    """Records the client's history after the reply (see the module docstring)."""

    def __init__(self, surface: Surface, owner: OwnerId, chat: str, messages: tuple[wire.Message, ...],
                 opened: Opened, fresh: bool):
        self.surface, self.owner, self.chat, self.messages, self.opened = surface, owner, chat, messages, opened
        self.fresh = fresh

    async def __call__(self, reply: str, kind: events.SseEvent, calls: tuple[ToolCall, ...] = ()) -> None:
        if self.fresh or kind is events.SseEvent.FAILED:
            return
        seen = (*self.messages, wire.Message(wire.Role.ASSISTANT, reply, tool_calls=calls))
        point = Point(self.opened.point.conversation, self.opened.point.turn)
        try:
            await self.surface.index.record(self.owner, self.surface.index.digest(self.owner, self.chat, seen), point)
        except Exception as exc:  # the reply is stored; the next request will start a conversation of its own
            log.warning("history_record_failed", error=type(exc).__name__)


class ChunkFraming:
    """`chat.completion.chunk` events. A delta is the hot path: a constant prefix and one json.dumps."""

    def __init__(self, surface: Surface, opened: Opened, include_usage: bool, cap: int, record: _Recorder):
        self._head = json.dumps({"id": ids.completion_id(opened.point.turn), "object": "chat.completion.chunk",
                                 "created": int(time.time()), "model": surface.model,
                                 "system_fingerprint": "chatmesh"}, separators=(",", ":"))[:-1]
        self._delta_prefix = b'data: ' + self._head.encode() + b',"choices":[{"index":0,"delta":{"content":'
        self._include_usage = include_usage
        self._cap = cap
        self._record = record
        self._parts: list[str] = []
        self._calls: list[ToolCall] = []
        self._kind = events.SseEvent.FAILED

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = json.dumps({"choices": choices, **extra}, separators=(",", ":"), ensure_ascii=False)
        return b"data: " + self._head.encode() + b"," + body[1:].encode() + b"\n\n"

    def delta(self, sequence: int, text: str) -> bytes:
        self._parts.append(text)
        return self._delta_prefix + json.dumps(text, ensure_ascii=False).encode() + \
            b'},"logprobs":null,"finish_reason":null}]}\n\n'

    async def event(self, event: events.ReplyEvent) -> bytes:
        match event:
            case events.ReplyStarted():
                return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}])
            case events.ReplyToolCall():  # one chunk per call: its id, name and whole arguments
                self._calls.append(event.call)
                return self._chunk([{"index": 0, "delta": {"tool_calls": [chunk_call(event.call, event.index)]},
                                     "logprobs": None, "finish_reason": None}])
            case events.ReplyDelta():  # the relay hands deltas to `delta`
                return self.delta(event.sequence, event.text)
            case events.ReplyFailed():
                return self.failed(event.sequence, event.message, event.retryable)
            case events.ReplyCompleted() | events.ReplyStopped() | events.ReplyBlocked():
                self._kind = event.kind
                out = self._chunk([{"index": 0, "delta": {}, "logprobs": None,
                                    "finish_reason": replies.finish_reason(event, self._cap)}])
                if self._include_usage:
                    out += self._chunk([], usage=usage_json(events.usage_of(event)))
                return out
            case _:
                assert_never(event)

    def failed(self, sequence: int, message: str, retryable: bool) -> bytes:
        self._kind = events.SseEvent.FAILED
        body = {"error": {"message": message or "the turn failed", "type": "server_error", "param": None,
                          "code": "turn_failed_retryable" if retryable else "turn_failed"}}
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    async def end(self, outcome: events.Outcome) -> bytes:
        await self._record("".join(self._parts), self._kind, tuple(self._calls))
        return b"data: [DONE]\n\n"


def ask_of(request: Request, surface: Surface, owner: OwnerId, req: wire.ChatRequest) -> Ask:
    chat = header(request, CHAT_HEADERS) or ""
    given, shape = req.input, options_key(req.options)
    return Ask(owner=owner, chat=chat, history=given.history, content=given.content, options=req.options,
               request_digest=surface.index.digest(owner, f"{chat}\0completion\0{shape}", req.messages),
               key=header(request, TURN_KEY_HEADERS), retry=retry_count(request) > 0,
               fresh=header(request, (TASK_HEADER,)) is not None, results=given.results)


async def create(request: Request) -> Response:
    surface = surface_of(request)
    owner = await owner_of(request, surface)
    body = await bodies.json_object(request, surface.edge.max_body_bytes)
    req = wire.chat_request(body, max_chars=surface.edge.max_body_bytes, context_tokens=surface.context_tokens)
    await surface.check_sizes(req.messages, "messages")
    surface.check_model(req.model)
    if req.user:
        log.info("openai_body_user", owner=owner, body_user=req.user[:64])
    ask = ask_of(request, surface, owner, req)
    cap = min(req.options.max_tokens or surface.reply_cap, surface.reply_cap)
    slot, opened = await replies.start(surface, ask)
    record = _Recorder(surface, owner, ask.chat, req.messages, opened, ask.fresh)
    after = replies.discard(surface, owner, opened) if ask.fresh else None
    if req.stream:
        return replies.relay(surface, slot, opened, ChunkFraming(surface, opened, req.include_usage, cap,
                                                                         record), after)
    reply = await replies.collect(surface, slot, opened, cap, after)
    if reply.kind is events.SseEvent.FAILED:
        raise ApiError(503, "turn_failed", reply.failure or "the turn failed; retry")
    await record(reply.text, reply.kind, reply.tool_calls)
    message: dict[str, Any] = {"role": "assistant", "content": reply.text, "refusal": None, "annotations": []}
    if reply.tool_calls:
        message["tool_calls"] = completion_calls(reply.tool_calls)
        message["content"] = reply.text or None  # as OpenAI answers a reply that is only calls
    return JSONResponse({
        "id": ids.completion_id(opened.point.turn), "object": "chat.completion", "created": int(time.time()),
        "model": surface.model, "system_fingerprint": "chatmesh",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reply.finish_reason}],
        "usage": usage_json(reply.usage), "service_tier": "default"})

