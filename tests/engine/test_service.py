"""GenerateService over real gRPC on a loopback port: validation codes, streaming, cancellation, stats."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from collections.abc import AsyncIterator

import grpc
import pytest
from chatmesh.v1 import generate_pb2, generate_pb2_grpc

from chatmesh.engine_adapter import service as engine_service
from chatmesh.engine_adapter import settings as engine_settings
from chatmesh.engine_adapter import sim
from chatmesh.engine_adapter.backend import Residency
from chatmesh.engine_adapter.local import backend as local_backend
from chatmesh.mesh.config import Config
from chatmesh.mesh.ids import ConversationId
from chatmesh.mesh import identity
from chatmesh.mesh.server import serve
from tests.conftest import free_port
from tests.trust import channel_as, trust_as


def _config(**extra: str) -> Config:
    env = {"CHATMESH_ENGINE": "sim", "CHATMESH_SIM_STEP_MS": "2", "CHATMESH_QUEUE_LIMIT": "4",
           "CHATMESH_DEVICE_BLOCKS": "256", "CHATMESH_HOST_BLOCKS": "256", "CHATMESH_MAX_BATCH": "2",
           "CHATMESH_SIM_TEXT": "words"}
    env.update(extra)
    return Config(env=env)


@pytest.fixture
async def stub(mesh_certs: Path) -> AsyncIterator[generate_pb2_grpc.GenerateServiceAsyncStub]:
    """The engine over mutual TLS, called as chat with a valid owner token for each request's owner."""
    port = free_port()
    ready, stop = asyncio.Event(), asyncio.Event()
    trust = trust_as(mesh_certs, identity.ENGINE)
    task = asyncio.create_task(serve(engine_service.build(_config(), trust), f"127.0.0.1:{port}", 0.5, ready, stop,
                                     trust=trust))
    await asyncio.wait_for(ready.wait(), 10)
    async with channel_as(mesh_certs, identity.CHAT, f"127.0.0.1:{port}", "engine", owner_tokens=True) as channel:
        yield generate_pb2_grpc.GenerateServiceStub(channel)
    stop.set()
    await asyncio.wait_for(task, 10)


def _request(prompt: list[int] | None = None, max_tokens: int = 5, **kw: object) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id=str(uuid.uuid4()), conversation_id=str(uuid.uuid4()), turn_id=str(uuid.uuid4()),
        prompt_token_ids=prompt if prompt is not None else list(range(1, 70)), owner_id="owner-a",
        platform_prefix_tokens=0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


async def test_generate_streams_started_deltas_finished(stub: generate_pb2_grpc.GenerateServiceAsyncStub) -> None:
    events = [r async for r in stub.Generate(_request(max_tokens=6))]
    assert events[0].WhichOneof("event") == "started"
    assert events[-1].WhichOneof("event") == "finished"
    assert all(e.WhichOneof("event") == "delta" for e in events[1:-1])
    tokens = [t for e in events[1:-1] for t in e.delta.token_ids]
    text = "".join(e.delta.text for e in events[1:-1])
    fin = events[-1].finished
    assert fin.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert len(tokens) == 6 and fin.usage.output_tokens == 6 and fin.usage.prompt_tokens == 69
    assert len(text.split()) == 6  # the sim's tokens are words


@pytest.mark.parametrize("bad", [
    _request(prompt=[]),
    _request(max_tokens=0),
    _request(top_p=1.5),
    _request(top_p=-0.1),
    generate_pb2.GenerateRequest(prompt_token_ids=[1], max_tokens=1, conversation_id="not-a-uuid"),
])
async def test_invalid_requests_are_invalid_argument(stub: generate_pb2_grpc.GenerateServiceAsyncStub,
                                                      bad: generate_pb2.GenerateRequest) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in stub.Generate(bad)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_full_queue_is_resource_exhausted(stub: generate_pb2_grpc.GenerateServiceAsyncStub) -> None:
    running = [stub.Generate(_request(max_tokens=10_000)) for _ in range(2)]  # max batch 2
    for call in running:
        assert isinstance(await call.read(), generate_pb2.GenerateResponse)
    queued = [stub.Generate(_request(max_tokens=10_000)) for _ in range(4)]  # queue limit 4
    for _ in range(500):
        if (await stub.GetStats(generate_pb2.GetStatsRequest())).stats.queue_depth == 4:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(_request()).read()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in running + queued:
        call.cancel()


