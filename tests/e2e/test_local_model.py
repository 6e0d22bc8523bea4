"""The embedded default, end to end: the real SmolLM2 model on the CPU behind the whole mesh answers in English,
and the second turn of a conversation is served mostly from the prefix cache."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from chatmesh.mesh.up import Mesh
from chatmesh.model.assets import SMOLLM2
from tests.e2e.conftest import read_sse, start_mesh
from tests.conftest import need_models


@pytest.fixture(scope="module")
def local_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    need_models(SMOLLM2)
    m = start_mesh(tmp_path_factory.mktemp("local"), CHATMESH_ENGINE="local", CHATMESH_SIM_STEP_MS="0",
                   CHATMESH_MAX_REPLY_TOKENS="24")
    try:
        yield m
    finally:
        m.stop()


def ask(client: httpx.Client, conv: str, content: str) -> tuple[str, dict[str, int]]:
    body = {"turn_id": str(uuid.uuid4()), "content": content}
    with client.stream("POST", f"/v1/conversations/{conv}/turns", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        events = list(read_sse(resp))
    assert events[-1].event == "turn.completed", [e.event for e in events]
    text = "".join(e.data["text"] for e in events if e.event == "turn.delta")
    usage: dict[str, int] = events[-1].data["usage"]
    return text, usage


def test_capital_of_france_is_paris_and_the_next_turn_hits_the_cache(local_mesh: Mesh, tmp_path: Path) -> None:
    with httpx.Client(base_url=local_mesh.gateway_url, timeout=120) as client:
        conv = client.post("/v1/conversations", json={}).json()["id"]
        reply, first = ask(client, conv, "What is the capital of France?")
        assert "Paris" in reply, reply
        _, second = ask(client, conv, "And of Italy?")
        # Turn 2 replays turn 1: everything up to the last full block of turn 1 is served from the cache.
        assert second["cached_prompt_tokens"] >= first["prompt_tokens"] - 32
        assert second["cached_prompt_tokens"] > second["prompt_tokens"] // 2


def test_the_openai_sdk_gets_paris_from_the_real_model(local_mesh: Mesh) -> None:
    import asyncio

    import openai

    from chatmesh.mesh import settings
    from tests.gateway.openai_client import make_key

    key = asyncio.run(make_key(Path(local_mesh.cfg[settings.DATA_DIR]), "sdk-user"))
    client = openai.OpenAI(base_url=local_mesh.gateway_url + "/openai/v1", api_key=key, max_retries=0, timeout=120)
    done = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in (done.choices[0].message.content or ""), done.choices[0].message.content
