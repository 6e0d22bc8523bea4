"""Request bodies: read with a size cap, parsed as a JSON object no deeper than `MAX_JSON_DEPTH`, each field
checked and named when wrong. Nothing reaches ChatService until its body has passed here, so a bad request stores
nothing. (A client that goes away mid-body raises Starlette's `ClientDisconnect`, answered by the app.)"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from chatmesh.gateway.errors import ApiError, bad_request
from chatmesh.mesh import errors, ids


# Deepest nesting of arrays and objects a body may have. chatmesh's bodies are flat objects; the limit is far
# above them and far below the depth where Python's parser hits its recursion limit (~1,000), which answered 500.
MAX_JSON_DEPTH = 32


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
    except RecursionError:
        raise too_deep() from None
    if not isinstance(value, dict):
        raise bad_request("body: expected a JSON object")
    if depth_over(value, MAX_JSON_DEPTH):
        raise too_deep()
    if not_unicode(value):
        raise bad_request("body: a string holds a lone surrogate (\\udc80-style escapes are not text)")
    return value


def too_deep() -> ApiError:
    return bad_request(f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels")


def depth_over(value: object, limit: int) -> bool:
    """True when arrays and objects nest more than `limit` deep (iterative: no recursion on hostile input)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def not_unicode(value: object) -> bool:
    """True when a string (key or value) holds a lone surrogate: JSON's `\\ud800` escapes (and json.loads, which
    decodes bytes with surrogatepass) let one in, and it fails later, as a 500, wherever the text is encoded
    (password hashing, protobuf). Called after `depth_over`, so the walk is shallow."""
    stack: list[object] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def turn_id_field(body: dict[str, Any], field: str = "turn_id") -> ids.TurnId:
    raw = body.get(field)
    if not isinstance(raw, str):
        raise bad_request(f"{field} is required (a UUID string)")
    try:
        return ids.parse_turn_id(raw, field)
    except errors.InvalidArgument as err:
        raise bad_request(str(err)) from None


def content_field(body: dict[str, Any]) -> str:
    """The message text, present and not blank. Its size is the message size policy's business
    (chatmesh.gateway.tokens), checked by the route before anything reaches chat."""
    raw = body.get("content")
    if not isinstance(raw, str):
        raise bad_request("content is required (a string)")
    if not raw.strip():
        raise bad_request("content must not be empty")
    return raw


def turn_body(body: dict[str, Any]) -> TurnBody:
    return TurnBody(turn_id_field(body), content_field(body))


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
