"""Chat's gRPC clients on real loopback gRPC, where they do more than convert: the router pick's bounded wait (a
router restarting, or answering that no replica serves yet, holds the turn for a moment instead of failing it)
and the engine stream's `EngineUnreachable` (nothing reached the replica, so the turn may go to another), and
the pick's pull source carried into the engine request."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from chatmesh.chat.clients import Channels, GrpcEngines, GrpcRouter
from chatmesh.chat.ports import EngineUnreachable, Generation, PullSource
from chatmesh.mesh import errors
from chatmesh.mesh.channels import open_channel
from chatmesh.mesh.config import Config
from chatmesh.mesh.ids import ConversationId, OwnerId, ReplicaId
from chatmesh.mesh.server import serve
from chatmesh.mesh.trust import Trust
from chatmesh.engine_adapter.backend import ResumeRefused
from chatmesh.router.service import build
from chatmesh.v1 import generate_pb2, generate_pb2_grpc, route_pb2, route_pb2_grpc
from tests.conftest import free_port

REPLICAS = "engine-0=127.0.0.1:1,engine-1=127.0.0.1:2"
CONV = ConversationId(str(uuid.uuid4()))


@asynccontextmanager
async def router_at(address: str) -> AsyncIterator[None]:
    cfg = Config(env={"CHATMESH_MESH_PLAINTEXT": "true", "CHATMESH_REPLICAS": REPLICAS,
                      "CHATMESH_ROUTER_HEALTH": "false"})
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve(build(cfg), address, 0.5, ready=ready, stop=stop, trust=Trust.insecure()))
    await asyncio.wait_for(ready.wait(), 30)
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_pick_waits_for_a_router_that_is_starting() -> None:
    address = f"127.0.0.1:{free_port()}"
    async with open_channel(Trust.insecure(), address, "router") as channel:
        router = GrpcRouter(channel, wait_s=60)
        pick = asyncio.create_task(router.pick(CONV))
        state = channel.get_state(try_to_connect=True)
        while state is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:  # its first connection attempt is refused
            await asyncio.wait_for(channel.wait_for_state_change(state), 10)
            state = channel.get_state()
        assert not pick.done()  # and the pick waits on
        async with router_at(address):
            got = await pick
            assert got.replica_id in ("engine-0", "engine-1") and got.lease
            await router.release(got.lease)


async def test_a_pick_fails_unavailable_once_the_wait_is_over() -> None:
    async with open_channel(Trust.insecure(), f"127.0.0.1:{free_port()}", "router") as channel:
        with pytest.raises(errors.Unavailable, match="router unavailable"):
            await GrpcRouter(channel, wait_s=0.2).pick(CONV)


class _NotYet(route_pb2_grpc.RouteServiceServicer):
    """A router that has no serving replica for its first `refusals` picks (as one just started does)."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.calls = 0
        self.source = ("", "")  # the pull source its picks name (none)

    async def PickReplica(self, request: route_pb2.PickReplicaRequest, context: grpc.aio.ServicerContext[
            route_pb2.PickReplicaRequest, route_pb2.PickReplicaResponse]) -> route_pb2.PickReplicaResponse:
        self.calls += 1
        if self.calls <= self.refusals:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy replica: none of 2 replicas is serving")
        return route_pb2.PickReplicaResponse(replica_id="engine-1", address="127.0.0.1:2", lease_id="l-1",
                                             source_replica_id=self.source[0], source_address=self.source[1])

    async def ReleaseLease(self, request: route_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext[
            route_pb2.ReleaseLeaseRequest, route_pb2.ReleaseLeaseResponse]) -> route_pb2.ReleaseLeaseResponse:
        return route_pb2.ReleaseLeaseResponse()

    async def ListReplicas(self, request: route_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext[
            route_pb2.ListReplicasRequest, route_pb2.ListReplicasResponse]) -> route_pb2.ListReplicasResponse:
        return route_pb2.ListReplicasResponse()


@asynccontextmanager
async def fake_router(servicer: route_pb2_grpc.RouteServiceServicer) -> AsyncIterator[str]:
    server = grpc.aio.server()
    route_pb2_grpc.add_RouteServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_a_pick_is_asked_again_while_no_replica_serves_yet() -> None:
    servicer = _NotYet(refusals=3)
    async with fake_router(servicer) as address, open_channel(Trust.insecure(), address, "router") as channel:
        got = await GrpcRouter(channel, wait_s=60).pick(CONV)
        assert got.replica_id == "engine-1" and servicer.calls == 4
        servicer.calls, servicer.refusals = 0, 1_000_000
        with pytest.raises(errors.Unavailable, match="no healthy replica"):
            await GrpcRouter(channel, wait_s=0.3).pick(CONV)  # still none when the wait is over: the turn fails
        assert servicer.calls >= 2


