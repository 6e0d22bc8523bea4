"""The gateway's channel to ChatService over several chat addresses: calls are spread round robin, a chat
process that goes away stops receiving them without failing any, and one that comes back receives them again
within a couple of seconds (the channel's reconnect backoff is capped at one second)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from chatmesh.v1 import chat_pb2
from tests.conftest import free_port
from tests.gateway.conftest import StartGateway
from tests.gateway.fake_chat import Ctx, FakeChat, start_fake_chat


class CountingChat(FakeChat):
    def __init__(self) -> None:
        super().__init__()
        self.lists = 0

    async def ListConversations(self, request: chat_pb2.ListConversationsRequest,
                                context: Ctx) -> chat_pb2.ListConversationsResponse:
        self.lists += 1
        return await super().ListConversations(request, context)


async def _serve(port: int, certs: Path) -> tuple[grpc.aio.Server, CountingChat]:
    server, _ = await start_fake_chat(port, certs, chat := CountingChat())
    return server, chat


async def test_turns_spread_over_chat_addresses_and_fail_over(start_gateway: StartGateway, mesh_certs: Path
                                                               ) -> None:
    ports = [free_port(), free_port()]
    servers = [await _serve(p, mesh_certs) for p in ports]
    gw = await start_gateway(CHATMESH_CHAT_ADDRESSES=",".join(f"127.0.0.1:{p}" for p in ports))
    try:
        async with gw.client() as http:
            for _ in range(40):
                assert (await http.get("/v1/conversations")).status_code == 200
            counts = [chat.lists for _, chat in servers]
            assert sum(counts) == 40 and min(counts) >= 10, f"calls not spread over both addresses: {counts}"

            await servers[1][0].stop(0)  # one chat process goes away: no call fails, the other takes them all
            before = servers[0][1].lists
            for _ in range(20):
                assert (await http.get("/v1/conversations")).status_code == 200
            assert servers[0][1].lists - before == 20

            servers[1] = await _serve(ports[1], mesh_certs)  # it comes back on its address
            for _ in range(60):  # 3 s of pauses on an idle machine, longer on a loaded one: a count, not a clock
                if servers[1][1].lists:
                    break
                assert (await http.get("/v1/conversations")).status_code == 200
                await asyncio.sleep(0.05)
            assert servers[1][1].lists, "a chat process that came back got no call in 60 calls"
    finally:
        for server, _ in servers:
            await server.stop(0)
