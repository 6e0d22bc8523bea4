"""Per-RPC authorization by workload identity: one table per service, checked in one place per server.

Each service declares its table next to its servicer (`Rules`: RPC name -> identity patterns allowed), and the
bootstrap builds the `Policy` at start-up from it, the standard services every peer may call (health,
reflection) and the overrides of CHATMESH_MESH_AUTHZ_FILE. A registered RPC without a rule refuses to start the
service (fail closed: a new RPC cannot be reachable by accident). Patterns: an exact identity,
`spiffe://chatmesh/client/*` for every internal client, `*` for every authenticated peer.

The check sits in each method's handler (`Guard`: the bootstrap registers every servicer through
`guarded(server, guard)`; not a server interceptor, whose path in gRPC Python costs more per call than the check):
it reads the peer's identity from the call's TLS session and answers PERMISSION_DENIED ("<identity> may not call
<rpc>"), logged once per denied call with ids only, before the servicer runs. It also publishes who is calling
(`caller`), so checks that need the request itself (owner tokens, owner_guard.py) can name the caller and RPC.
"""

from __future__ import annotations

import contextvars
import inspect
import json
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pool

from chatmesh.mesh import grants, logs
from chatmesh.mesh import identity as ident
from chatmesh.mesh.identity import Identity

log = logs.get("chatmesh.authz")

Rules = Mapping[str, Sequence[Identity]]  # RPC name ("ReadConversation") -> allowed patterns
OPEN_TO_PEERS = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")


@dataclass(frozen=True)
class Caller:
    identity: Identity
    method: str


caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("chatmesh_caller", default=None)


def methods_of(service_name: str) -> list[str]:
    """Full method paths (`/pkg.Service/Rpc`) of a registered protobuf service."""
    service = descriptor_pool.Default().FindServiceByName(service_name)  # type: ignore[no-untyped-call]
    return [f"/{service_name}/{m.name}" for m in service.methods]


def table(service_name: str, rules: Rules) -> dict[str, tuple[Identity, ...]]:
    """A service's rules as full method paths; ValueError when an RPC has no rule or a rule names no RPC."""
    paths = methods_of(service_name)
    names = {p.rsplit("/", 1)[1] for p in paths}
    unknown = sorted(set(rules) - names)
    if unknown:
        raise ValueError(f"{service_name}: authorization rules for unknown RPCs {unknown}")
    missing = sorted(names - set(rules))
    if missing:
        raise ValueError(f"{service_name}: no authorization rule for {missing} (every RPC needs one)")
    return {f"/{service_name}/{name}": tuple(allowed) for name, allowed in rules.items()}