async def test_an_engine_nothing_listens_at_is_unreachable() -> None:
    """The error the turn reroutes on (claimed.py): UNAVAILABLE before the engine's first message."""
    channels = Channels(Trust.insecure())
    generation = Generation(request_id="r", conversation=CONV, turn=None, owner=OwnerId("o"), prompt_token_ids=(1,),
                            platform_prefix_tokens=0, max_tokens=1, temperature=0.0, top_p=1.0)
    try:
        with pytest.raises(EngineUnreachable):
            async for _ in GrpcEngines(channels).generate(f"127.0.0.1:{free_port()}", generation, 5.0):
                pass
    finally:
        await channels.close()


class _Recorder(generate_pb2_grpc.GenerateServiceServicer):
    """An engine that records each Generate request and answers it finished at once."""

    def __init__(self) -> None:
        self.requests: list[generate_pb2.GenerateRequest] = []

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext[
            generate_pb2.GenerateRequest, generate_pb2.GenerateResponse]) -> AsyncIterator[generate_pb2.GenerateResponse]:
        self.requests.append(request)
        yield generate_pb2.GenerateResponse(finished=generate_pb2.GenerateFinished(
            finish_reason=generate_pb2.FINISH_REASON_STOP))


async def test_the_picks_pull_source_reaches_the_engine_request() -> None:
    """PickReplicaResponse.source_* becomes Pick.source, and Generation.source the GenerateRequest's (issue 29)."""
    servicer = _NotYet(refusals=0)
    servicer.source = ("engine-0", "127.0.0.1:1")
    async with fake_router(servicer) as address, open_channel(Trust.insecure(), address, "router") as channel:
        pick = await GrpcRouter(channel, wait_s=5).pick(CONV)
    assert pick.source == PullSource(ReplicaId("engine-0"), "127.0.0.1:1")
    engine = _Recorder()  # type: ignore[abstract]  # only Generate is called
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels = Channels(Trust.insecure())
    try:
        for source in (pick.source, None):
            generation = Generation(request_id="r", conversation=CONV, turn=None, owner=OwnerId("o"),
                                    prompt_token_ids=(1,), platform_prefix_tokens=0, max_tokens=1, temperature=0.0,
                                    top_p=1.0, source=source)
            async for _ in GrpcEngines(channels).generate(f"127.0.0.1:{port}", generation, 5.0):
                pass
    finally:
        await channels.close()
        await server.stop(None)
    assert [(r.source_replica_id, r.source_address) for r in engine.requests] == [
        ("engine-0", "127.0.0.1:1"), ("", "")]


class _CannotResume:
    """A backend that, like triton on a sampled reply, cannot continue one exactly (the rest is never called)."""

    name = "refusing"
    model = None

    async def generate(self, params: object) -> AsyncIterator[object]:
        nothing: tuple[object, ...] = ()
        for event in nothing:  # an async generator, as every backend's generate is
            yield event
        raise ResumeRefused("cannot continue a sampled reply exactly")


async def test_an_engine_that_cannot_continue_a_reply_is_resume_refused() -> None:
    """The engine's refusal (FAILED_PRECONDITION with the resume-refused trailer) reaches the turn as
    ResumeRefused, so it fails retryable with the shown text dropped (claimed.py), never spliced."""
    from chatmesh.chat.ports import ResumeRefused as TurnResumeRefused
    from chatmesh.engine_adapter.service import GenerateServicer

    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(_CannotResume(), "r"), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels = Channels(Trust.insecure())
    generation = Generation(request_id="r", conversation=CONV, turn=None, owner=OwnerId("o"), prompt_token_ids=(1, 2),
                            platform_prefix_tokens=0, max_tokens=1, temperature=0.7, top_p=1.0, resumed_tokens=1)
    try:
        with pytest.raises(TurnResumeRefused):
            async for _ in GrpcEngines(channels).generate(f"127.0.0.1:{port}", generation, 5.0):
                pass
    finally:
        await channels.close()
        await server.stop(None)
