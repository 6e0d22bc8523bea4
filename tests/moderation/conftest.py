"""A ModerateService on an ephemeral loopback port, run in the test's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import grpc
import pytest

from chatmesh.mesh.config import Config
from chatmesh.mesh.trust import Trust
from chatmesh.mesh.server import serve
from chatmesh.moderation.moderator import Moderator
from chatmesh.moderation.service import build
from tests.conftest import free_port


@asynccontextmanager
async def running(env: Mapping[str, str] | None = None, moderator: Moderator | None = None,
                  address: str = "") -> AsyncIterator[str]:
    """Serves ModerateService built from `env` (and `moderator`) at `address` (default: a free port); yields its
    address; stops it on exit."""
    address = address or f"127.0.0.1:{free_port()}"
    ready, stop = asyncio.Event(), asyncio.Event()
    # A generous check deadline unless the test is about deadlines: a loaded CI machine must not turn a slow
    # scheduler into fallback verdicts.
    service = build(Config(env={"CHATMESH_MODERATION_CHECK_DEADLINE_MS": "10000", **(env or {})}), moderator)
    task = asyncio.create_task(serve(service, address, 1.0, ready=ready, stop=stop, trust=Trust.insecure()))
    await asyncio.wait_for(ready.wait(), 30)
    try:
        yield address
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)




@pytest.fixture
async def address() -> AsyncIterator[str]:
    async with running() as addr:
        yield addr


@pytest.fixture
async def channel(address: str) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(address) as ch:
        yield ch
