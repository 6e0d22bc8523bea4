"""The Responses API with server-side state: a response is a chatmesh turn, `resp_<conversation><turn>`.

- POST /responses: `input` (a string or message items) answered as the next turn of the conversation of
  `previous_response_id` (guarded: if that response is no longer the conversation's last, the answer forks a new
  conversation from it, as OpenAI branches), of `conversation` (appended as stored), or of a new conversation
  seeded with the input's earlier items and created with `instructions` as its first message. `instructions`
  apply to the turn they come with (chat does not repeat them when they are the conversation's own). `store:
  false` answers in a throwaway conversation, deleted when the response ends (GET then finds nothing).
- Streaming: response.created, response.in_progress, response.output_item.added, response.content_part.added,
  response.output_text.delta..., response.output_text.done, response.content_part.done, response.output_item.done,
  then exactly one of response.completed, response.incomplete (token cap, moderation, cancelled) or
  response.failed; each with a `sequence_number` from 0.
- GET /responses/{id}, DELETE /responses/{id} (the turn's messages and, on every engine, the conversation's cached
  blocks), POST /responses/{id}/cancel (chatmesh's stop: the partial reply is kept, status `cancelled`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import grpc

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatmesh.gateway import bodies, events
from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.sanitise import Sanitiser
from chatmesh.gateway.openai import ids, replies, wire
from chatmesh.gateway.openai.errors import OpenAIError, invalid
from chatmesh.gateway.openai.history import Point
from chatmesh.gateway.openai.surface import (
    TURN_KEY_HEADERS, Surface, header, owner_of, retry_count, surface_of,
)
from chatmesh.gateway.openai.turns import Ask, owner_token
from chatmesh.mesh import logs
from chatmesh.mesh.ids import OwnerId
from chatmesh.v1 import chat_pb2, common_pb2

log = logs.get("chatmesh.gateway.openai")
T = TypeVar("T")
CANCEL_WAIT_S = 3.0


def usage_json(u: common_pb2.Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "output_tokens": u.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.output_tokens}


def status_of(kind: events.SseEvent, finish: str) -> tuple[str, dict[str, str] | None]:
    """A final turn event as a response status and its incomplete_details."""
    match kind:
        case events.SseEvent.COMPLETED:
            return ("incomplete", {"reason": "max_output_tokens"}) if finish == "length" else ("completed", None)
        case events.SseEvent.STOPPED:
            return "cancelled", None
        case events.SseEvent.BLOCKED:
            return "incomplete", {"reason": "content_filter"}
        case events.SseEvent.FAILED | events.SseEvent.STARTED | events.SseEvent.DELTA:
            return "failed", None


class Shape:
    """The response object's fields that do not change while it runs."""

    def __init__(self, surface: Surface, point: Point, created_at: float, req: wire.ResponseRequest | None,
                 previous: str | None):
        self.id = ids.response_id(point.conversation, point.turn)
        self.item_id = ids.message_id(point.turn, "assistant")
        opts = req.options if req is not None else wire.Options()
        self.fixed: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": int(created_at), "model": surface.model,
            "instructions": (req.instructions or None) if req is not None else None,
            "previous_response_id": previous, "conversation": {"id": ids.conversation_id(point.conversation)},
            "max_output_tokens": opts.max_tokens, "temperature": opts.temperature, "top_p": opts.top_p,
            "store": req.store if req is not None else True, "background": False, "parallel_tool_calls": False,
            "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": {}, "user": req.user if req is not None else None}

    def item(self, text: str, status: str) -> dict[str, Any]:
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def body(self, status: str, text: str | None, usage: common_pb2.Usage | None,
             incomplete: dict[str, str] | None = None, error: dict[str, str] | None = None) -> dict[str, Any]:
        done = "completed" if status == "completed" else "incomplete"
        return {**self.fixed, "status": status, "error": error, "incomplete_details": incomplete,
                "output": [] if text is None else [self.item(text, done)],
                "usage": usage_json(usage) if usage is not None else None}