def read_file(path: Path) -> dict[str, object]:
    """The authorization file's JSON object: RPC paths ("/chatmesh.v1.Service/Rpc") to the identities allowed,
    and "owner_token_grants" (grants.py)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"CHATMESH_MESH_AUTHZ_FILE {path}: unreadable ({err})") from None
    return parse_file(path, data)


def parse_file(path: Path, data: bytes) -> dict[str, object]:
    """`read_file` of the bytes already read from `path`."""
    try:
        doc = json.loads(data)
    except ValueError as err:
        raise ValueError(f"CHATMESH_MESH_AUTHZ_FILE {path}: unreadable ({err})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"CHATMESH_MESH_AUTHZ_FILE {path}: expected a JSON object")
    return doc


def read_overrides(path: Path) -> dict[str, tuple[Identity, ...]]:
    """The authorization rules of the file (its grants are the gateway's: grants.py)."""
    doc = read_file(path)
    rules = {k: v for k, v in doc.items() if k != grants.KEY}
    usage = (f"CHATMESH_MESH_AUTHZ_FILE {path}: expected {{\"/chatmesh.v1.Service/Rpc\": [\"spiffe://chatmesh/...\", "
             f"...], \"{grants.KEY}\": {{...}}}}")
    odd = sorted(k for k, v in rules.items() if not (k.startswith("/") and isinstance(v, list)))
    if odd:
        raise ValueError(f"{usage} (unknown entries {odd})")
    try:
        return {k: tuple(ident.parse(str(v), pattern=True) for v in vs) for k, vs in rules.items()
                if isinstance(vs, list)}
    except ValueError as err:
        raise ValueError(f"{usage} ({err})") from None


class Policy:
    """Which identities may call which full method path."""

    def __init__(self, rules: Mapping[str, Iterable[Identity]]) -> None:
        self.rules = {path: tuple(allowed) for path, allowed in rules.items()}

    @classmethod
    def build(cls, service_tables: Mapping[str, Rules], overrides: Mapping[str, Sequence[Identity]] = {}
              ) -> Policy:
        rules: dict[str, tuple[Identity, ...]] = {}
        for name, service_rules in service_tables.items():
            rules.update(table(name, service_rules))
        for name in OPEN_TO_PEERS:
            try:
                rules.update({p: (ident.ANY_PEER,) for p in methods_of(name)})
            except KeyError:  # that reflection version is not in this process's descriptor pool
                pass
        for path, allowed in overrides.items():
            if path.rsplit("/", 1)[0].lstrip("/") in service_tables:
                if path not in rules:
                    raise ValueError(f"CHATMESH_MESH_AUTHZ_FILE names {path}, which this service does not have")
                rules[path] = tuple(allowed)
        return cls(rules)

    def allows(self, method: str, who: Identity | None) -> bool:
        if who is None:
            return False
        return any(ident.matches(p, who) for p in self.rules.get(method, ()))


def _denied(who: Identity | None, method: str) -> str:
    return f"{who or 'a peer without a chatmesh identity'} may not call {method}"


class Guard:
    """The check in every method handler a server is given: `guarded(server, guard)` is the server to register
    servicers on, and each RPC's handler, as gRPC finds it, comes back wrapped in the check.

    Not a grpc.aio ServerInterceptor: an interceptor runs a coroutine chain per RPC to find the handler (and
    wraps it again anyway, since it cannot see the peer), and gRPC Python's interceptor path is slow; here the
    lookup is gRPC's own and the check is one function call in front of the servicer. The caller's identity is
    read from each call's own TLS session (`identity.peer_identity`), never remembered across calls."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}

    def handler(self, method: str, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        """`handler` with the check in front (made once per method and handler)."""
        found = self._wrapped.get(method)
        if found is not None and found[0] is handler:
            return found[1]
        wrapped = self._wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _refusal(self, context: Any, method: str) -> str | None:
        """None when the caller may call `method` (and `caller` is set); else why not (logged here, once)."""
        who = ident.peer_identity(context)
        if who is not None and self.policy.allows(method, who):
            caller.set(Caller(who, method))
            return None
        log.warning("permission_denied", caller=who or "", rpc=method, peer=context.peer())
        return _denied(who, method)

    def _wrap(self, handler: grpc.RpcMethodHandler[Any, Any], method: str) -> grpc.RpcMethodHandler[Any, Any]:
        h: Any = handler
        if h.unary_unary is not None:
            return h._replace(unary_unary=self._unary(h.unary_unary, method))  # type: ignore[no-any-return]
        if h.stream_unary is not None:
            return h._replace(stream_unary=self._unary(h.stream_unary, method))  # type: ignore[no-any-return]
        if h.unary_stream is not None:
            return h._replace(unary_stream=self._streaming(h.unary_stream, method))  # type: ignore[no-any-return]
        return h._replace(stream_stream=self._streaming(h.stream_stream, method))  # type: ignore[no-any-return]

    def _unary(self, behaviour: Any, method: str) -> Any:
        """Also wraps stream-request handlers, and response-streaming ones that write with context.write: all
        are coroutine functions, told apart from async generator functions the way gRPC tells them apart."""
        async def checked(request: Any, context: Any) -> Any:
            if (why := self._refusal(context, method)) is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            return await behaviour(request, context)

        return checked

    def _streaming(self, behaviour: Any, method: str) -> Any:
        if not inspect.isasyncgenfunction(behaviour):
            return self._unary(behaviour, method)

        async def checked(request: Any, context: Any) -> AsyncIterator[Any]:
            if (why := self._refusal(context, method)) is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            async for item in behaviour(request, context):
                yield item

        return checked


class _GuardedHandlers(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    def __init__(self, inner: grpc.GenericRpcHandler[Any, Any], guard: Guard) -> None:
        self._inner = inner
        self._guard = guard

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED
        return self._guard.handler(handler_call_details.method, handler)


class _GuardedServer(grpc.aio.Server):
    """A grpc.aio.Server whose handlers, however they are added, come with the guard's check. It is a
    grpc.aio.Server (what gRPC's reflection looks at to pick its asyncio servicer); the rest is the server's."""

    def __init__(self, server: grpc.aio.Server, guard: Guard) -> None:
        self._server = server
        self._guard = guard

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Iterable[grpc.GenericRpcHandler[Any, Any]]) -> None:
        self._server.add_generic_rpc_handlers([_GuardedHandlers(h, self._guard) for h in generic_rpc_handlers])

    def add_registered_method_handlers(self, service_name: str,
                                       method_handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]]) -> None:
        add = getattr(self._server, "add_registered_method_handlers")
        add(service_name, {name: self._guard.handler(f"/{service_name}/{name}", h)
                           for name, h in method_handlers.items()})

    def add_insecure_port(self, address: str) -> int:
        return self._server.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._server.add_secure_port(address, server_credentials)

    async def start(self) -> None:
        await self._server.start()

    async def stop(self, grace: float | None = None) -> None:
        await self._server.stop(grace)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self._server.wait_for_termination(timeout)


def guarded(server: grpc.aio.Server, guard: Guard) -> grpc.aio.Server:
    """The server to register handlers on so that every RPC of theirs is checked by `guard` first (a method with
    no rule in its policy is refused: fail closed)."""
    return _GuardedServer(server, guard)
