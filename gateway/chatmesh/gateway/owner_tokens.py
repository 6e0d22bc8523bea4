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
README's typed client) asks it for a token naming the owner, and conversation, it acts for. It mints only what
the caller's grant allows (mesh/grants.py, in CHATMESH_MESH_AUTHZ_FILE; no grant, no token): an owner the grant
covers and the gateway knows (a user of its accounts, or the development user), the grant's scopes or fewer, and
its per-turn prompt budget; the token names the caller as its presenter, so no other identity can use it. Each
issue and each refusal is logged with the caller's identity and ids only (owner, conversation, key, scopes),
never the token: the audit trail of who acted for whom.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn, Protocol, assert_never

import grpc

from chatmesh.gateway.identity import Principal
from chatmesh.mesh import authz, grants, identity, logs, tokens
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import InvalidArgument, PermissionDenied
from chatmesh.mesh.grants import Grant, Owners
from chatmesh.mesh.reload import Watched
from chatmesh.mesh.identity import Identity
from chatmesh.mesh.ids import ConversationId, OwnerId, parse_conversation_id, parse_owner_id
from chatmesh.mesh.server import Running, Service, start_server, unary_errors
from chatmesh.mesh.settings import OWNER_TOKEN_ADDRESS
from chatmesh.mesh.trust import Trust, host_of
from chatmesh.v1 import owner_token_pb2, owner_token_pb2_grpc

log = logs.get("chatmesh.gateway.owner_tokens")
Grants = Mapping[Identity, Grant] | Watched[dict[Identity, Grant]]  # fixed, or the authorization file's

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


class Accounts(Protocol):
    """What the grants need of the gateway's accounts (chatmesh.gateway.accounts.Accounts)."""

    async def user_name(self, owner: OwnerId) -> str | None: ...

    async def in_group(self, owner: OwnerId, group: str) -> bool: ...


@dataclass(frozen=True)
class Directory:
    """The owners the gateway knows: its accounts' users, and the development user (CHATMESH_AUTH=local)."""

    accounts: Accounts | None
    local_owner: OwnerId | None = None

    async def name_of(self, owner: OwnerId) -> str | None:
        if owner == self.local_owner:
            return owner
        return await self.accounts.user_name(owner) if self.accounts is not None else None

    async def covers(self, grant: Grant, owner: OwnerId) -> bool:
        """Whether `grant` lets its client act for `owner` (never for an owner the gateway does not know)."""
        name = await self.name_of(owner)
        if name is None:
            return False
        match grant.owners:
            case Owners.ALL:
                return True
            case Owners.NONE:
                return False
            case Owners.LISTED:
                return owner in grant.listed or name in grant.listed
            case Owners.GROUP:
                return self.accounts is not None and await self.accounts.in_group(owner, grant.group)
            case _:
                assert_never(grant.owners)


class OwnerTokenServicer(owner_token_pb2_grpc.OwnerTokenServiceServicer):
    def __init__(self, issuer: tokens.Issuer, grants_by_client: Grants | None = None,
                 directory: Directory = Directory(None)) -> None:
        self.issuer = issuer
        self._grants = grants_by_client if isinstance(grants_by_client, Watched) else dict(grants_by_client or {})
        self.directory = directory

    @property
    def grants(self) -> Mapping[Identity, Grant]:
        """The grants in force: the authorization file's as it is now (re-read within a second of a change, so
        a grant revoked or narrowed mints nothing more; tokens already minted live out their TTL)."""
        return self._grants.current() if isinstance(self._grants, Watched) else self._grants

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
        grant = self.grants.get(caller.identity)
        if grant is None:
            self._refuse(caller.identity, owner, conversation, "no_grant",
                         f"{caller.identity} has no owner-token grant (CHATMESH_MESH_AUTHZ_FILE \"{grants.KEY}\")")
        if not await self.directory.covers(grant, owner):
            self._refuse(caller.identity, owner, conversation, "owner_not_granted",
                         f"{caller.identity}'s grant does not cover owner {owner!r} (not among its owners, or no "
                         f"user of this gateway)")
        outside = [s for s in request.scopes if s not in grant.scopes
                   and not any(s in tokens.SCOPES.get(g, ()) for g in grant.scopes)]
        if outside:
            self._refuse(caller.identity, owner, conversation, "scope_not_granted",
                         f"{caller.identity}'s grant does not include scopes {outside} (it has "
                         f"{', '.join(grant.scopes)})")
        scopes = tuple(request.scopes) or grant.scopes
        allowance = grant.prompt_tokens_per_turn if Grant(grant.owners, scopes).sends_turns else None
        minted = self.issuer.mint(owner, conversation, ttl_s=request.ttl_s or None, presenter=caller.identity,
                                  scopes=scopes, prompt_allowance=allowance)
        log.info("owner_token_issued", caller=caller.identity, owner_id=owner,
                 conversation_id=conversation or "", key_id=minted.claims.key_id,
                 expires_at=minted.claims.expires_at, scopes=list(scopes), prompt_token_allowance=allowance or 0)
        return owner_token_pb2.IssueOwnerTokenResponse(
            token=minted.token, expires_at_ms=minted.claims.expires_at * 1000, metadata_key=tokens.METADATA_KEY,
            key_id=minted.claims.key_id, scopes=scopes, prompt_token_allowance=allowance or 0)

    def _refuse(self, caller: Identity, owner: OwnerId, conversation: ConversationId | None, reason: str,
                message: str) -> NoReturn:
        log.warning("owner_token_refused", caller=caller, owner_id=owner, conversation_id=conversation or "",
                    reason=reason)
        raise PermissionDenied(message)


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


def token_service(issuer: tokens.Issuer, grants_by_client: Grants | None = None,
                  directory: Directory = Directory(None)) -> Service:
    servicer = OwnerTokenServicer(issuer, grants_by_client, directory)

    def register(server: grpc.aio.Server) -> list[str]:
        owner_token_pb2_grpc.add_OwnerTokenServiceServicer_to_server(servicer, server)
        return [owner_token_pb2.DESCRIPTOR.services_by_name["OwnerTokenService"].full_name]

    return Service(name="gateway", register=register, authz=AUTHZ)


def grants_of(trust: Trust) -> Grants:
    """The owner-token grants of the process's authorization file (none without one), re-read when it changes
    (a change that does not parse keeps the grants in force, and is logged: `reload.Watched`)."""
    path = trust.authz_file
    if path is None:
        return {}
    return Watched([path], lambda data: grants.parse(authz.parse_file(path, data[0])))


async def serve_token_service(cfg: Config, trust: Trust, edge: EdgeTokens, directory: Directory
                              ) -> TokenServer | None:
    """Starts OwnerTokenService on CHATMESH_OWNER_TOKEN_ADDRESS (None: the address is empty, or plaintext)."""
    address = cfg[OWNER_TOKEN_ADDRESS]
    if not address or edge.issuer is None:
        return None
    service = token_service(edge.issuer, grants_of(trust), directory)
    return TokenServer(service, await start_server(service, address, trust=trust), host_of(address))
