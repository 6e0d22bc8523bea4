"""The shared error mapping over real gRPC: typed core errors become their status codes with the message, and
anything unexpected becomes INTERNAL, never UNKNOWN; streams map the same way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from chatmesh.mesh import errors
from chatmesh.mesh.trust import Trust
from chatmesh.mesh.server import Service, serve, stream_errors, unary_errors
from chatmesh.v1 import route_pb2, route_pb2_grpc
from tests.conftest import free_port


class Failing(route_pb2_grpc.RouteServiceServicer):
    @unary_errors
    async def PickReplica(self, request: route_pb2.PickReplicaRequest, context: grpc.aio.ServicerContext[object, object]
                          ) -> route_pb2.PickReplicaResponse:
        match request.conversation_id:
            case "missing":
                raise errors.NotFound("no such conversation")
            case "bad":
                raise errors.InvalidArgument("conversation_id is bad")
            case "busy":
                raise errors.ResourceExhausted("queue full")
            case _:
                raise RuntimeError("boom")

    @unary_errors
    async def ReleaseLease(self, request: route_pb2.ReleaseLeaseRequest,
                           context: grpc.aio.ServicerContext[object, object]) -> route_pb2.ReleaseLeaseResponse:
        raise errors.NotFound("unknown lease")

    @unary_errors
    async def ListReplicas(self, request: route_pb2.ListReplicasRequest,
                           context: grpc.aio.ServicerContext[object, object]) -> route_pb2.ListReplicasResponse:
        raise errors.Unavailable("no replicas")


async def test_core_errors_map_to_status_codes() -> None:
    address = f"127.0.0.1:{free_port()}"
    stop, ready = asyncio.Event(), asyncio.Event()

    def register(server: grpc.aio.Server) -> list[str]:
        route_pb2_grpc.add_RouteServiceServicer_to_server(Failing(), server)
        return ["chatmesh.v1.RouteService"]

    task = asyncio.create_task(serve(Service("test", register), address, 0.1, ready=ready, stop=stop, trust=Trust.insecure()))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = route_pb2_grpc.RouteServiceStub(channel)
            for conv, code, text in [("missing", grpc.StatusCode.NOT_FOUND, "no such conversation"),
                                     ("bad", grpc.StatusCode.INVALID_ARGUMENT, "conversation_id is bad"),
                                     ("busy", grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
                                     ("other", grpc.StatusCode.INTERNAL, "RuntimeError")]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.PickReplica(route_pb2.PickReplicaRequest(conversation_id=conv))
                assert info.value.code() == code
                assert text in (info.value.details() or "")
    finally:
        stop.set()
        await task


class Streaming:
    @stream_errors
    async def Watch(self, request: str, context: object) -> AsyncIterator[str]:
        yield "first"
        raise errors.Unavailable("engine gone")


def test_stream_errors_keeps_items_before_the_error() -> None:
    class Ctx:
        aborted: tuple[grpc.StatusCode, str] | None = None

        async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
            self.aborted = (code, details)
            raise grpc.aio.AbortError()

    async def run() -> tuple[list[str], Ctx]:
        ctx = Ctx()
        got: list[str] = []
        with pytest.raises(grpc.aio.AbortError):
            async for item in Streaming().Watch("x", ctx):
                got.append(item)
        return got, ctx

    got, ctx = asyncio.run(run())
    assert got == ["first"]
    assert ctx.aborted == (grpc.StatusCode.UNAVAILABLE, "engine gone")
