"""Prompt-token limits on the real mesh (issue 17's denial-of-wallet findings; chatmesh.gateway.metering): two
gateway processes on one real Redis (127.0.0.1:6379) in front of real chat, store, moderation, router and the
`sim` engine. What a turn costs is what the store bills (GET /v1/usage), not what the gateway believes.

- A client that goes away after the first delta is charged its prompt: with a budget of about 2.5 prompts, a
  disconnected turn and a completed one leave too little for a third (which is refused 429 with Retry-After).
  Before the fix the disconnect cost nothing and the third ran.
- N concurrent turns, spread over both gateways, against a budget of B tokens: the store bills at most B (issue
  17: four concurrent turns spent 27 times a 600-token budget; issue 30: B plus one prompt while chat ignored
  prompt_token_allowance, which it now enforces after rendering).
- The gateway tests that relied on tests/gateway/fake_chat.py's enforcement of the allowance, against the real
  chat: a retry that replays is not charged again; a prompt larger than the whole budget is 400 (chat refused it
  before any engine work: nothing billed, nothing stored)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from chatmesh.gateway.cli import accounts_for
from chatmesh.mesh.config import Config
from chatmesh.mesh.up import Mesh, http_answers
from tests.conftest import REDIS_URL, free_port, need, port_open
from tests.e2e.conftest import mesh_env

pytestmark = pytest.mark.slow

MESSAGE = " ".join(f"line {i}: the shipment for warehouse {i * 7} was counted twice." for i in range(80))
USERS = ("calibrate", "disconnects", "concurrent", "replays", "oversized")


@dataclass
class LimitMesh:
    mesh: Mesh
    urls: list[str]
    keys: dict[str, str]
    budget: int
    prompt: int  # one turn's prompt tokens, as the store billed the calibration turn

    def client(self, user: str, gateway: int = 0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.urls[gateway], timeout=60,
                                 headers={"authorization": f"Bearer {self.keys[user]}"})


async def _make_users(env: dict[str, str]) -> dict[str, str]:
    accounts = accounts_for(Config(env=env))
    try:
        await accounts.create_tables()
        keys = {}
        for user in USERS:
            await accounts.create_user(user)
            keys[user] = await accounts.create_key(user)
        return keys
    finally:
        await accounts.close()


async def turn(client: httpx.AsyncClient, *, disconnect_after_delta: bool = False, content: str = MESSAGE,
               conv: str | None = None, turn_id: str | None = None) -> tuple[int, httpx.Headers]:
    """One turn, by default in a new conversation (so every prompt is the same size)."""
    conv = conv or (await client.post("/v1/conversations", json={})).json()["id"]
    async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                             json={"turn_id": turn_id or str(uuid.uuid4()), "content": content}) as r:
        if r.status_code == 200:
            async for line in r.aiter_lines():
                if disconnect_after_delta and line == "event: turn.delta":
                    break
        else:
            await r.aread()
        return r.status_code, r.headers


async def billed(client: httpx.AsyncClient) -> tuple[int, int]:
    """(turns, prompt tokens) the store billed this user, today."""
    days = (await client.get("/v1/usage", params={"days": 1})).json()["days"]
    return sum(d["turns"] for d in days), sum(d["usage"]["prompt_tokens"] for d in days)


async def _calibrate(urls: list[str], key: str) -> int:
    async with httpx.AsyncClient(base_url=urls[0], timeout=60, headers={"authorization": f"Bearer {key}"}) as c:
        status, _ = await turn(c)
        assert status == 200
        turns, tokens = await billed(c)
    assert turns == 1 and tokens > 500
    return tokens


@pytest.fixture(scope="module")
def limits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LimitMesh]:
    need(port_open("127.0.0.1", 6379), "Redis at 127.0.0.1:6379")
    tmp = tmp_path_factory.mktemp("limits")
    # The budget is set before the mesh starts, at about 2.5 prompts: MESSAGE is 1,333 tokens, the prompt
    # (system prompt and chat template around it) a little more. The calibration user's turn measures the real
    # prompt P, and the fixture checks that the budget lies between 2 P and 3 P, as the tests need.
    budget = 3500
    env = mesh_env(tmp / "data", CHATMESH_AUTH="required", CHATMESH_REDIS_URL=REDIS_URL,
                   CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR=str(budget), CHATMESH_LIMIT_OPEN_STREAMS="20",
                   CHATMESH_LIMIT_TURNS_PER_MINUTE="100", CHATMESH_SIM_STEP_MS="20")
    keys = asyncio.run(_make_users(env))
    mesh = Mesh(env=env, log_dir=tmp / "logs", start_timeout_s=180)
    mesh.start()
    port = free_port()
    with (tmp / "logs" / "gateway-2.log").open("ab") as log:
        second = subprocess.Popen(
            [sys.executable, "-m", "chatmesh.mesh.cli", "serve", "gateway"], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **mesh.env, "CHATMESH_GATEWAY_PORT": str(port), "CHATMESH_GATEWAY_METRICS_PORT": "0",
                 "CHATMESH_OWNER_TOKEN_ADDRESS": ""}, stdin=subprocess.DEVNULL)
    try:
        urls = [mesh.gateway_url, f"http://127.0.0.1:{port}"]
        for _ in range(600):
            if http_answers(urls[1] + "/healthz"):
                break
            assert second.poll() is None, (tmp / "logs" / "gateway-2.log").read_text()[-2000:]
            asyncio.run(asyncio.sleep(0.1))
        prompt = asyncio.run(_calibrate(urls, keys["calibrate"]))
        assert 2 * prompt < budget < 3 * prompt, prompt  # the tests below need B between 2 and 3 prompts
        yield LimitMesh(mesh, urls, keys, budget, prompt)
    finally:
        second.terminate()
        try:
            second.wait(10)
        except subprocess.TimeoutExpired:
            second.kill()
            second.wait()
        mesh.stop()


async def test_a_disconnect_after_the_first_delta_is_charged_its_prompt(limits: LimitMesh) -> None:
    async with limits.client("disconnects", 0) as one, limits.client("disconnects", 1) as two:
        assert (await turn(one, disconnect_after_delta=True))[0] == 200
        for _ in range(100):  # chat ends the disconnected turn (stored as stopped, or run to its end)
            if (await billed(one))[0] == 1:
                break
            await asyncio.sleep(0.1)
        first = await billed(one)
        second = await turn(two)  # on the other gateway: both see the disconnect's charge through Redis
        third = await turn(one)
        turns, tokens = await billed(one)
    statuses = [second[0], third[0]]
    # The disconnected turn is charged its prompt, the size turn.started reported before the engine ran (chat
    # sends it; charged its whole reservation, here the budget, neither turn below would run): the edge's log of
    # the ended stream says what it was told and kept, ids and counts only.
    ended = [json.loads(line) for line in (limits.mesh.log_dir / "gateway.log").read_text().splitlines()
             if '"turn_stream_ended"' in line]
    disconnected = [e for e in ended if e.get("outcome") == "disconnected"]
    assert len(disconnected) == 1 and disconnected[0]["started_prompt_tokens"] == limits.prompt, disconnected
    assert statuses.count(200) >= 1, statuses
    assert all(1 <= int(h["retry-after"]) <= 3600 for status, h in (second, third) if status == 429)
    assert first in ((1, limits.prompt), (0, 0))  # if the store bills a disconnect, it bills the whole prompt
    assert (turns, tokens) == (first[0] + statuses.count(200), first[1] + limits.prompt * statuses.count(200))
    # the edge's bound: B (a turn admitted with less left than its prompt is refused by chat before it runs)
    assert tokens <= limits.budget


async def test_concurrent_turns_on_two_gateways_spend_at_most_the_budget(limits: LimitMesh) -> None:
    """Four at once, each reserving all the budget has left (up to the largest prompt): whichever admissions find
    too little for their prompt are refused by chat, so the store bills at most B."""
    n = 4
    clients = [limits.client("concurrent", i % 2) for i in range(n)]
    try:
        results = await asyncio.gather(*(turn(c) for c in clients))
        await asyncio.sleep(0.5)
        turns, tokens = await billed(clients[0])
    finally:
        for c in clients:
            await c.aclose()
    statuses = [status for status, _ in results]
    assert statuses.count(200) >= 1 and statuses.count(429) >= n - 2, statuses
    assert all("retry-after" in headers for status, headers in results if status == 429)
    assert turns == statuses.count(200)
    assert tokens <= limits.budget, (tokens, limits.budget, limits.prompt)
    assert tokens == limits.prompt * turns


async def test_a_retry_that_replays_is_not_charged_again(limits: LimitMesh) -> None:
    async with limits.client("replays", 0) as one, limits.client("replays", 1) as two:
        conv = (await one.post("/v1/conversations", json={})).json()["id"]
        turn_id = str(uuid.uuid4())
        assert (await turn(one, conv=conv, turn_id=turn_id))[0] == 200
        assert (await turn(two, conv=conv, turn_id=turn_id))[0] == 200  # the stored reply, streamed again
        assert await billed(one) == (1, limits.prompt)
        # what the replay reserved went back: the next turn finds budget minus one prompt (enough for one more)
        assert (await turn(one))[0] == 200
        assert (await billed(one))[1] == 2 * limits.prompt


async def test_a_prompt_larger_than_the_whole_budget_is_refused_by_chat_and_answered_400(limits: LimitMesh) -> None:
    async with limits.client("oversized", 0) as client:
        status, _ = await turn(client, content=f"{MESSAGE}\n{MESSAGE}\n{MESSAGE}")
        assert status == 400
        assert await billed(client) == (0, 0)
        conversations = (await client.get("/v1/conversations")).json()["conversations"]
        messages = (await client.get(f"/v1/conversations/{conversations[0]['id']}")).json()["messages"]
        assert messages == []
        assert (await turn(client))[0] == 200  # the refused turn's reservation went back
