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
import redis.asyncio as aioredis

from chatmesh.gateway.accounts import Accounts
from chatmesh.gateway.cli import accounts_for
from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.limits import Budget, LimitBackend, MemoryLimits, Reservation
from chatmesh.gateway.redis_limits import RedisLimits
from chatmesh.mesh import ids
from chatmesh.mesh.config import Config
from tests.conftest import free_port
from tests.gateway.conftest import StartGateway
from tests.trust import gateway_env
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


ROOM = 7936  # the largest prompt the default model takes: a turn's reservation cap


async def test_memory_turn_bucket_refills_continuously() -> None:
    clock = Clock()
    limits = MemoryLimits(Budget(turns_per_minute=3, open_streams=2, prompt_tokens_per_hour=100), clock)
    for _ in range(3):
        await limits.settle(await limits.admit_turn(A, 1), 0)
    err = await refused(limits.admit_turn(A, 1))
    assert err.retry_after_s == pytest.approx(20.0)
    await limits.admit_turn(B, 1)  # another owner has its own bucket
    clock.now += 20.0
    await limits.admit_turn(A, 1)
    await refused(limits.admit_turn(A, 1))


async def test_memory_prompt_tokens_are_reserved_before_and_settled_after() -> None:
    clock = Clock()
    limits = MemoryLimits(Budget(turns_per_minute=100, open_streams=2, prompt_tokens_per_hour=3600), clock)
    first = await limits.admit_turn(A, 1000)
    assert first.held == 1000  # up to the cap
    second = await limits.admit_turn(A, 5000)
    assert second.held == 2600  # all that is left
    err = await refused(limits.admit_turn(A, 10))  # nothing left while both are held
    assert "prompt tokens per hour" in err.message and err.retry_after_s == pytest.approx(1.0)
    await limits.settle(first, 400)  # the true count: 600 back
    await limits.settle(second, 2600)
    third = await limits.admit_turn(A, 5000)
    assert third.held == 600
    await limits.settle(third, 1200)  # a turn may owe more than it held: the bucket goes below zero
    err = await refused(limits.admit_turn(A, 10))
    assert err.retry_after_s == pytest.approx(601.0)
    clock.now += 601.0
    assert (await limits.admit_turn(A, 10)).held == 1


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
        await redis_limits.admit_turn(A, 1)
    err = await refused(redis_limits.admit_turn(A, 1))
    assert 0 < (err.retry_after_s or 0) <= 20.0
    held = await redis_limits.admit_turn(B, 5000)
    assert held.held == 3600
    assert "prompt tokens" in (await refused(redis_limits.admit_turn(B, 1))).message
    await redis_limits.settle(held, 3000)
    assert (await redis_limits.admit_turn(B, 5000)).held == 600
    leases = [await redis_limits.open_stream(A), await redis_limits.open_stream(A)]
    await refused(redis_limits.open_stream(A))
    await leases[0].release()
    leases.append(await redis_limits.open_stream(A))
    for lease in leases:
        await lease.release()


async def test_a_connection_redis_dropped_is_reconnected_not_refused(redis_limits: RedisLimits,
                                                                     redis_url: str) -> None:
    """A restarted Redis leaves every pooled connection dead: the next check reconnects instead of answering 503
    (bench/faults saw one such 503 after a Redis restart)."""
    await redis_limits.admit_turn(A, 1)
    own = await redis_limits.redis.client_id()  # the pooled connection the next check takes
    admin = aioredis.Redis.from_url(redis_url)
    try:
        assert await admin.client_kill_filter(_id=str(own)) == 1
    finally:
        await admin.aclose()
    assert (await redis_limits.admit_turn(A, 1)).held == 1
    assert own != await redis_limits.redis.client_id()  # a new connection served it