async def test_evict_and_stats(stub: generate_pb2_grpc.GenerateServiceAsyncStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Evict(generate_pb2.EvictRequest())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Evict(generate_pb2.EvictRequest(cache_salt=b""))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.WatchStats(generate_pb2.WatchStatsRequest(interval_ms=-1)).read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    resp = await stub.Evict(generate_pb2.EvictRequest(conversation_id=str(uuid.uuid4()), owner_id="owner-a"))
    assert resp.blocks_evicted == 0
    [r async for r in stub.Generate(_request(max_tokens=2))]
    stats = (await stub.GetStats(generate_pb2.GetStatsRequest())).stats
    assert stats.backend == "sim" and stats.replica_id == "engine-0"
    assert stats.generations == 1
    watch = stub.WatchStats(generate_pb2.WatchStatsRequest(interval_ms=10))
    first, second = await watch.read(), await watch.read()
    assert isinstance(first, generate_pb2.WatchStatsResponse) and isinstance(second, generate_pb2.WatchStatsResponse)
    assert second.stats.generations == 1
    watch.cancel()


async def test_watch_stats_streams_which_conversations_are_cached(
        stub: generate_pb2_grpc.GenerateServiceAsyncStub) -> None:
    watch = stub.WatchStats(generate_pb2.WatchStatsRequest(interval_ms=10, include_residency=True))
    first = await watch.read()
    assert isinstance(first, generate_pb2.WatchStatsResponse) and first.HasField("residency")
    assert first.residency.full
    request = _request(max_tokens=40)  # 69 prompt tokens + 40: three full private blocks of 32 (the sim's default)
    [r async for r in stub.Generate(request)]
    held: dict[str, int] = {}
    for _ in range(100):
        update = await watch.read()
        assert isinstance(update, generate_pb2.WatchStatsResponse) and not update.residency.full
        held.update((c.conversation_id, c.cached_tokens) for c in update.residency.conversations)
        if held.get(request.conversation_id) == 96:  # updates sent while it ran may show fewer
            break
    assert held[request.conversation_id] == 96
    await stub.Evict(generate_pb2.EvictRequest(conversation_id=request.conversation_id, owner_id="owner-a"))
    for _ in range(100):
        update = await watch.read()
        assert isinstance(update, generate_pb2.WatchStatsResponse)
        held.update((c.conversation_id, c.cached_tokens) for c in update.residency.conversations)
        if held[request.conversation_id] == 0:
            break
    assert held[request.conversation_id] == 0
    plain = stub.WatchStats(generate_pb2.WatchStatsRequest(interval_ms=10))
    unasked = await plain.read()
    assert isinstance(unasked, generate_pb2.WatchStatsResponse) and not unasked.HasField("residency")
    watch.cancel()
    plain.cancel()


def test_a_long_residency_listing_spans_several_updates() -> None:
    items = tuple((ConversationId(f"c{i}"), 32) for i in range(engine_service.RESIDENCY_PER_UPDATE + 5))
    updates = engine_service.residency_to_proto(Residency(7, True, items))
    assert [u.full for u in updates] == [True, False]
    assert sum(len(u.conversations) for u in updates) == len(items)
    assert [u.full for u in engine_service.residency_to_proto(Residency(7, False, ()))] == [False]


async def test_cancel_frees_the_sequence(stub: generate_pb2_grpc.GenerateServiceAsyncStub) -> None:
    call = stub.Generate(_request(max_tokens=10_000))
    first = await call.read()
    assert isinstance(first, generate_pb2.GenerateResponse) and first.WhichOneof("event") == "started"
    await call.read()
    call.cancel()
    for _ in range(200):
        stats = (await stub.GetStats(generate_pb2.GetStatsRequest())).stats
        if stats.running_sequences == 0:
            break
        await asyncio.sleep(0.01)
    assert stats.running_sequences == 0


def test_step_token_budget_is_the_backends_unless_set() -> None:
    unset = Config(env={})
    assert engine_settings.step_token_budget(unset, sim.DEFAULT_STEP_TOKENS) == 512
    assert engine_settings.step_token_budget(unset, local_backend.DEFAULT_STEP_TOKENS) == 256
    assert engine_settings.step_token_budget(Config(env={"CHATMESH_STEP_TOKEN_BUDGET": "1024"}), 256) == 1024
    for bad in ("0", "-2"):
        with pytest.raises(ValueError, match="at least 1"):
            engine_settings.step_token_budget(Config(env={"CHATMESH_STEP_TOKEN_BUDGET": bad}), 256)


async def test_cancel_turn_ends_that_turns_generations_and_no_other(
        stub: generate_pb2_grpc.GenerateServiceAsyncStub) -> None:
    """A chat process that took a turn over cancels the old holder's sequence (issue 33): CancelTurn ends that
    turn's generation as its caller's cancel would, and leaves another owner's generation of the same ids running
    (the engine runs two at once here)."""
    victim = _request(max_tokens=10_000)
    other_owner = _request(max_tokens=10_000)
    other_owner.owner_id, other_owner.conversation_id, other_owner.turn_id = (
        "owner-b", victim.conversation_id, victim.turn_id)
    calls = [stub.Generate(r) for r in (victim, other_owner)]
    for call in calls:
        await call.read()  # started
    done = await stub.CancelTurn(generate_pb2.CancelTurnRequest(
        owner_id=victim.owner_id, conversation_id=victim.conversation_id, turn_id=victim.turn_id))
    assert done.cancelled == 1
    while True:  # the victim's stream ends as a cancelled generation does
        message = await calls[0].read()
        assert isinstance(message, generate_pb2.GenerateResponse)
        if message.WhichOneof("event") == "finished":
            assert message.finished.finish_reason == generate_pb2.FINISH_REASON_CANCELLED
            break
    for call in calls[1:]:
        message = await call.read()
        assert isinstance(message, generate_pb2.GenerateResponse) and message.WhichOneof("event") == "delta"
        call.cancel()  # the other owner's is still generating
    again = await stub.CancelTurn(generate_pb2.CancelTurnRequest(
        owner_id=victim.owner_id, conversation_id=victim.conversation_id, turn_id=victim.turn_id))
    assert again.cancelled == 0
    for _ in range(200):
        stats = (await stub.GetStats(generate_pb2.GetStatsRequest())).stats
        if stats.running_sequences == 0:
            break
        await asyncio.sleep(0.01)
    assert stats.running_sequences == 0
