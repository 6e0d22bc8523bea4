"""The one gRPC bootstrap every chatmesh service runs on.

`serve()` starts an asyncio gRPC server with the standard health service (`grpc.health.v1`), server
reflection, and graceful shutdown: on SIGTERM or SIGINT every service turns NOT_SERVING, open RPCs get
`CHATMESH_SHUTDOWN_GRACE_S` seconds to finish, then the rest are cancelled, then the service's own
`close` hook runs.

Errors: servicer methods are wrapped by `unary_errors` / `stream_errors`, the single place where typed core
errors become gRPC status codes (`status_for`). Anything unexpected is logged with its traceback and
answered INTERNAL, never UNKNOWN.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Concatenate, ParamSpec, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as AsyncHealthServicer
from grpc_reflection.v1alpha import reflection

from chatmesh.mesh import errors, logs

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
        case _:
            return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext[object, object], exc: BaseException, method: str) -> None:
    if isinstance(exc, errors.CoreError):
        await context.abort(status_for(exc), str(exc))
    log.error("unexpected_error", method=method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}")


def unary_errors(
    fn: Callable[Concatenate[S, Req, P], Awaitable[Resp]],
) -> Callable[Concatenate[S, Req, P], Awaitable[Resp]]:
    @functools.wraps(fn)
    async def wrapper(self: S, request: Req, /, *args: P.args, **kwargs: P.kwargs) -> Resp:
        try:
            return await fn(self, request, *args, **kwargs)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # every error is answered with a status, never swallowed
            await _abort(_context_of(args, kwargs), exc, fn.__qualname__)
            raise  # unreachable: abort raises

    return wrapper


def stream_errors(
    fn: Callable[Concatenate[S, Req, P], AsyncIterator[Resp]],
) -> Callable[Concatenate[S, Req, P], AsyncIterator[Resp]]:
    @functools.wraps(fn)
    async def wrapper(self: S, request: Req, /, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[Resp]:
        try:
            async for item in fn(self, request, *args, **kwargs):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await _abort(_context_of(args, kwargs), exc, fn.__qualname__)
            raise

    return wrapper


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
    background: list[asyncio.Task[None]] = field(default_factory=list)


async def serve(service: Service, listen: str, grace_s: float, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Runs `service` on `listen` until SIGTERM/SIGINT (or `stop` is set), then shuts down gracefully."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    names = list(service.register(server))
    health_servicer = AsyncHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise errors.Unavailable(f"{service.name}: cannot bind {listen}")
    if service.start is not None:
        await service.start()
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", address=listen, services=names)
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
    await health_servicer.enter_graceful_shutdown()
    if service.stopping is not None:
        service.stopping()
    await server.stop(grace_s)
    for task in service.background:
        task.cancel()
    if service.background:
        await asyncio.gather(*service.background, return_exceptions=True)
    if service.close is not None:
        await service.close()
    log.info("stopped")
