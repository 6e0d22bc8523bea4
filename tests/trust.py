"""Acting as a mesh identity in tests: development certificates (the same `pki.ensure` as `chatmesh up`), a
service's trust, and client channels that present an identity and, optionally, an owner token for the owner
each request names (what the gateway and chat do for a real turn)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from chatmesh.mesh import identity as ident
from chatmesh.mesh import pki, tls, tokens
from chatmesh.mesh.identity import Identity
from chatmesh.mesh.errors import CoreError
from chatmesh.mesh.ids import ConversationId, OwnerId
from chatmesh.mesh.owner_guard import OwnerGuard
from chatmesh.mesh.server import status_for
from chatmesh.mesh.tls import TlsFiles
from chatmesh.mesh.trust import Trust
from chatmesh.v1 import chat_pb2


def make_certs(folder: Path) -> Path:
    pki.ensure(folder)
    return folder


def trust_as(certs: Path, who: Identity) -> Trust:
    return Trust.from_files(TlsFiles.in_folder(certs, who), who, certs / pki.TOKEN_PUBLIC_KEYS_FILE)


def issuer_of(certs: Path, ttl_s: int = 900) -> tokens.Issuer:
    return tokens.Issuer(tokens.watch_keys(pki.private_keys_file(certs)), ttl_s)


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
    carries a valid token for the owner its request names, minted for `who` (its presenter)."""
    files = TlsFiles.in_folder(certs, who)
    pems = tls.parse_pems(files.ca.read_bytes(), files.cert.read_bytes(), files.key.read_bytes(), who)
    issuer = issuer_of(certs)
    def mint(owner: OwnerId) -> str:
        return issuer.mint(owner, presenter=who).token

    interceptors: list[Any] | None = [UnaryOwnerTokens(mint), StreamOwnerTokens(mint)] if owner_tokens else None
    return grpc.aio.secure_channel(address, tls.channel_credentials(pems),
                                   [("grpc.ssl_target_name_override", ident.server_name(service))],
                                   interceptors=interceptors)


def gateway_env(certs: Path) -> dict[str, str]:
    """Settings that make a gateway in this process act as spiffe://chatmesh/gateway with `certs` (it mints
    owner tokens with the private key set); its OwnerTokenService is off unless a test sets an address."""
    stem = ident.file_stem(ident.GATEWAY)
    return {"CHATMESH_MESH_CA_FILE": str(certs / pki.CA_FILE), "CHATMESH_MESH_CERT_FILE": str(certs / f"{stem}.pem"),
            "CHATMESH_MESH_KEY_FILE": str(certs / f"{stem}-key.pem"),
            "CHATMESH_OWNER_TOKEN_KEYS_FILE": str(pki.private_keys_file(certs)), "CHATMESH_OWNER_TOKEN_ADDRESS": ""}


class OwnerChecked:
    """A servicer's stand-in that checks each call's owner token as chat does (`OwnerGuard`: for the request's
    owner, and its conversation when the request names one) before the servicer runs, and records the verified
    claims, so a test double of a service enforces the same contract as the real one."""

    def __init__(self, servicer: object, verifier: tokens.Verifier) -> None:
        self._servicer = servicer
        self._guard = OwnerGuard(verifier)
        self.claims: list[tokens.OwnerClaims] = []

    def _check(self, request: Any, context: Any) -> None:
        conversation = getattr(request, "conversation_id", "")
        # a SendTurn that creates its conversation is owner-wide, as CreateConversation is: chat forwards its
        # token to the store's InsertConversation, which needs an owner-wide one
        creates = isinstance(request, chat_pb2.SendTurnRequest) and request.HasField("create")
        self._guard.owner(context, request.owner_id, ConversationId(conversation) if conversation else None,
                          owner_wide=not conversation or creates)
        self.claims.append(self._guard.claims(context))

    def __getattr__(self, name: str) -> Any:
        behaviour = getattr(self._servicer, name)
        if inspect.isasyncgenfunction(behaviour):
            async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
                try:
                    self._check(request, context)
                except CoreError as err:
                    await context.abort(status_for(err), str(err))
                async for item in behaviour(request, context):
                    yield item
            return streaming
        if inspect.iscoroutinefunction(behaviour):
            async def unary(request: Any, context: Any) -> Any:
                try:
                    self._check(request, context)
                except CoreError as err:
                    await context.abort(status_for(err), str(err))
                return await behaviour(request, context)
            return unary
        return behaviour
