"""Fixtures for the edge: a FakeChat over real gRPC and mutual TLS on an ephemeral port (checking each call's
owner token), and gateways (real uvicorn servers on ephemeral ports, in this event loop, as spiffe://chatmesh/
gateway minting owner tokens) in front of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any
from dataclasses import dataclass

import httpx
import pytest

from starlette.applications import Starlette

from chatmesh.gateway.app import create_app, server_for
from chatmesh.mesh.config import Config
from tests.conftest import free_port
from tests.gateway.fake_chat import FakeChat, start_fake_chat
from tests.gateway.openai_client import make_key
from tests.trust import gateway_env


@dataclass
class Gateway:
    url: str
    task: asyncio.Task[None]
    stop: Callable[[], Coroutine[Any, Any, None]]
    app: Starlette

    def client(self, **kwargs: object) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=10.0, **kwargs)  # type: ignore[arg-type]


StartGateway = Callable[..., Awaitable[Gateway]]



async def until_listening(client: httpx.AsyncClient, tries: int = 100) -> None:
    """Waits (at most ~5 s) until a gateway started in the test answers /healthz on `client`'s base URL."""
    for _ in range(tries):
        try:
            await client.get("/healthz")
            return
        except httpx.ConnectError:
            await asyncio.sleep(0.05)

@pytest.fixture
async def fake_chat(mesh_certs: Path) -> AsyncIterator[tuple[FakeChat, str]]:
    """The fake ChatService over mutual TLS, checking every call's owner token as chat does."""
    port = free_port()
    server, fake = await start_fake_chat(port, mesh_certs)
    yield fake, f"127.0.0.1:{port}"
    await server.stop(0)


@pytest.fixture
async def start_gateway(fake_chat: tuple[FakeChat, str], tmp_path: object, mesh_certs: Path
                        ) -> AsyncIterator[StartGateway]:
    started: list[Gateway] = []

    async def start(scheme: str = "http", **env: str) -> Gateway:
        port = free_port()
        values = {**gateway_env(mesh_certs), "CHATMESH_CHAT_ADDRESS": fake_chat[1],
                  "CHATMESH_DATA_DIR": str(tmp_path),
                  "CHATMESH_SHUTDOWN_GRACE_S": "1", **env}
        cfg = Config(env=values)
        app = create_app(cfg)
        server = server_for(cfg, app, port=port)
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("gateway did not start")
            await asyncio.sleep(0.02)

        async def stop() -> None:
            server.should_exit = True
            await asyncio.wait_for(task, 10)

        gw = Gateway(f"{scheme}://127.0.0.1:{port}", task, stop, app)
        started.append(gw)
        return gw

    yield start
    for gw in started:
        if not gw.task.done():
            await gw.stop()


@pytest.fixture
async def gateway(start_gateway: StartGateway) -> Gateway:
    return await start_gateway()


@pytest.fixture
def fake(fake_chat: tuple[FakeChat, str]) -> FakeChat:
    return fake_chat[0]


@pytest.fixture
async def key(tmp_path: Path) -> str:
    """An API key of the user alice, made in the tables of the gateways this test starts (same data folder)."""
    return await make_key(tmp_path, "alice")


def http(gateway: Gateway, key: str) -> httpx.AsyncClient:
    """A client of `gateway` presenting `key` as its bearer token."""
    return gateway.client(headers={"authorization": f"Bearer {key}"})
