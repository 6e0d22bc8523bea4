"""The Responses API with server-side state: a response is a chatmesh turn, `resp_<conversation><turn>`.

- POST /responses: `input` (a string or message items) answered as the next turn of the conversation of
  `previous_response_id` (guarded: if that response is no longer the conversation's last, the answer forks a new
  conversation from it, as OpenAI branches), of `conversation` (appended as stored), or of a new conversation
  seeded with the input's earlier items and created with `instructions` as its first message. `instructions`
  apply to the turn they come with (chat does not repeat them when they are the conversation's own). `store:
  false` answers in a throwaway conversation, deleted when the response ends (GET then finds nothing).
  `background: true` runs it without its client (`background.py`).
- The object: every field Open Responses requires (`response_object.py`), recorded at create (`records.py`) with
  how it ended, so GET on any gateway answers what create did. Streaming: the events of `response_events.py`.
- GET /responses/{id} (with `stream=true&starting_after=N`, a background response's events again), DELETE
  /responses/{id} (the turn's messages and, on every engine, the conversation's cached blocks), POST
  /responses/{id}/cancel (chatmesh's stop: the partial reply is kept, status `cancelled`).
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
from chatmesh.gateway.openai import background, compaction, ids, replies, wire
from chatmesh.gateway.openai.errors import OpenAIError, invalid
from chatmesh.gateway.openai.history import Point
from chatmesh.gateway.openai.records import Ended, Recorded
from chatmesh.gateway.openai.response_events import Ending, EventFraming, Immediate, Outcome
from chatmesh.gateway.openai.response_object import Shape, request_fields, status_of
from chatmesh.gateway.openai.tool_wire import NO_TOOLS
from chatmesh.gateway.openai.surface import (
    TURN_KEY_HEADERS, Surface, header, owner_of, retry_count, surface_of,
)
from chatmesh.gateway.openai.stored import delete_turn, options_key, read_turn, stop_turn
from chatmesh.gateway.openai.turns import Ask, Opened
from chatmesh.mesh import logs
from chatmesh.mesh.ids import OwnerId

log = logs.get("chatmesh.gateway.openai")
T = TypeVar("T")
CANCEL_WAIT_S = 3.0


def _fields(surface: Surface, req: wire.ResponseRequest | None, created_at: int) -> dict[str, Any]:
    """The request side of the object; without the request (a response this edge has no record of), the
    defaults it would have run with."""
    opts = req.options if req is not None else wire.Options()
    return request_fields(
        model=surface.model, created_at=created_at,
        instructions=(req.instructions or None) if req is not None else None,
        previous_response_id=req.previous_response_id if req is not None else None,
        max_output_tokens=opts.max_tokens,
        temperature=opts.temperature if opts.temperature is not None else surface.sampling.temperature,
        top_p=opts.top_p if opts.top_p is not None else surface.sampling.top_p,
        store=req.store if req is not None else True, background=req.background if req is not None else False,
        truncation=req.truncation if req is not None else "disabled",
        metadata=req.metadata if req is not None else {}, user=req.user if req is not None else None,
        safety_identifier=req.safety_identifier if req is not None else None,
        prompt_cache_key=req.prompt_cache_key if req is not None else None,
        tools=req.tools if req is not None else NO_TOOLS)


class _Recording:
    """A foreground response's record (`records.py`): its object written as it starts, off the token path, and
    how it ended written before the client hears it ended, so a GET right after agrees."""

    def __init__(self, surface: Surface, owner: OwnerId, point: Point, shape: Shape, cap: int, digest: str,
                 keep: bool):
        self.surface, self.owner, self.point, self.cap = surface, owner, point, cap
        self._described = asyncio.create_task(surface.records.describe(
            owner, point.turn, point.conversation, digest, shape.recorded, cap)) if keep else None

    async def end(self, outcome: Outcome) -> None:
        if self._described is None:
            return
        try:
            await self._described
            await self.surface.records.end(self.owner, self.point.turn,
                                           Ended(outcome.status, outcome.reason, outcome.completed_at))
        except Exception as exc:  # the reply is stored; retrieve then decides from the turn alone
            log.warning("response_record_failed", error=type(exc).__name__)

    def ending(self) -> Ending:
        async def ending(end: events.ReplyEnd) -> Outcome:
            status, reason = status_of(end.kind, replies.finish_reason(end, self.cap))
            outcome = Outcome(status, reason, int(time.time()))
            await self.end(outcome)
            return outcome
        return ending


def _split_input(req: wire.ResponseRequest, continuing: bool) -> tuple[tuple[wire.Message, ...], str]:
    """The input's earlier items (the seed of a new conversation) and the turn's instructions. A continuing
    response takes one new user message; system/developer items in its input join its instructions."""
    history = req.input.history
    instructions = req.instructions
    if continuing:
        extra = [m.text for m in history if m.role is wire.Role.SYSTEM]
        for i, m in enumerate(history):
            if m.role is wire.Role.ASSISTANT and m.tool_calls and not m.text:
                continue  # the calls its tool results answer, sent back with them: already in the conversation
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
    if req.compacted is not None:  # a compaction item: continue where it summarised (compaction.py)
        point = compaction.point_of(req.compacted, "input")
        after = (point.conversation, point.turn)
    conversation = ids.parse_conversation(req.conversation, "conversation") if req.conversation else None
    history, instructions = _split_input(req, continuing=after is not None or conversation is not None)
    options = wire.Options(req.options.temperature, req.options.top_p, None, (), req.options.max_tokens,
                           instructions, req.tools, req.compact_threshold)
    shape_key = json.dumps([req.previous_response_id, req.conversation, req.raw_input, instructions,
                            options_key(options), req.store, req.background], sort_keys=True)
    given = req.input
    ask = Ask(owner=owner, chat="", history=history, content=given.content, options=options,
              request_digest=surface.index.digest(owner, "response\0" + shape_key, ()),
              key=header(request, TURN_KEY_HEADERS), retry=retry_count(request) > 0,
              after=Point(*after) if after else None, conversation=conversation, results=given.results,
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
    try:
        shape = await _shape_of(surface, owner, opened, req)
    except BaseException as exc:
        opened.call.cancel()
        await surface.edge.ended(slot, events.Outcome(None, 0))
        raise exc
    if req.background:
        return await background.start(surface, owner, slot, opened, shape, cap, ask.request_digest, req.stream)
    recording = _Recording(surface, owner, opened.point, shape, cap, ask.request_digest, keep=not ask.fresh)
    done = replies.discard(surface, owner, opened) if ask.fresh else None
    if req.stream:
        return replies.relay(surface, slot, opened, EventFraming(shape, recording.ending(), Immediate()), done)
    reply = await replies.collect(surface, slot, opened, cap, done)
    if reply.kind is events.SseEvent.FAILED:
        raise ApiError(503, "turn_failed", reply.failure or "the turn failed; retry")
    status, reason = status_of(reply.kind, reply.finish_reason)
    outcome = Outcome(status, reason, int(time.time()))
    await recording.end(outcome)
    return JSONResponse(shape.body(status, reply.text, reply.usage, reason=reason, completed_at=outcome.completed_at,
                                   calls=reply.tool_calls))


async def _shape_of(surface: Surface, owner: OwnerId, opened: Opened, req: wire.ResponseRequest) -> Shape:
    """The object's request side: this request's, or, when the turn replays (a retry), the first request's."""
    if opened.replayed:
        recorded = await surface.records.get(owner, opened.point.turn)
        if recorded is not None and recorded.body:
            return Shape(opened.point, recorded.body)
    return Shape(opened.point, _fields(surface, req, int(time.time())))


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


