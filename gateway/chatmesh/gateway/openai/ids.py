"""The OpenAI surface's public ids, which carry chatmesh's own: `conv_<hex>` is a conversation, `resp_<hex><hex>`
a turn of a conversation (a response is a chatmesh turn), `chatcmpl-<hex>` the turn a completion answered. A
malformed id names nothing: 404, as for another owner's (no hint either way)."""

from __future__ import annotations

import uuid

from chatmesh.gateway.openai.errors import not_found
from chatmesh.mesh.ids import ConversationId, TurnId


def conversation_id(conv: str) -> str:
    return "conv_" + uuid.UUID(conv).hex


def response_id(conv: str, turn: str) -> str:
    return "resp_" + uuid.UUID(conv).hex + uuid.UUID(turn).hex


def completion_id(turn: str) -> str:
    return "chatcmpl-" + uuid.UUID(turn).hex


def message_id(turn: str, role: str) -> str:
    return f"msg_{uuid.UUID(turn).hex}_{role[0]}"


def parse_conversation(text: str, param: str | None = None) -> ConversationId:
    """`conv_<32 hex>`, or chatmesh's own UUID form (the same conversations as /v1/conversations)."""
    raw = text.removeprefix("conv_") if text.startswith("conv_") else text
    try:
        return ConversationId(str(uuid.UUID(raw)))
    except ValueError:
        raise not_found("conversation", param) from None


def parse_response(text: str, param: str | None = None) -> tuple[ConversationId, TurnId]:
    raw = text.removeprefix("resp_")
    if not text.startswith("resp_") or len(raw) != 64:
        raise not_found("response", param)
    try:
        return ConversationId(str(uuid.UUID(raw[:32]))), TurnId(str(uuid.UUID(raw[32:])))
    except ValueError:
        raise not_found("response", param) from None
