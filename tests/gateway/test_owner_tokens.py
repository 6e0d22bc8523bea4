"""Owner tokens minted by the edge, over real gRPC and mutual TLS: every ChatService call a route makes carries a
token for the authenticated principal (never an owner a request names), bound to the conversation when the
route names one; and the gateway's OwnerTokenService gives tokens to client identities only."""

from __future__ import annotations

import io
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from chatmesh.gateway.cli import accounts_for
from chatmesh.mesh import identity as ident
from chatmesh.mesh import pki, tokens
from chatmesh.mesh.config import Config
from chatmesh.mesh.ids import ConversationId, OwnerId
from chatmesh.v1 import chat_pb2, chat_pb2_grpc, owner_token_pb2, owner_token_pb2_grpc
from tests.conftest import free_port
from tests.gateway.conftest import StartGateway
from tests.gateway.fake_chat import FakeChat
from tests.gateway.sse_client import collect, reply_text
from tests.mesh.conftest import captured, events  # noqa: F401  # captured: a fixture
from tests.trust import channel_as


def verifier(certs: Path) -> tokens.Verifier:
    return tokens.Verifier(tokens.watch_keys(certs / pki.TOKEN_PUBLIC_KEYS_FILE))


async def test_each_route_sends_a_token_for_the_principal_bound_to_the_conversation_it_names(
        start_gateway: StartGateway, fake: FakeChat) -> None:
    gw = await start_gateway()
    async with gw.client() as client:
        conv = (await client.post("/v1/conversations", json={"title": "t"})).json()["id"]
        created = fake.token_claims[-1]
        assert (created.owner, created.conversation) == ("local", None)  # owner-wide: no conversation yet
        turn = str(uuid.uuid4())
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                  json={"turn_id": turn, "content": "Hi"}) as r:
            assert reply_text(await collect(r)) == "Hello, world."
        async with client.stream("GET", f"/v1/conversations/{conv}/turns/{turn}/events") as r:
            await collect(r)
        assert (await client.post(f"/v1/conversations/{conv}/turns/{turn}/stop")).status_code == 200
        assert (await client.get(f"/v1/conversations/{conv}")).status_code == 200
        bound = fake.token_claims[1:]
        assert len(bound) == 4 and {(c.owner, c.conversation) for c in bound} == {("local", conv)}
        for path in ("/v1/conversations", "/v1/usage", "/v1/export"):
            assert (await client.get(path)).status_code == 200
            assert (fake.token_claims[-1].owner, fake.token_claims[-1].conversation) == ("local", None)
        assert (await client.delete(f"/v1/conversations/{conv}")).status_code == 204
        assert fake.token_claims[-1].conversation == conv
    # each request got its own short-lived token
    assert all(c.expires_at <= time.time() + 900 + 5 for c in fake.token_claims)


async def test_a_user_gets_tokens_for_themselves_only(start_gateway: StartGateway, fake: FakeChat,
                                                     tmp_path: Path) -> None:
    accounts = accounts_for(Config(env={"CHATMESH_DATA_DIR": str(tmp_path)}))
    await accounts.create_tables()
    alice = await accounts.create_user("alice")
    key = await accounts.create_key("alice")
    await accounts.close()
    gw = await start_gateway(CHATMESH_AUTH="required")
    async with gw.client(headers={"authorization": f"Bearer {key}"}) as client:
        assert (await client.post("/v1/conversations?owner_id=bob", json={"owner_id": "bob"})).status_code == 201
        assert (await client.get("/v1/conversations")).status_code == 200
    assert {c.owner for c in fake.token_claims} == {alice}


@dataclass
class Users:
    alice: OwnerId
    bob: OwnerId
    carol: OwnerId


@pytest.fixture
async def users(tmp_path: Path) -> Users:
    """Three users of the gateway's accounts; carol in group "support"."""
    accounts = accounts_for(Config(env={"CHATMESH_DATA_DIR": str(tmp_path)}))
    await accounts.create_tables()
    made = Users(*[await accounts.create_user(name) for name in ("alice", "bob", "carol")])
    assert await accounts.set_group("support", "carol", True)
    await accounts.close()
    return made


GRANTS = {
    "spiffe://chatmesh/client/dev": {"owners": "all", "scopes": ["read", "turns"], "prompt_tokens_per_turn": 4000},
    "spiffe://chatmesh/client/reports": {"owners": ["alice"], "scopes": ["read"]},
    "spiffe://chatmesh/client/support": {"owners": {"group": "support"}, "scopes": ["SendTurn", "GetTurn"],
                                         "prompt_tokens_per_turn": 500},
    "spiffe://chatmesh/client/nobody": {"owners": "none", "scopes": ["read"]},
}


