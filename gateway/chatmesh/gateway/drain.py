"""The gateway's drain: from the shutdown signal on, no new request is taken, only the streams already open finish.

Closing the listening socket stops new connections, but a client with a kept-alive connection (a browser, the
`openai` SDK, a load balancer's pool) goes on sending requests on it; the servers accept them and, before this,
each such turn started generating only to be cut at the end of the grace and stored as stopped, cut short (12 of
12 turns started during a drain under load, issue 33), and the drain waited out the whole grace for them. So once
draining (`Drain.begin`, called by both servers' shutdown before the open relays are given the grace), every
request is answered at once, without reaching a route:

    503, `Retry-After: 1`, `Connection: close` (HTTP/1.x; HTTP/2 connections get the server's GOAWAY instead)

in the surface's own error shape (chatmesh's, or OpenAI's under /openai/v1, which the SDK retries by itself), so the
client retries on a new connection, which reaches another gateway, and nothing is stored for the refused turn.
`/healthz` answers the same 503, so a load balancer takes the gateway out. Open streams are responses already in
progress: they finish within the grace (`sse.Relays.drain`). Then the gateway lingers a moment more
(`LINGER_S`, within the grace) still answering 503, so a client that sends on its kept-alive connection just as
the last stream ends is answered, not reset; then the server closes its connections. The grace bounds the
process's exit (plus the server's own close).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Receive, Scope, Send

from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.openai.errors import OpenAIError, response_for
from chatmesh.gateway.openai.routes import is_openai_path
from chatmesh.gateway.sse import Relays
from chatmesh.mesh import logs

log = logs.get("chatmesh.gateway")

RETRY_AFTER_S = 1.0
LINGER_S = 1.0  # refusing after the last open stream ended, before connections close (within the grace)
MESSAGE = "this gateway is shutting down; retry the request"


class Drain:
    """Whether the process is draining, and how many requests it refused since."""

    def __init__(self) -> None:
        self.draining = False
        self.refused = 0

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            log.info("gateway_draining")

    async def run(self, relays: Relays, grace_s: float) -> None:
        """The whole drain, as both servers' shutdown runs it: refuse from now on, give the open streams the
        grace, linger (what is left of it, at most LINGER_S)."""
        self.begin()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        if relays.open:
            log.info("draining_streams", open=len(relays.open), grace_s=grace_s)
        await relays.drain(grace_s)
        await asyncio.sleep(max(0.0, min(LINGER_S, deadline - loop.time())))


class DrainGuard:
    """ASGI middleware: while `drain.draining`, every HTTP request is refused as the module header says."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.drain.draining:
            await self.app(scope, receive, send)
            return
        self.drain.refused += 1
        path: str = scope.get("path", "")
        response = response_for(OpenAIError(503, "unavailable", MESSAGE, retry_after_s=RETRY_AFTER_S)) \
            if is_openai_path(path) else ApiError(503, "unavailable", MESSAGE, retry_after_s=RETRY_AFTER_S).response()
        if scope.get("http_version", "1.1").startswith("1"):
            response.headers["connection"] = "close"  # the server closes the kept-alive connection after this
        await response(scope, receive, send)
