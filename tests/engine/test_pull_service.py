"""PullPrefix over real gRPC and mutual TLS between two `sim` engines: a moved turn pulls its history from the
replica that computed it (the puller forwarding the turn's owner token), a gone source means prefill, and
PullPrefix refuses every caller but an engine acting for the blocks' own owner, revealing nothing to the others."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from chatmesh.v1 import generate_pb2, generate_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chatmesh.engine_adapter import service as engine_service
from chatmesh.engine_adapter.block_manager import chain_hashes
from chatmesh.engine_adapter.engine import EngineCore
from chatmesh.engine_adapter.sim import build_sim
from chatmesh.mesh import identity, tokens
from chatmesh.mesh.config import Config
from chatmesh.mesh.ids import ConversationId, OwnerId
from chatmesh.mesh.server import Running, Service, start_server
from chatmesh.mesh.trust import Trust
from tests.trust import channel_as, issuer_of, trust_as

SECRET = "test-salt-secret"
BS = 16
SYSTEM = list(range(1000, 1032))  # two shared blocks


@dataclass
class Engine:
    core: EngineCore
    service: Service
    running: Running

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.running.port}"


async def _engine(certs: Path, replica: str) -> Engine:
    cfg = Config(env={"CHATMESH_ENGINE": "sim", "CHATMESH_SIM_STEP_MS": "1", "CHATMESH_SIM_TEXT": "words",
                      "CHATMESH_BLOCK_SIZE": str(BS), "CHATMESH_DEVICE_BLOCKS": "256", "CHATMESH_HOST_BLOCKS": "0",
                      "CHATMESH_REPLICA_ID": replica})
    core = build_sim(cfg)
    trust = trust_as(certs, identity.ENGINE)
    service = engine_service.service_for(core, replica, trust, SECRET.encode())
    return Engine(core, service, await start_server(service, "127.0.0.1:0", trust=trust))


@pytest.fixture
async def engines(mesh_certs: Path) -> AsyncIterator[tuple[Engine, Engine]]:
    a, b = await _engine(mesh_certs, "a"), await _engine(mesh_certs, "b")
    yield a, b
    for e in (a, b):
        await e.running.stop(e.service, 0)


CONVERSATION = str(uuid.uuid4())
HISTORY = SYSTEM + list(range(2000, 2100))  # 132 tokens: 8 full blocks, 6 private


def _generate(prompt: list[int], owner: str = "alice", source: Engine | None = None) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id=str(uuid.uuid4()), conversation_id=CONVERSATION, turn_id=str(uuid.uuid4()),
        prompt_token_ids=prompt, owner_id=owner, platform_prefix_tokens=len(SYSTEM), max_tokens=4,
        source_replica_id="a" if source else "", source_address=source.address if source else "")


async def _turn(certs: Path, engine: Engine, request: generate_pb2.GenerateRequest
                ) -> tuple[generate_pb2.GenerateStarted, list[int]]:
    async with channel_as(certs, identity.CHAT, engine.address, "engine", owner_tokens=True) as channel:
        events = [e async for e in generate_pb2_grpc.GenerateServiceStub(channel).Generate(request)]
    assert events[0].WhichOneof("event") == "started" and events[-1].WhichOneof("event") == "finished"
    return events[0].started, [t for e in events if e.WhichOneof("event") == "delta" for t in e.delta.token_ids]


async def test_a_moved_turn_pulls_its_history_over_the_mesh(mesh_certs: Path, engines: tuple[Engine, Engine]
                                                            ) -> None:
    a, b = engines
    await _turn(mesh_certs, a, _generate(HISTORY))
    turn2 = HISTORY + list(range(3000, 3020))
    started, ids = await _turn(mesh_certs, b, _generate(turn2, source=a))
    assert started.pull_outcome == generate_pb2.PULL_OUTCOME_PULLED
    assert started.pulled_prompt_tokens == (len(HISTORY) // BS) * BS and started.cached_prompt_tokens == 0
    home, home_ids = await _turn(mesh_certs, a, _generate(turn2))
    assert home.cached_prompt_tokens == started.pulled_prompt_tokens and ids == home_ids
    async with channel_as(mesh_certs, identity.ROUTER, b.address, "engine") as channel:
        stats = (await generate_pb2_grpc.GenerateServiceStub(channel).GetStats(generate_pb2.GetStatsRequest())).stats
    t = stats.prefix_transfer
    assert t.serves and t.receives and t.layout.backend == "sim" and t.kv_bytes_per_token > 0
    assert t.pulls == 1 and t.failed_pulls == 0 and t.pulled_tokens == started.pulled_prompt_tokens
    assert t.pulled_bytes == t.pulled_tokens * t.kv_bytes_per_token
    rendered = b.service.metrics.exposition().decode()
    assert f"chatmesh_engine_prefix_pulled_tokens_total {float(t.pulled_tokens)}" in rendered
    assert 'chatmesh_engine_prefix_pulls_total{outcome="pulled"} 1.0' in rendered
    assert "chatmesh_engine_prefix_pull_seconds_count 1.0" in rendered
    assert a.core.transfers.served_blocks == len(HISTORY) // BS and a.core.transfers.serving == 0


async def test_a_gone_source_means_prefill_and_the_turn_completes(mesh_certs: Path,
                                                                  engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    await _turn(mesh_certs, a, _generate(HISTORY))
    await a.running.stop(a.service, 0)
    started, ids = await _turn(mesh_certs, b, _generate(HISTORY + [7], source=a))
    assert started.pull_outcome == generate_pb2.PULL_OUTCOME_UNAVAILABLE
    assert started.pulled_prompt_tokens == 0 and len(ids) == 4


def _pull(owner: str, hashes: list[bytes], layout: generate_pb2.KvLayout) -> generate_pb2.PullPrefixRequest:
    return generate_pb2.PullPrefixRequest(request_id="r", owner_id=owner, conversation_id=CONVERSATION,
                                          block_hashes=hashes, layout=layout)


async def _call(certs: Path, who: identity.Identity, engine: Engine, request: generate_pb2.PullPrefixRequest,
                token: str | None) -> tuple[grpc.StatusCode, list[bytes]]:
    """The status of one PullPrefix call and its messages, serialized (so answers compare byte for byte)."""
    async with channel_as(certs, who, engine.address, "engine") as channel:
        call = generate_pb2_grpc.GenerateServiceStub(channel).PullPrefix(
            request, timeout=10, metadata=tokens.metadata_of(token))
        try:
            return grpc.StatusCode.OK, [m.SerializeToString() async for m in call]
        except grpc.aio.AioRpcError as err:
            return err.code(), []


async def test_pull_prefix_serves_only_an_engine_acting_for_the_blocks_owner(
        mesh_certs: Path, engines: tuple[Engine, Engine]) -> None:
    a, _ = engines
    await _turn(mesh_certs, a, _generate(HISTORY))
    alice_salt = engine_service.OwnerSalts(SECRET.encode()).of(OwnerId("alice"))
    private = chain_hashes(HISTORY, len(SYSTEM), alice_salt, BS)[len(SYSTEM) // BS:]
    layout = a.core.transfers.layout
    assert layout is not None
    wire_layout = engine_service.layout_to_proto(layout)
    issuer = issuer_of(mesh_certs)
    alice = issuer.mint(OwnerId("alice"), presenter=identity.CHAT).token  # chat's, forwarded by the puller
    bob = issuer.mint(OwnerId("bob"), presenter=identity.CHAT).token

    code, served = await _call(mesh_certs, identity.ENGINE, a, _pull("alice", private, wire_layout), alice)
    assert code == grpc.StatusCode.OK
    first = generate_pb2.PullPrefixResponse.FromString(served[0])
    assert first.started.blocks == len(private)
    blocks = [b for m in served[1:] for b in generate_pb2.PullPrefixResponse.FromString(m).chunk.blocks]
    assert [b.block_hash for b in blocks] == private and all(len(b.digest) == 16 for b in blocks)

    refused = {
        "chat, not an engine": (identity.CHAT, "alice", alice, grpc.StatusCode.PERMISSION_DENIED),
        "the operator": (identity.OPERATOR, "alice", alice, grpc.StatusCode.PERMISSION_DENIED),
        "no token": (identity.ENGINE, "alice", None, grpc.StatusCode.UNAUTHENTICATED),
        "bob's token for alice": (identity.ENGINE, "alice", bob, grpc.StatusCode.PERMISSION_DENIED),
    }
    for why, (who, owner, token, status) in refused.items():
        assert await _call(mesh_certs, who, a, _pull(owner, private, wire_layout), token) == (status, []), why

    # bob, with his own valid token, naming alice's hashes: exactly the answer to hashes nobody holds
    foreign = await _call(mesh_certs, identity.ENGINE, a, _pull("bob", private, wire_layout), bob)
    unknown = await _call(mesh_certs, identity.ENGINE, a, _pull("bob", [bytes(16)] * len(private), wire_layout), bob)
    assert foreign == unknown == (grpc.StatusCode.OK, [generate_pb2.PullPrefixResponse(
        started=generate_pb2.PullPrefixStarted(blocks=0, block_bytes=layout.block_bytes)).SerializeToString()])
    # another layout is refused before anything is looked up
    other = generate_pb2.KvLayout()
    other.CopyFrom(wire_layout)
    other.block_size = 32
    assert (await _call(mesh_certs, identity.ENGINE, a, _pull("alice", private, other), alice))[0] == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert a.core.transfers.serving == 0
    a.core.blocks.check()


async def test_a_draining_engine_refuses_new_turns_and_serves_pulls_until_it_holds_nothing(
        mesh_certs: Path, engines: tuple[Engine, Engine]) -> None:
    """SIGTERM's stop with a long grace: health NOT_SERVING, stats say draining, a new turn is UNAVAILABLE, a pull
    is served; the drain ends as soon as nothing is cached (here: the conversation evicted), not at the grace."""
    _, b = engines
    d = await _engine(mesh_certs, "d")
    await _turn(mesh_certs, d, _generate(HISTORY))
    stopping = asyncio.create_task(d.running.stop(d.service, 120))
    async with channel_as(mesh_certs, identity.ROUTER, d.address, "engine") as channel:
        watch = generate_pb2_grpc.GenerateServiceStub(channel).WatchStats(generate_pb2.WatchStatsRequest(
            interval_ms=10))
        async for update in watch:
            if update.stats.draining:
                break
        watch.cancel()
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _turn(mesh_certs, d, _generate(HISTORY + [1]))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (refused.value.details() or "")
    moved = _generate(HISTORY + list(range(3000, 3020)), source=d)
    moved.source_replica_id = "d"
    started, _ = await _turn(mesh_certs, b, moved)
    assert started.pull_outcome == generate_pb2.PULL_OUTCOME_PULLED and started.pulled_prompt_tokens > 0
    assert not stopping.done()  # it still caches the conversation: the drain goes on
    await d.core.evict_conversation(ConversationId(CONVERSATION))
    await asyncio.wait_for(stopping, 30)  # far less than the 120 s grace


async def test_a_plaintext_loopback_mesh_pulls_too() -> None:
    """CHATMESH_MESH_PLAINTEXT (development, loopback only): no identities or tokens, the owner id is believed."""
    engines: list[Engine] = []
    for replica in ("p", "q"):
        cfg = Config(env={"CHATMESH_ENGINE": "sim", "CHATMESH_SIM_STEP_MS": "1", "CHATMESH_SIM_TEXT": "words",
                          "CHATMESH_BLOCK_SIZE": str(BS), "CHATMESH_REPLICA_ID": replica})
        core = build_sim(cfg)
        service = engine_service.service_for(core, replica, Trust.insecure(), SECRET.encode())
        engines.append(Engine(core, service, await start_server(service, "127.0.0.1:0", trust=Trust.insecure())))
    p, q = engines
    try:
        async with grpc.aio.insecure_channel(p.address) as channel:
            async for _ in generate_pb2_grpc.GenerateServiceStub(channel).Generate(_generate(HISTORY)):
                pass
        moved = _generate(HISTORY + [5, 6, 7], source=p)
        moved.source_replica_id = "p"
        async with grpc.aio.insecure_channel(q.address) as channel:
            events = [e async for e in generate_pb2_grpc.GenerateServiceStub(channel).Generate(moved)]
        assert events[0].started.pull_outcome == generate_pb2.PULL_OUTCOME_PULLED
        assert events[0].started.pulled_prompt_tokens == (len(HISTORY) // BS) * BS
    finally:
        for e in engines:
            await e.running.stop(e.service, 0)
