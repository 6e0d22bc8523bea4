"""Per-user limits: token buckets in memory (a fake clock), the Redis scripts, 429 with Retry-After at the edge,
and two gateway PROCESSES sharing one user's budget through real Redis while another user is unaffected."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from chatmesh.gateway.accounts import Accounts
from chatmesh.gateway.cli import accounts_for
from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.limits import Budget, LimitBackend, MemoryLimits
from chatmesh.gateway.redis_limits import RedisLimits
from chatmesh.mesh import ids
from chatmesh.mesh.config import Config
from tests.conftest import free_port
from tests.gateway.conftest import StartGateway
from tests.gateway.fake_chat import FakeChat
from tests.gateway.sse_client import collect, frames

A, B = ids.OwnerId("owner-a"), ids.OwnerId("owner-b")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def refused(coro: object) -> ApiError:
    with pytest.raises(ApiError) as info:
        await coro  # type: ignore[misc]
    assert info.value.status == 429
    return info.value


async def test_memory_turn_bucket_refills_continuously() -> None:
    clock = Clock()
    limits = MemoryLimits(Budget(turns_per_minute=3, open_streams=2, prompt_tokens_per_hour=100), clock)
    for _ in range(3):
        await limits.admit_turn(A)
    err = await refused(limits.admit_turn(A))
    assert err.retry_after_s == pytest.approx(20.0)
    await limits.admit_turn(B)  # another owner has its own bucket
    clock.now += 20.0
    await limits.admit_turn(A)
    await refused(limits.admit_turn(A))


async def test_memory_prompt_tokens_are_charged_after_the_turn() -> None:
    clock = Clock()
    limits = MemoryLimits(Budget(turns_per_minute=100, open_streams=2, prompt_tokens_per_hour=3600), clock)
    await limits.admit_turn(A)
    await limits.charge_prompt_tokens(A, 3610)  # a big prompt takes the bucket below zero
    err = await refused(limits.admit_turn(A))
    assert "prompt tokens" in err.message
    assert err.retry_after_s == pytest.approx(11.0)
    clock.now += 11.0
    await limits.admit_turn(A)


async def test_memory_open_streams_are_leases() -> None:
    limits = MemoryLimits(Budget(turns_per_minute=100, open_streams=2, prompt_tokens_per_hour=100))
    first, second = await limits.open_stream(A), await limits.open_stream(A)
    await refused(limits.open_stream(A))
    await limits.open_stream(B)
    await first.release()
    await first.release()  # idempotent
    third = await limits.open_stream(A)
    await refused(limits.open_stream(A))
    await second.release()
    await third.release()


@pytest.fixture
async def redis_limits(redis_url: str) -> AsyncIterator[RedisLimits]:
    limits = RedisLimits(redis_url, Budget(turns_per_minute=3, open_streams=2, prompt_tokens_per_hour=3600),
                         prefix=f"test:{uuid.uuid4().hex}:")
    yield limits
    await limits.close()


async def test_redis_scripts_enforce_the_same_buckets(redis_limits: RedisLimits) -> None:
    for _ in range(3):
        await redis_limits.admit_turn(A)
    err = await refused(redis_limits.admit_turn(A))
    assert 0 < (err.retry_after_s or 0) <= 20.0
    await redis_limits.admit_turn(B)
    await redis_limits.charge_prompt_tokens(B, 5000)
    assert "prompt tokens" in (await refused(redis_limits.admit_turn(B))).message
    leases = [await redis_limits.open_stream(A), await redis_limits.open_stream(A)]
    await refused(redis_limits.open_stream(A))
    await leases[0].release()
    leases.append(await redis_limits.open_stream(A))
    for lease in leases:
        await lease.release()


async def test_edge_answers_429_with_retry_after(start_gateway: StartGateway) -> None:
    gw = await start_gateway(CHATMESH_LIMIT_TURNS_PER_MINUTE="2")
    async with gw.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        for _ in range(2):
            async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                     json={"turn_id": str(uuid.uuid4()), "content": "x"}) as r:
                assert r.status_code == 200
                await collect(r)
        third = await client.post(f"/v1/conversations/{conv}/turns",
                                  json={"turn_id": str(uuid.uuid4()), "content": "x"})
    assert third.status_code == 429
    assert third.json()["error"]["code"] == "rate_limited"
    assert 1 <= int(third.headers["retry-after"]) <= 30


@contextlib.contextmanager
def gateway_process(env: dict[str, str], log: Path) -> Iterator[str]:
    port = free_port()
    full = {**os.environ, **env, "CHATMESH_GATEWAY_PORT": str(port), "CHATMESH_HOST": "127.0.0.1",
            "CHATMESH_GATEWAY_METRICS_PORT": "0"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "chatmesh.mesh.cli", "serve", "gateway"], env=full,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_healthy(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as client:
        for _ in range(300):
            with contextlib.suppress(httpx.TransportError):
                if (await client.get("/healthz")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise AssertionError(f"gateway at {url} did not become healthy")


async def open_stream(client: httpx.AsyncClient, conv: str, stack: contextlib.AsyncExitStack) -> int:
    r = await stack.enter_async_context(client.stream(
        "POST", f"/v1/conversations/{conv}/turns", json={"turn_id": str(uuid.uuid4()), "content": "x"}))
    if r.status_code == 200:
        reader = aiter(frames(r))
        assert isinstance(reader, AsyncGenerator)
        # Keep the reader referenced until the stack closes: a dropped async generator is finalised, which
        # closes the HTTP stream, and the gateway rightly frees the slot of a disconnected client.
        stack.push_async_callback(reader.aclose)
        async for frame in reader:
            if frame.event == "turn.started":
                break
    return r.status_code


@pytest.mark.slow
async def test_two_gateway_processes_share_one_users_limits(
        redis_url: str, fake_chat: tuple[FakeChat, str], tmp_path: Path) -> None:
    fake, chat_address = fake_chat
    accounts: Accounts = accounts_for(Config(env={"CHATMESH_DATA_DIR": str(tmp_path)}))
    await accounts.create_tables()
    for name in ("a", "b"):
        await accounts.create_user(name)
    key_a, key_b = await accounts.create_key("a"), await accounts.create_key("b")
    await accounts.close()
    env = {"CHATMESH_MESH_PLAINTEXT": "true", "CHATMESH_CHAT_ADDRESS": chat_address,
           "CHATMESH_DATA_DIR": str(tmp_path), "CHATMESH_AUTH": "required",
           "CHATMESH_REDIS_URL": redis_url, "CHATMESH_LIMIT_TURNS_PER_MINUTE": "4",
           "CHATMESH_LIMIT_OPEN_STREAMS": "2", "CHATMESH_LOG_JSON": "true"}
    with gateway_process(env, tmp_path / "gw1.log") as url1, gateway_process(env, tmp_path / "gw2.log") as url2:
        await asyncio.gather(wait_healthy(url1), wait_healthy(url2))
        a1 = httpx.AsyncClient(base_url=url1, headers={"authorization": f"Bearer {key_a}"}, timeout=10)
        a2 = httpx.AsyncClient(base_url=url2, headers={"authorization": f"Bearer {key_a}"}, timeout=10)
        b2 = httpx.AsyncClient(base_url=url2, headers={"authorization": f"Bearer {key_b}"}, timeout=10)
        async with a1, a2, b2:
            conv_a = (await a1.post("/v1/conversations")).json()["id"]
            conv_b = (await b2.post("/v1/conversations")).json()["id"]
            fake.delay_s, fake.chunks = 0.3, ["x"] * 200
            async with contextlib.AsyncExitStack() as held:
                assert await open_stream(a1, conv_a, held) == 200
                assert await open_stream(a2, conv_a, held) == 200
                third = [await open_stream(a1, conv_a, held), await open_stream(a2, conv_a, held)]
                assert await open_stream(b2, conv_b, held) == 200  # B is unaffected
            assert third == [429, 429]
            fake.delay_s, fake.chunks = 0.0, ["y"]
            statuses = []
            for client in (a1, a2, a1, a2):  # the two held streams took 2 of A's 4 turns
                for _ in range(50):  # the held streams' leases are released as their relays end
                    r = await client.post(f"/v1/conversations/{conv_a}/turns",
                                          json={"turn_id": str(uuid.uuid4()), "content": "x"})
                    if r.status_code != 429 or "open streams" not in r.text:
                        break
                    await asyncio.sleep(0.1)
                statuses.append(r.status_code)
            b_again = await b2.post(f"/v1/conversations/{conv_b}/turns",
                                    json={"turn_id": str(uuid.uuid4()), "content": "x"})
    assert statuses == [200, 200, 429, 429]
    assert b_again.status_code == 200
    for log in ("gw1.log", "gw2.log"):
        assert "Traceback" not in (tmp_path / log).read_text()
