"""The REST/SSE routes: each authenticates, validates, calls ChatService with the principal's owner id and an
owner token minted for that principal (bound to the conversation the route names: owner_tokens.py), and turns
the answer into JSON or an SSE relay. gRPC errors become HTTP through `errors.ApiError.from_rpc` only."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatmesh.gateway import bodies, events
from chatmesh.gateway.auth import Authenticator
from chatmesh.gateway.errors import ApiError, bad_request
from chatmesh.gateway.identity import Principal
from chatmesh.gateway.limits import Budget, LimitBackend, StreamLease
from chatmesh.gateway.metering import TurnCharge, over_allowance
from chatmesh.gateway.owner_tokens import EdgeTokens
from chatmesh.gateway.sanitise import Sanitiser
from chatmesh.gateway.sse import PromptOverAllowance, Relays, Release, TurnCall, TurnRelay, open_relay
from chatmesh.gateway.token_counts import MessageTokens
from chatmesh.gateway.observe import EdgeMetrics
from chatmesh.mesh import ids, logs, tracing
from chatmesh.v1 import chat_pb2, chat_pb2_grpc, common_pb2

log = logs.get("chatmesh.gateway")
T = TypeVar("T")

_ROLES = {common_pb2.ROLE_SYSTEM: "system", common_pb2.ROLE_USER: "user", common_pb2.ROLE_ASSISTANT: "assistant",
          common_pb2.ROLE_TOOL: "tool"}
_STATUSES = {common_pb2.MESSAGE_STATUS_COMPLETE: "complete", common_pb2.MESSAGE_STATUS_STOPPED: "stopped",
             common_pb2.MESSAGE_STATUS_BLOCKED: "blocked"}


@dataclass
class Edge:
    """Everything a route needs, built once per process in the app's lifespan."""

    chat: chat_pb2_grpc.ChatServiceAsyncStub
    auth: Authenticator
    tokens: EdgeTokens
    limits: LimitBackend
    relays: Relays
    allowlist: tuple[str, ...]
    heartbeat_s: float
    max_body_bytes: int
    message_tokens: MessageTokens
    budget: Budget
    deadline_s: float
    observed: EdgeMetrics

    async def unary(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except grpc.aio.AioRpcError as err:
            raise ApiError.from_rpc(err) from None

    async def take_stream(self, owner: ids.OwnerId, *, new_turn: bool) -> StreamSlot:
        """Takes an open-stream slot and, for a new turn, a turn and a prompt-token reservation from the budget
        (after the slot, so a refused stream costs nothing). Whoever holds it ends it with `ended` once the turn's
        stream is over, or `refuse`s it when the turn never started."""
        lease = await self.limits.open_stream(owner)
        try:
            charge = TurnCharge(self.limits, await self.limits.admit_turn(owner, self.message_tokens.input_tokens)) \
                if new_turn else None
        except BaseException:
            await lease.release()
            raise
        return StreamSlot(owner, lease, charge)

    async def relay(self, owner: ids.OwnerId, make: Callable[[int], TurnCall], *, new_turn: bool,
                    release: Release | None = None) -> TurnRelay:
        """Takes a stream slot (`take_stream`), starts the gRPC turn stream `make(allowance)` and relays it; the
        reservation is settled as chatmesh.gateway.metering says. `release`: a new turn's (`releaser`)."""
        slot = await self.take_stream(owner, new_turn=new_turn)
        call: TurnCall | None = None
        try:
            call = make(slot.allowance)
            return await open_relay(
                call, sanitiser=Sanitiser(self.allowlist), heartbeat_s=self.heartbeat_s, relays=self.relays,
                on_end=lambda outcome: self.ended(slot, outcome), on_started=slot.started,
                ttft=self.observed.ttft.labels() if new_turn else None, release=release)
        except BaseException as exc:
            if call is not None:
                call.cancel()
            raise await self.refuse(slot, exc) from None

    def releaser(self, who: Principal, conversation: ids.ConversationId, turn: ids.TurnId) -> Release:
        """How a new turn's relay releases it when its client saw none of it (sse.py's module header)."""
        def release() -> Awaitable[chat_pb2.StopTurnResponse]:
            return self.chat.StopTurn(chat_pb2.StopTurnRequest(
                owner_id=who.owner, conversation_id=conversation, turn_id=turn, release=True),
                timeout=self.deadline_s, metadata=self.tokens.metadata(who, conversation))
        return release

    async def refuse(self, slot: StreamSlot, exc: BaseException) -> BaseException:
        """Gives a slot back whose turn never started; returns what to raise for `exc`."""
        await slot.lease.release()
        if slot.charge is not None:
            await slot.charge.refund()
            if isinstance(exc, PromptOverAllowance):
                return over_allowance(self.budget, slot.charge.reserved, exc.prompt_tokens)
        return exc

    async def ended(self, slot: StreamSlot, outcome: events.Outcome) -> None:
        charge = slot.charge
        self.observed.turns.labels(outcome.kind.value if outcome.kind else "disconnected").inc()
        log.info("turn_stream_ended", owner_id=slot.owner,
                 outcome=outcome.kind.value if outcome.kind else "disconnected", prompt_tokens=outcome.prompt_tokens,
                 started_prompt_tokens=outcome.started_prompt_tokens,
                 reserved=charge.reserved if charge is not None else 0)
        try:
            await slot.lease.release()
        except Exception as exc:  # the stream is over; a limits backend error must not surface as a traceback
            log.warning("limits_after_stream_failed", exc_info=exc)
        if charge is not None:
            await charge.ended(outcome)


@dataclass
class StreamSlot:
    """An owner's open-stream slot and, for a new turn, its prompt-token reservation (`allowance`, sent to chat)."""

    owner: ids.OwnerId
    lease: StreamLease
    charge: TurnCharge | None

    @property
    def allowance(self) -> int:
        return self.charge.reserved if self.charge is not None else 0

    async def started(self, replayed: bool, prompt_tokens: int | None) -> None:
        if self.charge is not None:
            await self.charge.started(replayed, prompt_tokens)


def edge_of(request: Request) -> Edge:
    edge: Edge = request.app.state.edge
    return edge


async def _who(request: Request) -> tuple[Edge, Principal]:
    edge = edge_of(request)
    return edge, await edge.auth.identify(request)


def conversation_json(c: common_pb2.Conversation) -> dict[str, Any]:
    return {"id": c.conversation_id, "title": c.title, "created_at_ms": c.created_at_ms,
            "updated_at_ms": c.updated_at_ms}


def message_json(m: common_pb2.Message, sanitiser: Sanitiser | None) -> dict[str, Any]:
    role = _ROLES.get(m.role, "unspecified")
    content = sanitiser.whole(m.content) if sanitiser is not None and role == "assistant" else m.content
    out: dict[str, Any] = {"index": m.index, "role": role, "content": content,
                           "status": _STATUSES.get(m.status, "unspecified"), "turn_id": m.turn_id,
                           "token_count": m.token_count, "created_at_ms": m.created_at_ms}
    if m.tool_calls:  # a reply that called tools (through the OpenAI-compatible surface)
        out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]
    if m.tool_results:
        out["tool_results"] = [{"tool_call_id": r.tool_call_id, "content": r.content} for r in m.tool_results]
    return out


