"""Backend conformance: the Generate-level behaviour every backend (sim, local, triton) must show.

The tests take the `backend` fixture, parametrised over the backend names of
chatmesh.engine_adapter.service.BACKENDS and built through the same registry `chatmesh serve engine` uses. A
backend whose optional package, model files or server are absent skips with the reason through `need` (so it
fails under CHATMESH_REQUIRE_SERVICES=1, as CI runs); any other error of the builder fails the test.
tests/engine/test_conformance.py collects these tests; prompts use token ids below 1,000 so they are valid for
every tokenizer.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path

import pytest

from chatmesh.engine_adapter import service
from chatmesh.engine_adapter.backend import (
    Backend,
    Delta,
    EngineStats,
    Finished,
    FinishReason,
    GenerateEvent,
    GenerateParams,
    ResumeRefused,
    Started,
)
from chatmesh.engine_adapter.executor import SamplingParams
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import InvalidArgument
from chatmesh.mesh.ids import ConversationId, TurnId
from chatmesh.model.assets import ModelMissing
from tests.conftest import need

BLOCK = 32
ENV = {
    "CHATMESH_BLOCK_SIZE": str(BLOCK), "CHATMESH_DEVICE_BLOCKS": "512", "CHATMESH_HOST_BLOCKS": "512",
    "CHATMESH_MAX_BATCH": "8", "CHATMESH_QUEUE_LIMIT": "16", "CHATMESH_FLUSH_INTERVAL_MS": "5",
    "CHATMESH_SIM_STEP_MS": "1", "CHATMESH_SIM_TEXT": "words",
}
SYSTEM = list(range(300, 364))  # two blocks of platform prefix


@pytest.fixture(params=sorted(service.BACKENDS))
async def backend(request: pytest.FixtureRequest, mesh_certs: Path) -> AsyncIterator[Backend]:
    name: str = request.param
    # the data folder holds the test session's mesh certificates: triton's engine -> tritonserver hop runs mutual
    # TLS with the engine's, as it does under `chatmesh up`
    env = {**os.environ, **ENV, "CHATMESH_ENGINE": name, "CHATMESH_DATA_DIR": str(mesh_certs.parent)}
    try:
        built = service.build_backend(Config(env=env))
    except ModuleNotFoundError as err:  # the backend's optional package (torch, pytriton) is not installed
        need(False, f"backend {name}'s package {err.name}")
        raise
    except ModelMissing as err:
        need(False, f"backend {name}'s model files ({err})")
        raise
    # anything else the builder raises is the backend's bug, and fails the test
    try:
        await asyncio.wait_for(built.start(), 120)
    except Exception as err:
        need(False, f"backend {name}'s server (it did not start: {type(err).__name__}: {err})")
        raise
    assert built.ready()
    yield built
    await built.close()


def _params(prompt: list[int], max_tokens: int = 6, salt: bytes = b"owner-a", prefix: int = len(SYSTEM),
            conversation: ConversationId | None = None, stop: frozenset[int] = frozenset()) -> GenerateParams:
    return GenerateParams(tuple(prompt), max_tokens, cache_salt=salt, platform_prefix_tokens=prefix,
                          conversation_id=conversation, stop_token_ids=stop)


async def _collect(backend: Backend, params: GenerateParams) -> list[GenerateEvent]:
    return [e async for e in backend.generate(params)]


def _tokens(events: list[GenerateEvent]) -> list[int]:
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


async def test_stream_is_started_deltas_finished(backend: Backend) -> None:
    prompt = SYSTEM + list(range(1, 40))
    events = await _collect(backend, _params(prompt, max_tokens=5))
    assert isinstance(events[0], Started)
    assert isinstance(events[-1], Finished)
    assert all(isinstance(e, Delta) for e in events[1:-1])
    fin = events[-1]
    assert fin.usage.prompt_tokens == len(prompt)
    if fin.reason is FinishReason.LENGTH:
        assert len(_tokens(events)) == 5 == fin.usage.output_tokens
    else:
        assert fin.reason is FinishReason.STOP and fin.usage.output_tokens == len(_tokens(events)) + 1
    assert "".join(e.text for e in events if isinstance(e, Delta))


async def test_same_seed_same_prompt_same_tokens(backend: Backend) -> None:
    prompt = SYSTEM + list(range(50, 90))
    first = _tokens(await _collect(backend, _params(prompt, max_tokens=8)))
    second = _tokens(await _collect(backend, _params(prompt, max_tokens=8, salt=b"owner-b")))
    assert first == second and first


async def test_stop_token_ends_the_generation(backend: Backend) -> None:
    prompt = SYSTEM + list(range(100, 130))
    tokens = _tokens(await _collect(backend, _params(prompt, max_tokens=6)))
    assert len(tokens) >= 2
    stop = tokens[1]
    events = await _collect(backend, _params(prompt, max_tokens=6, stop=frozenset({stop})))
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.reason is FinishReason.STOP
    assert _tokens(events) == tokens[:tokens.index(stop)]


async def test_prefix_reuse_is_scoped_to_the_owner(backend: Backend) -> None:
    prompt = SYSTEM + list(range(400, 500))
    first = await _collect(backend, _params(prompt, max_tokens=2, salt=b"alice"))
    assert isinstance(first[0], Started) and first[0].cached_tokens == 0
    same_owner = await _collect(backend, _params(prompt, max_tokens=2, salt=b"alice"))
    assert isinstance(same_owner[0], Started)
    assert same_owner[0].cached_tokens >= (len(prompt) - 1) // BLOCK * BLOCK
    other = await _collect(backend, _params(prompt, max_tokens=2, salt=b"bob"))
    assert isinstance(other[0], Started) and other[0].cached_tokens == len(SYSTEM)


async def test_evicting_a_conversation_makes_its_next_turn_miss(backend: Backend) -> None:
    conv = ConversationId(str(uuid.uuid4()))
    prompt = SYSTEM + list(range(600, 700))
    await _collect(backend, _params(prompt, max_tokens=2, conversation=conv))
    assert await backend.evict_conversation(conv) > 0
    again = await _collect(backend, _params(prompt, max_tokens=2, conversation=conv))
    assert isinstance(again[0], Started) and again[0].cached_tokens <= len(SYSTEM)
    assert await backend.evict_salt(b"owner-a") > 0


async def _eventually(backend: Backend, ok: Callable[[EngineStats], bool]) -> EngineStats:
    """Stats that satisfy `ok` within ~5 s (some backends poll their engine's stats)."""
    for _ in range(500):
        s = backend.stats()
        if ok(s):
            return s
        await asyncio.sleep(0.01)
    return backend.stats()


async def test_cancelling_frees_the_sequence(backend: Backend) -> None:
    stream = backend.generate(_params(SYSTEM + list(range(700, 760)), max_tokens=100_000))
    async for event in stream:
        if isinstance(event, Delta):
            break
    assert (await _eventually(backend, lambda s: s.running_sequences == 1)).running_sequences == 1
    assert isinstance(stream, AsyncGenerator)  # closing it is how a caller cancels
    await stream.aclose()
    s = await _eventually(backend, lambda s: s.running_sequences == 0 and s.device.used == s.device.cached)
    assert s.running_sequences == 0
    if backend.name in ("sim", "local"):  # these split cached blocks out of used; triton reports no split
        assert s.device.used == s.device.cached  # no block is referenced any more


async def test_cancel_turn_ends_that_turns_generation_as_cancelled(backend: Backend) -> None:
    """A chat process that took a turn over cancels its old holder's generation (issue 33): it ends with
    Finished(CANCELLED) and frees its sequence; the same turn id under another owner's salt runs on."""
    turn = TurnId(str(uuid.uuid4()))
    mine = backend.generate(replace(_params(SYSTEM + list(range(400, 440)), max_tokens=100_000), turn_id=turn))
    theirs = backend.generate(replace(_params(SYSTEM + list(range(400, 440)), max_tokens=100_000, salt=b"owner-b"),
                                      turn_id=turn))
    for stream in (mine, theirs):
        async for event in stream:
            if isinstance(event, Delta):
                break
    assert backend.cancel_turn(b"owner-a", turn) == 1
    last = [e async for e in mine][-1]
    assert isinstance(last, Finished) and last.reason is FinishReason.CANCELLED
    assert isinstance(await anext(theirs), Delta)  # another owner's generation is untouched
    assert backend.cancel_turn(b"owner-a", turn) == 0
    assert isinstance(theirs, AsyncGenerator)
    await theirs.aclose()
    assert (await _eventually(backend, lambda s: s.running_sequences == 0)).running_sequences == 0


async def test_a_continuation_goes_on_with_the_reply_or_is_refused(backend: Backend) -> None:
    """A reply continued from its first tokens (resumed_tokens: the prompt ends with them, a turn taken over) goes
    on with the tokens the reply had, greedy or sampled; a backend that cannot continue a sampled reply exactly
    (triton: TensorRT-LLM's sampler) refuses it before any work, and never answers it with other draws."""
    prompt = SYSTEM + list(range(140, 180))
    for sampling in (SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=11)):
        whole = _tokens(await _collect(backend, replace(_params(prompt, max_tokens=8), sampling=sampling)))
        shown = min(3, len(whole) - 1)
        if shown < 1:
            continue  # the model ended at once: nothing to continue
        params = replace(_params(prompt + whole[:shown], max_tokens=len(whole) - shown), sampling=sampling,
                         resumed_tokens=shown)
        try:
            rest = _tokens(await _collect(backend, params))
        except ResumeRefused:
            assert backend.name == "triton" and sampling.temperature > 0
            continue
        assert rest == whole[shown:], (backend.name, sampling)


async def test_invalid_params_are_rejected() -> None:
    with pytest.raises(InvalidArgument):
        GenerateParams((), 5)
    with pytest.raises(InvalidArgument):
        GenerateParams((1, 2), 0)
    with pytest.raises(InvalidArgument):
        GenerateParams((1, 2), 5, platform_prefix_tokens=3)


async def test_stats_count_generations_and_hits(backend: Backend) -> None:
    before = backend.stats()
    prompt = SYSTEM + list(range(800, 870))
    await _collect(backend, _params(prompt, max_tokens=1))
    await _collect(backend, _params(prompt, max_tokens=1))
    after = backend.stats()
    assert after.generations == before.generations + 2
    assert after.hit_tokens > before.hit_tokens and after.miss_tokens > before.miss_tokens
    assert after.device.used + after.device.free == after.device.total
    assert after.block_size == BLOCK
