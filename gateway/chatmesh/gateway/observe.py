"""What the edge exports: Prometheus metrics of requests and turn streams as clients see them, and each
request's root span (the turn's trace starts here, or continues the caller's W3C `traceparent`).

`Observe` is an ASGI middleware around the whole app. Per request it notes the start time (the relay's TTFT is
measured from it), and when the response starts it counts the request by route template (never the raw path:
it carries conversation and turn ids), method and status. With tracing on it also opens a SERVER span for the
request, current while the app runs (so the gRPC call to chat carries it) and ended when the response ends,
which for a turn is the end of its event stream.

Metrics: `chatmesh_gateway_requests_total{route,method,status}`, `chatmesh_gateway_open_streams` (SSE relays now
open), `chatmesh_gateway_limit_rejections_total{limit}` (429s by which budget refused),
`chatmesh_gateway_time_to_first_token_seconds` (request received -> first text written to the client, new turns
only), `chatmesh_gateway_turns_total{outcome}` (how relayed turn streams ended, `disconnected` when the client
left first).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatmesh.mesh import metrics, tracing

START_KEY = "chatmesh.start"  # scope key: perf_counter() when the request arrived
LIMITS = ("turns_per_minute", "open_streams", "prompt_tokens_per_hour",  # the budgets' names (limits.refused)
          "unauthenticated_requests_per_minute")


class EdgeMetrics:
    def __init__(self, registry: metrics.Registry, open_streams: Callable[[], int]) -> None:
        self.requests = registry.counter("chatmesh_gateway_requests", "HTTP requests by route, method and status",
                                         ["route", "method", "status"])
        registry.gauges("chatmesh_gateway_open_streams", "SSE turn streams open now",
                        lambda: [((), float(open_streams()))])
        self.rejections = registry.counter("chatmesh_gateway_limit_rejections",
                                           "requests refused with 429, by the limit that refused them", ["limit"])
        for limit in LIMITS:  # every series exists from the start (0), so rates and alerts see the first refusal
            self.rejections.labels(limit)
        self.ttft = registry.histogram("chatmesh_gateway_time_to_first_token_seconds",
                                       "a new turn's request received -> its first text written to the client",
                                       metrics.TTFT_BUCKETS)
        self.turns = registry.counter("chatmesh_gateway_turns", "relayed turn streams by how they ended",
                                      ["outcome"])


def route_of(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class Observe:
    """The ASGI middleware (see the module docstring)."""

    def __init__(self, app: ASGIApp, metrics: EdgeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[START_KEY] = time.perf_counter()
        method = scope["method"]
        root = tracing.start_root(method, {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                                           if k in (b"traceparent", b"tracestate")},
                                  {"http.request.method": method}) if tracing.ON else None

        async def observed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route, status = route_of(scope), message["status"]
                self.metrics.requests.labels(route, method, str(status)).inc()
                if root is not None:
                    root.update_name(f"{method} {route}")
                    root.set_attribute("http.route", route)
                    root.set_attribute("http.response.status_code", status)
            await send(message)

        try:
            with tracing.use(root):
                await self.app(scope, receive, observed_send)
        finally:
            if root is not None:
                root.end()