async def create_conversation(request: Request) -> Response:
    edge, who = await _who(request)
    body = await bodies.json_object(request, edge.max_body_bytes, optional=True)
    title = body.get("title", "")
    if not isinstance(title, str) or len(title) > 200:
        raise bad_request("title must be a string of at most 200 characters")
    reply = await edge.unary(edge.chat.CreateConversation(
        chat_pb2.CreateConversationRequest(owner_id=who.owner, title=title), timeout=edge.deadline_s,
        metadata=edge.tokens.metadata(who)))
    return JSONResponse(conversation_json(reply.conversation), 201)


async def list_conversations(request: Request) -> Response:
    edge, who = await _who(request)
    page_size = _int_query(request, "page_size", 50, 1, 500)
    reply = await edge.unary(edge.chat.ListConversations(
        chat_pb2.ListConversationsRequest(owner_id=who.owner, page_size=page_size), timeout=edge.deadline_s,
        metadata=edge.tokens.metadata(who)))
    return JSONResponse({"conversations": [conversation_json(c) for c in reply.conversations]})


async def get_conversation(request: Request) -> Response:
    edge, who = await _who(request)
    conversation = bodies.conversation_path(request.path_params["conversation_id"])
    reply = await edge.unary(edge.chat.GetConversation(
        chat_pb2.GetConversationRequest(owner_id=who.owner, conversation_id=conversation), timeout=edge.deadline_s,
        metadata=edge.tokens.metadata(who, conversation)))
    out = conversation_json(reply.conversation)
    out["messages"] = [message_json(m, Sanitiser(edge.allowlist)) for m in reply.messages]
    return JSONResponse(out)


async def delete_conversation(request: Request) -> Response:
    edge, who = await _who(request)
    conversation = bodies.conversation_path(request.path_params["conversation_id"])
    await edge.unary(edge.chat.DeleteConversation(
        chat_pb2.DeleteConversationRequest(owner_id=who.owner, conversation_id=conversation),
        timeout=edge.deadline_s, metadata=edge.tokens.metadata(who, conversation)))
    surface = getattr(request.app.state, "openai", None)
    if surface is not None:  # what the OpenAI surface keeps of it (its history digests and turn records)
        await surface.forget(who.owner, conversation)
    return Response(status_code=204)


