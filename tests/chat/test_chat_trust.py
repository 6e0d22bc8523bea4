"""ChatService in a mesh that trusts no network, over real gRPC and real mutual TLS: the store (SQLite), a `sim`
engine, the router and moderation as their own servers in this process, chat between them with its own
certificate, and the test acting as the gateway with owner tokens it mints.

Chat verifies the owner token of each request and forwards it to the store and the engine, which accept
owner-scoped calls only with it: a turn with bob's token runs and is stored, one with alice's token (or none)
reads, runs, charges and stores nothing of bob's. The engine salts the prefix cache by the forwarded owner, so
bob's second turn reuses his first turn's KV and alice's turn reuses nothing past the platform prefix."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from chatmesh.chat import service as chat_service
from chatmesh.engine_adapter import service as engine_service
from chatmesh.mesh import identity as ident
from chatmesh.mesh import tokens
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import PROMPT_TOKENS_TRAILER
from chatmesh.mesh.identity import Identity
from chatmesh.mesh.ids import ConversationId, OwnerId
from chatmesh.mesh.server import Running, Service, start_server
from chatmesh.moderation import service as moderation_service
from chatmesh.router import service as router_service
from chatmesh.store import service as store_service
from chatmesh.v1 import chat_pb2, chat_pb2_grpc, generate_pb2, generate_pb2_grpc
from tests.trust import channel_as, issuer_of, trust_as

ALICE, BOB = OwnerId("alice"), OwnerId("bob")


@dataclass
class Mesh:
    certs: Path
    chat: str
    engine: str

    def token(self, owner: OwnerId, conversation: str | None = None, presenter: Identity = ident.GATEWAY,
              scopes: tuple[str, ...] | None = None, prompt_allowance: int | None = None
              ) -> tuple[tuple[str, str], ...]:
        """What the gateway mints (for itself, or for an internal client that asked its OwnerTokenService)."""
        minted = issuer_of(self.certs).mint(owner, ConversationId(conversation) if conversation else None,
                                            presenter=presenter, scopes=scopes, prompt_allowance=prompt_allowance)
        return tokens.metadata_of(minted.token)


@pytest.fixture
async def mesh(mesh_certs: Path, tmp_path: Path) -> AsyncIterator[Mesh]:
    env = {"CHATMESH_DATA_DIR": str(tmp_path), "CHATMESH_ENGINE": "sim", "CHATMESH_SIM_TEXT": "tokenizer",
           "CHATMESH_SIM_STEP_MS": "1", "CHATMESH_MAX_REPLY_TOKENS": "12", "CHATMESH_STORE_PURGE_INTERVAL_S": "0",
           "CHATMESH_ROUTER_HEALTH": "false"}
    running: list[tuple[Service, Running]] = []

    async def start(service: Service, who: Identity) -> str:
        r = await start_server(service, "127.0.0.1:0", trust=trust_as(mesh_certs, who))
        running.append((service, r))
        return f"127.0.0.1:{r.port}"

    first = Config(env=env)
    store = await start(store_service.build(first, trust_as(mesh_certs, ident.STORE)), ident.STORE)
    engine = await start(engine_service.build(first, trust_as(mesh_certs, ident.ENGINE)), ident.ENGINE)
    moderation = await start(moderation_service.build(first), ident.MODERATION)
    cfg = Config(env={**env, "CHATMESH_STORE_ADDRESS": store, "CHATMESH_MODERATION_ADDRESS": moderation,
                      "CHATMESH_REPLICAS": f"engine-0={engine}"})
    router = await start(router_service.build(cfg, trust_as(mesh_certs, ident.ROUTER)), ident.ROUTER)
    chat_cfg = Config(env={**env, "CHATMESH_STORE_ADDRESS": store, "CHATMESH_MODERATION_ADDRESS": moderation,
                           "CHATMESH_ROUTER_ADDRESS": router})
    chat = await start(chat_service.build(chat_cfg, trust_as(mesh_certs, ident.CHAT)), ident.CHAT)
    try:
        yield Mesh(mesh_certs, chat, engine)
    finally:
        for service, r in reversed(running):
            await r.stop(service, 0)


async def refused(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call  # type: ignore[misc]
    return err.value.code()


async def turn(chat: chat_pb2_grpc.ChatServiceAsyncStub, owner: OwnerId, conv: str, content: str,
               metadata: tuple[tuple[str, str], ...]) -> chat_pb2.TurnEvent:
    final = None
    async for response in chat.SendTurn(chat_pb2.SendTurnRequest(
            owner_id=owner, conversation_id=conv, turn_id=str(uuid.uuid4()), content=content), metadata=metadata):
        final = response.event
    assert final is not None
    return final


async def generations(mesh: Mesh) -> int:
    async with channel_as(mesh.certs, ident.OPERATOR, mesh.engine, "engine") as channel:
        stats = await generate_pb2_grpc.GenerateServiceStub(channel).GetStats(generate_pb2.GetStatsRequest())
        return stats.stats.generations


async def test_a_turn_runs_with_its_owners_token_and_the_engine_salts_by_the_forwarded_owner(mesh: Mesh) -> None:
    async with channel_as(mesh.certs, ident.GATEWAY, mesh.chat, "chat") as channel:
        chat = chat_pb2_grpc.ChatServiceStub(channel)
        conv = (await chat.CreateConversation(chat_pb2.CreateConversationRequest(owner_id=BOB),
                                              metadata=mesh.token(BOB))).conversation.conversation_id
        bound = mesh.token(BOB, conv)  # what the gateway mints for a route that names the conversation
        first = await turn(chat, BOB, conv, "Tell me about the routers of the mesh.", bound)
        second = await turn(chat, BOB, conv, "And about the engines?", bound)
        assert first.WhichOneof("kind") == second.WhichOneof("kind") == "completed"
        # the store was written with the forwarded token: bob reads both turns back
        view = await chat.GetConversation(chat_pb2.GetConversationRequest(owner_id=BOB, conversation_id=conv),
                                          metadata=bound)
        assert len(view.messages) == 4
        # one owner, one salt: the second prompt reuses the first (prompt and reply) from the cache
        assert second.completed.usage.cached_prompt_tokens >= first.completed.usage.prompt_tokens - 16
        # another owner shares nothing past the platform prefix, even with the same words
        alices = (await chat.CreateConversation(chat_pb2.CreateConversationRequest(owner_id=ALICE),
                                                metadata=mesh.token(ALICE))).conversation.conversation_id
        alice = await turn(chat, ALICE, alices, "Tell me about the routers of the mesh.", mesh.token(ALICE, alices))
        assert alice.WhichOneof("kind") == "completed"
        assert alice.completed.usage.cached_prompt_tokens < first.completed.usage.prompt_tokens - 16
        # deleting evicts bob's blocks on the engine, which takes the forwarded token for bob's conversation
        deleted = await chat.DeleteConversation(chat_pb2.DeleteConversationRequest(
            owner_id=BOB, conversation_id=conv), metadata=bound)
        assert deleted.blocks_evicted > 0


async def test_without_bobs_token_nothing_of_bobs_is_read_run_or_stored(mesh: Mesh) -> None:
    async with channel_as(mesh.certs, ident.GATEWAY, mesh.chat, "chat") as channel:
        chat = chat_pb2_grpc.ChatServiceStub(channel)
        conv = (await chat.CreateConversation(chat_pb2.CreateConversationRequest(owner_id=BOB),
                                              metadata=mesh.token(BOB))).conversation.conversation_id
        other = (await chat.CreateConversation(chat_pb2.CreateConversationRequest(owner_id=BOB),
                                               metadata=mesh.token(BOB))).conversation.conversation_id
        ran = await generations(mesh)
        for metadata, code in ((mesh.token(ALICE), grpc.StatusCode.PERMISSION_DENIED),
                               (mesh.token(ALICE, conv), grpc.StatusCode.PERMISSION_DENIED),
                               (mesh.token(BOB, other), grpc.StatusCode.PERMISSION_DENIED),  # another conversation
                               ((), grpc.StatusCode.UNAUTHENTICATED)):
            send = chat.SendTurn(chat_pb2.SendTurnRequest(owner_id=BOB, conversation_id=conv,
                                                          turn_id=str(uuid.uuid4()), content="spend bob's budget"),
                                 metadata=metadata)
            assert await refused(send.read()) == code
            assert await refused(chat.GetConversation(chat_pb2.GetConversationRequest(
                owner_id=BOB, conversation_id=conv), metadata=metadata)) == code
            assert await refused(chat.DeleteConversation(chat_pb2.DeleteConversationRequest(
                owner_id=BOB, conversation_id=conv), metadata=metadata)) == code
        # owner-wide RPCs need an owner-wide token: one bound to a conversation opens no export
        assert await refused(chat.ExportUserData(chat_pb2.ExportUserDataRequest(owner_id=BOB),
                                                 metadata=mesh.token(BOB, conv))) == grpc.StatusCode.PERMISSION_DENIED
        assert await generations(mesh) == ran  # no engine work was done for any refused turn
        view = await chat.GetConversation(chat_pb2.GetConversationRequest(owner_id=BOB, conversation_id=conv),
                                          metadata=mesh.token(BOB, conv))
        assert list(view.messages) == []  # nothing was stored, nothing deleted
        usage = await chat.GetUsage(chat_pb2.GetUsageRequest(owner_id=BOB), metadata=mesh.token(BOB))
        assert sum(d.turns for d in usage.days) == 0  # nothing was charged


async def test_an_internal_client_acts_for_a_user_with_a_token_and_other_services_may_not(mesh: Mesh) -> None:
    request = chat_pb2.CreateConversationRequest(owner_id=ALICE, title="from the reports service")
    async with channel_as(mesh.certs, ident.client("dev"), mesh.chat, "chat") as channel:
        made = await chat_pb2_grpc.ChatServiceStub(channel).CreateConversation(
            request, metadata=mesh.token(ALICE, presenter=ident.client("dev")))
        assert made.conversation.title == "from the reports service"
    async with channel_as(mesh.certs, ident.STORE, mesh.chat, "chat") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await chat_pb2_grpc.ChatServiceStub(channel).CreateConversation(request, metadata=mesh.token(ALICE))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.details() == "spiffe://chatmesh/store may not call /chatmesh.v1.ChatService/CreateConversation"


async def test_chat_refuses_a_prompt_over_its_allowance_before_any_engine_work(mesh: Mesh) -> None:
    """chat.proto's contract, which chat ignored (issue 30: an internal client ran 6 turns of 7k tokens with
    allowance 1): a rendered prompt larger than the request's allowance, or than the per-turn budget the owner
    token carries (an internal client's grant), is RESOURCE_EXHAUSTED with the prompt's size in the
    `chatmesh-prompt-tokens` trailer, nothing stored, no engine work; the claim is released, so the same turn id
    runs once the allowance holds it."""
    client = ident.client("dev")
    budgeted = mesh.token(BOB, presenter=client, scopes=("read", "turns"), prompt_allowance=5)
    async with channel_as(mesh.certs, client, mesh.chat, "chat") as channel:
        chat = chat_pb2_grpc.ChatServiceStub(channel)
        conv = (await chat.CreateConversation(chat_pb2.CreateConversationRequest(owner_id=BOB),
                                              metadata=budgeted)).conversation.conversation_id
        turn_id = str(uuid.uuid4())
        for allowance in (0, 1, 10_000):  # asking for none, or for more, does not lift the grant's budget
            request = chat_pb2.SendTurnRequest(owner_id=BOB, conversation_id=conv, turn_id=turn_id,
                                               content="Tell me about the routers.", prompt_token_allowance=allowance)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in chat.SendTurn(request, metadata=budgeted):
                    pass
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            trailing: Any = err.value.trailing_metadata()  # grpc.aio's Metadata: (key, value) pairs
            size = int(dict(trailing)[PROMPT_TOKENS_TRAILER])
            assert size > 5 and f"the prompt is {size} tokens" in (err.value.details() or "")
        view = await chat.GetConversation(chat_pb2.GetConversationRequest(owner_id=BOB, conversation_id=conv),
                                          metadata=budgeted)
        assert list(view.messages) == []
    assert await generations(mesh) == 0
    # the gateway's token carries no budget: the request's allowance decides, and the same turn id then runs
    async with channel_as(mesh.certs, ident.GATEWAY, mesh.chat, "chat") as channel:
        chat = chat_pb2_grpc.ChatServiceStub(channel)
        over = chat_pb2.SendTurnRequest(owner_id=BOB, conversation_id=conv, turn_id=turn_id,
                                        content="Tell me about the routers.", prompt_token_allowance=size - 1)
        assert await refused(chat.SendTurn(over, metadata=mesh.token(BOB, conv)).read()) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        fits = chat_pb2.SendTurnRequest(owner_id=BOB, conversation_id=conv, turn_id=turn_id,
                                        content="Tell me about the routers.", prompt_token_allowance=size)
        events = [r.event async for r in chat.SendTurn(fits, metadata=mesh.token(BOB, conv))]
        assert events[0].started.prompt_tokens == size and events[-1].WhichOneof("kind") == "completed"
        regenerate = chat_pb2.RegenerateTurnRequest(owner_id=BOB, conversation_id=conv, turn_id=str(uuid.uuid4()),
                                                    prompt_token_allowance=1)
        assert await refused(chat.RegenerateTurn(regenerate, metadata=mesh.token(BOB, conv)).read()) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await generations(mesh) == 1
