"""ChatService invariants over real gRPC, with several processes where it matters: two chat processes and two
`sim` engine replicas behind the router, the store on embedded SQLite.

I2: one turn id, one generation, one bill, whichever chat process the retries reach.
I3: the prompt of turn n+1 starts with the prompt of turn n plus reply n, token for token (except across a
    summary boundary, where two builds of the same turn agree).
I5: stop frees the engine sequence and stores what the user saw; a lost engine stores nothing and the retry
    generates once elsewhere; afterwards no engine runs a sequence and no router lease is open.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from chatmesh.chat import context
from chatmesh.chat.clients import Channels, GrpcEngines, GrpcRouter, GrpcStore, Moderation
from chatmesh.chat.core import DEFAULT_SYSTEM_PROMPTS, ChatCore, ChatOptions
from chatmesh.chat.prompting import ProfileRenderer
from chatmesh.mesh import identity as ident
from chatmesh.mesh import settings, tokens
from chatmesh.mesh.ids import ConversationId, OwnerId
from chatmesh.mesh.up import Extra, Mesh
from chatmesh.model import profile
from chatmesh.moderation.client import ModerationClient
from prometheus_client import CollectorRegistry
from chatmesh.mesh.config import Config
from chatmesh.v1 import (
    chat_pb2, chat_pb2_grpc, common_pb2, generate_pb2, generate_pb2_grpc, route_pb2, route_pb2_grpc,
)
from tests.conftest import free_port
from tests.e2e.conftest import channel, mesh_env
from tests.trust import issuer_of

OWNER = "alice"


@dataclass
class Cluster:
    mesh: Mesh
    chats: list[str]  # chat process addresses
    engines: dict[str, str]  # replica id -> address


def as_gateway(mesh: Mesh, address: str) -> grpc.aio.Channel:
    """ChatService at `address` as the gateway calls it: its certificate, an owner token for the request's owner."""
    return channel(mesh, "chat", ident.GATEWAY, owner_tokens=True, address=address)


def start_cluster(tmp: Path, **extra: str) -> Cluster:
    env = mesh_env(tmp / "data", CHATMESH_SIM_STEP_MS="40", CHATMESH_MAX_REPLY_TOKENS="40",
                   CHATMESH_TURN_PROGRESS_INTERVAL_MS="100", CHATMESH_TURN_LEASE_TTL_MS="3000", **extra)
    engine0 = env["CHATMESH_ENGINE_ADDRESS"]
    engine1 = f"127.0.0.1:{free_port()}"
    env["CHATMESH_REPLICAS"] = f"engine-0={engine0},engine-1={engine1}"
    mesh = Mesh(env=env, log_dir=tmp / "logs", start_timeout_s=180)
    chat1 = f"127.0.0.1:{free_port()}"
    mesh.start(extra=[Extra("engine-1", "engine", engine1, {"CHATMESH_REPLICA_ID": "engine-1"}),
                      Extra("chat-1", "chat", chat1, {"CHATMESH_CHAT_INSTANCE_ID": "chat-1"})])
    return Cluster(mesh, [env["CHATMESH_CHAT_ADDRESS"], chat1], {"engine-0": engine0, "engine-1": engine1})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("cluster"), CHATMESH_SUMMARY_THRESHOLD_TOKENS="300",
                      CHATMESH_KEEP_RECENT_MESSAGES="4")
    try:
        yield c
    finally:
        c.mesh.stop()


async def engine_stats(mesh: Mesh, address: str) -> generate_pb2.EngineStats:
    async with channel(mesh, "engine", address=address) as ch:
        return (await generate_pb2_grpc.GenerateServiceStub(ch).GetStats(generate_pb2.GetStatsRequest())).stats


async def open_leases(cluster: Cluster) -> int:
    async with channel(cluster.mesh, "router") as ch:
        resp = await route_pb2_grpc.RouteServiceStub(ch).ListReplicas(route_pb2.ListReplicasRequest())
        return sum(r.open_leases for r in resp.replicas)


@pytest.fixture(autouse=True)
async def nothing_left_running(cluster: Cluster) -> AsyncIterator[None]:
    """After every test: no engine runs a sequence and no router lease is open."""
    yield
    deadline = time.monotonic() + 10
    while True:
        running = [(await engine_stats(cluster.mesh, address)).running_sequences for replica, address in cluster.engines.items()
                   if cluster.mesh.procs[_proc_name(replica)].poll() is None]
        leases = await open_leases(cluster)
        if not any(running) and leases == 0:
            return
        assert time.monotonic() < deadline, f"left running: sequences {running}, leases {leases}"
        await asyncio.sleep(0.2)


def _proc_name(replica: str) -> str:
    return "engine" if replica == "engine-0" else replica


async def new_conversation(mesh: Mesh, address: str, owner: str = OWNER) -> str:
    async with as_gateway(mesh, address) as ch:
        resp = await chat_pb2_grpc.ChatServiceStub(ch).CreateConversation(
            chat_pb2.CreateConversationRequest(owner_id=owner))
        return resp.conversation.conversation_id


