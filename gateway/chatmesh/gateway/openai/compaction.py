"""POST /responses/compact over chatmesh's summaries (I3).

chatmesh already compacts long conversations itself: past the summary threshold, chat summarises the older turns
at a turn boundary and stores the summary, and every later prompt is rebuilt from it (the system prompt, the stored
summary, the turns after it, the new message). Compaction is that step on request, for the whole conversation:

- `previous_response_id` names the point: chat summarises the conversation through that response's reply
  (CompactConversation, refused when the conversation has moved on since) and stores it as THE summary; a
  history of the client's own (`input`, ending with a reply) is first stored as a conversation of its own.
- The answer is a `response.compaction`: the conversation's user messages, then one `compaction` item whose
  `encrypted_content` names the point (`cmp1.<conversation><turn>`, opaque to clients) and which carries the
  stored summary text itself in `summary` (an extension field: what the next prompts will hold).
- Sent back in a later `responses.create` input (`[...output, new message]`), the compaction item continues the
  conversation at that point, like `previous_response_id`; the items before it are what it summarised and are
  not sent again. The turn's prompt is then built by chat from the stored summary, exactly as after any summary.

`context_management: [{"type": "compaction", "compact_threshold": N}]` on a create sets that turn's summary
threshold (TurnOptions.compact_threshold_tokens) instead of CHATMESH_SUMMARY_THRESHOLD_TOKENS.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatmesh.gateway import bodies
from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.openai import ids, wire
from chatmesh.gateway.openai.errors import OpenAIError, invalid
from chatmesh.gateway.openai.history import Point
from chatmesh.gateway.openai.surface import owner_of, surface_of
from chatmesh.gateway.openai.stored import (
    MessageStatus, Seed, StoredMessage, compact_conversation, create_conversation, read_conversation,
)
from chatmesh.mesh.ids import ConversationId, TurnId

PREFIX = "cmp1."


def token_of(point: Point) -> str:
    raw = uuid.UUID(point.conversation).bytes + uuid.UUID(point.turn).bytes
    return PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def point_of(token: str, param: str = "input") -> Point:
    """The point a compaction item names; a 400 for anything chatmesh did not write."""
    try:
        if not token.startswith(PREFIX):
            raise ValueError
        raw = base64.urlsafe_b64decode(token[len(PREFIX):] + "=" * (-len(token[len(PREFIX):]) % 4))
        if len(raw) != 32:
            raise ValueError
        return Point(ConversationId(str(uuid.UUID(bytes=raw[:16]))), TurnId(str(uuid.UUID(bytes=raw[16:]))))
    except ValueError:
        raise invalid(param, "not a compaction chatmesh made (POST /responses/compact's output)") from None


async def compact(request: Request) -> Response:
    surface = surface_of(request)
    owner = await owner_of(request, surface)
    body = await bodies.json_object(request, surface.edge.max_body_bytes)
    req = wire.compact_request(body, max_chars=surface.edge.max_body_bytes)
    surface.check_model(req.model)
    edge = surface.edge
    expect: str = ""
    if req.previous_response_id is not None:
        point = Point(*ids.parse_response(req.previous_response_id, "previous_response_id"))
        conversation, expect = point.conversation, point.turn
    elif req.compacted is not None:
        point = point_of(req.compacted)
        conversation, expect = point.conversation, point.turn
    else:
        await surface.check_sizes(req.items, "input")
        made = await edge.unary(create_conversation(edge, owner, [Seed(m.role, m.text) for m in req.items
                                                                   if m.text.strip()]))
        conversation = made.id
    try:
        done = await edge.unary(compact_conversation(edge, owner, conversation, expect))
        view = await read_conversation(edge, owner, conversation)
    except ApiError as err:
        if err.status == 404:
            raise OpenAIError(404, "not_found", "response not found", "previous_response_id") from None
        raise
    live = view.live
    last = Point(conversation, TurnId(live[-1].turn_id or ""))
    return JSONResponse({
        "id": "cmp_" + uuid.UUID(conversation).hex + uuid.UUID(last.turn).hex, "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [*(_user_item(m) for m in live if m.role is wire.Role.USER
                     and m.status is not MessageStatus.BLOCKED),
                   {"type": "compaction", "id": "cmp_" + uuid.UUID(last.turn).hex, "encrypted_content": token_of(last),
                    "created_by": "chatmesh", "summary": done.summary}],
        "usage": {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": done.token_count if done.prompt_tokens else 0,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": done.prompt_tokens + (done.token_count if done.prompt_tokens else 0)}})


def _user_item(m: StoredMessage) -> dict[str, Any]:
    return {"type": "message", "id": ids.message_id(m.turn_id, "user") if m.turn_id else f"msg_{m.index}",
            "status": "completed", "role": "user", "content": [{"type": "input_text", "text": m.content}]}