class EventFraming:
    """`response.*` events, each with its sequence number (see the module docstring)."""

    def __init__(self, shape: Shape, cap: int):
        self._shape = shape
        self._cap = cap
        self._sequence = 0
        self._parts: list[str] = []
        self._delta_head = json.dumps({"type": "response.output_text.delta", "item_id": shape.item_id,
                                       "output_index": 0, "content_index": 0, "logprobs": []},
                                      separators=(",", ":"))[:-1].encode()

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = json.dumps({"type": kind, "sequence_number": self._sequence, **fields}, separators=(",", ":"),
                          ensure_ascii=False)
        self._sequence += 1
        return f"event: {kind}\ndata: {body}\n\n".encode()

    def delta(self, sequence: int, text: str) -> bytes:
        self._parts.append(text)
        out = b"event: response.output_text.delta\ndata: " + self._delta_head + b',"sequence_number":%d,"delta":%s}\n\n' % (
            self._sequence, json.dumps(text, ensure_ascii=False).encode())
        self._sequence += 1
        return out

    def event(self, event: chat_pb2.TurnEvent, kind: events.SseEvent) -> bytes:
        s = self._shape
        if kind is events.SseEvent.STARTED:
            running = s.body("in_progress", None, None)
            return (self._event("response.created", response=running)
                    + self._event("response.in_progress", response=running)
                    + self._event("response.output_item.added", output_index=0, item={**s.item("", "in_progress"),
                                                                                      "content": []})
                    + self._event("response.content_part.added", item_id=s.item_id, output_index=0,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        if kind is events.SseEvent.FAILED:
            return self.failed(event.sequence, event.failed.message, event.failed.retryable)
        text = "".join(self._parts)
        usage = replies.usage_of(event)
        stated = event.completed.finish_reason if kind is events.SseEvent.COMPLETED else ""
        status, incomplete = status_of(kind, replies.finish_reason(kind, usage, stated, self._cap))
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        final = s.body(status, text, usage, incomplete)
        return (self._event("response.output_text.done", item_id=s.item_id, output_index=0, content_index=0,
                            text=text, logprobs=[])
                + self._event("response.content_part.done", item_id=s.item_id, output_index=0, content_index=0,
                              part=part)
                + self._event("response.output_item.done", output_index=0,
                              item=s.item(text, "completed" if status == "completed" else "incomplete"))
                + self._event("response.completed" if status == "completed" else "response.incomplete",
                              response=final))

    def failed(self, sequence: int, message: str, retryable: bool) -> bytes:
        error = {"code": "server_error", "message": message or "the turn failed"}
        return self._event("response.failed", response=self._shape.body("failed", "".join(self._parts), None,
                                                                        error=error))

    async def end(self, outcome: events.Outcome) -> bytes:
        return b""


def _split_input(req: wire.ResponseRequest, continuing: bool) -> tuple[tuple[wire.Message, ...], str]:
    """The input's earlier items (the seed of a new conversation) and the turn's instructions. A continuing
    response takes one new user message; system/developer items in its input join its instructions."""
    history = req.history
    instructions = req.instructions
    if continuing:
        extra = [m.text for m in history if m.role is wire.Role.SYSTEM]
        for i, m in enumerate(history):
            if m.role is not wire.Role.SYSTEM:
                raise invalid(f"input[{i}]", "a response that continues a conversation takes one new user message "
                                             "(earlier messages are already in the conversation)")
        instructions = "\n\n".join(t for t in (instructions, *extra) if t)
        history = ()
    elif instructions:
        history = (wire.Message(wire.Role.SYSTEM, instructions), *history)
    return history, instructions


async def create(request: Request) -> Response:
    surface = surface_of(request)
    owner = await owner_of(request, surface)
    body = await bodies.json_object(request, surface.edge.max_body_bytes)
    req = wire.response_request(body, max_chars=surface.edge.max_body_bytes,
                                context_tokens=surface.context_tokens)
    await surface.check_sizes(req.items, "input")
    surface.check_model(req.model)
    after = ids.parse_response(req.previous_response_id, "previous_response_id") \
        if req.previous_response_id else None
    conversation = ids.parse_conversation(req.conversation, "conversation") if req.conversation else None
    history, instructions = _split_input(req, continuing=after is not None or conversation is not None)
    options = wire.Options(req.options.temperature, req.options.top_p, None, (), req.options.max_tokens,
                           instructions).proto()
    shape_key = json.dumps([req.previous_response_id, req.conversation, req.raw_input, instructions,
                            options.SerializeToString(deterministic=True).hex()], sort_keys=True)
    ask = Ask(owner=owner, chat="", history=history, content=req.content, options=options,
              request_digest=surface.index.digest(owner, "response\0" + shape_key, ()),
              key=header(request, TURN_KEY_HEADERS), retry=retry_count(request) > 0,
              after=Point(*after) if after else None, conversation=conversation,
              fresh=not req.store and after is None and conversation is None,
              seed_from=Point(*after) if after and not req.store else None)
    if not req.store and (after is not None or conversation is not None):
        # store=false continuing a stored conversation: answer in a throwaway fork of it
        ask = Ask(**{**ask.__dict__, "after": None, "conversation": None, "fresh": True,
                     "seed_from": Point(*after) if after else None})
        if conversation is not None:
            raise invalid("store", "store=false cannot append to a conversation; use previous_response_id")
    cap = min(req.options.max_tokens or surface.reply_cap, surface.reply_cap)
    slot, opened = await replies.start(surface, ask)
    shape = Shape(surface, opened.point, time.time(), req, req.previous_response_id)
    done = replies.discard(surface, owner, opened) if ask.fresh else None
    if req.stream:
        return replies.relay(surface, slot, opened, EventFraming(shape, cap), done)
    reply = await replies.collect(surface, slot, opened, cap, done)
    if reply.kind is events.SseEvent.FAILED:
        raise ApiError(503, "turn_failed", reply.failure or "the turn failed; retry")
    status, incomplete = status_of(reply.kind, reply.finish_reason)
    return JSONResponse(shape.body(status, reply.text, reply.usage, incomplete))


async def _of_response(call: Awaitable[T]) -> T:
    """A ChatService call about one response; its NOT_FOUND is the response's (never a hint which part)."""
    try:
        return await call
    except grpc.aio.AioRpcError as err:
        if err.code() is grpc.StatusCode.NOT_FOUND:
            raise OpenAIError(404, "not_found", "response not found") from None
        raise ApiError.from_rpc(err) from None


async def _turn(request: Request) -> tuple[Surface, OwnerId, Point]:
    surface = surface_of(request)
    owner = await owner_of(request, surface)
    return surface, owner, Point(*ids.parse_response(request.path_params["response_id"]))


_STATUS = {chat_pb2.TURN_STATUS_COMPLETED: events.SseEvent.COMPLETED,
           chat_pb2.TURN_STATUS_STOPPED: events.SseEvent.STOPPED,
           chat_pb2.TURN_STATUS_BLOCKED: events.SseEvent.BLOCKED,
           chat_pb2.TURN_STATUS_FAILED: events.SseEvent.FAILED}


async def _body(surface: Surface, owner: OwnerId, point: Point) -> dict[str, Any]:
    turn = await _of_response(surface.edge.chat.GetTurn(chat_pb2.GetTurnRequest(
        owner_id=owner, conversation_id=point.conversation, turn_id=point.turn), timeout=surface.edge.deadline_s,
        metadata=owner_token(surface.edge, owner, point.conversation)))
    shape = Shape(surface, point, turn.stored_at_ms / 1000 or time.time(), None, None)
    text = Sanitiser(surface.edge.allowlist).whole(turn.reply)
    kind = _STATUS.get(turn.status)
    if kind is None:
        return shape.body("in_progress", text, None)
    if kind is events.SseEvent.FAILED:
        return shape.body("failed", None, None, error={"code": "server_error", "message": "the turn failed"})
    status, incomplete = status_of(kind, replies.finish_reason(kind, turn.usage, turn.finish_reason,
                                                                surface.reply_cap))
    return shape.body(status, text, turn.usage, incomplete)


async def retrieve(request: Request) -> Response:
    surface, owner, point = await _turn(request)
    return JSONResponse(await _body(surface, owner, point))


async def delete(request: Request) -> Response:
    surface, owner, point = await _turn(request)
    await _of_response(surface.edge.chat.DeleteTurn(chat_pb2.DeleteTurnRequest(
        owner_id=owner, conversation_id=point.conversation, turn_id=point.turn), timeout=surface.edge.deadline_s,
        metadata=owner_token(surface.edge, owner, point.conversation)))
    await surface.index.forget(owner, point.conversation)
    return JSONResponse({"id": ids.response_id(point.conversation, point.turn), "object": "response",
                         "deleted": True})


async def cancel(request: Request) -> Response:
    """Stops the response's generation (chatmesh's stop: the partial reply is stored and kept) and answers the
    response once the stop has landed."""
    surface, owner, point = await _turn(request)
    await _of_response(surface.edge.chat.StopTurn(chat_pb2.StopTurnRequest(
        owner_id=owner, conversation_id=point.conversation, turn_id=point.turn), timeout=surface.edge.deadline_s,
        metadata=owner_token(surface.edge, owner, point.conversation)))
    deadline = time.monotonic() + CANCEL_WAIT_S
    body = await _body(surface, owner, point)
    while body["status"] == "in_progress" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        body = await _body(surface, owner, point)
    return JSONResponse(body)

