"""The model profile end to end, through the real gateway, chat, store, router and `sim` engines as processes:

- every service on the Llama profile (CHATMESH_MODEL=llama3): turns complete, and the usage the edge reports and
  bills is counted in Llama 3 tokens (the prompt is exactly Llama 3.1's rendering of the conversation, in ids of
  the Llama tokenizer; the reply's tokens are the Llama ids of its text);
- chat on the Llama profile, its only engine on SmolLM2: the turn fails with an error naming both models, before
  the engine does any work (its stats: no generation, no prefill), and nothing is stored as a reply or billed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from chatmesh.chat.core import DEFAULT_SYSTEM_PROMPTS
from chatmesh.mesh.up import Extra, Mesh
from chatmesh.model import assets, profile
from chatmesh.model.profile import ModelProfile
from chatmesh.model.template import Role
from chatmesh.v1 import generate_pb2, generate_pb2_grpc
from tests.conftest import free_port, need_models
from tests.e2e.conftest import SseEvent, channel, mesh_env, start_mesh
from tests.e2e.test_turns import new_conversation, send_turn

SYSTEM = DEFAULT_SYSTEM_PROMPTS["v1"]


def _model_dir() -> Path:
    return need_models(assets.SMOLLM2, assets.LLAMA3_TOKENIZER)


@pytest.fixture(scope="module")
def llama3() -> ModelProfile:
    return profile.load_spec("llama3", _model_dir())


@pytest.fixture(scope="module")
def smollm2() -> ModelProfile:
    return profile.load_spec("smollm2", _model_dir())


@pytest.fixture(scope="module")
def llama_mesh(tmp_path_factory: pytest.TempPathFactory, llama3: ModelProfile) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("llama"), CHATMESH_MODEL="llama3", CHATMESH_SIM_TEXT="tokenizer")
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def mismatched_mesh(tmp_path_factory: pytest.TempPathFactory, llama3: ModelProfile) -> Iterator[Mesh]:
    """Every service on Llama 3 but the one replica the router knows, which serves SmolLM2."""
    tmp = tmp_path_factory.mktemp("mismatch")
    smol = f"127.0.0.1:{free_port()}"
    env = mesh_env(tmp / "data", CHATMESH_MODEL="llama3", CHATMESH_SIM_TEXT="tokenizer",
                   CHATMESH_REPLICAS=f"engine-smol={smol}")
    m = Mesh(env=env, log_dir=tmp / "logs", start_timeout_s=180)
    m.start(extra=[Extra("engine-smol", "engine", smol, {"CHATMESH_MODEL": "smollm2",
                                                          "CHATMESH_REPLICA_ID": "engine-smol"})])
    try:
        yield m
    finally:
        m.stop()


def _reply(events: list[SseEvent]) -> str:
    return "".join(e.data["text"] for e in events if e.event == "turn.delta")


def engine_stats(mesh: Mesh, address: str) -> generate_pb2.EngineStats:
    async def stats() -> generate_pb2.EngineStats:
        async with channel(mesh, "engine", address=address) as ch:
            resp = await generate_pb2_grpc.GenerateServiceStub(ch).GetStats(generate_pb2.GetStatsRequest(), timeout=10)
            return resp.stats

    return asyncio.run(stats())


def test_a_llama_mesh_completes_turns_with_usage_in_llama_tokens(llama_mesh: Mesh, llama3: ModelProfile,
                                                                 smollm2: ModelProfile) -> None:
    questions = ["What is the capital of France? Café, naïve, 東京.", "And the capital of Japan?"]
    messages: list[tuple[Role, str]] = [(Role.SYSTEM, SYSTEM)]
    with httpx.Client(base_url=llama_mesh.gateway_url, timeout=60) as client:
        conv = new_conversation(client)
        usages = []
        for question in questions:
            events, _ = send_turn(client, conv, question)
            assert events[-1].event == "turn.completed", events[-1]
            messages.append((Role.USER, question))
            reply = _reply(events)
            usage = events[-1].data["usage"]
            # The prompt the engine was sent is Llama 3.1's rendering of the conversation in Llama 3 ids.
            assert usage["prompt_tokens"] == len(llama3.render(messages).token_ids)
            assert usage["prompt_tokens"] != len(smollm2.render(messages).token_ids)
            # The reply streamed in Llama ids: its text is their decoding, so its count is theirs.
            assert reply and usage["output_tokens"] == len(llama3.encode(reply))
            usages.append(usage)
            messages.append((Role.ASSISTANT, reply))
        assert usages[1]["cached_prompt_tokens"] > 0  # the second prompt extends the first: its KV is reused
        billed = client.get("/v1/usage").json()["days"]
        assert sum(d["turns"] for d in billed) == 2
        assert sum(d["usage"]["prompt_tokens"] for d in billed) == sum(u["prompt_tokens"] for u in usages)
        assert sum(d["usage"]["output_tokens"] for d in billed) == sum(u["output_tokens"] for u in usages)
    stats = engine_stats(llama_mesh, llama_mesh.env["CHATMESH_ENGINE_ADDRESS"])
    assert (stats.model.model_id, stats.model.tokenizer_digest) == (llama3.model_id, llama3.identity.tokenizer_digest)
    assert stats.generations == 2


def test_a_llama_chat_and_a_smollm2_engine_fail_the_turn_before_any_engine_work(
        mismatched_mesh: Mesh, llama3: ModelProfile, smollm2: ModelProfile) -> None:
    smol = mismatched_mesh.env["CHATMESH_REPLICAS"].split("=", 1)[1]
    with httpx.Client(base_url=mismatched_mesh.gateway_url, timeout=60) as client:
        conv = new_conversation(client)
        events, _ = send_turn(client, conv, "What is the capital of France?")
        final = events[-1]
        assert final.event == "turn.failed", final
        assert not [e for e in events if e.event == "turn.delta"]
        message = final.data["message"]
        assert "engine-smol" in message and "CHATMESH_MODEL" in message
        assert smollm2.model_id in message and llama3.model_id in message
        assert smollm2.identity.tokenizer_digest[:19] in message and llama3.identity.tokenizer_digest[:19] in message
        assert final.data["retryable"] is False  # a misconfiguration: retrying cannot help
        stored = client.get(f"/v1/conversations/{conv}").json()["messages"]
        assert [m for m in stored if m["role"] == "assistant"] == []
        billed = client.get("/v1/usage").json()["days"]
        assert sum(d["turns"] for d in billed) == 0
        assert sum(d["usage"]["prompt_tokens"] + d["usage"]["output_tokens"] for d in billed) == 0
    stats = engine_stats(mismatched_mesh, smol)
    assert stats.model.tokenizer_digest == smollm2.identity.tokenizer_digest
    assert stats.generations == 0 and stats.miss_tokens == 0 and stats.hit_tokens == 0  # no engine work
