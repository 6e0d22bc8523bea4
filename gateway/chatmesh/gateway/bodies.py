"""Request bodies: read with a size cap, bounded in elements before they are parsed, parsed as a JSON object no
deeper than `MAX_JSON_DEPTH`, each field checked and named when wrong. Nothing reaches ChatService until its body
has passed here, so a bad request stores nothing. (A client that goes away mid-body raises Starlette's
`ClientDisconnect`, answered by the app.)

Parsing happens on the event loop (json.loads holds the GIL, so a thread would not spare the loop), so what a
body may cost is bounded before it is parsed, in elements as well as bytes and depth: a JSON value holds at most
one element more than its commas and opening brackets, so a body with at most `MAX_JSON_ELEMENTS` of those bytes
(counted anywhere, strings included: a few C passes, ~1 ms a MiB) costs at most that many objects to parse (200k:
~15 ms and ~13 MB here). A 4 MiB body of 1.4 million empty arrays took ~0.3-1.2 s of the loop and ~100 MB per
copy (issue 30: /healthz went from 35 ms to 1.5 s, open streams stalled 2 s); it is now refused (413) in ~3 ms.
Counting in strings too keeps the worst case at that ~3 ms (dropping the strings first costs up to seconds on a
body of many short strings) at the price of counting a message's own commas: no message within the token limits
holds that many (a comma is a token or part of one, and the largest context is 131k tokens). The body must be
UTF-8 (RFC 8259: JSON between systems is)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from chatmesh.gateway.errors import ApiError, bad_request
from chatmesh.mesh import errors, ids
from chatmesh.v1 import chat_pb2


# Deepest nesting of arrays and objects a body may have. chatmesh's bodies are flat objects; the limit is far
# above them and far below the depth where Python's parser hits its recursion limit (~1,000), which answered 500.
MAX_JSON_DEPTH = 32
# Most commas and opening brackets a body may hold (strings included): a bound on the elements parsing it makes.
MAX_JSON_ELEMENTS = 200_000


@dataclass(frozen=True)
class TurnBody:
    turn_id: ids.TurnId
    content: str
    options: chat_pb2.TurnOptions | None = None  # how the reply is sampled (`options_field`)


# A turn's optional `options` on chatmesh's own routes: the same knobs as chat's TurnOptions (chat checks the ranges).
_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "temperature": (int, float), "top_p": (int, float), "seed": (int,), "max_tokens": (int,), "stop": (list,)}


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
    if elements_over(raw, MAX_JSON_ELEMENTS):
        raise ApiError(413, "payload_too_large", f"request body holds more than {MAX_JSON_ELEMENTS:,} JSON "
                                                 f"elements (commas and opening brackets)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("body: not UTF-8 text (an invalid byte sequence, or a lone surrogate)") from None
    try:
        value = json.loads(text)
    except ValueError:
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


def elements_over(data: bytes | bytearray, limit: int) -> bool:
    """Whether a body holds more than `limit` commas and opening brackets (an upper bound on its elements, see the
    module header)."""
    return data.count(b",") + data.count(b"[") + data.count(b"{") > limit


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
    (chatmesh.gateway.token_counts), checked by the route before anything reaches chat."""
    raw = body.get("content")
    if not isinstance(raw, str):
        raise bad_request("content is required (a string)")
    if not raw.strip():
        raise bad_request("content must not be empty")
    return raw


def turn_body(body: dict[str, Any]) -> TurnBody:
    return TurnBody(turn_id_field(body), content_field(body), options_field(body))


def options_field(body: dict[str, Any]) -> chat_pb2.TurnOptions | None:
    """`options`: {"temperature", "top_p", "seed", "max_tokens", "stop"}, each optional (absent: the mesh's
    defaults). Types are checked here, ranges by chat (400 naming the field either way)."""
    raw = body.get("options")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request("options must be an object")
    unknown = sorted(set(raw) - set(_OPTION_TYPES))
    if unknown:
        raise bad_request(f"options: unknown field(s) {', '.join(unknown)}; known: {', '.join(_OPTION_TYPES)}")
    for name, value in raw.items():
        if not isinstance(value, _OPTION_TYPES[name]) or isinstance(value, bool):
            raise bad_request(f"options.{name} has the wrong type")
    stop = raw.get("stop", [])
    if not all(isinstance(s, str) for s in stop):
        raise bad_request("options.stop must be a list of strings")
    seed = raw.get("seed")
    if seed is not None and not 0 <= seed < 2 ** 64:
        raise bad_request("options.seed must be between 0 and 2^64 - 1")
    max_tokens = raw.get("max_tokens", 0)
    if not 0 <= max_tokens < 2 ** 31:  # chat judges the reply budget; past int32 the field cannot carry it
        raise bad_request("options.max_tokens must be between 1 and 2^31 - 1")
    out = chat_pb2.TurnOptions(stop=stop, max_tokens=max_tokens)
    if "temperature" in raw:
        out.temperature = float(raw["temperature"])
    if "top_p" in raw:
        out.top_p = float(raw["top_p"])
    if seed is not None:
        out.seed = seed
    return out


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