async def _body(surface: Surface, owner: OwnerId, point: Point) -> dict[str, Any]:
    """The object as create answered it: its recorded request side and ending, the turn's reply and usage."""
    turn = await _of_response(read_turn(surface.edge, owner, point))
    recorded: Recorded | None = await surface.records.get(owner, point.turn)
    if recorded is not None and (recorded.conversation != point.conversation or not recorded.body):
        recorded = None
    shape = Shape(point, recorded.body if recorded is not None else
                  _fields(surface, None, turn.stored_at_ms // 1000 or int(time.time())))
    text = Sanitiser(surface.edge.allowlist).whole(turn.reply)
    end = turn.end
    if end is None:
        return shape.body("in_progress", text, None)
    if isinstance(end, events.ReplyFailed):
        return shape.body("failed", None, None, error={"code": "server_error", "message": "the turn failed"})
    ended = recorded.ended if recorded is not None else None
    if ended is None:  # no record of how it ended: decided from the stored turn and the cap it ran with
        cap = recorded.cap if recorded is not None and recorded.cap else surface.reply_cap
        status, reason = status_of(end.kind, replies.finish_reason(end, cap))
        ended = Ended(status, reason, turn.stored_at_ms // 1000 or None)
    return shape.body(ended.status, text, turn.usage, reason=ended.reason, completed_at=ended.completed_at,
                      calls=turn.tool_calls)


async def retrieve(request: Request) -> Response:
    surface, owner, point = await _turn(request)
    if _flag(request, "stream"):
        raw = request.query_params.get("starting_after", "-1")
        if not raw.lstrip("-").isdigit() or int(raw) < -1:
            raise invalid("starting_after", "must be an event's sequence_number (an integer from 0)")
        return await background.resume(surface, owner, point, int(raw))
    return JSONResponse(await _body(surface, owner, point))


def _flag(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise invalid(name, "must be true or false")
    return raw in ("true", "1")


async def delete(request: Request) -> Response:
    surface, owner, point = await _turn(request)
    await _of_response(delete_turn(surface.edge, owner, point))
    await surface.index.forget(owner, point.conversation)
    await surface.records.drop(owner, point.turn)
    return JSONResponse({"id": ids.response_id(point.conversation, point.turn), "object": "response",
                         "deleted": True})


async def cancel(request: Request) -> Response:
    """Stops the response's generation (chatmesh's stop: the partial reply is stored and kept) and answers the
    response once the stop has landed."""
    surface, owner, point = await _turn(request)
    await _of_response(stop_turn(surface.edge, owner, point))
    deadline = time.monotonic() + CANCEL_WAIT_S
    body = await _body(surface, owner, point)
    while body["status"] == "in_progress" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        body = await _body(surface, owner, point)
    return JSONResponse(body)

