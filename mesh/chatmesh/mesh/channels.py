"""The channel factory every chatmesh client uses: `open_channel(trust, address, service)`.

With mutual TLS the channel presents this process's certificate and accepts only a server whose certificate is
signed by the mesh CA and names `service` (its DNS SAN `<service>.chatmesh`, set as the TLS target name, so
whichever address is dialled, only that service's certificate answers). In plaintext (loopback only) it is a
plain insecure channel. Whatever else every hop needs is added here, once: trace propagation (only when tracing is
on: `chatmesh.mesh.tracing.traced_channel`), so the current trace context travels in each call's metadata. Open
every service-to-service channel through `open_channel`, never `grpc.aio.insecure_channel` directly.

Rotation: a gRPC channel's credentials are fixed when it is made, so the TLS channel is a thin wrapper that looks
at the watched certificate files (at most once a second, `reload.Watched`) when a call starts; after a change it
opens a new channel for new calls, and closes the old one with a long grace (`RETIRE_GRACE_S`), so calls and
streams already open on it finish on the connection they started on. Stubs are made once, over the wrapper.

Reconnect backoff. A channel whose connection attempt fails waits before the next one, by gRPC's connection
backoff (doc/connection-backoff.md in grpc): 1 s, then x1.6 per failure with 20% jitter, up to 120 s. A peer that
is down for 10 s (a restart) is then retried ~10 s after it is back: calls fail fast meanwhile (no call waits for
a connection), so recovery is as slow as the backoff. Inside the mesh every peer is a few hops away and a
connection attempt costs a SYN, so every `open_channel` channel gets `RECONNECT`: it starts at 100 ms and caps
at `MAX_RECONNECT_BACKOFF_MS` (1 s), so a peer that comes back is reached within about a second, at the cost of
one connect attempt a second while it is down. MIN_CONNECT_TIMEOUT (the time one attempt may take, 20 s) is
left alone: a slow TLS handshake still completes.

A peer that vanishes without closing its connections (its host powered off, its link down, a network partition)
sends no FIN or RST: without keepalive a call on that connection, a Generate stream or the router's WatchStats,
waits for its deadline (minutes) and the router keeps the replica serving. So `RECONNECT` also turns on HTTP/2
keepalive: a PING every 5 s (`KEEPALIVE_TIME_MS`) on every connection, with or without calls; no answer within
3 s (`KEEPALIVE_TIMEOUT_MS`; grpc 1.81 times the keepalive PING by `grpc.http2.ping_timeout_ms`, default
60 s, so both are set) and the connection is closed, its calls end UNAVAILABLE (which chat and the router
handle as the peer being gone) and the channel reconnects. A silent peer is seen within ~8 s; the cost is one
PING frame and its ack per connection every 5 s. The servers (`chatmesh.mesh.server.SERVER_OPTIONS`) accept
pings that often and ping their clients the same way, so an engine notices a vanished chat.

Several addresses. `target_for("10.0.0.1:50051,10.0.0.2:50051")` is gRPC's static `ipv4:` resolver target, and
`dns:///chat.internal:50051` (every A record of a name, re-resolved when connections fail) passes through; with
`balanced_options` the channel keeps a connection to each address and spreads calls round robin over those that
are connected, so a dead address stops receiving calls as soon as its connection drops. (With TLS the target
name is the service's, whichever address answers.)
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import grpc

from chatmesh.mesh import identity as ident
from chatmesh.mesh import tls, tracing
from chatmesh.mesh.errors import InvalidArgument
from chatmesh.mesh.reload import Watched
from chatmesh.mesh.trust import Trust

RETIRE_GRACE_S = 600.0
Options = Sequence[tuple[str, Any]]
INITIAL_RECONNECT_BACKOFF_MS = 100
MAX_RECONNECT_BACKOFF_MS = 1000
# keepalive: a ping every KEEPALIVE_TIME_MS on every connection, busy or idle; no answer within
# KEEPALIVE_TIMEOUT_MS and the connection is dead (its calls end UNAVAILABLE, the channel reconnects)
KEEPALIVE_TIME_MS = 5000
KEEPALIVE_TIMEOUT_MS = 3000
RECONNECT: Options = (
    ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
)


def _with_reconnect(options: Options) -> list[tuple[str, Any]]:
    given = {key for key, _ in options}
    return [*(o for o in RECONNECT if o[0] not in given), *options]


def _tls_options(service: str, options: Options) -> list[tuple[str, Any]]:
    return [("grpc.ssl_target_name_override", ident.server_name(service)), *options]


def open_channel(trust: Trust, address: str, service: str, options: Options = ()) -> grpc.aio.Channel:
    """A channel to `service` (one of identity.SERVICES) at `address` (a host:port or any target `target_for`
    returns), secured as `trust` says, with `RECONNECT` unless `options` sets those keys."""
    options = _with_reconnect(options)
    if trust.tls is None:
        for one in addresses_of(address):
            trust.check_address(one, f"dialling {service} at")
        return tracing.traced_channel(grpc.aio.insecure_channel(address, options=options))
    return RotatingChannel(trust.tls, address, service, options)


def open_blocking_channel(trust: Trust, address: str, service: str, options: Options = ()) -> grpc.Channel:
    """A synchronous channel (short-lived tools: health checks of `chatmesh up`); no rotation."""
    if trust.tls is None:
        trust.check_address(address, f"dialling {service} at")
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(trust.tls.current()), _tls_options(service, options))


def target_for(addresses: str) -> str:
    """A gRPC target for one address, a comma-separated list of IP literal addresses (`localhost` allowed), or
    a target with a scheme (`dns:///name:port`, `ipv4:...`), which is passed through."""
    text = addresses.strip()
    if not text:
        raise InvalidArgument("expected an address (host:port), a list of them, or a gRPC target; got nothing")
    if "://" in text or text.startswith(("ipv4:", "ipv6:", "unix:")):
        return text
    items = [item.strip() for item in text.split(",")]
    if len(items) == 1:
        return items[0]
    families = {_family(item) for item in items}
    if len(families) != 1:
        raise InvalidArgument(f"addresses {text!r} mix IPv4 and IPv6; list one family, or use a dns:/// target")
    return f"{families.pop()}:{','.join(item.replace('localhost:', '127.0.0.1:') for item in items)}"


def addresses_of(target: str) -> list[str]:
    """The host:port addresses of a static `ipv4:`/`ipv6:` list target; any other target as it is."""
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            return target.removeprefix(scheme).split(",")
    return [target]


def _family(item: str) -> str:
    host, sep, port = item.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InvalidArgument(f"expected host:port in an address list, got {item!r}")
    if host == "localhost":
        return "ipv4"
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise InvalidArgument(
            f"an address list takes IP addresses; {host!r} is a name: use one dns:///{host}:{port} target, "
            "which spreads calls over every address the name resolves to") from None
    return "ipv4" if ip.version == 4 else "ipv6"


def balanced_options(retry_service: str = "", retry_methods: Sequence[str] = ()) -> Options:
    """Round-robin balancing over every address of the target, and, for the named methods of
    `retry_service` (safe to repeat: idempotent by a request id), up to 3 attempts of a call answered UNAVAILABLE
    before its first response (a stream that has delivered a message is never retried by gRPC)."""
    config: dict[str, object] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if retry_service and retry_methods:
        config["methodConfig"] = [{
            "name": [{"service": retry_service, "method": m} for m in retry_methods],
            "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
        }]
    return (("grpc.service_config", json.dumps(config)), ("grpc.enable_retries", 1))


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
        return tracing.traced_channel(grpc.aio.secure_channel(self._address, tls.channel_credentials(pems),
                                                              self._options))

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
