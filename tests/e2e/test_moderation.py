"""Moderation through the whole mesh: blocked input never reaches an engine, and with the moderation service down
the configured failure policy decides and the turn's outcome says so."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import httpx
import pytest

from chatmesh.mesh.up import Mesh
from chatmesh.v1 import generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import SseEvent, channel, read_sse, start_mesh


@pytest.fixture(scope="module")
def own_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("moderated"))
    try:
        yield m
    finally:
        m.stop()


def generations(mesh: Mesh) -> int:
    async def stats() -> int:
        async with channel(mesh, "engine") as ch:
            resp = await generate_pb2_grpc.GenerateServiceStub(ch).GetStats(generate_pb2.GetStatsRequest())
            return resp.stats.generations

    return asyncio.run(stats())


def turn(client: httpx.Client, conv: str, content: str) -> list[SseEvent]:
    body = {"turn_id": str(uuid.uuid4()), "content": content}
    with client.stream("POST", f"/v1/conversations/{conv}/turns", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        return list(read_sse(resp))


def test_blocked_input_never_reaches_the_engine_and_is_recorded(own_mesh: Mesh) -> None:
    with httpx.Client(base_url=own_mesh.gateway_url, timeout=60) as client:
        conv = client.post("/v1/conversations", json={}).json()["id"]
        before = generations(own_mesh)
        events = turn(client, conv, "Please charge my card 4111 1111 1111 1111, expiry 12/29.")
        assert events[-1].event == "turn.blocked", [e.event for e in events]
        assert events[-1].data.get("stage") == "input"
        assert events[-1].data.get("category") == "payment_card"
        assert not [e for e in events if e.event == "turn.delta"]
        assert generations(own_mesh) == before, "blocked input reached an engine"
        messages = client.get(f"/v1/conversations/{conv}").json()["messages"]
        assert [m["status"] for m in messages] == ["blocked", "blocked"] or messages[-1]["status"] == "blocked"
        # Benign text in the same conversation still flows.
        ok = turn(client, conv, "What is a good name for a cat?")
        assert ok[-1].event == "turn.completed"
        assert generations(own_mesh) == before + 1


def test_moderation_down_input_fails_closed_and_says_why(own_mesh: Mesh) -> None:
    """Failing closed while moderation is down fails the turn as retryable: an outage is not a verdict, so nothing
    is stored as blocked (a retry of the same turn id once it is back gets an answer)."""
    own_mesh.procs["moderation"].terminate()
    own_mesh.procs["moderation"].wait(15)
    with httpx.Client(base_url=own_mesh.gateway_url, timeout=60) as client:
        conv = client.post("/v1/conversations", json={}).json()["id"]
        before = generations(own_mesh)
        events = turn(client, conv, "Hello, is anyone there?")
        final = events[-1]
        assert final.event == "turn.failed", [e.event for e in events]
        assert final.data.get("retryable") is True, final.data
        assert "moderation unavailable" in final.data.get("message", ""), final.data
        assert "closed" in final.data.get("message", ""), final.data
        assert generations(own_mesh) == before
        assert client.get(f"/v1/conversations/{conv}").json()["messages"] == []
