"""The official `openai` SDK pointed at a test gateway: keys made in the gateway's own tables, and a TCP proxy that
drops a connection after forwarding its request (the server going away before it answers)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import openai

from chatmesh.gateway.cli import accounts_for
from chatmesh.mesh.config import Config

MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the default model profile's id (CHATMESH_MODEL=smollm2)


async def make_key(data_dir: Path, name: str, *, frontend: bool = False) -> str:
    accounts = accounts_for(Config(env={"CHATMESH_DATA_DIR": str(data_dir)}))
    try:
        await accounts.create_tables()
        if await accounts.user_named(name) is None:
            await accounts.create_user(name)
        return await accounts.create_key(name, frontend=frontend)
    finally:
        await accounts.close()


def sdk(url: str, key: str, *, max_retries: int = 0, timeout: float = 20.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/openai/v1", api_key=key, max_retries=max_retries, timeout=timeout)


class DroppingProxy:
    """Forwards TCP connections to `target`; the first `drop` connections are closed towards the client as soon
    as the server has their request (the server keeps working on it), later ones pass through."""

    def __init__(self, target_port: int, drop: int = 1):
        self.target_port = target_port
        self.drop = drop
        self.connections = 0
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        dropping = self.connections <= self.drop
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, stop_after_first: bool) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
                    if stop_after_first:
                        await asyncio.sleep(0.2)  # the whole request is in
                        return

        if dropping:
            await pipe(reader, up_writer, True)
            writer.close()  # the client's connection goes away without an answer; the server's stays open
            task = asyncio.create_task(self._drain(up_reader, up_writer))  # the server's side stays open
            self._tasks.add(task)
            return
        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, False))
        writer.close()
        up_writer.close()

    @staticmethod
    async def _drain(up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while await up_reader.read(65536):
                pass
        up_writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def dropping_proxy(target_port: int, drop: int = 1) -> AsyncIterator[tuple[DroppingProxy, int]]:
    proxy = DroppingProxy(target_port, drop)
    port = await proxy.start()
    try:
        yield proxy, port
    finally:
        await proxy.close()
