"""RouteService over real gRPC on loopback: picks, releases, listing and the error codes."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from chatmesh.mesh.config import Config
from chatmesh.mesh.trust import Trust
from chatmesh.mesh.server import serve
from chatmesh.router.service import build
from chatmesh.v1 import route_pb2, route_pb2_grpc

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


REPLICAS = "engine-0=127.0.0.1:1,engine-1=127.0.0.1:2,engine-2=127.0.0.1:3"


@pytest.fixture
async def stub() -> AsyncIterator[route_pb2_grpc.RouteServiceAsyncStub]:
    address = f"127.0.0.1:{free_port()}"
    cfg = Config(env={"CHATMESH_MESH_PLAINTEXT": "true", "CHATMESH_REPLICAS": REPLICAS,
                      "CHATMESH_ROUTER_HEALTH": "false"})
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve(build(cfg), address, 0.5, ready=ready, stop=stop, trust=Trust.insecure()))
    await asyncio.wait_for(ready.wait(), 10)
    async with grpc.aio.insecure_channel(address) as channel:
        yield route_pb2_grpc.RouteServiceStub(channel)
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_pick_is_sticky_and_lease_counts_until_released(stub: route_pb2_grpc.RouteServiceAsyncStub) -> None:
    conv = str(uuid.uuid4())
    first = await stub.PickReplica(route_pb2.PickReplicaRequest(conversation_id=conv))
    assert first.outcome == route_pb2.PICK_OUTCOME_PLACED  # the default (follow) policy: a first turn
    assert first.replica_id == first.home_replica_id
    assert first.address == dict(r.split("=") for r in REPLICAS.split(","))[first.replica_id]
    assert first.lease_expires_at_ms > 0
    listed = await stub.ListReplicas(route_pb2.ListReplicasRequest())
    loads = {r.replica_id: r.open_leases for r in listed.replicas}
    assert loads == {"engine-0": 0, "engine-1": 0, "engine-2": 0} | {first.replica_id: 1}
    released = await stub.ReleaseLease(route_pb2.ReleaseLeaseRequest(lease_id=first.lease_id))
    assert released.replica_id == first.replica_id
    listed = await stub.ListReplicas(route_pb2.ListReplicasRequest())
    assert all(r.load == 0 and r.state == route_pb2.REPLICA_STATE_SERVING for r in listed.replicas)
    second = await stub.PickReplica(route_pb2.PickReplicaRequest(conversation_id=conv))
    assert second.replica_id == first.replica_id and second.outcome == route_pb2.PICK_OUTCOME_HOME
    listed = await stub.ListReplicas(route_pb2.ListReplicasRequest())
    assert {r.replica_id: r.cached_conversations for r in listed.replicas}[first.replica_id] == 1


async def test_exclusion_spills_to_another_replica(stub: route_pb2_grpc.RouteServiceAsyncStub) -> None:
    conv = str(uuid.uuid4())
    home = (await stub.PickReplica(route_pb2.PickReplicaRequest(conversation_id=conv))).replica_id
    spill = await stub.PickReplica(route_pb2.PickReplicaRequest(conversation_id=conv, exclude_replica_ids=[home]))
    assert spill.outcome == route_pb2.PICK_OUTCOME_SPILL
    assert spill.home_replica_id == home and spill.replica_id != home


@pytest.mark.parametrize("conv", ["", "x" * 129])
async def test_bad_conversation_id_is_invalid_argument(stub: route_pb2_grpc.RouteServiceAsyncStub, conv: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PickReplica(route_pb2.PickReplicaRequest(conversation_id=conv))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "conversation_id" in (err.value.details() or "")


async def test_unknown_lease_is_not_found(stub: route_pb2_grpc.RouteServiceAsyncStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ReleaseLease(route_pb2.ReleaseLeaseRequest(lease_id=str(uuid.uuid4())))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_every_replica_excluded_is_unavailable_with_reason(
        stub: route_pb2_grpc.RouteServiceAsyncStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PickReplica(route_pb2.PickReplicaRequest(
            conversation_id="c", exclude_replica_ids=["engine-0", "engine-1", "engine-2"]))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (err.value.details() or "").startswith("no healthy replica: ")


async def test_metrics_count_picks_spills_and_load() -> None:
    from typing import Any, cast

    from chatmesh.router.membership import Membership, parse_replicas
    from chatmesh.router.ring import Ring
    from chatmesh.router.service import Metrics, RouteServicer

    membership = Membership(Ring(), parse_replicas(REPLICAS, "unused"), watch=False)
    metrics = Metrics(membership)
    servicer = RouteServicer(membership, metrics)
    ctx = cast(Any, object())  # only consulted on errors
    home = await servicer.PickReplica(route_pb2.PickReplicaRequest(conversation_id="c-1"), ctx)
    await servicer.PickReplica(route_pb2.PickReplicaRequest(conversation_id="c-1",
                                                            exclude_replica_ids=[home.replica_id]), ctx)
    text = metrics.registry.exposition().decode()
    assert f'chatmesh_router_picks_total{{outcome="home",replica="{home.replica_id}"}} 1.0' in text
    spilled = [line for line in text.splitlines() if line.startswith('chatmesh_router_picks_total{outcome="spill_')]
    assert len(spilled) == 1 and spilled[0].endswith(" 1.0") and home.replica_id not in spilled[0]
    assert 'chatmesh_router_spills_total{reason="excluded"} 1.0' in text
    assert f'chatmesh_router_replica_load{{replica="{home.replica_id}"}} 1.0' in text
    assert 'chatmesh_router_replica_serving{replica="engine-2"} 1.0' in text


async def test_a_moved_turn_names_its_source_and_a_draining_replica_is_listed_so() -> None:
    from typing import Any, cast

    from chatmesh.mesh.ids import ConversationId, ReplicaId
    from chatmesh.router.follow import Follow
    from chatmesh.router.link import DEFAULT_COST
    from chatmesh.router.membership import Membership, parse_replicas
    from chatmesh.router.service import Metrics, RouteServicer

    policy = Follow(min_spill_load=0, pulls=DEFAULT_COST)
    membership = Membership(policy, parse_replicas(REPLICAS, "unused"), watch=False)
    servicer = RouteServicer(membership, Metrics(membership))
    ctx = cast(Any, object())
    e0, e1 = ReplicaId("engine-0"), ReplicaId("engine-1")
    policy.placement.report(e0, [(ConversationId("c-pull"), 3000)])
    # no engine has said it serves or receives pulls yet: a move prefills
    spill = await servicer.PickReplica(route_pb2.PickReplicaRequest(conversation_id="c-pull",
                                                                    exclude_replica_ids=["engine-0"]), ctx)
    assert spill.outcome == route_pb2.PICK_OUTCOME_SPILL and spill.source_replica_id == ""
    assert spill.source_cached_tokens == 0
    policy.placement.report(e0, [(ConversationId("c-pull"), 3000)], full=True)
    policy.placement.report(ReplicaId(spill.replica_id), [(ConversationId("c-pull"), 0)])
    for rid in ("engine-0", "engine-1", "engine-2"):
        policy.set_pulls(ReplicaId(rid), True, True)
    membership.mark(e0, False, "health NOT_SERVING")  # SIGTERM: it still serves pulls
    moved = await servicer.PickReplica(route_pb2.PickReplicaRequest(conversation_id="c-pull"), ctx)
    assert moved.outcome == route_pb2.PICK_OUTCOME_SPILL and moved.home_replica_id == "engine-0"
    assert (moved.source_replica_id, moved.source_address, moved.source_cached_tokens) == (
        "engine-0", "127.0.0.1:1", 3000)
    listed = {r.replica_id: r for r in (await servicer.ListReplicas(route_pb2.ListReplicasRequest(), ctx)).replicas}
    assert listed["engine-0"].state == route_pb2.REPLICA_STATE_DRAINING
    assert listed["engine-0"].serves_pulls and listed["engine-1"].receives_pulls
    assert listed["engine-0"].cached_tokens == 3000 and listed["engine-0"].cached_conversations == 1
    policy.set_pulls(e0, False, False)  # its grace is over
    assert {r.replica_id: r.state for r in (await servicer.ListReplicas(
        route_pb2.ListReplicasRequest(), ctx)).replicas}["engine-0"] == route_pb2.REPLICA_STATE_NOT_SERVING
    text = servicer._metrics.registry.exposition().decode()
    assert 'chatmesh_router_spills_total{reason="home_draining"} 1.0' in text
    assert 'chatmesh_router_pull_picks_total{source="engine-0"} 1.0' in text
    assert 'chatmesh_router_pull_planned_tokens_total{source="engine-0"} 3000.0' in text
    assert e1 in {ReplicaId(r) for r in listed}
