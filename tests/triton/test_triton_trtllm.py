"""The TensorRT-LLM engine's control flow against a stand-in `tensorrt_llm` module (no GPU here): the LLM API
arguments it passes, stop handling, abort on cancel, KV statistics from iteration stats."""

from __future__ import annotations

import sys
import types
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from chatmesh.engine_adapter.backend import Delta, Finished, FinishReason, GenerateParams, Started
from chatmesh.engine_adapter.triton.trtllm import TrtLlmBackend


@dataclass
class FakeCompletion:
    token_ids: list[int]
    text_diff: str
    finish_reason: str | None = None
    request_perf_metrics: Any = None


@dataclass
class FakeOutput:
    outputs: list[FakeCompletion]
    finished: bool


@dataclass
class FakeStream:
    steps: list[FakeOutput]
    aborted: bool = False

    def __aiter__(self) -> AsyncIterator[FakeOutput]:
        return self._run()

    async def _run(self) -> AsyncIterator[FakeOutput]:
        for step in self.steps:
            yield step

    def abort(self) -> None:
        self.aborted = True


@dataclass
class FakeLLM:
    kwargs: dict[str, Any]
    script: list[FakeOutput] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)
    kv_events: list[dict[str, Any]] = field(default_factory=lambda: [
        {"event_id": 1, "data": {"type": "stored", "blocks": [{"block_hash": 11}]}},
        {"event_id": 2, "data": {"type": "removed", "block_hashes": [11, 12, 13]}}])

    def generate_async(self, inputs: list[int], sampling_params: Any, streaming: bool, cache_salt: str | None) -> FakeStream:
        self.calls.append({"inputs": inputs, "sampling": sampling_params, "streaming": streaming, "salt": cache_salt})
        self.streams.append(FakeStream(list(self.script)))
        return self.streams[-1]

    async def get_stats_async(self, timeout: float) -> AsyncIterator[dict[str, Any]]:
        yield {"numActiveRequests": 2, "numQueuedRequests": 1,
               "kvCacheStats": {"maxNumBlocks": 100, "freeNumBlocks": 60, "usedNumBlocks": 40, "tokensPerBlock": 32}}

    async def get_kv_cache_events_async(self, timeout: float) -> AsyncIterator[dict[str, Any]]:
        events, self.kv_events = self.kv_events, []  # each event is drained once
        for event in events:
            yield event

    def shutdown(self) -> None:
        pass


@pytest.fixture
def fake_trtllm() -> Iterator[list[FakeLLM]]:
    made: list[FakeLLM] = []
    root = types.ModuleType("tensorrt_llm")
    llmapi = types.ModuleType("tensorrt_llm.llmapi")

    def llm(**kwargs: Any) -> FakeLLM:
        made.append(FakeLLM(kwargs))
        return made[-1]

    root.LLM = llm  # type: ignore[attr-defined]
    root.SamplingParams = lambda **kw: kw  # type: ignore[attr-defined]
    llmapi.KvCacheConfig = lambda **kw: ("KvCacheConfig", kw)  # type: ignore[attr-defined]
    saved = {k: sys.modules.get(k) for k in ("tensorrt_llm", "tensorrt_llm.llmapi")}
    sys.modules.update({"tensorrt_llm": root, "tensorrt_llm.llmapi": llmapi})
    yield made
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v


def step(ids: list[int], text: str, reason: str | None = None) -> FakeOutput:
    return FakeOutput([FakeCompletion(ids, text, reason)], finished=reason is not None)


PARAMS = GenerateParams((1, 2, 3, 4), 8, cache_salt=b"\x01\x02", platform_prefix_tokens=2,
                        stop_token_ids=frozenset({99}))
ARGS = {"model": "m", "tokenizer": "/models/m", "backend": "pytorch", "tensor_parallel_size": 8,
        "kv_cache_config": {"enable_block_reuse": True, "tokens_per_block": 32}}


