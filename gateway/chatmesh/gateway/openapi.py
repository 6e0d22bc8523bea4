"""The OpenAPI 3.1 document of the edge, served at /openapi.json. Written out by hand, next to nothing else, so
it says exactly what the routes accept and answer; a test checks it names every route of the app."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from chatmesh.gateway.openai import openapi as openai_doc
from starlette.responses import JSONResponse, Response

UUID = {"type": "string", "format": "uuid"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    meaning = {400: "invalid argument (the message names the field; code message_too_long names the size limit)",
               401: "not authenticated",
               403: "CSRF token missing or wrong (session requests), or a cross-site request to the development "
                    "identity", 404: "not found (or not yours)",
               408: "the request body did not arrive in time (CHATMESH_EDGE_BODY_TIMEOUT_S)",
               409: "conflict: turn id reused with other content, or the state forbids it",
               413: "body too large (CHATMESH_MAX_BODY_BYTES), or holding more JSON elements than the edge parses",
               421: "the development identity answers only loopback host names",
               429: "a per-user limit is reached, or (unauthenticated) the per-address limit of requests that fail "
                    "authentication; the message names it (see Retry-After)",
               503: "a dependency is unavailable; retry"}
    out: dict[str, Any] = {}
    for status in sorted({401, 403, 408, 421, 429, *statuses, 503}):
        response = {"description": meaning[status], **_json(_ref("Error"))}
        if status == 429:
            response["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
        out[str(status)] = response
    return out


SSE = {
    "description": "text/event-stream of turn events: turn.started, turn.delta ({text}), then one of turn.completed "
                   "({usage, replica_id}), turn.stopped ({usage}), turn.failed ({message, retryable}), "
                   "turn.blocked ({stage, category, reason}). Each event's id is its sequence; comments are heartbeats.",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}
CONV_PARAM = {"name": "conversation_id", "in": "path", "required": True, "schema": UUID}
TURN_PARAM = {"name": "turn_id", "in": "path", "required": True, "schema": UUID}
TURN_BODY = {"required": True, **_json({
    "type": "object", "required": ["turn_id", "content"],
    "properties": {"turn_id": {**UUID, "description": "client-generated idempotency key"},
                   "content": {"type": "string", "minLength": 1, "description": "the user message"},
                   "options": {"type": "object", "additionalProperties": False,
                               "description": "how the reply is sampled (absent: the mesh's defaults); kept with "
                                              "the turn, so a retry or a takeover samples alike",
                               "properties": {
                                   "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                                   "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                                   "seed": {"type": "integer", "minimum": 0, "maximum": 2**64 - 1},
                                   "max_tokens": {"type": "integer", "minimum": 1},
                                   "stop": {"type": "array", "maxItems": 4,
                                            "items": {"type": "string", "minLength": 1, "maxLength": 64}}}}}})}

SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["code", "message"],
        "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}}},
    "Conversation": {"type": "object", "required": ["id", "title", "created_at_ms", "updated_at_ms"], "properties": {
        "id": UUID, "title": {"type": "string"}, "created_at_ms": {"type": "integer"},
        "updated_at_ms": {"type": "integer"}}},
    "Message": {"type": "object", "required": ["index", "role", "content", "status", "turn_id"], "properties": {
        "index": {"type": "integer"}, "role": {"enum": ["system", "user", "assistant", "unspecified"]},
        "content": {"type": "string"}, "status": {"enum": ["complete", "stopped", "blocked", "unspecified"]},
        "turn_id": {"type": "string"}, "token_count": {"type": "integer"}, "created_at_ms": {"type": "integer"}}},
    "Usage": {"type": "object", "required": ["prompt_tokens", "cached_prompt_tokens", "output_tokens"],
              "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "cached_prompt_tokens",
                                                                "output_tokens")}},
    "Session": {"type": "object", "required": ["user", "csrf_token"], "properties": {
        "user": {"type": "string"}, "via": {"enum": ["local", "api_key", "session"]},
        "csrf_token": {"type": ["string", "null"]}}},
}

PATHS: dict[str, Any] = {
    "/v1/conversations": {
        "post": {"summary": "Create a conversation", "operationId": "createConversation",
                 "requestBody": {"required": False, **_json({"type": "object", "properties": {
                     "title": {"type": "string", "maxLength": 200}}})},
                 "responses": {"201": {"description": "created", **_json(_ref("Conversation"))},
                               **_errors(400, 413)}},
        "get": {"summary": "List my conversations, most recently updated first", "operationId": "listConversations",
                "parameters": [{"name": "page_size", "in": "query", "required": False,
                                "schema": {"type": "integer", "minimum": 1, "maximum": 500}}],
                "responses": {"200": {"description": "conversations", **_json({
                    "type": "object", "required": ["conversations"],
                    "properties": {"conversations": {"type": "array", "items": _ref("Conversation")}}})},
                    **_errors(400)}},
    },
    "/v1/conversations/{conversation_id}": {
        "parameters": [CONV_PARAM],
        "get": {"summary": "A conversation and its messages in order", "operationId": "getConversation",
                "responses": {"200": {"description": "the conversation", **_json({
                    "allOf": [_ref("Conversation"), {"type": "object", "required": ["messages"], "properties": {
                        "messages": {"type": "array", "items": _ref("Message")}}}]})}, **_errors(404)}},
        "delete": {"summary": "Delete a conversation everywhere", "operationId": "deleteConversation",
                   "responses": {"204": {"description": "deleted"}, **_errors(404)}},
    },
    "/v1/conversations/{conversation_id}/turns": {
        "parameters": [CONV_PARAM],
        "post": {"summary": "Send a message and stream the reply", "operationId": "sendTurn",
                 "requestBody": TURN_BODY, "responses": {"200": SSE, **_errors(400, 404, 409, 413, 429)}},
    },
    "/v1/conversations/{conversation_id}/turns/{turn_id}/stop": {
        "parameters": [CONV_PARAM, TURN_PARAM],
        "post": {"summary": "Stop a reply in progress", "operationId": "stopTurn",
                 "responses": {"200": {"description": "whether it was running", **_json({
                     "type": "object", "required": ["stopped"], "properties": {"stopped": {"type": "boolean"}}})},
                     **_errors(404)}},
    },
    "/v1/conversations/{conversation_id}/turns/{turn_id}/regenerate": {
        "parameters": [CONV_PARAM, TURN_PARAM],
        "post": {"summary": "Regenerate the last reply under a new turn id", "operationId": "regenerateTurn",
                 "requestBody": {"required": True, **_json({"type": "object", "required": ["turn_id"],
                                                            "properties": {"turn_id": UUID}})},
                 "responses": {"200": SSE, **_errors(400, 404, 409, 413, 429)}},
    },
    "/v1/conversations/{conversation_id}/turns/{turn_id}/events": {
        "parameters": [CONV_PARAM, TURN_PARAM],
        "get": {"summary": "Attach to a turn's stream; resume after Last-Event-ID", "operationId": "attachTurn",
                "parameters": [{"name": "Last-Event-ID", "in": "header", "required": False,
                                "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"}},
                               {"name": "after", "in": "query", "required": False,
                                "schema": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}}],
                "responses": {"200": SSE, **_errors(400, 404, 429)}},
    },
    "/v1/usage": {
        "get": {"summary": "My token usage per day", "operationId": "getUsage",
                "parameters": [{"name": "days", "in": "query", "required": False,
                                "schema": {"type": "integer", "minimum": 1, "maximum": 366}}],
                "responses": {"200": {"description": "usage", **_json({
                    "type": "object", "required": ["days"], "properties": {"days": {"type": "array", "items": {
                        "type": "object", "required": ["day", "turns", "usage"], "properties": {
                            "day": {"type": "string"}, "turns": {"type": "integer"}, "usage": _ref("Usage")}}}}})},
                    **_errors(400)}},
    },
    "/v1/export": {
        "get": {"summary": "All of my data as JSON", "operationId": "exportUserData",
                "responses": {"200": {"description": "the export", **_json({"type": "object"})}, **_errors()}},
    },
    "/v1/session": {
        "post": {"summary": "Browser login: sets an HttpOnly SameSite session cookie", "operationId": "login",
                 "security": [], "requestBody": {"required": True, **_json({"type": "object", "properties": {
                     "username": {"type": "string"}, "password": {"type": "string"},
                     "api_key": {"type": "string"}}})},
                 "responses": {"201": {"description": "logged in", **_json(_ref("Session"))},
                               **_errors(400, 413, 429)}},
        "get": {"summary": "Who am I, and the CSRF token for session requests", "operationId": "whoami",
                "responses": {"200": {"description": "the principal", **_json(_ref("Session"))}, **_errors()}},
        "delete": {"summary": "Log out", "operationId": "logout",
                   "responses": {"204": {"description": "logged out"}, **_errors()}},
    },
    "/healthz": {
        "get": {"summary": "Liveness", "operationId": "health", "security": [],
                "responses": {"200": {"description": "ok", **_json({"type": "object"})}}},
    },
}

DOCUMENT: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "chatmesh edge", "version": "1",
             "description": "REST and server-sent events for chatmesh conversations. Every call acts as the "
                            "authenticated user: an API key (Bearer), or a browser session cookie plus the "
                            "X-CSRF-Token header on state-changing requests. Errors are "
                            '{"error": {"code", "message"}}. Under /openai/v1: an OpenAI-compatible surface '
                            "(Models, Chat Completions, Responses, Conversations) over the same conversations, with "
                            'errors in OpenAI\'s shape {"error": {"message", "type", "param", "code"}}.'},
    "paths": {**PATHS, **openai_doc.PATHS},
    "components": {"schemas": {**SCHEMAS, **openai_doc.SCHEMAS}, "securitySchemes": {
        "apiKey": {"type": "http", "scheme": "bearer"},
        "session": {"type": "apiKey", "in": "cookie", "name": "chatmesh_session"}}},
    "security": [{"apiKey": []}, {"session": []}],
}


async def document(request: Request) -> Response:
    return JSONResponse(DOCUMENT)