@pytest.fixture
async def token_service(start_gateway: StartGateway, users: Users, tmp_path: Path, mesh_certs: Path) -> str:
    pki.ensure(mesh_certs, [ident.client(n) for n in ("reports", "support", "nobody", "stranger")])
    grants_file = tmp_path / "authz.json"
    grants_file.write_text(json.dumps({"owner_token_grants": GRANTS}))
    address = f"127.0.0.1:{free_port()}"
    await start_gateway(CHATMESH_OWNER_TOKEN_ADDRESS=address, CHATMESH_MESH_AUTHZ_FILE=str(grants_file))
    return address


async def issue(address: str, certs: Path, who: str, **request: Any) -> owner_token_pb2.IssueOwnerTokenResponse:
    async with channel_as(certs, ident.client(who), address, "gateway") as channel:
        return await owner_token_pb2_grpc.OwnerTokenServiceStub(channel).IssueOwnerToken(
            owner_token_pb2.IssueOwnerTokenRequest(**request), timeout=10)


async def refusal(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details() or ""


async def test_a_client_identity_gets_an_owner_token_that_chat_accepts_for_that_owner_only(
        token_service: str, mesh_certs: Path, fake_chat: tuple[FakeChat, str]) -> None:
    conv = str(uuid.uuid4())
    wide = await issue(token_service, mesh_certs, "dev", owner_id="local")
    short = await issue(token_service, mesh_certs, "dev", owner_id="local", conversation_id=conv, ttl_s=60)
    capped = await issue(token_service, mesh_certs, "dev", owner_id="local", ttl_s=10**6)
    for bad in ({"owner_id": "local", "ttl_s": -1}, {}):
        assert (await refusal(issue(token_service, mesh_certs, "dev", **bad)))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert wide.metadata_key == tokens.METADATA_KEY
    now = time.time()
    claims = verifier(mesh_certs).verify(wide.token)
    assert (claims.owner, claims.conversation, claims.key_id) == (OwnerId("local"), None, wide.key_id)
    assert (claims.presenter, claims.scopes, claims.prompt_allowance) == (ident.client("dev"), ("read", "turns"), 4000)
    assert (list(wide.scopes), wide.prompt_token_allowance) == (["read", "turns"], 4000)
    assert abs(wide.expires_at_ms / 1000 - (now + 900)) < 5
    assert verifier(mesh_certs).verify(short.token).conversation == ConversationId(conv)
    assert abs(short.expires_at_ms / 1000 - (now + 60)) < 5
    assert abs(capped.expires_at_ms / 1000 - (now + 900)) < 5  # never longer than CHATMESH_OWNER_TOKEN_TTL_S
    # chat takes the token for local from client/dev, and refuses it for bob, or from the gateway's identity
    as_local = ((wide.metadata_key, wide.token),)
    async with channel_as(mesh_certs, ident.client("dev"), fake_chat[1], "chat") as channel:
        chat = chat_pb2_grpc.ChatServiceStub(channel)
        made = await chat.CreateConversation(chat_pb2.CreateConversationRequest(owner_id="local"), metadata=as_local)
        assert made.conversation.owner_id == "local"
        code, _ = await refusal(chat.CreateConversation(chat_pb2.CreateConversationRequest(owner_id="bob"),
                                                        metadata=as_local))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    async with channel_as(mesh_certs, ident.GATEWAY, fake_chat[1], "chat") as channel:
        code, details = await refusal(chat_pb2_grpc.ChatServiceStub(channel).CreateConversation(
            chat_pb2.CreateConversationRequest(owner_id="local"), metadata=as_local))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "minted for spiffe://chatmesh/client/dev" in details


async def test_each_client_gets_what_its_grant_allows_and_no_grant_gets_nothing(
        token_service: str, mesh_certs: Path, users: Users, captured: io.StringIO) -> None:
    """The finding: any client identity got a token for any string, user or not. Now a grant decides: which
    owners (all, none, a list, a group the accounts know), which scopes, what budget; the default is nothing."""
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert (await refusal(issue(token_service, mesh_certs, "stranger", owner_id=users.alice))) == (
        denied, "spiffe://chatmesh/client/stranger has no owner-token grant (CHATMESH_MESH_AUTHZ_FILE "
                "\"owner_token_grants\")")
    # "all" is every owner the gateway knows, not any string
    assert (await refusal(issue(token_service, mesh_certs, "dev", owner_id="mallory")))[0] == denied
    assert (await issue(token_service, mesh_certs, "dev", owner_id=users.bob)).token
    # a list (by name here), a group, none
    assert (await issue(token_service, mesh_certs, "reports", owner_id=users.alice)).scopes == ["read"]
    assert (await refusal(issue(token_service, mesh_certs, "reports", owner_id=users.bob)))[0] == denied
    support = await issue(token_service, mesh_certs, "support", owner_id=users.carol)
    assert (list(support.scopes), support.prompt_token_allowance) == (["SendTurn", "GetTurn"], 500)
    assert (await refusal(issue(token_service, mesh_certs, "support", owner_id=users.alice)))[0] == denied
    assert (await refusal(issue(token_service, mesh_certs, "nobody", owner_id=users.alice)))[0] == denied
    # fewer scopes than the grant's, never more; a read-only token carries no turn budget
    read_only = await issue(token_service, mesh_certs, "dev", owner_id=users.bob, scopes=["read"])
    assert (list(read_only.scopes), read_only.prompt_token_allowance) == (["read"], 0)
    assert verifier(mesh_certs).verify(read_only.token).prompt_allowance is None
    assert (await issue(token_service, mesh_certs, "reports", owner_id=users.alice,
                        scopes=["ExportUserData"])).scopes == ["ExportUserData"]
    code, details = await refusal(issue(token_service, mesh_certs, "reports", owner_id=users.alice,
                                        scopes=["read", "delete"]))
    assert code == denied and "does not include scopes ['delete']" in details
    # the audit trail: each issue and each refusal, ids only
    issued, refused = events(captured, "owner_token_issued"), events(captured, "owner_token_refused")
    assert len(issued) == 5 and len(refused) == 6
    assert {r["reason"] for r in refused} == {"no_grant", "owner_not_granted", "scope_not_granted"}
    assert {(e["caller"], e["owner_id"]) for e in issued} >= {(str(ident.client("support")), users.carol)}
    assert all(set(e) <= {"event", "caller", "owner_id", "conversation_id", "key_id", "expires_at", "scopes",
                          "prompt_token_allowance", "level", "timestamp", "service", "logger"} for e in issued)
    assert support.token not in captured.getvalue()


async def test_only_client_identities_may_ask_and_only_with_a_certificate(token_service: str,
                                                                          mesh_certs: Path) -> None:
    request = owner_token_pb2.IssueOwnerTokenRequest(owner_id="alice")
    for who in (ident.GATEWAY, ident.CHAT, ident.STORE, ident.OPERATOR):
        async with channel_as(mesh_certs, who, token_service, "gateway") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await owner_token_pb2_grpc.OwnerTokenServiceStub(channel).IssueOwnerToken(request)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert err.value.details() == f"{who} may not call /chatmesh.v1.OwnerTokenService/IssueOwnerToken"
    async with grpc.aio.insecure_channel(token_service) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await owner_token_pb2_grpc.OwnerTokenServiceStub(plain).IssueOwnerToken(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # the HTTP edge never serves it
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(httpx.HTTPError):
            await client.get(f"http://{token_service}/")


def test_a_conversations_requests_within_a_minute_share_one_token_and_it_always_has_life_left(
        tmp_path: Path) -> None:
    from chatmesh.gateway.owner_tokens import REUSE_S, EdgeTokens

    certs = tmp_path / "certs"
    pki.ensure(certs, identities=[])
    issuer = tokens.Issuer(tokens.watch_keys(pki.private_keys_file(certs)), 900)
    edge = EdgeTokens(issuer)
    alice, bob = OwnerId("alice"), OwnerId("bob")
    conv, other = ConversationId(str(uuid.uuid4())), ConversationId(str(uuid.uuid4()))
    t0 = time.time()
    first = edge.token(issuer, alice, conv, now=t0)
    assert edge.token(issuer, alice, conv, now=t0 + REUSE_S - 1) == first
    assert len({first, edge.token(issuer, alice, other, now=t0), edge.token(issuer, alice, None, now=t0),
                edge.token(issuer, bob, conv, now=t0)}) == 4  # each owner and conversation its own
    later = edge.token(issuer, alice, conv, now=t0 + REUSE_S + 1)
    assert later != first
    claims = verifier(certs).verify(later, now=t0 + REUSE_S + 1)
    assert claims.expires_at - (t0 + REUSE_S + 1) >= 900 - REUSE_S - 1
    kid = pki.rotate_token_key(certs)  # a new signing key: tokens of the old one are not handed out again
    issuer.keys.current(force=True)
    rotated = edge.token(issuer, alice, conv, now=t0 + REUSE_S + 2)
    assert rotated != later and verifier(certs).verify(rotated, now=t0 + REUSE_S + 2).key_id == kid
