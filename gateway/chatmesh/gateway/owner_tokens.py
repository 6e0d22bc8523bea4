"""Owner tokens at the edge (chatmesh.mesh.tokens): minted per request for the user the gateway has just
authenticated, and issued over gRPC to internal clients that act for users.

Per request: `EdgeTokens.metadata(principal, conversation)` mints a token for the principal's owner id (the one
owner id the gateway believes: from the session or the key, never from a request field), bound to the
conversation when the route names one, so a token that leaks opens that conversation only, and owner-wide
otherwise (create, list, usage, export). It lives CHATMESH_OWNER_TOKEN_TTL_S (longer than a turn: a turn's last
store write carries the token its request came with) and travels in the `chatmesh-owner-token` metadata of the
request's ChatService calls; chat verifies it and forwards it to the store and the engine. Minting is one
Ed25519 signature (~40 us here); a conversation's requests within a minute share one token (`EdgeTokens`), so
its verifiers' caches answer for it. In plaintext (CHATMESH_MESH_PLAINTEXT) nothing is minted: nothing
behind the edge verifies.

`OwnerTokenService` (protos/chatmesh/v1/owner_token.proto) on CHATMESH_OWNER_TOKEN_ADDRESS, mutual TLS only and
callable by spiffe://chatmesh/client/* identities only (`AUTHZ`): an internal service that acts for users (the
README's typed client) asks it for a token naming the owner, and conversation, it acts for. Each issue is logged
with the caller's identity, the owner and conversation ids and the key id, never the token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from chatmesh.gateway.identity import Principal
from chatmesh.mesh import authz, identity, logs, tokens
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import InvalidArgument, PermissionDenied
from chatmesh.mesh.ids import ConversationId, OwnerId, parse_conversation_id, parse_owner_id
from chatmesh.mesh.server import Running, Service, start_server, unary_errors
from chatmesh.mesh.settings import OWNER_TOKEN_ADDRESS
from chatmesh.mesh.trust import Trust, host_of
from chatmesh.v1 import owner_token_pb2, owner_token_pb2_grpc

log = logs.get("chatmesh.gateway.owner_tokens")

Metadata = tuple[tuple[str, str], ...]
REUSE_S = 60.0  # how long a minted token is handed out again for the same owner and conversation
REUSE_ENTRIES = 65536  # minted tokens kept for reuse (then forgotten all at once; a miss only costs a signature)
AUTHZ = {"chatmesh.v1.OwnerTokenService": {"IssueOwnerToken": [identity.ANY_CLIENT]}}


class EdgeTokens:
    """Mints the owner token each request's ChatService calls carry (none in plaintext).

    A token minted for (owner, conversation) is handed out again for `REUSE_S` (a tenth of the TTL when that
    is shorter) while its key still signs, so the turns of a conversation a minute apart carry the same token:
    chat, the store and the engine find it in the cache of what they verified (by the token's bytes) instead of
    verifying an Ed25519 signature each (~60-110 us here, three on a turn's way to its first token), and the
    gateway signs once instead of per request. A token handed out still has at least TTL - REUSE_S to live
    (840 s by default), longer than a turn."""

    def __init__(self, issuer: tokens.Issuer | None) -> None:
        self.issuer = issuer
        self._minted: dict[tuple[OwnerId, ConversationId | None], tokens.Minted] = {}

    @classmethod
    def from_trust(cls, trust: Trust, ttl_s: int) -> EdgeTokens:
        """With mutual TLS the gateway's trust verifies with the key set holding private halves: it signs with it."""
        return cls(None if trust.verifier is None else tokens.Issuer(trust.verifier.keys, ttl_s))

    def metadata(self, who: Principal, conversation: ConversationId | None = None) -> Metadata:
        if self.issuer is None:
            return ()
        return tokens.metadata_of(self.token(self.issuer, who.owner, conversation))

    def token(self, issuer: tokens.Issuer, owner: OwnerId, conversation: ConversationId | None,
              now: float | None = None) -> str:
        at = time.time() if now is None else now
        key = (owner, conversation)
        minted = self._minted.get(key)
        fresh_for = issuer.ttl_s - min(REUSE_S, issuer.ttl_s / 10)
        if minted is None or minted.claims.expires_at - at < fresh_for \
                or minted.claims.key_id != issuer.keys.current().signing_key_id:
            minted = issuer.mint(owner, conversation, now=at, presenter=identity.GATEWAY)
            if len(self._minted) >= REUSE_ENTRIES:
                self._minted.clear()
            self._minted[key] = minted
        return minted.token


class OwnerTokenServicer(owner_token_pb2_grpc.OwnerTokenServiceServicer):
    def __init__(self, issuer: tokens.Issuer) -> None:
        self.issuer = issuer

    @unary_errors
    async def IssueOwnerToken(self, request: owner_token_pb2.IssueOwnerTokenRequest,
                              context: grpc.aio.ServicerContext[object, object]
                              ) -> owner_token_pb2.IssueOwnerTokenResponse:
        owner = parse_owner_id(request.owner_id)
        conversation = parse_conversation_id(request.conversation_id) if request.conversation_id else None
        if request.ttl_s < 0:
            raise InvalidArgument("ttl_s must not be negative (0: the gateway's CHATMESH_OWNER_TOKEN_TTL_S)")
        caller = authz.caller.get()
        if caller is None:  # the guard in front of every RPC names the caller; without it nobody may mint
            raise PermissionDenied("owner tokens are issued to mesh identities only")
        minted = self.issuer.mint(owner, conversation, ttl_s=request.ttl_s or None, presenter=caller.identity)
        log.info("owner_token_issued", caller=caller.identity, owner_id=owner,
                 conversation_id=conversation or "", key_id=minted.claims.key_id,
                 expires_at=minted.claims.expires_at)
        return owner_token_pb2.IssueOwnerTokenResponse(
            token=minted.token, expires_at_ms=minted.claims.expires_at * 1000, metadata_key=tokens.METADATA_KEY,
            key_id=minted.claims.key_id)


@dataclass
class TokenServer:
    service: Service
    running: Running
    host: str

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.running.port}" if ":" in self.host else f"{self.host}:{self.running.port}"

    async def stop(self, grace_s: float = 0) -> None:
        await self.running.stop(self.service, grace_s)


def token_service(issuer: tokens.Issuer) -> Service:
    servicer = OwnerTokenServicer(issuer)

    def register(server: grpc.aio.Server) -> list[str]:
        owner_token_pb2_grpc.add_OwnerTokenServiceServicer_to_server(servicer, server)
        return [owner_token_pb2.DESCRIPTOR.services_by_name["OwnerTokenService"].full_name]

    return Service(name="gateway", register=register, authz=AUTHZ)


async def serve_token_service(cfg: Config, trust: Trust, edge: EdgeTokens) -> TokenServer | None:
    """Starts OwnerTokenService on CHATMESH_OWNER_TOKEN_ADDRESS (None: the address is empty, or plaintext)."""
    address = cfg[OWNER_TOKEN_ADDRESS]
    if not address or edge.issuer is None:
        return None
    service = token_service(edge.issuer)
    return TokenServer(service, await start_server(service, address, trust=trust), host_of(address))
