"""Workload identities: who a gRPC peer is, by its certificate.

Every mesh certificate names one identity as a URI SAN in SPIFFE form, `spiffe://chatmesh/<name>`:

- a service: `spiffe://chatmesh/gateway`, `.../chat`, `.../store`, `.../router`, `.../engine`, `.../moderation`
  (every replica of a service shares its identity: authorization is by role, not by instance);
- the operator: `spiffe://chatmesh/operator` (grpcurl, purge, debugging reads of stats);
- an internal service that acts for users: `spiffe://chatmesh/client/<name>` (the README's typed client).

A server reads the caller's identity from the TLS session (`peer_identity`); a client checks the server's by the
DNS SAN `<service>.chatmesh` that every service certificate also carries (`server_name`): gRPC Python verifies a
server's certificate against a host name only, so clients name the service they expect instead of the network
address they dial, and a store certificate cannot answer for the engine wherever it listens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import NewType, Protocol

Identity = NewType("Identity", str)

TRUST_DOMAIN = "chatmesh"
PREFIX = f"spiffe://{TRUST_DOMAIN}/"
SERVICES = ("gateway", "chat", "store", "router", "engine", "moderation")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def _checked(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"identity name must be lower-case letters, digits and dashes, got {name!r}")
    return name


def service(name: str) -> Identity:
    if name not in SERVICES:
        raise ValueError(f"unknown service {name!r} (one of {', '.join(SERVICES)})")
    return Identity(PREFIX + name)


def client(name: str) -> Identity:
    """An internal service allowed to act for users (it calls ChatService and the token-issuing RPC)."""
    return Identity(f"{PREFIX}client/{_checked(name)}")


GATEWAY, CHAT, STORE, ROUTER, ENGINE, MODERATION = (service(s) for s in SERVICES)
OPERATOR = Identity(PREFIX + "operator")
ANY_CLIENT = Identity(PREFIX + "client/*")  # a pattern in authorization tables: every client/<name>
ANY_PEER = Identity("*")  # a pattern in authorization tables: every authenticated peer


def matches(pattern: Identity, identity: Identity) -> bool:
    if pattern == ANY_PEER:
        return True
    if pattern.endswith("/*"):
        return identity.startswith(pattern[:-1])
    return identity == pattern


def file_stem(identity: Identity) -> str:
    """The file name an identity's certificate is kept under: `store`, `operator`, `client-reports`."""
    return identity.removeprefix(PREFIX).replace("/", "-")


def server_name(service_name: str) -> str:
    """The DNS SAN a service's certificate carries and its clients verify (never resolved)."""
    return f"{service_name}.{TRUST_DOMAIN}"


def parse(text: str, pattern: bool = False) -> Identity:
    """A SPIFFE id of this trust domain (from a certificate; with `pattern`, from an authorization table, where
    `spiffe://chatmesh/client/*` stands for every client and `*` for every authenticated peer)."""
    if pattern and text == "*":
        return Identity(text)
    if not text.startswith(PREFIX):
        raise ValueError(f"not a chatmesh identity (expected {PREFIX}...): {text!r}")
    rest = text.removeprefix(PREFIX)
    if rest == "operator" or rest in SERVICES:
        return Identity(text)
    kind, _, name = rest.partition("/")
    if kind == "client" and ((pattern and name == "*") or _NAME.fullmatch(name)):
        return Identity(text)
    raise ValueError(f"unknown chatmesh identity {text!r}")


class _HasAuthContext(Protocol):
    def auth_context(self) -> Mapping[str, Iterable[bytes]]: ...


def peer_identity(context: _HasAuthContext) -> Identity | None:
    """The caller's identity from its verified client certificate, or None (plaintext, or no chatmesh identity).

    gRPC's TLS layer sets `peer_spiffe_id` when the verified peer certificate has exactly one URI SAN and it is a
    well-formed SPIFFE id (a certificate naming two identities has none: refused, not guessed); it must also be
    an identity of this trust domain."""
    found = context.auth_context().get("peer_spiffe_id")
    if not found:
        return None
    try:
        return parse(next(iter(found)).decode())
    except ValueError:
        return None
