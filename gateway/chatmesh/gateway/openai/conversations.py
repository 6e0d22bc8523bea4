"""The Conversations API over chatmesh's own conversations (one store, two surfaces): the same durable,
owner-scoped conversations as /v1/conversations, kept 30 days, deletable (a delete reaches every copy: messages,
summary, turns, the history digests of `history.py`, and the cached KV blocks on every engine)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatmesh.gateway import bodies
from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.openai import ids, wire
from chatmesh.gateway.openai.errors import OpenAIError, invalid, unsupported
from chatmesh.gateway.openai.surface import Surface, owner_of, surface_of
from chatmesh.gateway.openai.tool_wire import function_call_item
from chatmesh.gateway.openai.stored import (
    MessageStatus, StoredConversation, StoredMessage, create_conversation, delete_conversation, read_conversation,
)
from chatmesh.gateway.openai.turns import Seeded, keep_phases, seeds_of
from chatmesh.gateway.openai.wire import Phase
from chatmesh.gateway.sanitise import Sanitiser
from chatmesh.mesh.ids import ConversationId, OwnerId

def conversation_json(c: StoredConversation) -> dict[str, Any]:
    return {"id": ids.conversation_id(c.id), "object": "conversation",
            "created_at": c.created_at_ms // 1000, "metadata": {}}


def items_of(m: StoredMessage, sanitiser: Sanitiser, phase: Phase | None = None) -> list[dict[str, Any]]:
    """A stored message as Conversations items: a message (with the `phase` it was seeded with, if any), an
    assistant's calls as function_call items after it (the message left out when it is only calls), a tool
    message's results as function_call_output items."""
    if m.role is wire.Role.TOOL:
        return [{"type": "function_call_output", "id": "fco_" + call_id.removeprefix("call_"),
                 "call_id": call_id, "output": output, "status": "completed"} for call_id, output in m.tool_results]
    calls = [function_call_item(c, "completed") for c in m.tool_calls]
    return ([] if calls and not m.content else [item_json(m, sanitiser, phase)]) + calls


def item_json(m: StoredMessage, sanitiser: Sanitiser, phase: Phase | None = None) -> dict[str, Any]:
    role = m.role.value
    if m.role is wire.Role.ASSISTANT:
        content = [{"type": "output_text", "text": sanitiser.whole(m.content), "annotations": [], "logprobs": []}]
    else:
        content = [{"type": "input_text", "text": m.content}]
    status = "completed" if m.status is MessageStatus.COMPLETE else "incomplete"
    message_id = ids.message_id(m.turn_id, role) if m.turn_id else f"msg_{m.index}"
    item: dict[str, Any] = {"type": "message", "id": message_id, "status": status, "role": role, "content": content}
    if phase is not None and m.role is wire.Role.ASSISTANT:
        item["phase"] = phase.value
    return item


async def _existing(request: Request) -> tuple[Surface, OwnerId, ConversationId]:
    surface = surface_of(request)
    owner = await owner_of(request, surface)
    return surface, owner, ids.parse_conversation(request.path_params["conversation_id"])


async def _read(surface: Surface, owner: OwnerId, conv: ConversationId) -> StoredConversation:
    try:
        return await read_conversation(surface.edge, owner, conv)
    except ApiError as err:
        if err.status == 404:
            raise OpenAIError(404, "not_found", "conversation not found") from None
        raise


async def create(request: Request) -> Response:
    surface = surface_of(request)
    owner = await owner_of(request, surface)
    body = await bodies.json_object(request, surface.edge.max_body_bytes, optional=True)
    for key, value in body.items():
        if key == "metadata" and not value:
            continue
        if key != "items":
            raise unsupported(key) if key == "metadata" else invalid(key, "unknown parameter", "unknown_parameter")
    seed = Seeded()
    if body.get("items"):
        messages = wire.conversation_items(body["items"], surface.edge.max_body_bytes)
        await surface.check_sizes(messages, "items")
        seed = seeds_of(messages)
    made = await surface.edge.unary(create_conversation(surface.edge, owner, seed.messages))
    await keep_phases(surface.records, owner, made.id, seed)
    return JSONResponse(conversation_json(made))


async def retrieve(request: Request) -> Response:
    surface, owner, conv = await _existing(request)
    return JSONResponse(conversation_json(await _read(surface, owner, conv)))


async def delete(request: Request) -> Response:
    surface, owner, conv = await _existing(request)
    try:
        await surface.edge.unary(delete_conversation(surface.edge, owner, conv, surface.edge.deadline_s * 3))
    except ApiError as err:
        if err.status == 404:
            raise OpenAIError(404, "not_found", "conversation not found") from None
        raise
    await surface.forget(owner, conv)
    return JSONResponse({"id": ids.conversation_id(conv), "object": "conversation.deleted", "deleted": True})


async def items(request: Request) -> Response:
    surface, owner, conv = await _existing(request)
    limit = request.query_params.get("limit", "20")
    order = request.query_params.get("order", "desc")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise invalid("limit", "must be an integer from 1 to 100")
    if order not in ("asc", "desc"):
        raise invalid("order", "must be asc or desc")
    view = await _read(surface, owner, conv)
    sanitiser = Sanitiser(surface.edge.allowlist)
    phases = await surface.records.phases(owner, conv)
    all_items = [item for m in view.messages if not m.superseded
                 for item in items_of(m, sanitiser, phases.get(m.index))]
    if order == "desc":
        all_items.reverse()
    after = request.query_params.get("after")
    if after:
        seen = [i for i, item in enumerate(all_items) if item["id"] == after]
        all_items = all_items[seen[0] + 1:] if seen else []
    page = all_items[:int(limit)]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(all_items) > len(page)})
