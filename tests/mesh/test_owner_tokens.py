"""Owner tokens at the store and the engine, over real gRPC and TLS, with chat's own certificate: without a
token, with alice's token for bob, or with an expired, foreign-key or tampered token, bob's data is not read,
charged or deleted; with bob's token it is. And the guard's other checks, at a ChatService that makes chat's
calls to it: the presenter a token was minted for, its scopes, the conversation a bound token needs."""

from __future__ import annotations

import base64
import io
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from chatmesh.engine_adapter import service as engine_service
from chatmesh.mesh import authz, pki, tokens
from chatmesh.mesh import identity as ident
from chatmesh.mesh.config import Config
from chatmesh.mesh.ids import ConversationId, OwnerId
from chatmesh.mesh.owner_guard import OwnerGuard
from chatmesh.mesh.server import Service, start_server, unary_errors
from chatmesh.store import service as store_service
from chatmesh.v1 import chat_pb2, chat_pb2_grpc, generate_pb2, generate_pb2_grpc, store_pb2, store_pb2_grpc
from tests.mesh.conftest import events
from tests.trust import channel_as, issuer_of, make_certs, trust_as

if TYPE_CHECKING:
    from chatmesh.v1.generate_pb2_grpc import GenerateServiceAsyncStub
    from chatmesh.v1.store_pb2_grpc import StoreServiceAsyncStub


def StoreStub(channel: grpc.aio.Channel) -> StoreServiceAsyncStub:
    return store_pb2_grpc.StoreServiceStub(channel)


def EngineStub(channel: grpc.aio.Channel) -> GenerateServiceAsyncStub:
    return generate_pb2_grpc.GenerateServiceStub(channel)

ALICE, BOB = OwnerId("alice"), OwnerId("bob")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_certs(tmp_path_factory.mktemp("tokens") / "certs")
    pki.ensure(folder, [ident.client("reports")])
    return folder


@pytest.fixture
async def mesh(certs: Path, tmp_path: Path) -> AsyncIterator[tuple[grpc.aio.Channel, grpc.aio.Channel]]:
    """(chat -> store channel, chat -> engine channel); no token is added: each call says which it carries."""
    cfg = Config(env={"CHATMESH_DATA_DIR": str(tmp_path), "CHATMESH_ENGINE": "sim", "CHATMESH_SIM_TEXT": "words",
                      "CHATMESH_STORE_PURGE_INTERVAL_S": "0"})
    store = store_service.build(cfg, trust_as(certs, ident.STORE))
    engine = engine_service.build(cfg, trust_as(certs, ident.ENGINE))
    s = await start_server(store, "127.0.0.1:0", trust=trust_as(certs, ident.STORE))
    e = await start_server(engine, "127.0.0.1:0", trust=trust_as(certs, ident.ENGINE))
    async with channel_as(certs, ident.CHAT, f"127.0.0.1:{s.port}", "store") as sc, \
            channel_as(certs, ident.CHAT, f"127.0.0.1:{e.port}", "engine") as ec:
        yield sc, ec
    await s.stop(store, 0)
    await e.stop(engine, 0)


def token(certs: Path, owner: OwnerId, conversation: str | None = None, ttl_s: int = 300) -> str:
    return issuer_of(certs).mint(owner, ConversationId(conversation) if conversation else None, ttl_s,
                                 presenter=ident.GATEWAY).token  # the gateway's; chat forwards it


def md(tok: str | None) -> tuple[tuple[str, str], ...]:
    return tokens.metadata_of(tok)


