"""The OpenAI-compatible routes in the edge's OpenAPI document (/openapi.json): paths, request bodies and the
error shape. The request schemas list exactly the parameters chatmesh honours; others are refused (400)."""

from __future__ import annotations

from typing import Any

from chatmesh.gateway.openai.routes import BASE


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_MEANING = {400: "invalid or unsupported parameter (error.param names it)", 401: "no or unknown API key",
            403: "this key may not name an end user", 404: "not found (or not yours)",
            409: "conflicts with the stored conversation, or the Idempotency-Key was used for another request "
                 "(x-should-retry: false)", 422: "the conversation's state forbids it now",
            429: "a per-user limit is reached, or (unauthenticated) the per-address limit of requests that fail "
                 "authentication (see Retry-After)", 503: "a dependency is unavailable; retry"}


def _errors(*statuses: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for status in sorted({400, 401, 403, 429, *statuses, 503}):
        response = {"description": _MEANING[status], **_json(_ref("OpenAIError"))}
        if status == 429:
            response["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
        out[str(status)] = response
    return out


_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"enum": ["text", "input_text", "output_text"]}, "text": {"type": "string"}}}}]}}}
_SAMPLING = {"temperature": {"type": "number", "minimum": 0, "maximum": 2},
             "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}}
_HEADERS = [
    {"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "names the turn: a retry replays or attaches to the first generation"},
    {"name": "X-OpenWebUI-Message-Id", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "Open WebUI's message id, used as the Idempotency-Key"},
    {"name": "X-OpenWebUI-Chat-Id", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "the client's chat id: keeps its conversations apart from identical others"},
    {"name": "X-OpenWebUI-User-Id", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "the end user (trusted front-end keys only; anyone else: 403)"},
]

SCHEMAS: dict[str, Any] = {
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]}}}}},
    "ChatCompletionRequest": {"type": "object", "required": ["model", "messages"], "properties": {
        "model": {"type": "string"}, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "max_tokens": {"type": "integer", "minimum": 1}, "max_completion_tokens": {"type": "integer", "minimum": 1},
        **_SAMPLING, "seed": {"type": "integer"},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "maxItems": 4, "items": {"type": "string"}}]},
        "n": {"const": 1}, "user": {"type": "string"}}},
    "ResponseRequest": {"type": "object", "required": ["model", "input"], "properties": {
        "model": {"type": "string"}, "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": _MESSAGE}]},
        "instructions": {"type": "string"}, "previous_response_id": {"type": "string"},
        "conversation": {"oneOf": [{"type": "string"}, {"type": "object", "properties": {"id": {"type": "string"}}}]},
        "store": {"type": "boolean"}, "stream": {"type": "boolean"},
        "background": {"type": "boolean", "description": "run without the client; stream=true events resume "
                                                         "with GET ?stream=true&starting_after=N on any gateway"},
        "max_output_tokens": {"type": "integer", "minimum": 1}, **_SAMPLING, "user": {"type": "string"},
        "metadata": {"type": "object", "maxProperties": 16, "additionalProperties": {"type": "string"}},
        "safety_identifier": {"type": "string", "maxLength": 64},
        "prompt_cache_key": {"type": "string", "maxLength": 64},
        "truncation": {"enum": ["auto", "disabled"]}}},
    "Object": {"type": "object", "description": "OpenAI's object of that name"},
}

_OBJECT = {"description": "ok", **_json(_ref("Object"))}
_STREAM = {"description": "the object, or with stream: true a text/event-stream of its events",
           "content": {"application/json": {"schema": _ref("Object")},
                       "text/event-stream": {"schema": {"type": "string"}}}}
_RESP = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
_CONV = {"name": "conversation_id", "in": "path", "required": True, "schema": {"type": "string"}}

