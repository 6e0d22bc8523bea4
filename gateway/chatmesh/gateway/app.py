"""The gateway process: a Starlette app (`create_app`) served by uvicorn (`run`, for `chatmesh serve gateway`).

Lifespan: the gRPC channel to ChatService, the auth tables, the limits backend and the gRPC OwnerTokenService
(owner_tokens.py) are opened when the app starts and closed when it stops, all inside the server's event loop.

Shutdown on SIGTERM/SIGINT (uvicorn's handler): the listening socket closes and the gateway drains (drain.py):
every new request, kept-alive connections' included, is refused 503 with Retry-After and `Connection: close`, so
its client retries elsewhere and nothing starts that the drain would cut; open SSE relays get
CHATMESH_SHUTDOWN_GRACE_S to finish their turns, the rest are ended (their gRPC calls cancelled, so chat stores
the partial replies as stopped), then uvicorn closes idle connections and runs the lifespan shutdown. The exit
comes within the grace (plus the close), sooner when the open streams end first. The process returns 0 instead
of re-raising the signal, and nothing is logged with a traceback.

Identity: CHATMESH_AUTH=local serves one development user and is refused on any address but loopback.

Servers: uvicorn (default; HTTP/1.1, with or without TLS) or, with CHATMESH_GATEWAY_SERVER=hypercorn, hypercorn,
which also speaks HTTP/2 to clients that offer it in the TLS handshake (ALPN), so a browser multiplexes its
streams over one connection instead of hitting its six-connections-per-host limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from types import FrameType

from urllib.parse import urlsplit

import grpc
import uvicorn
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Match, Mount, Route

from chatmesh.chat import settings as chat_settings
from chatmesh.gateway import login, openapi, page, routes, settings
from chatmesh.gateway.openai import routes as openai_routes
from chatmesh.gateway.openai.errors import OpenAIError
from chatmesh.gateway.openai.errors import response_for as openai_error
from chatmesh.gateway.openai.history import HistoryIndex
from chatmesh.gateway.openai.response_object import Sampling
from chatmesh.gateway.openai.models import served_model
from chatmesh.gateway.openai.surface import Surface
from chatmesh.gateway.cli import accounts_for
from chatmesh.gateway.deadlines import BodyDeadline, BodyTimeout, uvicorn_options
from chatmesh.gateway.drain import Drain, DrainGuard
from chatmesh.gateway.anonymous import AddressLimit
from chatmesh.gateway.auth import Authenticator
from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.identity import is_loopback
from chatmesh.gateway.login_throttle import LoginThrottle
from chatmesh.gateway.owner_tokens import Directory, EdgeTokens, serve_token_service
from chatmesh.gateway.limits import Budget, LimitBackend, MemoryLimits
from chatmesh.gateway.redis_limits import RedisLimits
from chatmesh.gateway.observe import EdgeMetrics, Observe
from chatmesh.gateway.sse import Relays
from chatmesh.gateway.token_counts import MessageTokens
from chatmesh.mesh import channels, ids, logs, metrics
from chatmesh.mesh.trust import Trust, service_trust
from chatmesh.mesh import settings as mesh_settings
from chatmesh.mesh.commands import report_unread
from chatmesh.mesh.config import Config
from chatmesh.mesh.secrets_guard import DevelopmentSecrets, refuse_development_secrets
from chatmesh.store import settings as store_settings
from chatmesh.v1 import chat_pb2, chat_pb2_grpc

log = logs.get("chatmesh.gateway")


class StartupRefused(Exception):
    """The configuration is unsafe to serve (development identity on a public address)."""


def public_because(cfg: Config) -> list[str]:
    """The settings that say this gateway serves the public whatever it binds (a loopback bind behind a proxy):
    a public origin, secure cookies (set, or TLS at the edge), trusted proxies."""
    found = []
    origin = cfg[settings.PUBLIC_ORIGIN]
    if origin and not is_loopback(urlsplit(origin).hostname or ""):
        found.append(f"CHATMESH_PUBLIC_ORIGIN={origin}")
    if cfg[settings.SECURE_COOKIES]:
        found.append("CHATMESH_SECURE_COOKIES=true")
    if cfg[settings.TLS_CERT]:
        found.append("CHATMESH_TLS_CERT (TLS at the edge)")
    if cfg[settings.FORWARDED_ALLOW_IPS]:
        found.append(f"CHATMESH_FORWARDED_ALLOW_IPS={cfg[settings.FORWARDED_ALLOW_IPS]}")
    return found


def check_bind(cfg: Config) -> None:
    host = cfg[mesh_settings.HOST]
    if cfg[settings.AUTH] == "local" and not is_loopback(host):
        raise StartupRefused(
            f"CHATMESH_AUTH=local serves an unauthenticated development user, so the gateway binds loopback only; "
            f"got CHATMESH_HOST={host}. Set CHATMESH_AUTH=required (API keys, sessions) to serve {host}.")
    try:
        refuse_development_secrets(cfg, "gateway", host, public_because(cfg))
    except DevelopmentSecrets as err:
        raise StartupRefused(str(err)) from None


def forwarded_from(cfg: Config) -> list[Middleware]:
    """X-Forwarded-For/-Proto believed from CHATMESH_FORWARDED_ALLOW_IPS only (uvicorn's own middleware, in front
    of both servers; uvicorn's default of trusting 127.0.0.1 is off), so a client cannot pick the address the
    edge's per-address limits key on."""
    proxies = [p.strip() for p in cfg[settings.FORWARDED_ALLOW_IPS].split(",") if p.strip()]
    return [Middleware(ProxyHeadersMiddleware, trusted_hosts=proxies)] if proxies else []


def budget_of(cfg: Config) -> Budget:
    return Budget(cfg[settings.TURNS_PER_MINUTE], cfg[settings.OPEN_STREAMS], cfg[settings.PROMPT_TOKENS_PER_HOUR])


def _limits(cfg: Config) -> LimitBackend:
    if cfg[settings.REDIS_URL]:
        return RedisLimits(cfg[settings.REDIS_URL], budget_of(cfg))
    return MemoryLimits(budget_of(cfg))


# ChatService calls safe to send again after UNAVAILABLE (before a first response): the turn calls are idempotent
# by turn id, the rest read or are idempotent. CreateConversation is not among them: a lost answer would make two.
_RETRIED = ("SendTurn", "AttachTurn", "RegenerateTurn", "StopTurn", "GetConversation", "ListConversations",
            "DeleteConversation", "GetUsage", "ExportUserData")


def chat_target(cfg: Config) -> str:
    return channels.target_for(cfg[settings.CHAT_ADDRESSES] or cfg[mesh_settings.CHAT_ADDRESS])


def chat_channel(cfg: Config, trust: Trust) -> grpc.aio.Channel:
    """One channel over every chat address: round robin over those connected, so a chat process that dies
    stops getting turns when its connection drops and one that returns gets them within about a second."""
    service = chat_pb2.DESCRIPTOR.services_by_name["ChatService"].full_name
    return channels.open_channel(trust, chat_target(cfg), "chat", channels.balanced_options(service, _RETRIED))


def route_table() -> list[BaseRoute]:
    conv = "/v1/conversations/{conversation_id}"
    turn = conv + "/turns/{turn_id}"
    return [
        Route("/healthz", routes.health, methods=["GET"]),
        Route("/v1/conversations", routes.create_conversation, methods=["POST"]),
        Route("/v1/conversations", routes.list_conversations, methods=["GET"]),
        Route(conv, routes.get_conversation, methods=["GET"]),
        Route(conv, routes.delete_conversation, methods=["DELETE"]),
        Route(conv + "/turns", routes.send_turn, methods=["POST"]),
        Route(turn + "/stop", routes.stop_turn, methods=["POST"]),
        Route(turn + "/regenerate", routes.regenerate_turn, methods=["POST"]),
        Route(turn + "/events", routes.attach_turn, methods=["GET"]),
        Route("/v1/usage", routes.usage, methods=["GET"]),
        Route("/v1/export", routes.export, methods=["GET"]),
        Route("/v1/session", login.login, methods=["POST"]),
        Route("/v1/session", login.whoami, methods=["GET"]),
        Route("/v1/session", login.logout, methods=["DELETE"]),
        *openai_routes.route_table(),
        Route("/openapi.json", openapi.document, methods=["GET"]),
        Route("/", page.index, methods=["GET"]),
        Mount("/static", app=page.static(), name="static"),
    ]


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if exc.limit:
        observed: EdgeMetrics = request.app.state.observed
        observed.rejections.labels(exc.limit).inc()
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if openai_routes.is_openai_path(request.url.path):
        return openai_routes.http_error(request, exc)
    if exc.status_code == 404 and (redirect := _slash_redirect(request)) is not None:
        return redirect
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse({"error": {"code": code, "message": str(exc.detail)}}, exc.status_code,
                        headers=dict(exc.headers or {}))


def _slash_redirect(request: Request) -> Response | None:
    """`/v1/conversations/` -> `/v1/conversations` (and the reverse) when only the slash differs. The Location
    is CHATMESH_PUBLIC_ORIGIN plus the path, or the path alone: never built from the request's Host header,
    which the client chooses (Starlette's own slash redirect reflected it)."""
    path = request.scope["path"]
    if path == "/" or path.startswith("//") or "\\" in path:
        return None  # `//host` would be a scheme-relative Location: an open redirect
    other = path.rstrip("/") if path.endswith("/") else path + "/"
    scope = {**request.scope, "path": other}
    if not any(route.matches(scope)[0] is not Match.NONE for route in request.app.router.routes):
        return None
    query = request.scope.get("query_string", b"").decode("latin-1")
    origin: str = request.app.state.public_origin
    return RedirectResponse(origin + other + (f"?{query}" if query else ""), 307)


async def _body_timeout(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BodyTimeout)
    response = exc.response()
    response.headers["connection"] = "close"
    return response


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client went away mid-body: nobody reads the answer, and nothing of the request is logged."""
    route = request.scope.get("route")
    log.info("client_disconnected", method=request.method, route=getattr(route, "path", None))
    return Response(status_code=400)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("unexpected_error", path=request.url.path, error=type(exc).__name__, exc_info=exc)
    if openai_routes.is_openai_path(request.url.path):
        return openai_error(OpenAIError(500, "internal", "internal error"))
    route = request.scope.get("route")
    log.error("unexpected_error", method=request.method, route=getattr(route, "path", None), exc_info=exc)
    return JSONResponse({"error": {"code": "internal", "message": "internal error"}}, 500)


def create_app(cfg: Config, metrics_port: int = 0) -> Starlette:
    """The app; with `metrics_port`, its Prometheus metrics are served there while it runs (`chatmesh serve
    gateway` passes CHATMESH_GATEWAY_METRICS_PORT; tests leave it off)."""
    relays = Relays()
    drain = Drain()
    registry = metrics.Registry()
    observed = EdgeMetrics(registry, lambda: len(relays.open))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        trust = service_trust(cfg, "gateway")
        channel = chat_channel(cfg, trust)
        owner_tokens = EdgeTokens.from_trust(trust, cfg[mesh_settings.OWNER_TOKEN_TTL_S])
        limits = _limits(cfg)
        accounts = accounts_for(cfg)
        await accounts.create_tables()
        app.state.accounts = accounts
        local = ids.parse_owner_id(cfg[settings.LOCAL_USER], "CHATMESH_LOCAL_USER") \
            if cfg[settings.AUTH] == "local" else None
        token_server = await serve_token_service(cfg, trust, owner_tokens, Directory(accounts, local))
        served = await asyncio.to_thread(served_model, cfg)  # the profile's model id and context (chat's too)
        app.state.edge = routes.Edge(
            chat=chat_pb2_grpc.ChatServiceStub(channel),
            auth=Authenticator(accounts, local, AddressLimit(cfg[settings.LIMIT_UNAUTHENTICATED_PER_MINUTE])),
            tokens=owner_tokens,
            limits=limits,
            relays=relays, allowlist=cfg[settings.LINK_ALLOWLIST], heartbeat_s=cfg[settings.HEARTBEAT_S],
            max_body_bytes=cfg[settings.MAX_BODY_BYTES],
            message_tokens=MessageTokens.from_config(cfg, served.context_tokens),
            budget=budget_of(cfg),
            deadline_s=cfg[settings.CHAT_DEADLINE_S], observed=observed)
        app.state.openai = Surface(
            edge=app.state.edge, accounts=accounts,
            index=HistoryIndex(accounts.engine, b"openai-history\0" + cfg[settings.KEY_PEPPER].encode(),
                               cfg[store_settings.RETENTION_DAYS]),
            model=served.model, context_tokens=served.context_tokens,
            reply_cap=cfg[chat_settings.MAX_REPLY_TOKENS],
            sampling=Sampling(cfg[chat_settings.TEMPERATURE], cfg[chat_settings.TOP_P]))
        log.info("gateway_ready", chat=cfg[mesh_settings.CHAT_ADDRESS], auth=cfg[settings.AUTH])
        exporter = metrics.MetricsServer(registry, cfg[mesh_settings.HOST], metrics_port) if metrics_port else None
        if exporter is not None:
            await exporter.start()
        log.info("gateway_ready", chat=chat_target(cfg), auth=cfg[settings.AUTH],
                 owner_token_service=token_server.address if token_server is not None else "off",
                 metrics=f"{exporter.host}:{exporter.port}" if exporter is not None else "off")
        report_unread(cfg)
        try:
            yield
        finally:
            if exporter is not None:
                await exporter.close()
            await relays.drain(0)
            await limits.close()
            await accounts.close()
            await channel.close(None)
            if token_server is not None:
                await token_server.stop()

    app = Starlette(routes=route_table(), lifespan=lifespan, exception_handlers={
        ApiError: _api_error, BodyTimeout: _body_timeout, ClientDisconnect: _client_gone,
        HTTPException: _http_error, Exception: _unexpected},
        middleware=[*forwarded_from(cfg), Middleware(Observe, metrics=observed), Middleware(DrainGuard, drain=drain),
                    Middleware(BodyDeadline, timeout_s=cfg[settings.BODY_TIMEOUT_S])])
    app.router.redirect_slashes = False  # see _slash_redirect
    app.state.public_origin = cfg[settings.PUBLIC_ORIGIN].rstrip("/")
    app.state.login_throttle = LoginThrottle(cfg[settings.KEY_PEPPER])
    app.state.relays = relays
    app.state.drain = drain
    app.state.metrics = registry
    app.state.observed = observed
    app.state.accounts = None
    app.state.secure_cookies = cfg[settings.SECURE_COOKIES] or bool(cfg[settings.TLS_CERT])
    return app


class _Server(uvicorn.Server):
    """uvicorn with a drain step for open SSE relays and no re-raised signal at exit (see the module header)."""

    def __init__(self, config: uvicorn.Config, relays: Relays, grace_s: float, drain: Drain):
        super().__init__(config)
        self._relays = relays
        self._grace_s = grace_s
        self._drain = drain

    async def shutdown(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        for server in self.servers:
            server.close()
        await self._drain.run(self._relays, self._grace_s)
        await super().shutdown(sockets)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def server_for(cfg: Config, app: Starlette | None = None, port: int | None = None) -> _Server:
    check_bind(cfg)
    app = app or create_app(cfg)
    cert, key = cfg[settings.TLS_CERT], cfg[settings.TLS_KEY]
    if bool(cert) != bool(key):
        raise StartupRefused("CHATMESH_TLS_CERT and CHATMESH_TLS_KEY go together")
    grace = cfg[mesh_settings.SHUTDOWN_GRACE_S]
    config = uvicorn.Config(
        app, host=cfg[mesh_settings.HOST], port=cfg[mesh_settings.GATEWAY_PORT] if port is None else port,
        ssl_certfile=cert or None, ssl_keyfile=key or None, log_config=None, access_log=False, lifespan="on",
        proxy_headers=False,  # forwarded_from: only CHATMESH_FORWARDED_ALLOW_IPS (uvicorn trusted 127.0.0.1)
        timeout_graceful_shutdown=int(grace) + 2, server_header=False,
        **uvicorn_options(cfg[settings.HEADER_TIMEOUT_S], cfg[settings.IDLE_TIMEOUT_S]))
    return _Server(config, app.state.relays, grace, app.state.drain)


# Garbage collection for a process that holds thousands of open streams. Every open stream keeps a few hundred
# live objects (connection, request, tasks, gRPC call, sanitiser), all long-lived, so CPython's default
# thresholds (700, 10, 10) keep triggering full collections that walk every one of them: with 2,000 streams open
# each pause took hundreds of milliseconds and set the p95 latency of every stream (bench/edge_sse.py: p95
# 300-2,400 ms with the defaults, 22 ms with collection off). So: what start-up built (modules, the app) is moved
# out of the collector's sight (`gc.freeze`), and young collections run every 50,000 allocations instead of 700,
# which makes full collections ~1,000x rarer. Per-event garbage is acyclic and freed by reference counting, so
# memory does not wait on the collector.
GC_THRESHOLDS = (50_000, 20, 50)


def tune_gc() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def serve_hypercorn(cfg: Config, app: Starlette, port: int | None = None,
                          stop: asyncio.Event | None = None) -> None:
    """The app on hypercorn: HTTP/2 (ALPN h2) and HTTP/1.1 over TLS, HTTP/1.1 in the clear. Same shutdown as on
    uvicorn: SIGTERM/SIGINT (or `stop`) -> open relays drain for the grace period -> the server stops."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config as HypercornConfig

    check_bind(cfg)
    host = cfg[mesh_settings.HOST]
    hc = HypercornConfig()
    hc.bind = [f"[{host}]:{port or cfg[mesh_settings.GATEWAY_PORT]}" if ":" in host
               else f"{host}:{port or cfg[mesh_settings.GATEWAY_PORT]}"]
    if cfg[settings.TLS_CERT]:
        hc.certfile, hc.keyfile = cfg[settings.TLS_CERT], cfg[settings.TLS_KEY]
    grace = cfg[mesh_settings.SHUTDOWN_GRACE_S]
    hc.graceful_timeout = grace + 2
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")  # through chatmesh.mesh.logs, not hypercorn's own handler
    # hypercorn's idle timer runs from a connection's start (and each response's end) until a request's headers
    # are complete: the idle bound and the header deadline at once (chatmesh.gateway.deadlines). No read_timeout:
    # hypercorn applies it to every read, so it cut every SSE stream whose client sent nothing for that long.
    hc.keep_alive_timeout = min(cfg[settings.IDLE_TIMEOUT_S], cfg[settings.HEADER_TIMEOUT_S])
    hc.read_timeout = None
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError, RuntimeError):  # not the main thread (tests): the caller sets `stop`
            loop.add_signal_handler(sig, stop.set)
    relays: Relays = app.state.relays
    drain: Drain = app.state.drain

    async def shutdown_trigger() -> None:
        await stop.wait()
        await drain.run(relays, grace)

    await serve(app, hc, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]


def run(cfg: Config) -> int:
    if bool(cfg[settings.TLS_CERT]) != bool(cfg[settings.TLS_KEY]):
        log.error("startup_refused", reason="CHATMESH_TLS_CERT and CHATMESH_TLS_KEY go together")
        return 2
    try:
        app = create_app(cfg, metrics_port=cfg[mesh_settings.METRIC_PORTS["gateway"]])
        if cfg[settings.SERVER] == "hypercorn":
            check_bind(cfg)
            tune_gc()
            asyncio.run(serve_hypercorn(cfg, app))
            return 0
        server = server_for(cfg, app)
    except StartupRefused as err:
        log.error("startup_refused", reason=str(err))
        return 2
    tune_gc()
    server.run()
    return 0 if server.started else 1