async def test_redis_reservations_of_two_gateways_never_exceed_the_budget(redis_url: str) -> None:
    prefix = f"test:{uuid.uuid4().hex}:"
    budget = Budget(turns_per_minute=1000, open_streams=100, prompt_tokens_per_hour=10_000)
    gateways = [RedisLimits(redis_url, budget, prefix=prefix) for _ in range(2)]
    try:
        async def admit(limits: RedisLimits) -> int:
            try:
                return (await limits.admit_turn(A, 700)).held
            except ApiError:
                return 0

        held = await asyncio.gather(*(admit(gateways[i % 2]) for i in range(40)))
    finally:
        for limits in gateways:
            await limits.close()
    assert sum(held) <= 10_000 + 10  # plus the refill while they ran (2.8 tokens a second)
    assert sum(1 for h in held if h == 700) == 14 and held.count(0) >= 24


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


async def send(client: httpx.AsyncClient, conv: str, turn: str | None = None, *, disconnect_after_delta: bool = False
               ) -> httpx.Response:
    """One turn; with `disconnect_after_delta` the client goes away after the first delta."""
    body = {"turn_id": turn or str(uuid.uuid4()), "content": "x"}
    async with client.stream("POST", f"/v1/conversations/{conv}/turns", json=body) as r:
        if r.status_code == 200:
            async for frame in frames(r):
                if frame.event == "turn.delta" and disconnect_after_delta:
                    break
        else:
            await r.aread()
    return r


async def test_a_disconnect_after_the_first_delta_is_charged_its_prompt(start_gateway: StartGateway,
                                                                        fake: FakeChat) -> None:
    gw = await start_gateway(CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR="1200")
    fake.prompt_tokens, fake.delay_s, fake.chunks = 500, 0.2, ["x"] * 20
    async with gw.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        assert (await send(client, conv, disconnect_after_delta=True)).status_code == 200
        fake.delay_s = 0.0
        assert (await send(client, conv)).status_code == 200
        third = await send(client, conv)
    assert fake.allowances == [1200, 700, 200]  # what was left at each admission: the disconnect paid 500
    assert third.status_code == 429
    assert third.json()["error"]["message"] == ("limit reached: prompt tokens per hour (the prompt is 500 tokens; "
                                                "200 are left)")
    assert int(third.headers["retry-after"]) == 900  # 300 more tokens at 1,200 an hour


async def test_without_a_reported_prompt_size_a_disconnect_keeps_its_whole_reservation(
        start_gateway: StartGateway, fake: FakeChat, monkeypatch: pytest.MonkeyPatch) -> None:
    settled: list[int] = []  # what each settlement of a reservation charged, once it is done
    settle = MemoryLimits.settle

    async def recorded(limits: MemoryLimits, reservation: Reservation, used: int) -> None:
        await settle(limits, reservation, used)
        settled.append(used)

    monkeypatch.setattr(MemoryLimits, "settle", recorded)
    gw = await start_gateway(CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR="3000")
    fake.prompt_tokens, fake.delay_s, fake.chunks = 500, 0.2, ["x"] * 20
    fake.report_prompt_tokens = False
    async with gw.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        await send(client, conv, disconnect_after_delta=True)
        for _ in range(500):  # the gateway settles the disconnected turn after its client has gone
            if settled:
                break
            await asyncio.sleep(0.01)
        assert settled == [3000]  # no size from turn.started: the disconnect is charged the whole reservation
        fake.delay_s = 0.0
        refused_turn = await send(client, conv)
    assert fake.allowances == [3000]
    assert refused_turn.status_code == 429 and "prompt tokens per hour" in refused_turn.text


