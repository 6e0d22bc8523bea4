"""The channel factory every chatmesh client uses: `open_channel(trust, address, service)`.

With mutual TLS the channel presents this process's certificate and accepts only a server whose certificate is
signed by the mesh CA and names `service` (its DNS SAN `<service>.chatmesh`, set as the TLS target name, so
whichever address is dialled, only that service's certificate answers). In plaintext (loopback only) it is a
plain insecure channel. Whatever else every hop needs is added here, once: the tracing interceptors (only when
tracing is on: `chatmesh.mesh.tracing`), so the current trace context travels in each call's metadata. Open
every service-to-service channel through `open_channel`, never `grpc.aio.insecure_channel` directly.

Rotation: a gRPC channel's credentials are fixed when it is made, so the TLS channel is a thin wrapper that looks
at the watched certificate files (at most once a second, `reload.Watched`) when a call starts; after a change it
opens a new channel for new calls, and closes the old one with a long grace (`RETIRE_GRACE_S`), so calls and
streams already open on it finish on the connection they started on. Stubs are made once, over the wrapper.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import grpc

from chatmesh.mesh import identity as ident
from chatmesh.mesh import tls, tracing
from chatmesh.mesh.reload import Watched
from chatmesh.mesh.trust import Trust

RETIRE_GRACE_S = 600.0
Options = Sequence[tuple[str, Any]]


def _tls_options(service: str, options: Options) -> list[tuple[str, Any]]:
    return [("grpc.ssl_target_name_override", ident.server_name(service)), *options]


def open_channel(trust: Trust, address: str, service: str, options: Options = ()) -> grpc.aio.Channel:
    """A channel to `service` (one of identity.SERVICES) at `address`, secured as `trust` says."""
    if trust.tls is None:
        trust.check_address(address, f"dialling {service} at")
        return grpc.aio.insecure_channel(address, options=list(options) or None,
                                         interceptors=tracing.client_interceptors() or None)
    return RotatingChannel(trust.tls, address, service, options)


def open_blocking_channel(trust: Trust, address: str, service: str, options: Options = ()) -> grpc.Channel:
    """A synchronous channel (short-lived tools: health checks of `chatmesh up`); no rotation."""
    if trust.tls is None:
        trust.check_address(address, f"dialling {service} at")
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(trust.tls.current()), _tls_options(service, options))


class RotatingChannel(grpc.aio.Channel):
    """A TLS channel that moves new calls to a fresh channel when the certificate files change."""

    def __init__(self, watched: Watched[tls.Pems], address: str, service: str, options: Options) -> None:
        self._watched = watched
        self._address = address
        self._options = _tls_options(service, options)
        self._pems = watched.current()
        self._channel = self._open(self._pems)
        self._callables: dict[tuple[str, str], Any] = {}
        self._retiring: dict[asyncio.Task[None], grpc.aio.Channel] = {}

    def _open(self, pems: tls.Pems) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(self._address, tls.channel_credentials(pems), self._options,
                                       interceptors=tracing.client_interceptors() or None)

    def current(self) -> grpc.aio.Channel:
        pems = self._watched.current()
        if pems is not self._pems:
            old, self._channel, self._pems = self._channel, self._open(pems), pems
            self._callables.clear()
            task = asyncio.get_running_loop().create_task(old.close(RETIRE_GRACE_S))
            self._retiring[task] = old
            task.add_done_callback(lambda t: self._retiring.pop(t, None))
        return self._channel

    def _callable(self, kind: str, method: str, make: Callable[[grpc.aio.Channel], Any]) -> Any:
        channel = self.current()
        found = self._callables.get((kind, method))
        if found is None:
            found = self._callables[(kind, method)] = make(channel)
        return found

    def unary_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                    **kwargs: Any) -> Any:
        return _Deferred(lambda: self._callable("uu", method, lambda ch: ch.unary_unary(
            method, request_serializer, response_deserializer, **kwargs)))

    def unary_stream(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                     **kwargs: Any) -> Any:
        return _Deferred(lambda: self._callable("us", method, lambda ch: ch.unary_stream(
            method, request_serializer, response_deserializer, **kwargs)))

    def stream_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                     **kwargs: Any) -> Any:
        return _Deferred(lambda: self._callable("su", method, lambda ch: ch.stream_unary(
            method, request_serializer, response_deserializer, **kwargs)))

    def stream_stream(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                      **kwargs: Any) -> Any:
        return _Deferred(lambda: self._callable("ss", method, lambda ch: ch.stream_stream(
            method, request_serializer, response_deserializer, **kwargs)))

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    async def close(self, grace: float | None = None) -> None:
        for task, old in list(self._retiring.items()):
            task.cancel()
            await old.close(grace)
        await self._channel.close(grace)

    async def __aenter__(self) -> RotatingChannel:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc_val: BaseException | None,
                        exc_tb: TracebackType | None) -> None:
        await self.close(None)


class _Deferred:
    """A multi-callable that resolves the current channel's own multi-callable at each call."""

    __slots__ = ("_resolve",)

    def __init__(self, resolve: Callable[[], Any]) -> None:
        self._resolve = resolve

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._resolve()(*args, **kwargs)
