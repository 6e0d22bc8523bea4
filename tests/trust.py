"""Acting as a mesh identity in tests: development certificates (the same `pki.ensure` as `chatmesh up`), a
service's trust, and client channels that present an identity and, optionally, an owner token for the owner
each request names (what the gateway and chat do for a real turn)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from chatmesh.mesh import identity as ident
from chatmesh.mesh import pki, tls, tokens
from chatmesh.mesh.identity import Identity
from chatmesh.mesh.ids import OwnerId
from chatmesh.mesh.tls import TlsFiles
from chatmesh.mesh.trust import Trust


def make_certs(folder: Path) -> Path:
    pki.ensure(folder)
    return folder


def trust_as(certs: Path, who: Identity) -> Trust:
    return Trust.from_files(TlsFiles.in_folder(certs, who), who, certs / pki.TOKEN_PUBLIC_KEYS_FILE)


def issuer_of(certs: Path, ttl_s: int = 900) -> tokens.Issuer:
    return tokens.Issuer(tokens.watch_keys(certs / pki.TOKEN_KEYS_FILE), ttl_s)


def _with_token(details: Any, token: str | None) -> Any:
    if token is None:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()), (tokens.METADATA_KEY, token))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _OwnerTokens:
    """Adds an owner-wide token for the request's `owner_id` (none when the request names no owner)."""

    def __init__(self, mint: Callable[[OwnerId], str]) -> None:
        self.mint = mint

    def _token(self, request: Any) -> str | None:
        owner = getattr(request, "owner_id", "")
        return self.mint(OwnerId(owner)) if owner else None


# one class per call shape: grpc.aio files an interceptor under the first shape it implements only
class UnaryOwnerTokens(_OwnerTokens, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._token(request)), request)


class StreamOwnerTokens(_OwnerTokens, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[type-arg]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._token(request)), request)


def channel_as(certs: Path, who: Identity, address: str, service: str, owner_tokens: bool = False
               ) -> grpc.aio.Channel:
    """A TLS channel to `service` at `address` presenting `who`'s certificate; with `owner_tokens`, every call
    carries a valid token for the owner its request names."""
    files = TlsFiles.in_folder(certs, who)
    pems = tls.parse_pems(files.ca.read_bytes(), files.cert.read_bytes(), files.key.read_bytes(), who)
    issuer = issuer_of(certs)
    def mint(owner: OwnerId) -> str:
        return issuer.mint(owner).token

    interceptors: list[Any] | None = [UnaryOwnerTokens(mint), StreamOwnerTokens(mint)] if owner_tokens else None
    return grpc.aio.secure_channel(address, tls.channel_credentials(pems),
                                   [("grpc.ssl_target_name_override", ident.server_name(service))],
                                   interceptors=interceptors)