async def test_streams_with_the_salt_and_counts_a_stop_token_without_streaming_it(fake_trtllm: list[FakeLLM]) -> None:
    backend = TrtLlmBackend(ARGS, end_ids=frozenset({7}))
    await backend.start()
    llm = fake_trtllm[0]
    assert llm.kwargs["kv_cache_config"] == ("KvCacheConfig", ARGS["kv_cache_config"])
    llm.script = [step([10], "a"), step([10, 11], "b"), step([10, 11, 7], "", "stop")]
    events = [e async for e in backend.generate(PARAMS)]
    call = llm.calls[0]
    assert call["salt"] == "0102" and call["streaming"] and call["inputs"] == [1, 2, 3, 4]
    assert call["sampling"]["max_tokens"] == 8 and call["sampling"]["stop_token_ids"] == [99]
    assert isinstance(events[0], Started)
    assert [e.token_ids for e in events if isinstance(e, Delta)] == [(10,), (11,)]
    last = events[-1]
    assert isinstance(last, Finished) and last.reason is FinishReason.STOP and last.usage.output_tokens == 3
    assert not llm.streams[0].aborted
    await backend.close()


async def test_cancel_aborts_and_salt_policy_none_sends_no_salt(fake_trtllm: list[FakeLLM]) -> None:
    backend = TrtLlmBackend(ARGS, salt_policy="none", end_ids=frozenset({7}))
    await backend.start()
    llm = fake_trtllm[0]
    llm.script = [step([10], "a"), step([10, 11], "b"), step([10, 11, 12], "c", "length")]
    stream = backend.generate(PARAMS)
    assert isinstance(await anext(stream), Started)
    assert isinstance(await anext(stream), Delta)
    await stream.aclose()  # type: ignore[attr-defined]
    assert llm.streams[0].aborted and llm.calls[0]["salt"] is None
    await backend.close()


async def test_stats_come_from_iteration_stats_and_kv_events(fake_trtllm: list[FakeLLM]) -> None:
    import asyncio

    backend = TrtLlmBackend(ARGS, end_ids=frozenset({7}))
    await backend.start()
    for _ in range(50):
        if backend.stats().device.total and backend.stats().device_evictions:
            break
        await asyncio.sleep(0.01)
    s = backend.stats()
    assert (s.device.total, s.device.used, s.device.free) == (100, 40, 60)
    assert s.running_sequences == 2 and s.queue_depth == 1 and s.block_size == 32
    assert s.device_evictions == 3  # from the KV events: three blocks removed
    await backend.close()


async def test_residency_comes_from_the_kv_events_of_its_generations(fake_trtllm: list[FakeLLM]) -> None:
    import asyncio

    from chatmesh.engine_adapter.residency import FROM_START
    from chatmesh.mesh.ids import ConversationId

    backend = TrtLlmBackend({**ARGS, "kv_cache_config": {"enable_block_reuse": True, "tokens_per_block": 2}},
                            end_ids=frozenset({7}))
    await backend.start()
    llm = fake_trtllm[0]
    llm.kv_events = []
    llm.script = [step([7, 8], "ok"), step([7, 8, 9], " fine", "length")]
    conversation = ConversationId("5f0c2a55-8d5c-4b8e-a0e9-9a6ff0f0c0de")
    params = GenerateParams((1, 2, 3, 4, 5, 6), 3, conversation_id=conversation, platform_prefix_tokens=2)
    events = [e async for e in backend.generate(params)]
    assert isinstance(events[-1], Finished)

    def block(h: int, tokens: list[int]) -> dict[str, Any]:
        return {"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens]}

    # TensorRT-LLM stored the prompt's blocks and the one the reply filled: (1,2) is the platform prefix
    llm.kv_events = [{"event_id": 3, "window_size": 64, "data": {"type": "stored", "parent_hash": None, "blocks": [
        block(1, [1, 2]), block(2, [3, 4]), block(3, [5, 6])]}},
        {"event_id": 4, "window_size": 64, "data": {"type": "stored", "parent_hash": 3, "blocks": [block(4, [7, 8])]}}]
    for _ in range(300):  # the backend drains events once a second (STATS_POLL_S)
        r = backend.residency(FROM_START)
        if r is not None and r.conversations:
            break
        await asyncio.sleep(0.01)
    assert r is not None and dict(r.conversations) == {conversation: 6}
    await backend.close()
