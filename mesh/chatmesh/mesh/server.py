"""The one gRPC bootstrap every chatmesh service runs on.

`serve()` starts an asyncio gRPC server with the standard health service (`grpc.health.v1`), server
reflection, and graceful shutdown: on SIGTERM or SIGINT every service turns NOT_SERVING, open RPCs get
`CHATMESH_SHUTDOWN_GRACE_S` seconds to finish, then the rest are cancelled, then the service's own
`close` hook runs. A service with a `drain` hook (the engine: it keeps serving prefix pulls) spends the grace in
it first, still taking calls, and the server's stop gets what is left.

Trust (trust.py): with mutual TLS (the default) the port takes only clients with a certificate of the mesh CA,
certificates are reloaded when their files change, and every RPC is checked against the service's
authorization table (`Service.authz`, authz.py) before its servicer runs; health and reflection are open to
every authenticated peer. With CHATMESH_HEALTH_PORT set, a second, plaintext port serves grpc.health.v1 and
nothing else, for probes that hold no certificate. Plaintext (CHATMESH_MESH_PLAINTEXT) listens on loopback only.

Errors: servicer methods are wrapped by `unary_errors` / `stream_errors`, the single place where typed core
errors become gRPC status codes (`status_for`). Anything unexpected is logged with its traceback and
answered INTERNAL, never UNKNOWN. The same decorators count every RPC by method and status code and time it
(`chatmesh.mesh.metrics.RPC`), so each service has its calls by RPC and outcome with no code of its own.

Tracing: with OTEL_EXPORTER_OTLP_ENDPOINT set, an RPC that arrives with a W3C trace context gets a server span
(`chatmesh.mesh.tracing.serving`), started by the same decorators: no interceptor. Off, they test one boolean.

Metrics: `serve(..., metrics_port=N)` serves the service's `metrics` registry (plus the RPC counts and process
figures) at http://<listen host>:N/metrics while the service runs (`chatmesh.mesh.metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Concatenate, ParamSpec, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as AsyncHealthServicer
from grpc_reflection.v1alpha import reflection

from chatmesh.mesh import authz, errors, logs, metrics, tls, tracing
from chatmesh.mesh.trust import Trust, host_of

log = logs.get("chatmesh.server")

S = TypeVar("S")
Req = TypeVar("Req")
Resp = TypeVar("Resp")
P = ParamSpec("P")


def status_for(err: errors.CoreError) -> grpc.StatusCode:
    """The one mapping from core errors to gRPC status codes."""
    match err:
        case errors.InvalidArgument():
            return grpc.StatusCode.INVALID_ARGUMENT
        case errors.NotFound():
            return grpc.StatusCode.NOT_FOUND
        case errors.Conflict():
            return grpc.StatusCode.ALREADY_EXISTS
        case errors.FailedPrecondition():
            return grpc.StatusCode.FAILED_PRECONDITION
        case errors.ResourceExhausted():
            return grpc.StatusCode.RESOURCE_EXHAUSTED
        case errors.Unavailable():
            return grpc.StatusCode.UNAVAILABLE
        case errors.Unauthenticated():
            return grpc.StatusCode.UNAUTHENTICATED
        case errors.PermissionDenied():
            return grpc.StatusCode.PERMISSION_DENIED
        case _:
            return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext[object, object], exc: BaseException, method: str) -> None:
    if isinstance(exc, errors.CoreError):
        await context.abort(status_for(exc), str(exc), exc.trailing_metadata())
    log.error("unexpected_error", method=method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}")


def unary_errors(
    fn: Callable[Concatenate[S, Req, P], Awaitable[Resp]],
) -> Callable[Concatenate[S, Req, P], Awaitable[Resp]]:
    method = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: S, request: Req, /, *args: P.args, **kwargs: P.kwargs) -> Resp:
        start, code = time.perf_counter(), "OK"
        try:
            if tracing.ON:
                with tracing.serving(self, method, _context_of(args, kwargs)):
                    return await fn(self, request, *args, **kwargs)
            return await fn(self, request, *args, **kwargs)
        except (grpc.aio.AbortError, asyncio.CancelledError) as exc:
            code = _code_of(exc, args, kwargs)
            raise
        except Exception as exc:  # every error is answered with a status, never swallowed
            code = _status_name(exc)
            await _abort(_context_of(args, kwargs), exc, fn.__qualname__)
            raise  # unreachable: abort raises
        finally:
            metrics.RPC.done(method, code, time.perf_counter() - start)

    return wrapper


_UNTRACED = contextlib.nullcontext()


def stream_errors(
    fn: Callable[Concatenate[S, Req, P], AsyncIterator[Resp]],
) -> Callable[Concatenate[S, Req, P], AsyncIterator[Resp]]:
    method = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: S, request: Req, /, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[Resp]:
        start, code = time.perf_counter(), "OK"
        try:
            with tracing.serving(self, method, _context_of(args, kwargs)) if tracing.ON else _UNTRACED:
                async for item in fn(self, request, *args, **kwargs):
                    yield item
        except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit) as exc:
            code = _code_of(exc, args, kwargs)
            raise
        except Exception as exc:
            code = _status_name(exc)
            await _abort(_context_of(args, kwargs), exc, fn.__qualname__)
            raise
        finally:
            metrics.RPC.done(method, code, time.perf_counter() - start)

    return wrapper


def _status_name(exc: Exception) -> str:
    return status_for(exc).name if isinstance(exc, errors.CoreError) else "INTERNAL"


def _code_of(exc: BaseException, args: tuple[object, ...], kwargs: dict[str, object]) -> str:
    """The status of an RPC that ended by abort (the code the handler chose) or by cancellation."""
    if isinstance(exc, grpc.aio.AbortError):
        code = getattr(kwargs.get("context", args[0] if args else None), "code", lambda: None)()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    return "CANCELLED"


def _context_of(args: tuple[object, ...], kwargs: dict[str, object]) -> grpc.aio.ServicerContext[object, object]:
    # grpc's runtime context (a Cython class) does not subclass the abstract grpc.aio.ServicerContext,
    # so this is a cast, not an isinstance check.
    ctx = kwargs.get("context", args[0] if args else None)
    if ctx is None or not hasattr(ctx, "abort"):
        raise TypeError("servicer method called without a gRPC context")
    return typing.cast("grpc.aio.ServicerContext[object, object]", ctx)


@dataclass
class Service:
    """What a service hands the bootstrap: how to register itself, and what to do at start and stop."""

    name: str
    register: Callable[[grpc.aio.Server], Sequence[str]]
    start: Callable[[], Awaitable[None]] | None = None
    close: Callable[[], Awaitable[None]] | None = None
    stopping: Callable[[], None] | None = None  # shutdown began (before the grace period): end long-lived streams
    # shutdown began: awaited with the grace period before the server stops taking calls (health already NOT_SERVING);
    # the server's own stop then gets what is left of the grace (an engine keeps serving prefix pulls meanwhile)
    drain: Callable[[float], Awaitable[None]] | None = None
    background: list[asyncio.Task[None]] = field(default_factory=list)
    # proto service full name -> RPC name -> identities allowed (authz.py); every registered RPC needs a rule
    authz: Mapping[str, authz.Rules] = field(default_factory=dict)
    metrics: metrics.Registry = field(default_factory=metrics.Registry)  # served on the service's metrics port


SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    # keepalive (chatmesh.mesh.channels: every mesh channel pings every 5 s): accept pings that often, with or
    # without calls, and never answer them with GOAWAY too_many_pings; ping clients the same way, so a call from
    # a client that vanished ends within ~8 s instead of running to its deadline
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 4000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.http2.ping_timeout_ms", 3000),
]


@dataclass
class Running:
    """A started server: the service port and, when asked for, the plaintext health-only port."""

    server: grpc.aio.Server
    health: AsyncHealthServicer
    names: list[str]
    port: int
    health_server: grpc.aio.Server | None = None
    health_port: int = 0
    exporter: metrics.MetricsServer | None = None

    async def stop(self, service: Service, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        if service.stopping is not None:
            service.stopping()
        if service.drain is not None:
            loop = asyncio.get_running_loop()
            began = loop.time()
            await service.drain(grace_s)
            grace_s = max(0.0, grace_s - (loop.time() - began))
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
        for task in service.background:
            task.cancel()
        if service.background:
            await asyncio.gather(*service.background, return_exceptions=True)
        if service.close is not None:
            await service.close()
        if self.exporter is not None:
            await self.exporter.close()


def policy_for(service: Service, names: Sequence[str], trust: Trust) -> authz.Policy:
    missing = [n for n in names if n not in service.authz]
    if missing:
        raise ValueError(f"{service.name}: no authorization table for {missing}")
    overrides = authz.read_overrides(trust.authz_file) if trust.authz_file is not None else {}
    return authz.Policy.build({n: service.authz[n] for n in names}, overrides)


async def start_server(service: Service, listen: str, *, trust: Trust, health_port: int = 0,
                       metrics_port: int = 0) -> Running:
    """Binds and starts `service` (its `start` hook first); every service reports SERVING."""
    trust.check_address(listen, f"{service.name}: listening on")
    server = grpc.aio.server(options=SERVER_OPTIONS)
    # With TLS every handler is registered through the guard (authz.py), so every RPC is checked; the policy
    # needs the registered names: it is set once they are known, before the server starts.
    guard = authz.Guard(authz.Policy({}))
    checked = server if trust.tls is None else authz.guarded(server, guard)
    names = list(service.register(checked))
    tracing.served(names)
    if trust.tls is not None:
        guard.policy = policy_for(service, names, trust)
    health_servicer = AsyncHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, checked)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], checked)
    port = server.add_insecure_port(listen) if trust.tls is None else \
        server.add_secure_port(listen, tls.server_credentials(trust.tls))
    if port == 0:
        raise errors.Unavailable(f"{service.name}: cannot bind {listen}")
    running = Running(server, health_servicer, names, port)
    if health_port:
        running.health_server = grpc.aio.server(options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, running.health_server)
        host = host_of(listen)
        running.health_port = running.health_server.add_insecure_port(
            f"[{host}]:{health_port}" if ":" in host else f"{host}:{health_port}")
        if running.health_port == 0:
            raise errors.Unavailable(f"{service.name}: cannot bind the health port {health_port}")
    if metrics_port:
        running.exporter = metrics.MetricsServer(service.metrics, metrics.bind_host(listen), metrics_port)
        await running.exporter.start()
    if service.start is not None:
        await service.start()
    await server.start()
    if running.health_server is not None:
        await running.health_server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", address=listen, services=names, identity=trust.identity or "plaintext",
             health_port=running.health_port or None,
             metrics=f"{running.exporter.host}:{running.exporter.port}" if running.exporter is not None else "off")
    return running


async def serve(service: Service, listen: str, grace_s: float, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None, *, trust: Trust, health_port: int = 0, metrics_port: int = 0
                ) -> None:
    """Runs `service` on `listen` until SIGTERM/SIGINT (or `stop` is set), then shuts down gracefully; with
    `metrics_port`, its metrics are served there meanwhile."""
    running = await start_server(service, listen, trust=trust, health_port=health_port, metrics_port=metrics_port)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (ValueError, RuntimeError):  # not the main thread (tests): the caller sets `stop`
            pass
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("stopping", grace_s=grace_s)
    await running.stop(service, grace_s)
    log.info("stopped")