async def refused(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details() or ""


async def bobs_conversation(store: StoreServiceAsyncStub, certs: Path) -> str:
    bob = md(token(certs, BOB))
    conv = (await store.InsertConversation(store_pb2.InsertConversationRequest(
        owner_id=BOB, title="bob's", system_prompt_version="v1"), metadata=bob)).conversation.conversation_id
    turn = str(uuid.uuid4())
    claimed = await store.BeginTurn(store_pb2.BeginTurnRequest(
        owner_id=BOB, conversation_id=conv, turn_id=turn, content="bob's secret", lease_holder="t"), metadata=bob)
    await store.FinishTurn(store_pb2.FinishTurnRequest(
        owner_id=BOB, conversation_id=conv, turn_id=turn, lease_id=claimed.claimed.lease_id, user_token_count=3,
        reply="noted", reply_token_count=1), metadata=bob)
    return conv


async def test_no_token_or_alices_token_opens_nothing_of_bobs(
        certs: Path, mesh: tuple[grpc.aio.Channel, grpc.aio.Channel]) -> None:
    store = StoreStub(mesh[0])
    engine = EngineStub(mesh[1])
    conv = await bobs_conversation(store, certs)
    alice, alice_in_bobs = md(token(certs, ALICE)), md(token(certs, ALICE, conv))
    for metadata, code in ((md(None), grpc.StatusCode.UNAUTHENTICATED), (alice, grpc.StatusCode.PERMISSION_DENIED),
                           (alice_in_bobs, grpc.StatusCode.PERMISSION_DENIED)):
        assert (await refused(store.ReadConversation(store_pb2.ReadConversationRequest(
            owner_id=BOB, conversation_id=conv), metadata=metadata)))[0] == code
        assert (await refused(store.ExportOwnerData(store_pb2.ExportOwnerDataRequest(owner_id=BOB),
                                                    metadata=metadata)))[0] == code
        assert (await refused(store.DeleteOwnerData(store_pb2.DeleteOwnerDataRequest(owner_id=BOB),
                                                    metadata=metadata)))[0] == code
        assert (await refused(engine.Generate(generate_pb2.GenerateRequest(
            owner_id=BOB, conversation_id=conv, prompt_token_ids=[1, 2, 3], max_tokens=4),
            metadata=metadata).read()))[0] == code
        assert (await refused(engine.Evict(generate_pb2.EvictRequest(owner_id=BOB),
                                           metadata=metadata)))[0] == code
    # a token bound to one conversation is not an owner-wide token
    bob_in_conv = md(token(certs, BOB, conv))
    code, details = await refused(store.DeleteOwnerData(store_pb2.DeleteOwnerDataRequest(owner_id=BOB),
                                                        metadata=bob_in_conv))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "owner-wide" in details
    # nothing of bob's was read, charged or deleted: his own token sees it all, the engine ran nothing
    stats = (await engine.GetStats(generate_pb2.GetStatsRequest())).stats
    assert stats.generations == 0
    bob = md(token(certs, BOB))
    history = await store.ReadConversation(store_pb2.ReadConversationRequest(owner_id=BOB, conversation_id=conv),
                                           metadata=bob_in_conv)
    assert [m.content for m in history.messages] == ["bob's secret", "noted"]
    usage = await store.ReadUsage(store_pb2.ReadUsageRequest(owner_id=BOB), metadata=bob)
    assert [d.turns for d in usage.days] == [1]
    exported = json.loads((await store.ExportOwnerData(store_pb2.ExportOwnerDataRequest(owner_id=BOB),
                                                       metadata=bob)).json)
    assert len(exported["conversations"]) == 1
    events = [r.WhichOneof("event") async for r in engine.Generate(generate_pb2.GenerateRequest(
        owner_id=BOB, conversation_id=conv, prompt_token_ids=[1, 2, 3], max_tokens=4), metadata=bob_in_conv)]
    assert events[0] == "started" and events[-1] == "finished"


def _tampered(tok: str) -> str:
    header, payload, signature = tok.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    forged = base64.urlsafe_b64encode(json.dumps({**claims, "sub": "bob"}).encode()).rstrip(b"=").decode()
    return f"{header}.{forged}.{signature}"


async def test_expired_foreign_and_tampered_tokens_are_refused(
        certs: Path, mesh: tuple[grpc.aio.Channel, grpc.aio.Channel], tmp_path: Path) -> None:
    store = StoreStub(mesh[0])
    conv = await bobs_conversation(store, certs)
    expired = issuer_of(certs).mint(BOB, now=1_000_000, presenter=ident.GATEWAY).token
    foreign = issuer_of(make_certs(tmp_path / "other")).mint(BOB, presenter=ident.GATEWAY).token
    tampered = _tampered(token(certs, ALICE))
    for bad, why in ((expired, "expired"), (foreign, "unknown key"), (tampered, "signature does not verify")):
        code, details = await refused(store.ReadConversation(store_pb2.ReadConversationRequest(
            owner_id=BOB, conversation_id=conv), metadata=md(bad)))
        assert code == grpc.StatusCode.UNAUTHENTICATED and why in details, (code, details)


async def test_a_conversation_bound_token_creates_that_conversation_only(
        certs: Path, mesh: tuple[grpc.aio.Channel, grpc.aio.Channel]) -> None:
    """Chat's SendTurn with `create` (the OpenAI surface's first turn) inserts the conversation it names with the
    token the edge bound to it; that token makes no other conversation, and no unnamed one."""
    store = StoreStub(mesh[0])
    conv, other = str(uuid.uuid4()), str(uuid.uuid4())
    bound = md(token(certs, BOB, conv))
    made = await store.InsertConversation(store_pb2.InsertConversationRequest(
        owner_id=BOB, conversation_id=conv, system_prompt_version="v1"), metadata=bound)
    assert made.created and made.conversation.conversation_id == conv
    for request in (store_pb2.InsertConversationRequest(owner_id=BOB, conversation_id=other,
                                                        system_prompt_version="v1"),
                    store_pb2.InsertConversationRequest(owner_id=BOB, system_prompt_version="v1")):
        assert (await refused(store.InsertConversation(request, metadata=bound)))[0] == \
            grpc.StatusCode.PERMISSION_DENIED
    alice_bound = md(token(certs, ALICE, other))
    assert (await refused(store.InsertConversation(store_pb2.InsertConversationRequest(
        owner_id=BOB, conversation_id=other, system_prompt_version="v1"), metadata=alice_bound)))[0] == \
        grpc.StatusCode.PERMISSION_DENIED
    listed = await store.ListOwnerConversations(store_pb2.ListOwnerConversationsRequest(owner_id=BOB),
                                                metadata=md(token(certs, BOB)))
    assert [c.conversation_id for c in listed.conversations] == [conv]


async def test_an_owner_refusal_is_logged_once_with_ids_and_never_the_token(
        certs: Path, mesh: tuple[grpc.aio.Channel, grpc.aio.Channel], captured: io.StringIO) -> None:
    store = StoreStub(mesh[0])
    conv = await bobs_conversation(store, certs)
    alices = token(certs, ALICE)
    await refused(store.ReadConversation(store_pb2.ReadConversationRequest(owner_id=BOB, conversation_id=conv),
                                         metadata=md(alices)))
    denied = events(captured, "owner_denied")
    assert len(denied) == 1, captured.getvalue()
    assert {k: denied[0][k] for k in ("reason", "caller", "rpc", "owner_id", "conversation_id")} == {
        "reason": "owner_mismatch", "caller": ident.CHAT, "rpc": "/chatmesh.v1.StoreService/ReadConversation",
        "owner_id": BOB, "conversation_id": conv}
    assert alices not in captured.getvalue() and alices.split(".")[2] not in captured.getvalue()


class GuardedChat(chat_pb2_grpc.ChatServiceServicer):
    """ChatService's owner check alone (the real chat makes the same `OwnerGuard` calls), answering empty."""

    def __init__(self, guard: OwnerGuard) -> None:
        self.guard = guard

    @unary_errors
    async def ExportUserData(self, request: chat_pb2.ExportUserDataRequest, context: Any
                             ) -> chat_pb2.ExportUserDataResponse:
        self.guard.owner_wide(context, request)
        return chat_pb2.ExportUserDataResponse(json="{}")

    @unary_errors
    async def GetTurn(self, request: chat_pb2.GetTurnRequest, context: Any) -> chat_pb2.GetTurnResponse:
        self.guard.in_conversation(context, request)
        return chat_pb2.GetTurnResponse()

    @unary_errors
    async def DeleteTurn(self, request: chat_pb2.DeleteTurnRequest, context: Any) -> chat_pb2.DeleteTurnResponse:
        self.guard.in_conversation(context, request)
        return chat_pb2.DeleteTurnResponse()

    @unary_errors
    async def StopTurn(self, request: chat_pb2.StopTurnRequest, context: Any) -> chat_pb2.StopTurnResponse:
        self.guard.in_conversation(context, request)
        return chat_pb2.StopTurnResponse()


@pytest.fixture
async def guarded_chat(certs: Path) -> AsyncIterator[str]:
    trust = trust_as(certs, ident.CHAT)
    assert trust.verifier is not None
    servicer = GuardedChat(OwnerGuard(trust.verifier))  # type: ignore[abstract]  # four RPCs are called

    def register(server: grpc.aio.Server) -> list[str]:
        chat_pb2_grpc.add_ChatServiceServicer_to_server(servicer, server)
        return ["chatmesh.v1.ChatService"]

    everyone = [ident.GATEWAY, ident.ANY_CLIENT, ident.CHAT]
    service = Service("chat", register, authz={"chatmesh.v1.ChatService": {
        name: everyone for name in (m.rsplit("/", 1)[1] for m in authz.methods_of("chatmesh.v1.ChatService"))}})
    running = await start_server(service, "127.0.0.1:0", trust=trust)
    yield f"127.0.0.1:{running.port}"
    await running.stop(service, 0)


async def test_a_token_is_honoured_only_from_the_identity_it_was_minted_for_or_a_forwarder(
        certs: Path, guarded_chat: str) -> None:
    """The finding: owner tokens were bearer tokens, so one minted for client/dev worked from the gateway's (or
    chat's) identity. A token names its presenter (`azp`); chat, which forwards its requests' tokens, is the only
    other identity that may present it."""
    issuer = issuer_of(certs)
    request = chat_pb2.ExportUserDataRequest(owner_id=BOB)
    dev, reports = ident.client("dev"), ident.client("reports")
    cases = [(dev, dev, grpc.StatusCode.OK), (dev, ident.GATEWAY, grpc.StatusCode.PERMISSION_DENIED),
             (dev, reports, grpc.StatusCode.PERMISSION_DENIED), (ident.GATEWAY, dev, grpc.StatusCode.PERMISSION_DENIED),
             (ident.GATEWAY, ident.GATEWAY, grpc.StatusCode.OK), (dev, ident.CHAT, grpc.StatusCode.OK)]
    for minted_for, presented_by, expected in cases:
        tok = issuer.mint(BOB, presenter=minted_for).token
        async with channel_as(certs, presented_by, guarded_chat, "chat") as channel:
            try:
                await chat_pb2_grpc.ChatServiceStub(channel).ExportUserData(request, metadata=md(tok), timeout=5)
                code, details = grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as err:
                code, details = err.code(), err.details() or ""
        assert code == expected, (minted_for, presented_by, code, details)
        if code != grpc.StatusCode.OK:
            assert details == f"the owner token was minted for {minted_for}; {presented_by} may not present it"


async def test_a_scoped_token_opens_its_scopes_rpcs_only_and_a_bound_one_only_calls_naming_its_conversation(
        certs: Path, guarded_chat: str) -> None:
    issuer = issuer_of(certs)
    dev = ident.client("dev")
    conv, turn = str(uuid.uuid4()), str(uuid.uuid4())
    read = md(issuer.mint(BOB, presenter=dev, scopes=("read",)).token)
    turns = md(issuer.mint(BOB, presenter=dev, scopes=("turns",)).token)
    async with channel_as(certs, dev, guarded_chat, "chat") as channel:
        chat = chat_pb2_grpc.ChatServiceStub(channel)
        assert (await chat.ExportUserData(chat_pb2.ExportUserDataRequest(owner_id=BOB), metadata=read)).json
        await chat.GetTurn(chat_pb2.GetTurnRequest(owner_id=BOB, conversation_id=conv, turn_id=turn), metadata=read)
        code, details = await refused(chat.DeleteTurn(chat_pb2.DeleteTurnRequest(
            owner_id=BOB, conversation_id=conv, turn_id=turn), metadata=read))
        assert code == grpc.StatusCode.PERMISSION_DENIED and details == \
            "the owner token's scopes (read) do not open /chatmesh.v1.ChatService/DeleteTurn"
        await chat.StopTurn(chat_pb2.StopTurnRequest(owner_id=BOB, conversation_id=conv, turn_id=turn),
                            metadata=turns)
        assert (await refused(chat.ExportUserData(chat_pb2.ExportUserDataRequest(owner_id=BOB),
                                                  metadata=turns)))[0] == grpc.StatusCode.PERMISSION_DENIED
    # chat forwarding a client's read token (a peer StopTurn) is not held to the client's scopes: chat checked
    # them where the token entered
    async with channel_as(certs, ident.CHAT, guarded_chat, "chat") as channel:
        await chat_pb2_grpc.ChatServiceStub(channel).StopTurn(chat_pb2.StopTurnRequest(
            owner_id=BOB, conversation_id=conv, turn_id=turn), metadata=read)


async def test_generate_without_the_bound_conversation_is_refused(
        certs: Path, mesh: tuple[grpc.aio.Channel, grpc.aio.Channel]) -> None:
    """The finding: a conversation-bound token let Generate run without a conversation id, an oracle over the
    owner's other conversations' cache. A bound token opens only calls naming its conversation."""
    engine = EngineStub(mesh[1])
    conv = str(uuid.uuid4())
    bound = md(token(certs, BOB, conv))
    code, details = await refused(engine.Generate(generate_pb2.GenerateRequest(
        owner_id=BOB, prompt_token_ids=[1, 2, 3], max_tokens=4), metadata=bound).read())
    assert code == grpc.StatusCode.PERMISSION_DENIED and "must name it" in details
    events = [r.WhichOneof("event") async for r in engine.Generate(generate_pb2.GenerateRequest(
        owner_id=BOB, conversation_id=conv, prompt_token_ids=[1, 2, 3], max_tokens=4), metadata=bound)]
    assert events[-1] == "finished"
    assert (await engine.GetStats(generate_pb2.GetStatsRequest())).stats.generations == 1


async def test_evicting_a_conversation_drops_only_the_callers_own_blocks(
        certs: Path, mesh: tuple[grpc.aio.Channel, grpc.aio.Channel]) -> None:
    """The finding: Evict by conversation id was not owner-scoped, so alice's token (for her own conversation id,
    or owner-wide) evicted bob's cached blocks by naming his conversation."""
    engine = EngineStub(mesh[1])
    bobs = str(uuid.uuid4())
    prompt = list(range(1, 200))

    async def generate(owner: OwnerId, conv: str) -> int:
        events = [r async for r in engine.Generate(generate_pb2.GenerateRequest(
            owner_id=owner, conversation_id=conv, prompt_token_ids=prompt, max_tokens=2), metadata=md(token(certs,
                                                                                                         owner, conv)))]
        return events[0].started.cached_prompt_tokens

    assert await generate(BOB, bobs) == 0
    assert await generate(BOB, bobs) > 0  # bob's prefix is cached under his salt
    for alices in (md(token(certs, ALICE)), md(token(certs, ALICE, bobs))):
        evicted = await engine.Evict(generate_pb2.EvictRequest(owner_id=ALICE, conversation_id=bobs), metadata=alices)
        assert evicted.blocks_evicted == 0
    assert (await refused(engine.Evict(generate_pb2.EvictRequest(owner_id=BOB, conversation_id=bobs),
                                       metadata=md(token(certs, ALICE)))))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert await generate(BOB, bobs) > 0  # still cached
    mine = await engine.Evict(generate_pb2.EvictRequest(owner_id=BOB, conversation_id=bobs),
                              metadata=md(token(certs, BOB, bobs)))
    assert mine.blocks_evicted > 0


async def test_an_owner_id_that_would_forge_a_log_line_is_refused_and_logs_stay_one_line_per_event(
        certs: Path, mesh: tuple[grpc.aio.Channel, grpc.aio.Channel], captured: io.StringIO) -> None:
    """The finding: an internal caller's owner_id was written into a log line verbatim (log injection). Owner ids
    are validated to a charset that cannot forge a line or a field; human-readable lines quote every value."""
    store = StoreStub(mesh[0])
    forged = 'bob\n{"event": "owner_token_issued", "caller": "spiffe://chatmesh/gateway"} caller=x'
    for owner in (forged, "bob caller=spiffe://chatmesh/gateway", "b\x1b[2Jb"):
        code, details = await refused(store.ReadConversation(store_pb2.ReadConversationRequest(
            owner_id=owner, conversation_id=str(uuid.uuid4())), metadata=md(token(certs, BOB))))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "ASCII letters, digits" in details
    assert "caller=x" not in captured.getvalue() and "\x1b" not in captured.getvalue()
    assert all(json.loads(line) for line in captured.getvalue().splitlines() if line.strip())
    out = io.StringIO()
    from chatmesh.mesh import logs
    logs.configure("test", json=False, stream=out)
    logs.get("test").info("probe", reason="a\nb caller=spiffe://chatmesh/gateway")
    lines = [line for line in out.getvalue().splitlines() if "probe" in line]
    assert len(lines) == 1 and "reason='a\\nb caller=spiffe://chatmesh/gateway'" in lines[0], out.getvalue()
