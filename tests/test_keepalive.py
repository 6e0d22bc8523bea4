"""A peer that vanishes without closing its connection (host off, link down) is noticed by keepalive.

A TCP relay between a client channel and a server stops moving bytes, both sockets left open: no FIN, no RST,
what a partition looks like from either end. A stream opened through `open_channel` ends UNAVAILABLE within
keepalive's ~8 s; the same stream on a channel without the keepalive options is still waiting after that.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as AsyncHealthServicer

from chatmesh.mesh import channels
from chatmesh.mesh.server import SERVER_OPTIONS
from chatmesh.mesh.trust import Trust

DETECT_WITHIN_S = (channels.KEEPALIVE_TIME_MS + channels.KEEPALIVE_TIMEOUT_MS) / 1000 + 6.0


class FreezingRelay:
    """Relays 127.0.0.1:<port> to the server until `freeze()`; then moves no byte and closes nothing."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.frozen = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers += [writer, up_writer]
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while not self.frozen.is_set():
            read = asyncio.create_task(src.read(65536))
            frozen = asyncio.create_task(self.frozen.wait())
            done, _ = await asyncio.wait({read, frozen}, return_when=asyncio.FIRST_COMPLETED)
            if frozen in done:
                read.cancel()
                return
            frozen.cancel()
            data = read.result()
            if not data:
                return
            dst.write(data)
            await dst.drain()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def health_port() -> AsyncIterator[int]:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(AsyncHealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(0)


async def _watch_until_end(channel: grpc.aio.Channel, started: asyncio.Event) -> grpc.StatusCode:
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    try:
        async for reply in call:
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            started.set()
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def test_a_silent_peer_ends_the_stream_by_keepalive_and_not_without_it(health_port: int) -> None:
    with_ka, without_ka = FreezingRelay(health_port), FreezingRelay(health_port)
    await with_ka.start()
    await without_ka.start()
    mesh_channel = channels.open_channel(Trust.insecure(), f"127.0.0.1:{with_ka.port}", "engine")
    bare_channel = grpc.aio.insecure_channel(f"127.0.0.1:{without_ka.port}")
    started = [asyncio.Event(), asyncio.Event()]
    watched = asyncio.create_task(_watch_until_end(mesh_channel, started[0]))
    control = asyncio.create_task(_watch_until_end(bare_channel, started[1]))
    try:
        await asyncio.wait_for(asyncio.gather(started[0].wait(), started[1].wait()), 20)
        with_ka.frozen.set()
        without_ka.frozen.set()
        t0 = time.monotonic()
        code = await asyncio.wait_for(watched, DETECT_WITHIN_S + 10)  # a hang guard, not the bound
        seen_after = time.monotonic() - t0
        assert code == grpc.StatusCode.UNAVAILABLE
        # Ordering, not a clock: the stream with keepalive ended while the one without still waits, and still
        # waits as long again after that.
        assert not control.done(), "without keepalive the stream should still be waiting on the silent peer"
        await asyncio.sleep(seen_after)
        assert not control.done(), "without keepalive the stream should still be waiting on the silent peer"
    finally:
        control.cancel()
        watched.cancel()
        await mesh_channel.close(None)
        await bare_channel.close(None)
        await with_ka.close()
        await without_ka.close()
