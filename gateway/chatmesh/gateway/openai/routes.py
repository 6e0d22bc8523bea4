"""The route table of the OpenAI-compatible surface, mounted at /openai/v1. Every route answers errors in
OpenAI's shape (`errors.response_for`); so do unknown paths and methods under the base path (the app's HTTP
error handler asks `is_openai_path`)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.openai import compaction, completions, conversations, errors, models, responses

BASE = "/openai/v1"
Endpoint = Callable[[Request], Awaitable[Response]]


def openai_errors(fn: Endpoint) -> Endpoint:
    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except ApiError as err:
            return errors.response_for(err)
    return wrapper


def route_table() -> list[BaseRoute]:
    table: list[tuple[str, Endpoint, str]] = [
        ("/models", models.listing, "GET"),
        ("/models/{model}", models.one, "GET"),
        ("/chat/completions", completions.create, "POST"),
        ("/responses", responses.create, "POST"),
        ("/responses/compact", compaction.compact, "POST"),
        ("/responses/{response_id}", responses.retrieve, "GET"),
        ("/responses/{response_id}", responses.delete, "DELETE"),
        ("/responses/{response_id}/cancel", responses.cancel, "POST"),
        ("/conversations", conversations.create, "POST"),
        ("/conversations/{conversation_id}", conversations.retrieve, "GET"),
        ("/conversations/{conversation_id}", conversations.delete, "DELETE"),
        ("/conversations/{conversation_id}/items", conversations.items, "GET"),
    ]
    return [*(Route(BASE + path, openai_errors(fn), methods=[method]) for path, fn, method in table),
            WebSocketRoute(BASE + "/responses", websocket_refused)]


async def websocket_refused(websocket: WebSocket) -> None:
    """Responses' WebSocket mode is an optional extension of Open Responses (its specification: "all messages
    MUST follow the HTTP protocol"), and chatmesh does not offer it: the handshake is answered with a 400 saying
    so, in OpenAI's error shape, where a server without the route would close it with a bare 403."""
    await websocket.send_denial_response(errors.response_for(errors.OpenAIError(
        400, "websocket_not_supported", "WebSocket mode is not offered by chatmesh: POST /responses with "
        "stream: true for server-sent events (and background: true to resume them with GET "
        "/responses/{id}?stream=true&starting_after=N)")))


def is_openai_path(path: str) -> bool:
    return path == BASE or path.startswith(BASE + "/")


def http_error(request: Request, exc: HTTPException) -> Response:
    """405 and the like under the mount, in OpenAI's shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return errors.response_for(errors.OpenAIError(exc.status_code, code, str(exc.detail)))