async def send_turn(request: Request) -> Response:
    edge, who = await _who(request)
    conversation = bodies.conversation_path(request.path_params["conversation_id"])
    turn = bodies.turn_body(await bodies.json_object(request, edge.max_body_bytes))
    await edge.message_tokens.check(turn.content)

    tracing.annotate({"gen_ai.conversation.id": conversation, "chatmesh.turn.id": turn.turn_id})

    def send(allowance: int) -> TurnCall:
        return edge.chat.SendTurn(chat_pb2.SendTurnRequest(
            owner_id=who.owner, conversation_id=conversation, turn_id=turn.turn_id, content=turn.content,
            options=turn.options, prompt_token_allowance=allowance), metadata=edge.tokens.metadata(who, conversation))

    return await edge.relay(who.owner, send, new_turn=True, release=edge.releaser(who, conversation, turn.turn_id))


async def regenerate_turn(request: Request) -> Response:
    edge, who = await _who(request)
    conversation = bodies.conversation_path(request.path_params["conversation_id"])
    bodies.turn_path(request.path_params["turn_id"])  # the reply being replaced; ChatService picks the last one
    new_turn = bodies.turn_id_field(await bodies.json_object(request, edge.max_body_bytes))

    tracing.annotate({"gen_ai.conversation.id": conversation, "chatmesh.turn.id": new_turn})

    def regenerate(allowance: int) -> TurnCall:
        return edge.chat.RegenerateTurn(chat_pb2.RegenerateTurnRequest(
            owner_id=who.owner, conversation_id=conversation, turn_id=new_turn, prompt_token_allowance=allowance),
            metadata=edge.tokens.metadata(who, conversation))

    return await edge.relay(who.owner, regenerate, new_turn=True, release=edge.releaser(who, conversation, new_turn))


async def attach_turn(request: Request) -> Response:
    edge, who = await _who(request)
    conversation = bodies.conversation_path(request.path_params["conversation_id"])
    turn = bodies.turn_path(request.path_params["turn_id"])
    after = _after_sequence(request)
    tracing.annotate({"gen_ai.conversation.id": conversation, "chatmesh.turn.id": turn})
    req = chat_pb2.AttachTurnRequest(owner_id=who.owner, conversation_id=conversation, turn_id=turn,
                                     after_sequence=after)
    metadata = edge.tokens.metadata(who, conversation)
    return await edge.relay(who.owner, lambda _: edge.chat.AttachTurn(req, metadata=metadata), new_turn=False)


async def stop_turn(request: Request) -> Response:
    edge, who = await _who(request)
    conversation = bodies.conversation_path(request.path_params["conversation_id"])
    turn = bodies.turn_path(request.path_params["turn_id"])
    reply = await edge.unary(edge.chat.StopTurn(
        chat_pb2.StopTurnRequest(owner_id=who.owner, conversation_id=conversation, turn_id=turn),
        timeout=edge.deadline_s, metadata=edge.tokens.metadata(who, conversation)))
    return JSONResponse({"stopped": reply.stopped})


async def usage(request: Request) -> Response:
    edge, who = await _who(request)
    days = _int_query(request, "days", 30, 1, 366)
    reply = await edge.unary(edge.chat.GetUsage(chat_pb2.GetUsageRequest(owner_id=who.owner, days=days),
                                                timeout=edge.deadline_s, metadata=edge.tokens.metadata(who)))
    return JSONResponse({"days": [{"day": d.day, "turns": d.turns, "usage": events.usage_json(d.usage)}
                                  for d in reply.days]})


async def export(request: Request) -> Response:
    edge, who = await _who(request)
    reply = await edge.unary(edge.chat.ExportUserData(chat_pb2.ExportUserDataRequest(owner_id=who.owner),
                                                      timeout=edge.deadline_s * 6, metadata=edge.tokens.metadata(who)))
    try:
        json.loads(reply.json)
    except ValueError:
        raise ApiError(503, "unavailable", "the chat service returned a malformed export") from None
    return Response(reply.json, media_type="application/json",
                    headers={"content-disposition": 'attachment; filename="chatmesh-export.json"'})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def _int_query(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer") from None
    if not low <= value <= high:
        raise bad_request(f"{name} must be between {low} and {high}")
    return value


def _after_sequence(request: Request) -> int:
    raw = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    try:
        value = int(raw)
    except ValueError:
        raise bad_request("Last-Event-ID (or after) must be an event id (an integer)") from None
    if not 0 <= value < 2**63:
        raise bad_request("Last-Event-ID (or after) must be an event id from 0 to 2^63-1")
    return value
