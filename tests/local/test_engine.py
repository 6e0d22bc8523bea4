"""The `local` backend through the engine core: a real answer, prefix reuse on the next turn, and the same
greedy reply whether or not the prefix came from the cache."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from chatmesh.engine_adapter.backend import Delta, Finished, FinishReason, GenerateParams, Started
from chatmesh.engine_adapter.engine import EngineCore
from chatmesh.engine_adapter.local.backend import build_local
from chatmesh.engine_adapter.local.executor import LocalExecutor
from chatmesh.engine_adapter.local.model import LoadedModel
from chatmesh.mesh.config import Config
from chatmesh.model.template import Role, render

ENV = {"CHATMESH_BLOCK_SIZE": "16", "CHATMESH_DEVICE_BLOCKS": "64", "CHATMESH_HOST_BLOCKS": "16",
       "CHATMESH_LOCAL_THREADS": "1", "CHATMESH_FLUSH_INTERVAL_MS": "5"}


@pytest.fixture
async def engine(loaded: object) -> AsyncIterator[EngineCore]:
    assert isinstance(loaded, LoadedModel)
    core = build_local(Config(env=ENV), model=loaded)
    await core.start()
    yield core
    await core.close()


async def _ask(engine: EngineCore, prompt: tuple[int, ...], prefix: int, max_tokens: int = 24
               ) -> tuple[Started, str, list[int], Finished]:
    started: Started | None = None
    text: list[str] = []
    ids: list[int] = []
    finished: Finished | None = None
    params = GenerateParams(prompt, max_tokens, cache_salt=b"owner", platform_prefix_tokens=prefix)
    async for event in engine.generate(params):
        match event:
            case Started():
                started = event
            case Delta():
                text.append(event.text)
                ids.extend(event.token_ids)
            case Finished():
                finished = event
    assert started is not None and finished is not None
    return started, "".join(text), ids, finished


async def test_capital_of_france_and_the_next_turn_hits_the_cache(engine: EngineCore, loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    convo: list[tuple[Role, str]] = [(Role.USER, "What is the capital of France?")]
    first = render(tok, convo)
    started, text, ids, finished = await _ask(engine, first.token_ids, first.platform_prefix_len)
    assert "Paris" in text
    assert finished.reason is FinishReason.STOP
    assert started.cached_tokens == 0
    assert finished.usage.prompt_tokens == len(first.token_ids)

    convo += [(Role.ASSISTANT, text), (Role.USER, "And of Italy?")]
    second = render(tok, convo)
    assert second.token_ids[:len(first.token_ids)] == first.token_ids
    executor = engine.executor
    assert isinstance(executor, LocalExecutor)
    before = executor.prefill_tokens + executor.decode_tokens
    started2, text2, ids2, finished2 = await _ask(engine, second.token_ids, second.platform_prefix_len)
    assert started2.cached_tokens >= (len(first.token_ids) // 16) * 16
    # only the uncached prompt tokens were prefilled, then one decode forward per sampled token but the last
    computed = executor.prefill_tokens + executor.decode_tokens - before
    assert computed == len(second.token_ids) - started2.cached_tokens + finished2.usage.output_tokens - 1
    assert "Rome" in text2

    # the same prompt under another owner's salt misses past the platform prefix, and answers the same
    cold, text3, ids3, _ = await _ask_salted(engine, second.token_ids, second.platform_prefix_len, b"other")
    assert cold.cached_tokens <= second.platform_prefix_len
    assert ids3 == ids2 and text3 == text2


async def _ask_salted(engine: EngineCore, prompt: tuple[int, ...], prefix: int, salt: bytes
                      ) -> tuple[Started, str, list[int], Finished]:
    started: Started | None = None
    text: list[str] = []
    ids: list[int] = []
    finished: Finished | None = None
    async for event in engine.generate(GenerateParams(prompt, 24, cache_salt=salt, platform_prefix_tokens=prefix)):
        match event:
            case Started():
                started = event
            case Delta():
                text.append(event.text)
                ids.extend(event.token_ids)
            case Finished():
                finished = event
    assert started is not None and finished is not None
    return started, "".join(text), ids, finished
