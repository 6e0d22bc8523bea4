"""Request bodies: read with a size cap, parsed as a JSON object, each field checked and named when wrong.
Nothing reaches ChatService until its body has passed here, so a bad request stores nothing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from chatmesh.gateway.errors import ApiError, bad_request
from chatmesh.mesh import errors, ids


@dataclass(frozen=True)
class TurnBody:
    turn_id: ids.TurnId
    content: str


async def json_object(request: Request, max_bytes: int, *, optional: bool = False) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, "payload_too_large", f"request body over {max_bytes} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise ApiError(413, "payload_too_large", f"request body over {max_bytes} bytes")
    if not raw.strip() and optional:
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("body: malformed JSON") from None
    if not isinstance(value, dict):
        raise bad_request("body: expected a JSON object")
    return value


def turn_id_field(body: dict[str, Any], field: str = "turn_id") -> ids.TurnId:
    raw = body.get(field)
    if not isinstance(raw, str):
        raise bad_request(f"{field} is required (a UUID string)")
    try:
        return ids.parse_turn_id(raw, field)
    except errors.InvalidArgument as err:
        raise bad_request(str(err)) from None


def content_field(body: dict[str, Any], max_chars: int) -> str:
    raw = body.get("content")
    if not isinstance(raw, str):
        raise bad_request("content is required (a string)")
    if not raw.strip():
        raise bad_request("content must not be empty")
    if len(raw) > max_chars:
        raise ApiError(413, "payload_too_large", f"content over {max_chars} characters")
    return raw


def turn_body(body: dict[str, Any], max_chars: int) -> TurnBody:
    return TurnBody(turn_id_field(body), content_field(body, max_chars))


def conversation_path(text: str) -> ids.ConversationId:
    """A path id that is not a UUID names no conversation: 404, as for another owner's id (no hint)."""
    try:
        return ids.parse_conversation_id(text)
    except errors.InvalidArgument:
        raise ApiError(404, "not_found", "conversation not found") from None


def turn_path(text: str) -> ids.TurnId:
    try:
        return ids.parse_turn_id(text)
    except errors.InvalidArgument:
        raise ApiError(404, "not_found", "turn not found") from None