@dataclass
class TurnResult:
    text: str
    final: str
    final_event: chat_pb2.TurnEvent
    sequences: list[int]


async def send(mesh: Mesh, address: str, conv: str, turn: str, content: str, stop_after_deltas: int = 0,
               owner: str = OWNER, stop_via: str | None = None) -> TurnResult:
    async with as_gateway(mesh, address) as ch:
        stub = chat_pb2_grpc.ChatServiceStub(ch)
        text, seqs, deltas = "", [], 0
        async for resp in stub.SendTurn(chat_pb2.SendTurnRequest(owner_id=owner, conversation_id=conv,
                                                                  turn_id=turn, content=content)):
            event = resp.event
            seqs.append(event.sequence)
            kind = event.WhichOneof("kind")
            if kind == "delta":
                text += event.delta.text
                deltas += 1
                if deltas == stop_after_deltas:
                    async with as_gateway(mesh, stop_via or address) as stop_ch:
                        stopped = await chat_pb2_grpc.ChatServiceStub(stop_ch).StopTurn(chat_pb2.StopTurnRequest(
                            owner_id=owner, conversation_id=conv, turn_id=turn))
                    assert stopped.stopped
            elif kind in ("completed", "stopped", "failed", "blocked"):
                return TurnResult(text, kind, event, seqs)
        raise AssertionError("stream ended without a final event")


async def messages(mesh: Mesh, address: str, conv: str, owner: str = OWNER) -> list[common_pb2.Message]:
    async with as_gateway(mesh, address) as ch:
        resp = await chat_pb2_grpc.ChatServiceStub(ch).GetConversation(
            chat_pb2.GetConversationRequest(owner_id=owner, conversation_id=conv))
        return list(resp.messages)


async def test_twenty_concurrent_sends_of_one_turn_id_over_two_chat_processes_generate_once(
        cluster: Cluster) -> None:
    owner = f"bob-{uuid.uuid4()}"
    conv = await new_conversation(cluster.mesh, cluster.chats[0], owner)
    before = sum([(await engine_stats(cluster.mesh, a)).generations for a in cluster.engines.values()])
    turn = str(uuid.uuid4())
    results = await asyncio.gather(*[
        send(cluster.mesh, cluster.chats[i % 2], conv, turn, "Please tell me a story about routers.", owner=owner)
        for i in range(20)])
    after = sum([(await engine_stats(cluster.mesh, a)).generations for a in cluster.engines.values()])
    assert after - before == 1, "one turn id must mean one engine generation"
    texts = {r.text for r in results}
    assert len(texts) == 1 and results[0].text, texts
    assert all(r.final == "completed" for r in results)
    assert all(r.sequences == sorted(r.sequences) for r in results)
    stored = await messages(cluster.mesh, cluster.chats[1], conv, owner)
    assert [m.role for m in stored] == [common_pb2.ROLE_USER, common_pb2.ROLE_ASSISTANT]
    assert stored[1].content == results[0].text
    async with as_gateway(cluster.mesh, cluster.chats[0]) as ch:
        usage = await chat_pb2_grpc.ChatServiceStub(ch).GetUsage(chat_pb2.GetUsageRequest(owner_id=owner))
    # Billed once: the owner's totals hold exactly this one turn's usage.
    billed = results[0].final_event.completed.usage
    assert billed.output_tokens > 0
    assert sum(d.turns for d in usage.days) == 1
    assert sum(d.usage.output_tokens for d in usage.days) == billed.output_tokens
    assert sum(d.usage.prompt_tokens for d in usage.days) == billed.prompt_tokens


def _core_for(cluster: Cluster, channels: Channels) -> ChatCore:
    cfg = Config(env=dict(cluster.mesh.env))
    served = profile.load(cfg)
    renderer = ProfileRenderer(served)
    options = ChatOptions(
        limits=context.PromptLimits(8192, 131072, 40), temperature=0, top_p=1, lease_ttl_ms=3000,
        progress_interval_s=0.1, engine_deadline_s=60, instance_id="test",
        system_prompts=dict(DEFAULT_SYSTEM_PROMPTS), default_prompt_version="v1", summary_threshold_tokens=300,
        keep_recent_messages=4)
    return ChatCore(GrpcStore(channels.get(cfg[settings.STORE_ADDRESS], "store")),
                    GrpcRouter(channels.get(cfg[settings.ROUTER_ADDRESS], "router")),
                    GrpcEngines(channels, model=served.identity),
                    Moderation(ModerationClient.from_config(cfg, registry=CollectorRegistry(), trust=channels.trust)),
                    renderer, renderer.count, options)