PATHS: dict[str, Any] = {
    BASE + "/models": {"get": {"summary": "The served model(s) with their context length",
                               "operationId": "openaiListModels", "responses": {"200": _OBJECT, **_errors()}}},
    BASE + "/models/{model}": {"parameters": [{"name": "model", "in": "path", "required": True,
                                               "schema": {"type": "string"}}],
                               "get": {"summary": "One model", "operationId": "openaiRetrieveModel",
                                       "responses": {"200": _OBJECT, **_errors(404)}}},
    BASE + "/chat/completions": {"post": {
        "summary": "Chat Completions; continues the stored conversation whose history the messages resend",
        "operationId": "openaiCreateChatCompletion", "parameters": _HEADERS,
        "requestBody": {"required": True, **_json(_ref("ChatCompletionRequest"))},
        "responses": {"200": _STREAM, **_errors(404, 409, 422, 429)}}},
    BASE + "/responses": {"post": {
        "summary": "Create a response (a chatmesh turn), streamed or not", "operationId": "openaiCreateResponse",
        "parameters": _HEADERS[:2], "requestBody": {"required": True, **_json(_ref("ResponseRequest"))},
        "responses": {"200": _STREAM, **_errors(404, 409, 422, 429)}}},
    BASE + "/responses/compact": {"post": {
        "summary": "Compact a conversation into chatmesh's stored summary (the next turns' prompts start from it)",
        "operationId": "openaiCompactResponse",
        "requestBody": {"required": True, **_json({"type": "object", "required": ["model"], "properties": {
            "model": {"type": "string"}, "previous_response_id": {"type": "string"},
            "input": {"oneOf": [{"type": "string"}, {"type": "array"}]},
            "prompt_cache_key": {"type": "string", "maxLength": 64}}})},
        "responses": {"200": _OBJECT, **_errors(404, 422)}}},
    BASE + "/responses/{response_id}": {
        "parameters": [_RESP],
        "get": {"summary": "Retrieve a response; a background one's events again with stream=true",
                "operationId": "openaiRetrieveResponse",
                "parameters": [{"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
                               {"name": "starting_after", "in": "query", "required": False,
                                "schema": {"type": "integer", "minimum": -1},
                                "description": "stream only the events after this sequence_number"}],
                "responses": {"200": _STREAM, **_errors(404)}},
        "delete": {"summary": "Delete a response (its turn, and the conversation's cached blocks)",
                   "operationId": "openaiDeleteResponse", "responses": {"200": _OBJECT, **_errors(404)}}},
    BASE + "/responses/{response_id}/cancel": {
        "parameters": [_RESP],
        "post": {"summary": "Stop a response in progress; the partial reply is kept",
                 "operationId": "openaiCancelResponse", "responses": {"200": _OBJECT, **_errors(404)}}},
    BASE + "/conversations": {"post": {
        "summary": "Create a conversation, optionally with items", "operationId": "openaiCreateConversation",
        "requestBody": {"required": False, **_json({"type": "object", "properties": {
            "items": {"type": "array", "items": _MESSAGE}}})},
        "responses": {"200": _OBJECT, **_errors()}}},
    BASE + "/conversations/{conversation_id}": {
        "parameters": [_CONV],
        "get": {"summary": "Retrieve a conversation", "operationId": "openaiRetrieveConversation",
                "responses": {"200": _OBJECT, **_errors(404)}},
        "delete": {"summary": "Delete a conversation everywhere", "operationId": "openaiDeleteConversation",
                   "responses": {"200": _OBJECT, **_errors(404)}}},
    BASE + "/conversations/{conversation_id}/items": {
        "parameters": [_CONV],
        "get": {"summary": "A conversation's messages as items", "operationId": "openaiListConversationItems",
                "parameters": [{"name": "limit", "in": "query", "required": False,
                                "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                               {"name": "order", "in": "query", "required": False,
                                "schema": {"enum": ["asc", "desc"]}},
                               {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}}],
                "responses": {"200": _OBJECT, **_errors(404)}}},
}
