"""An engine reports the model it serves (GetStats, WatchStats) and refuses, before any engine work, a prompt
rendered for another tokenizer; `sim` on the Llama profile streams and counts in Llama 3 token ids."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from chatmesh.v1 import generate_pb2, generate_pb2_grpc

from chatmesh.engine_adapter import service as engine_service
from chatmesh.engine_adapter.text import PASSAGE
from chatmesh.mesh import identity
from chatmesh.mesh.config import Config
from chatmesh.mesh.server import serve
from chatmesh.model import assets, profile
from chatmesh.model.profile import ModelProfile
from chatmesh.model.template import Role
from tests.conftest import free_port, need_models
from tests.trust import channel_as, trust_as


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return need_models(assets.SMOLLM2, assets.LLAMA3_TOKENIZER)


@pytest.fixture(scope="module")
def llama3(model_dir: Path) -> ModelProfile:
    return profile.load_spec("llama3", model_dir)


@pytest.fixture(scope="module")
def smollm2(model_dir: Path) -> ModelProfile:
    return profile.load_spec("smollm2", model_dir)


async def _serve(certs: Path, env: dict[str, str]) -> AsyncIterator[generate_pb2_grpc.GenerateServiceAsyncStub]:
    """A sim engine over mutual TLS, called as chat with owner tokens (as tests/engine/test_service.py)."""
    cfg = Config(env={"CHATMESH_ENGINE": "sim", "CHATMESH_SIM_STEP_MS": "1", "CHATMESH_DEVICE_BLOCKS": "256",
                      "CHATMESH_HOST_BLOCKS": "0", "CHATMESH_REPLICA_ID": "engine-7", **env})
    port = free_port()
    ready, stop = asyncio.Event(), asyncio.Event()
    trust = trust_as(certs, identity.ENGINE)
    task = asyncio.create_task(serve(engine_service.build(cfg, trust), f"127.0.0.1:{port}", 0.5, ready, stop,
                                     trust=trust))
    await asyncio.wait_for(ready.wait(), 30)
    async with channel_as(certs, identity.CHAT, f"127.0.0.1:{port}", "engine", owner_tokens=True) as channel:
        yield generate_pb2_grpc.GenerateServiceStub(channel)
    stop.set()
    await asyncio.wait_for(task, 10)


@pytest.fixture
async def llama_engine(model_dir: Path, mesh_certs: Path) -> AsyncIterator[generate_pb2_grpc.GenerateServiceAsyncStub]:
    async for stub in _serve(mesh_certs, {"CHATMESH_MODEL": "llama3", "CHATMESH_MODEL_DIR": str(model_dir),
                                          "CHATMESH_SIM_TEXT": "tokenizer"}):
        yield stub


def _request(p: ModelProfile, expected: ModelProfile | None, max_tokens: int = 12) -> generate_pb2.GenerateRequest:
    prompt = p.render([(Role.SYSTEM, "Be brief."), (Role.USER, "What is the capital of France?")])
    req = generate_pb2.GenerateRequest(
        request_id=str(uuid.uuid4()), conversation_id=str(uuid.uuid4()), turn_id=str(uuid.uuid4()),
        prompt_token_ids=list(prompt.token_ids), platform_prefix_tokens=prompt.platform_prefix_len,
        owner_id="owner-a", max_tokens=max_tokens)
    if expected is not None:
        req.expected_model.CopyFrom(engine_service.identity_to_proto(expected.identity))
    return req


async def test_stats_report_the_served_model(llama_engine: generate_pb2_grpc.GenerateServiceAsyncStub,
                                             llama3: ModelProfile) -> None:
    stats = (await llama_engine.GetStats(generate_pb2.GetStatsRequest())).stats
    assert (stats.model.model_id, stats.model.tokenizer_digest) == (llama3.model_id, llama3.identity.tokenizer_digest)
    watched = await llama_engine.WatchStats(generate_pb2.WatchStatsRequest(interval_ms=10)).read()
    assert isinstance(watched, generate_pb2.WatchStatsResponse)
    assert watched.stats.model == stats.model


async def test_sim_on_the_llama_profile_streams_and_counts_llama_tokens(
        llama_engine: generate_pb2_grpc.GenerateServiceAsyncStub, llama3: ModelProfile) -> None:
    req = _request(llama3, llama3)
    events = [r async for r in llama_engine.Generate(req)]
    ids = [t for e in events if e.WhichOneof("event") == "delta" for t in e.delta.token_ids]
    text = "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")
    usage = events[-1].finished.usage
    assert usage.prompt_tokens == len(req.prompt_token_ids) and usage.output_tokens == len(ids) == 12
    assert text == llama3.decode(ids)
    script = llama3.encode(PASSAGE)  # sim streams the passage in the profile's ids, from a seeded offset
    assert any((script + script)[i:i + len(ids)] == ids for i in range(len(script)))


async def test_a_prompt_for_another_model_is_refused_before_any_engine_work(
        llama_engine: generate_pb2_grpc.GenerateServiceAsyncStub, llama3: ModelProfile,
        smollm2: ModelProfile) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in llama_engine.Generate(_request(smollm2, smollm2))]
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = info.value.details() or ""
    assert "engine-7" in details and smollm2.model_id in details and llama3.model_id in details
    stats = (await llama_engine.GetStats(generate_pb2.GetStatsRequest())).stats
    assert stats.generations == 0 and stats.miss_tokens == 0  # nothing admitted, nothing prefilled


async def test_the_word_vocabulary_matches_no_model(smollm2: ModelProfile, mesh_certs: Path) -> None:
    async for stub in _serve(mesh_certs, {"CHATMESH_SIM_TEXT": "words"}):
        stats = (await stub.GetStats(generate_pb2.GetStatsRequest())).stats
        assert stats.model.model_id == "sim-words"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in stub.Generate(_request(smollm2, smollm2))]
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        events = [r async for r in stub.Generate(_request(smollm2, None, max_tokens=2))]  # no expectation: served
        assert events[-1].finished.usage.output_tokens == 2