async def test_prompt_n_plus_one_starts_with_prompt_n_plus_reply_n(cluster: Cluster) -> None:
    channels = Channels(cluster.mesh.trust(ident.CHAT))
    core = _core_for(cluster, channels)
    if not cluster.mesh.cfg[settings.MESH_PLAINTEXT]:  # the core acts for alice as chat does: with her token
        tokens.current.set(issuer_of(cluster.mesh.certs).mint(OwnerId(OWNER), presenter=ident.GATEWAY).token)
    assert isinstance(core.renderer, ProfileRenderer)
    tok = core.renderer.profile
    try:
        conv = await new_conversation(cluster.mesh, cluster.chats[0])
        owner, cid = OwnerId(OWNER), ConversationId(conv)
        previous: tuple[tuple[int, ...], str] | None = None
        boundaries = 0
        for n in range(10):
            message = f"Question number {n}: what happens next in the story?"
            planned = await core.next_prompt(owner, cid, message)
            result = await send(cluster.mesh, cluster.chats[n % 2], conv, str(uuid.uuid4()), message)
            assert result.final == "completed"
            sent_tokens = result.final_event.completed.usage.prompt_tokens
            rebuilt = await core.next_prompt(owner, cid, message)
            if sent_tokens != len(planned.token_ids):
                # A summary was stored during this turn: the prompt changed at the boundary, and it is now
                # stable: two builds agree and match what was sent.
                boundaries += 1
                again = await core.next_prompt(owner, cid, message)
                assert rebuilt == again
                previous = None
            elif previous is not None:
                prompt, reply = previous
                assert planned.token_ids[:len(prompt)] == prompt, f"turn {n}: prompt is not an extension"
                reply_ids = tuple(tok.encode(reply))
                assert planned.token_ids[len(prompt):len(prompt) + len(reply_ids)] == reply_ids
            if sent_tokens == len(planned.token_ids):
                previous = (planned.token_ids, result.text)
        assert boundaries >= 1, "the 300-token threshold should have produced a summary in 10 turns"
    finally:
        await channels.close()


async def test_stop_mid_stream_frees_the_sequence_and_stores_what_was_seen(cluster: Cluster) -> None:
    conv = await new_conversation(cluster.mesh, cluster.chats[0])
    before = {r: await engine_stats(cluster.mesh, a) for r, a in cluster.engines.items()}
    result = await send(cluster.mesh, cluster.chats[0], conv, str(uuid.uuid4()), "Write a very long essay.", stop_after_deltas=3)
    assert result.final == "stopped"
    stored = await messages(cluster.mesh, cluster.chats[0], conv)
    assert stored[-1].status == common_pb2.MESSAGE_STATUS_STOPPED
    assert stored[-1].content == result.text and result.text
    deadline = time.monotonic() + 5
    while True:
        after = {r: await engine_stats(cluster.mesh, a) for r, a in cluster.engines.items()}
        held = {r: s.device.blocks_used - s.device.blocks_cached for r, s in after.items()}
        held_before = {r: s.device.blocks_used - s.device.blocks_cached for r, s in before.items()}
        if held == held_before and all(s.running_sequences == 0 for s in after.values()):
            break
        assert time.monotonic() < deadline, (held_before, held)
        await asyncio.sleep(0.1)


async def test_stop_reaching_another_chat_process_is_forwarded_to_the_one_generating(cluster: Cluster) -> None:
    conv = await new_conversation(cluster.mesh, cluster.chats[0])
    result = await send(cluster.mesh, cluster.chats[0], conv, str(uuid.uuid4()), "Write a very long essay.", stop_after_deltas=3,
                        stop_via=cluster.chats[1])
    assert result.final == "stopped"
    stored = await messages(cluster.mesh, cluster.chats[1], conv)
    assert stored[-1].status == common_pb2.MESSAGE_STATUS_STOPPED and stored[-1].content == result.text


async def test_engine_killed_mid_stream_stores_nothing_and_the_retry_generates_once_elsewhere(
        tmp_path: Path) -> None:
    c = start_cluster(tmp_path)
    try:
        conv = await new_conversation(c.mesh, c.chats[0])
        turn = str(uuid.uuid4())
        first = asyncio.create_task(send(c.mesh, c.chats[0], conv, turn, "Tell me about consistent hashing."))
        victim = ""
        for _ in range(200):
            running = {r: (await engine_stats(c.mesh, a)).running_sequences for r, a in c.engines.items()}
            victim = next((r for r, n in running.items() if n), "")
            if victim:
                break
            await asyncio.sleep(0.02)
        assert victim, "no engine picked up the turn"
        c.mesh.procs[_proc_name(victim)].kill()
        failed = await asyncio.wait_for(first, 30)
        assert failed.final == "failed" and failed.final_event.failed.retryable
        assert await messages(c.mesh, c.chats[0], conv) == []
        retry = await send(c.mesh, c.chats[1], conv, turn, "Tell me about consistent hashing.")
        assert retry.final == "completed", retry.final_event
        assert retry.final_event.completed.replica_id != victim
        stored = await messages(c.mesh, c.chats[0], conv)
        assert len(stored) == 2 and stored[1].content == retry.text
    finally:
        c.mesh.stop()
