"""The router against three real sim engines over gRPC: health moves conversations away (and, for the ring,
back), engine load and residency arrive through WatchStats, and no serving replica is UNAVAILABLE with the
reason."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import pytest

from chatmesh.engine_adapter import service as engine_service
from chatmesh.mesh.config import Config
from chatmesh.mesh.trust import Trust
from chatmesh.mesh.server import serve
from chatmesh.router.service import build
from chatmesh.v1 import generate_pb2, generate_pb2_grpc, route_pb2, route_pb2_grpc

ENGINES = ("engine-0", "engine-1", "engine-2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Running:
    task: asyncio.Task[None]
    stop: asyncio.Event


async def start_engine(replica_id: str, address: str) -> Running:
    cfg = Config(env={"CHATMESH_MESH_PLAINTEXT": "true", "CHATMESH_ENGINE": "sim", "CHATMESH_REPLICA_ID": replica_id,
                      "CHATMESH_SIM_STEP_MS": "5",
                      "CHATMESH_DEVICE_BLOCKS": "256", "CHATMESH_HOST_BLOCKS": "0", "CHATMESH_SIM_TEXT": "words"})
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve(engine_service.build(cfg), address, 0.2, ready, stop, trust=Trust.insecure()))
    await asyncio.wait_for(ready.wait(), 20)
    return Running(task, stop)


async def halt(r: Running) -> None:
    r.stop.set()
    await asyncio.wait_for(r.task, 20)


@dataclass
class Mesh:
    router: route_pb2_grpc.RouteServiceAsyncStub
    addresses: dict[str, str]
    engines: dict[str, Running]
    policy: str


@contextlib.asynccontextmanager
async def running_mesh(policy: str, **env: str) -> AsyncIterator[Mesh]:
    addresses = {rid: f"127.0.0.1:{free_port()}" for rid in ENGINES}
    engines = {rid: await start_engine(rid, addr) for rid, addr in addresses.items()}
    router_address = f"127.0.0.1:{free_port()}"
    cfg = Config(env={"CHATMESH_MESH_PLAINTEXT": "true",
                      "CHATMESH_REPLICAS": ",".join(f"{k}={v}" for k, v in addresses.items()),
                      "CHATMESH_ROUTER_STATS_INTERVAL_MS": "50", "CHATMESH_ROUTER_POLICY": policy, **env})
    ready, stop = asyncio.Event(), asyncio.Event()
    router = asyncio.create_task(serve(build(cfg), router_address, 0.2, ready, stop, trust=Trust.insecure()))
    await asyncio.wait_for(ready.wait(), 20)
    async with grpc.aio.insecure_channel(router_address) as channel:
        yield Mesh(route_pb2_grpc.RouteServiceStub(channel), addresses, engines, policy)
    stop.set()
    await asyncio.wait_for(router, 20)
    for running in engines.values():
        if not running.task.done():
            await halt(running)


@pytest.fixture(params=["follow", "ring"])
async def mesh(request: pytest.FixtureRequest) -> AsyncIterator[Mesh]:
    async with running_mesh(request.param) as m:
        yield m


@pytest.fixture
async def follow_mesh() -> AsyncIterator[Mesh]:
    async with running_mesh("follow") as m:
        yield m


async def until(what: str, check: Callable[[route_pb2.ListReplicasResponse], bool], stub: Mesh,
                timeout_s: float = 20.0) -> route_pb2.ListReplicasResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        listed = await stub.router.ListReplicas(route_pb2.ListReplicasRequest())
        if check(listed):
            return listed
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {listed}"
        await asyncio.sleep(0.05)


def states(listed: route_pb2.ListReplicasResponse) -> dict[str, int]:
    return {r.replica_id: r.state for r in listed.replicas}


async def picks(mesh: Mesh, conversations: list[str]) -> dict[str, route_pb2.PickReplicaResponse]:
    out = {}
    for c in conversations:
        out[c] = await mesh.router.PickReplica(route_pb2.PickReplicaRequest(conversation_id=c))
        await mesh.router.ReleaseLease(route_pb2.ReleaseLeaseRequest(lease_id=out[c].lease_id))
    return out


SERVING = route_pb2.REPLICA_STATE_SERVING


async def test_unhealthy_engine_conversations_move_and_return(mesh: Mesh) -> None:
    await until("all serving", lambda r: set(states(r).values()) == {SERVING}, mesh)
    conversations = [str(uuid.uuid4()) for _ in range(60)]
    before = await picks(mesh, conversations)
    first = route_pb2.PICK_OUTCOME_PLACED if mesh.policy == "follow" else route_pb2.PICK_OUTCOME_HOME
    assert all(p.outcome == first for p in before.values())
    homes = {c: p.replica_id for c, p in before.items()}
    assert set(homes.values()) == set(ENGINES)
    assert all(p.address == mesh.addresses[p.replica_id] for p in before.values())

    await halt(mesh.engines["engine-1"])
    down = await until("engine-1 down", lambda r: states(r)["engine-1"] != SERVING, mesh)
    reasons = {r.replica_id: r.reason for r in down.replicas}
    assert reasons["engine-1"] and not reasons["engine-0"] and not reasons["engine-2"]
    during = await picks(mesh, conversations)
    for c, p in during.items():
        assert p.home_replica_id == homes[c]
        if homes[c] == "engine-1":
            assert p.replica_id != "engine-1" and p.outcome == route_pb2.PICK_OUTCOME_SPILL
        else:
            assert p.replica_id == homes[c] and p.outcome == route_pb2.PICK_OUTCOME_HOME

    mesh.engines["engine-1"] = await start_engine("engine-1", mesh.addresses["engine-1"])
    await until("engine-1 back", lambda r: states(r)["engine-1"] == SERVING, mesh)
    after = await picks(mesh, conversations)
    assert all(p.outcome == route_pb2.PICK_OUTCOME_HOME for p in after.values())
    if mesh.policy == "ring":  # the ring's homes are fixed: everyone returns
        assert {c: p.replica_id for c, p in after.items()} == homes
    else:  # follow: a moved conversation stays where its prefix now is, nobody else moved
        assert {c: p.replica_id for c, p in after.items()} == {c: p.replica_id for c, p in during.items()}


async def test_follow_learns_where_prefixes_are_from_the_engines(follow_mesh: Mesh) -> None:
    mesh = follow_mesh
    await until("all serving", lambda r: set(states(r).values()) == {SERVING}, mesh)
    conversation = str(uuid.uuid4())
    pick = (await picks(mesh, [conversation]))[conversation]
    assert pick.outcome == route_pb2.PICK_OUTCOME_PLACED
    async with grpc.aio.insecure_channel(pick.address) as channel:
        engine = generate_pb2_grpc.GenerateServiceStub(channel)
        [r async for r in engine.Generate(generate_pb2.GenerateRequest(
            request_id=str(uuid.uuid4()), conversation_id=conversation, turn_id=str(uuid.uuid4()),
            prompt_token_ids=list(range(1, 100)), cache_salt=b"owner", max_tokens=4))]
        await until("the engine's report", lambda r: {x.replica_id: x.cached_conversations for x in r.replicas}
                    [pick.replica_id] == 1, mesh)
        again = (await picks(mesh, [conversation]))[conversation]
        assert again.outcome == route_pb2.PICK_OUTCOME_HOME and again.replica_id == pick.replica_id
        await engine.Evict(generate_pb2.EvictRequest(conversation_id=conversation))  # deletion reaches the cache
        await until("the eviction's report", lambda r: all(x.cached_conversations == 0 for x in r.replicas), mesh)
    gone = (await picks(mesh, [conversation]))[conversation]
    assert gone.outcome == route_pb2.PICK_OUTCOME_PLACED  # nothing cached anywhere: placed by load again


async def test_engine_load_arrives_through_watch_stats(mesh: Mesh) -> None:
    await until("all serving", lambda r: set(states(r).values()) == {SERVING}, mesh)
    async with grpc.aio.insecure_channel(mesh.addresses["engine-2"]) as channel:
        engine = generate_pb2_grpc.GenerateServiceStub(channel)
        call = engine.Generate(generate_pb2.GenerateRequest(
            request_id=str(uuid.uuid4()), conversation_id=str(uuid.uuid4()), turn_id=str(uuid.uuid4()),
            prompt_token_ids=list(range(1, 40)), cache_salt=b"owner", max_tokens=2000))
        first = await call.read()
        assert isinstance(first, generate_pb2.GenerateResponse) and first.WhichOneof("event") == "started"
        listed = await until("engine-2 load", lambda r: {x.replica_id: x.engine_load for x in r.replicas}
                             ["engine-2"] >= 1, mesh)
        row = next(x for x in listed.replicas if x.replica_id == "engine-2")
        assert row.load == row.engine_load + row.open_leases
        call.cancel()
    await until("engine-2 idle", lambda r: all(x.engine_load == 0 for x in r.replicas), mesh)


async def test_no_serving_replica_is_unavailable_with_reasons(mesh: Mesh) -> None:
    await until("all serving", lambda r: set(states(r).values()) == {SERVING}, mesh)
    for rid in ENGINES:
        await halt(mesh.engines[rid])
    await until("all down", lambda r: SERVING not in states(r).values(), mesh)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mesh.router.PickReplica(route_pb2.PickReplicaRequest(conversation_id="c-1"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    details = err.value.details() or ""
    assert details.startswith("no healthy replica: none of 3 replicas is serving")
    assert all(rid in details for rid in ENGINES)


async def test_an_engine_that_returns_is_routed_to_within_a_second_or_two_of_serving(mesh: Mesh) -> None:
    """Down for long enough that gRPC's default reconnect backoff would have grown to a ~4 s gap (1, 1.6, 2.6 s
    ...), the engine is routed to again within 2 s of its server answering health checks."""
    await until("all serving", lambda r: set(states(r).values()) == {SERVING}, mesh)
    await halt(mesh.engines["engine-0"])
    await until("engine-0 down", lambda r: states(r)["engine-0"] != SERVING, mesh)
    await asyncio.sleep(5.5)
    mesh.engines["engine-0"] = await start_engine("engine-0", mesh.addresses["engine-0"])  # once it serves
    # Within 40 polls 0.05 s apart (2 s on an idle machine, longer on a loaded one: a count, not a clock).
    for _ in range(40):
        if states(await mesh.router.ListReplicas(route_pb2.ListReplicasRequest()))["engine-0"] == SERVING:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("engine-0 serves but the router did not route to it within 40 polls")


async def test_a_moved_turn_names_its_home_as_source_and_the_engine_pulls_from_it() -> None:
    """Issue 29 through the router: the engines say (stats) that they serve and receive pulls; a turn moved off
    its home (over the bound: no floor, pull eps 0, so one open turn fills it) names the home as source, and the
    replica it lands on pulls the history instead of prefilling it; an engine gone is no source."""
    async with running_mesh("follow", CHATMESH_ROUTER_MIN_SPILL_LOAD="0", CHATMESH_ROUTER_PULL_EPS="0") as mesh:
        await _moved_turn_pulls(mesh)


async def _moved_turn_pulls(mesh: Mesh) -> None:
    await until("all serving and pulling", lambda r: all(
        x.state == SERVING and x.serves_pulls and x.receives_pulls for x in r.replicas), mesh)
    conversation, history = str(uuid.uuid4()), list(range(1, 100))

    async def generate(pick: route_pb2.PickReplicaResponse, prompt: list[int]) -> generate_pb2.GenerateStarted:
        async with grpc.aio.insecure_channel(pick.address) as channel:
            events = [e async for e in generate_pb2_grpc.GenerateServiceStub(channel).Generate(
                generate_pb2.GenerateRequest(
                    request_id=str(uuid.uuid4()), conversation_id=conversation, turn_id=str(uuid.uuid4()),
                    prompt_token_ids=prompt, owner_id="alice", max_tokens=4,
                    source_replica_id=pick.source_replica_id, source_address=pick.source_address))]
        assert events[0].WhichOneof("event") == "started"
        return events[0].started

    first = (await picks(mesh, [conversation]))[conversation]
    assert first.source_replica_id == ""
    await generate(first, history)
    await until("the home's report", lambda r: {x.replica_id: x.cached_tokens for x in r.replicas}
                [first.replica_id] >= 80, mesh)  # the engine's count, not the pick's placeholder of 1
    busy = await mesh.router.PickReplica(route_pb2.PickReplicaRequest(conversation_id=conversation))
    assert busy.replica_id == first.replica_id and busy.outcome == route_pb2.PICK_OUTCOME_HOME
    moved = await mesh.router.PickReplica(route_pb2.PickReplicaRequest(conversation_id=conversation))
    for lease in (busy.lease_id, moved.lease_id):
        await mesh.router.ReleaseLease(route_pb2.ReleaseLeaseRequest(lease_id=lease))
    assert moved.outcome == route_pb2.PICK_OUTCOME_SPILL and moved.replica_id != first.replica_id
    assert (moved.source_replica_id, moved.source_address) == (first.replica_id, first.address)
    assert moved.source_cached_tokens > 0
    started = await generate(moved, history + [7, 8, 9])
    assert started.pull_outcome == generate_pb2.PULL_OUTCOME_PULLED and started.pulled_prompt_tokens >= 80
    await halt(mesh.engines[first.replica_id])
    await until("the old home no source", lambda r: not next(
        x for x in r.replicas if x.replica_id == first.replica_id).serves_pulls, mesh)
    await until("the new home's report", lambda r: {x.replica_id: x.cached_tokens for x in r.replicas}
                [moved.replica_id] >= 80, mesh)
    busy = await mesh.router.PickReplica(route_pb2.PickReplicaRequest(conversation_id=conversation))
    third = await mesh.router.PickReplica(route_pb2.PickReplicaRequest(conversation_id=conversation))
    assert busy.replica_id == moved.replica_id
    assert third.replica_id not in (first.replica_id, moved.replica_id)
    assert third.source_replica_id == moved.replica_id  # the newest copy, not the gone one