@pytest.mark.parametrize("chat_honours_allowance", [True, False])
async def test_concurrent_turns_cannot_together_spend_more_than_the_budget(
        start_gateway: StartGateway, fake: FakeChat, chat_honours_allowance: bool) -> None:
    budget, prompt = 1000, 300
    gw = await start_gateway(CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR=str(budget), CHATMESH_LIMIT_OPEN_STREAMS="20",
                             CHATMESH_LIMIT_TURNS_PER_MINUTE="100")
    fake.prompt_tokens, fake.delay_s, fake.chunks = prompt, 0.05, ["x"] * 4
    if not chat_honours_allowance:  # a chat that ignores the allowance: the bound is B plus one turn
        fake.prompt_tokens = 0

        original = fake._generate  # noqa: SLF001

        async def generate(conv: object, turn: object, context: object) -> object:
            fake.billed += prompt
            async for ev in original(conv, turn, context):  # type: ignore[arg-type]
                yield ev

        fake._generate = generate  # type: ignore[assignment,method-assign]  # noqa: SLF001
    async with gw.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        results = await asyncio.gather(*(send(client, conv) for _ in range(10)))
    ok = sum(1 for r in results if r.status_code == 200)
    assert all(r.status_code in (200, 429) for r in results)
    assert all("retry-after" in r.headers for r in results if r.status_code == 429)
    assert ok >= 1
    assert fake.billed <= budget + (0 if chat_honours_allowance else prompt)


async def test_two_gateways_on_redis_share_one_reservation_budget(
        start_gateway: StartGateway, fake: FakeChat, redis_url: str) -> None:
    env = {"CHATMESH_REDIS_URL": redis_url, "CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR": "1000",
           "CHATMESH_LIMIT_OPEN_STREAMS": "20", "CHATMESH_LIMIT_TURNS_PER_MINUTE": "100",
           "CHATMESH_LOCAL_USER": f"redis-user-{uuid.uuid4().hex[:8]}"}
    gateways = [await start_gateway(**env), await start_gateway(**env)]
    fake.prompt_tokens, fake.delay_s, fake.chunks = 300, 0.05, ["x"] * 4
    clients = [gw.client() for gw in gateways]
    try:
        conv = (await clients[0].post("/v1/conversations")).json()["id"]
        results = await asyncio.gather(*(send(clients[i % 2], conv) for i in range(12)))
        concurrent_billed = fake.billed
        sequential = [(await send(clients[i % 2], conv)).status_code for i in range(4)]
    finally:
        for client in clients:
            await client.aclose()
    assert sum(1 for r in results if r.status_code == 200) >= 1
    assert concurrent_billed <= 1000
    # each admission sees what the other gateway's turns left: 300 tokens a turn until under 300 remain
    assert fake.billed <= 1000 and sequential.count(429) >= 1
    assert fake.billed == 300 * (sum(1 for r in results if r.status_code == 200) + sequential.count(200))
    assert fake.allowances[-1] == 1000 - fake.billed


async def test_a_retry_that_replays_is_not_charged_again(start_gateway: StartGateway, fake: FakeChat) -> None:
    gw = await start_gateway(CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR="1000")
    fake.prompt_tokens = 600
    turn = str(uuid.uuid4())
    async with gw.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        assert (await send(client, conv, turn)).status_code == 200
        assert (await send(client, conv, turn)).status_code == 200  # the retry replays the stored reply
        again = await send(client, conv)
    assert fake.allowances == [1000, 400]
    assert again.status_code == 429 and "400 are left" in again.json()["error"]["message"]


async def test_a_prompt_larger_than_the_whole_budget_is_400(start_gateway: StartGateway, fake: FakeChat) -> None:
    gw = await start_gateway(CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR="100")
    fake.prompt_tokens = 150
    async with gw.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        r = await send(client, conv)
        after = await send(client, conv)
    assert r.status_code == 400 and "more than the whole prompt-token budget of 100" in r.text
    assert after.status_code == 400  # the refused turn's reservation went back
    assert fake.allowances == [100, 100]


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
        redis_url: str, fake_chat: tuple[FakeChat, str], tmp_path: Path, mesh_certs: Path) -> None:
    fake, chat_address = fake_chat
    accounts: Accounts = accounts_for(Config(env={"CHATMESH_DATA_DIR": str(tmp_path)}))
    await accounts.create_tables()
    for name in ("a", "b"):
        await accounts.create_user(name)
    key_a, key_b = await accounts.create_key("a"), await accounts.create_key("b")
    await accounts.close()
    env = {**gateway_env(mesh_certs), "CHATMESH_CHAT_ADDRESS": chat_address,
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
