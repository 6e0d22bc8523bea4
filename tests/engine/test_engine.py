"""The engine core over the sim executor, in virtual time: prefix reuse per owner and conversation, the host
tier, cancellation, stream coalescing, and the reference's roofline figures."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import pytest

from chatmesh.engine_adapter.backend import (
    Delta,
    Finished,
    FinishReason,
    GenerateEvent,
    GenerateParams,
    Started,
)
from chatmesh.engine_adapter.block_manager import BlockConfig
from chatmesh.engine_adapter.engine import EngineCore, StepReport, VirtualClock
from chatmesh.engine_adapter.executor import BlockCopy, SamplingParams, SeqWork, StepResult, Tier
from chatmesh.engine_adapter.roofline import H100_FP8, PRESETS
from chatmesh.engine_adapter.scheduler import SchedulerConfig
from chatmesh.engine_adapter.sim import SimExecutor
from chatmesh.engine_adapter.text import PASSAGE, WordCodec
from chatmesh.mesh.ids import ConversationId

SYSTEM = list(range(1000, 1064))  # a 64-token platform prefix (two blocks)


def _engine(device: int = 4096, host: int = 0, max_batch: int = 256, budget: int = 512, flush_s: float = 0.025,
            steps: list[StepReport] | None = None) -> EngineCore:
    codec = WordCodec()
    executor = SimExecutor(H100_FP8, codec.encode(PASSAGE), 32)
    return EngineCore(executor, BlockConfig(32, device, host), SchedulerConfig(max_batch, budget, 4096), codec,
                      flush_interval_s=flush_s, clock=VirtualClock(),
                      on_step=steps.append if steps is not None else None)


@pytest.fixture
async def engine() -> AsyncIterator[EngineCore]:
    core = _engine()
    await core.start()
    yield core
    await core.close()


def _params(prompt: list[int], salt: bytes = b"A", conversation: ConversationId | None = None,
            max_tokens: int = 8, prefix: int = len(SYSTEM)) -> GenerateParams:
    return GenerateParams(tuple(prompt), max_tokens, cache_salt=salt, conversation_id=conversation,
                          platform_prefix_tokens=min(prefix, len(prompt)))


async def _run(core: EngineCore, params: GenerateParams) -> tuple[Started, list[int], Finished]:
    events: list[GenerateEvent] = [e async for e in core.generate(params)]
    first, last = events[0], events[-1]
    assert isinstance(first, Started) and isinstance(last, Finished)
    tokens = [t for e in events if isinstance(e, Delta) for t in e.token_ids]
    return first, tokens, last


def _conversation() -> ConversationId:
    return ConversationId(str(uuid.uuid4()))


async def test_owner_b_reuses_only_the_platform_prefix(engine: EngineCore) -> None:
    user = list(range(1, 100))
    started_a, _, _ = await _run(engine, _params(SYSTEM + user, b"A"))
    assert started_a.cached_tokens == 0
    started_b, _, _ = await _run(engine, _params(SYSTEM + user, b"B"))
    assert started_b.cached_tokens == len(SYSTEM)  # B reuses the system prompt, never A's message
    started_a2, _, fin = await _run(engine, _params(SYSTEM + user, b"A"))
    assert started_a2.cached_tokens == 160  # A reuses its own blocks too (all full blocks but the last)
    assert fin.usage.cached_prompt_tokens == 160 and fin.usage.prompt_tokens == len(SYSTEM) + len(user)


async def test_next_turn_is_cached_until_the_conversation_is_evicted(engine: EngineCore) -> None:
    conv = _conversation()
    turn1 = SYSTEM + list(range(1, 90))
    _, reply, _ = await _run(engine, _params(turn1, conversation=conv, max_tokens=40))
    turn2 = turn1 + reply + list(range(200, 230))
    started, _, _ = await _run(engine, _params(turn2, conversation=conv))
    history = len(turn1) + len(reply) - 1  # the last sampled token was never run through the model
    assert started.cached_tokens == history // 32 * 32
    assert await engine.evict_conversation(conv) > 0
    started, _, _ = await _run(engine, _params(turn2, conversation=conv))
    assert started.cached_tokens == len(SYSTEM)
    before = engine.stats()
    assert before.hit_tokens > 0 and before.miss_tokens > 0 and before.generations == 3


async def test_idle_conversations_spill_to_host_and_return_as_host_hits() -> None:
    core = _engine(device=64, host=512)
    await core.start()
    try:
        conv = _conversation()
        turn1 = SYSTEM + list(range(1, 400))
        await _run(core, _params(turn1, conversation=conv, max_tokens=4))
        for i in range(4):  # other owners' turns push the idle conversation out of the device tier
            await _run(core, _params(SYSTEM + list(range(5000 + i * 1000, 5500 + i * 1000)), salt=bytes([i])))
        assert core.stats().device_evictions > 0
        started, _, _ = await _run(core, _params(turn1 + [7, 8, 9], conversation=conv))
        assert started.cached_tokens >= 448 and started.host_cached_tokens > 0
        s = core.stats()
        assert s.host_hit_tokens >= started.host_cached_tokens and s.host.used > 0
    finally:
        await core.close()


async def test_cancel_returns_every_block_within_one_step() -> None:
    steps: list[StepReport] = []
    core = _engine(steps=steps)
    await core.start()
    try:
        stream = core.generate(_params(SYSTEM + list(range(1, 300)), max_tokens=10_000))
        async for event in stream:
            if isinstance(event, Delta):
                break
        held = core.stats().device
        assert held.used - held.cached > 0
        n = len(steps)
        assert isinstance(stream, AsyncGenerator)  # closing it is how a caller cancels
        await stream.aclose()
        for _ in range(100):  # let the loop take its next step
            if core.stats().running_sequences == 0:
                break
            await asyncio.sleep(0)
        assert len(steps) <= n + 1
        after = core.stats()
        assert after.device.used - after.device.cached == 0  # nothing referenced: all returned
        assert after.running_sequences == 0
    finally:
        await core.close()


async def test_stop_token_ends_the_stream_and_is_not_streamed(engine: EngineCore) -> None:
    _, tokens, _ = await _run(engine, _params(SYSTEM + [1, 2, 3], max_tokens=5))
    stop = tokens[2]
    params = GenerateParams(tuple(SYSTEM + [1, 2, 3]), 5, stop_token_ids=frozenset({stop}))
    _, again, fin = await _run(engine, params)
    assert fin.reason is FinishReason.STOP
    assert again == tokens[:tokens.index(stop)]
    assert fin.usage.output_tokens == len(again) + 1


async def test_deltas_coalesce_by_flush_interval() -> None:
    for flush_s in (0.0, 0.025):
        core = _engine(flush_s=flush_s)
        await core.start()
        events = [e async for e in core.generate(_params(SYSTEM + list(range(1, 3200)), max_tokens=60))]
        await core.close()
        deltas = [e for e in events if isinstance(e, Delta)]
        assert sum(len(d.token_ids) for d in deltas) == 60
        if flush_s == 0:
            assert len(deltas) == 60  # one per step
        else:
            assert 5 <= len(deltas) <= 15  # ~4.4 ms steps at batch 1: about six tokens per 25 ms send


async def test_preemption_by_recompute_keeps_every_stream_correct() -> None:
    core = _engine(device=24, max_batch=8)
    await core.start()
    try:
        prompts = [SYSTEM + list(range(i * 100, i * 100 + 60)) for i in range(6)]
        results = await asyncio.gather(*(_run(core, _params(p, salt=bytes([i]), max_tokens=120))
                                         for i, p in enumerate(prompts)))
        solo = _engine()
        await solo.start()
        for i, p in enumerate(prompts):
            _, expect, _ = await _run(solo, _params(p, salt=bytes([i]), max_tokens=120))
            assert results[i][1] == expect  # recompute after preemption changes no token
            assert results[i][2].reason is FinishReason.LENGTH
        await solo.close()
        assert core.stats().preemptions > 0
    finally:
        await core.close()


# ---- the reference's roofline figures, in virtual time ---------------------------------------------------


def _decode_work(batch: int, context: int) -> list[SeqWork]:
    return [SeqWork(i, [1], context - 1, [], True, SamplingParams()) for i in range(batch)]


def test_decode_step_at_batch_256_is_12_7_ms() -> None:
    sim = SimExecutor(H100_FP8, [1, 2, 3], 32)
    duration = sim.execute(_decode_work(256, 3200)).duration_s
    assert duration == pytest.approx(0.0127, rel=0.05)
    assert 1 / duration == pytest.approx(79, rel=0.05)  # tokens/s per stream
    assert 256 / duration == pytest.approx(20_100, rel=0.05)  # per node


def test_prefill_rate_is_44850_tokens_per_s() -> None:
    assert H100_FP8.prefill_tokens_per_s == pytest.approx(44_850, rel=0.01)
    sim = SimExecutor(H100_FP8, [1], 32)
    chunk = SeqWork(1, list(range(16_000)), 0, [], True, SamplingParams())
    assert 16_000 / sim.execute([chunk]).duration_s == pytest.approx(44_850, rel=0.05)


def test_presets_scale_as_the_hardware_does() -> None:
    h200, bf16 = PRESETS["h200-fp8"], PRESETS["h100-bf16"]
    assert h200.memory_s(256 * 3200) < H100_FP8.memory_s(256 * 3200)
    assert h200.kv_tokens > H100_FP8.kv_tokens
    assert bf16.prefill_tokens_per_s == pytest.approx(H100_FP8.prefill_tokens_per_s / 2, rel=0.01)
    assert H100_FP8.kv_tokens == pytest.approx(3.08e6, rel=0.01)  # the reference's KV capacity per node


def test_sim_steps_agree_with_the_capacity_planner() -> None:
    for node in PRESETS.values():
        p = node.plan
        batch_tokens = int(p.hardware.max_batch * p.mean_context_tokens)
        assert node.memory_s(batch_tokens) == pytest.approx(p.decode_step_s, rel=1e-9)


async def _long_prompt_among_decoders(budget: int) -> tuple[float, int]:
    """64 streams decode at ~3,200 tokens of context while a 16,000-token prompt arrives: the slowest step
    while it prefills, and how many steps it took."""
    steps: list[StepReport] = []
    core = _engine(device=20_000, budget=budget, steps=steps)
    await core.start()
    shared = list(range(1, 3200))  # one platform prefix: every decoder attends over ~3,200 tokens
    decoders = [asyncio.create_task(_run(core, _params(shared + [5000 + i], prefix=3168, max_tokens=400)))
                for i in range(64)]
    while len(steps) < 20:
        await core.clock.pace(0, 0)
    mark = len(steps)
    started, _, _ = await _run(core, _params(list(range(20_000, 36_000)), salt=b"long", max_tokens=1))
    assert started.cached_tokens == 0
    during = steps[mark:]
    for task in decoders:
        task.cancel()
    await asyncio.gather(*decoders, return_exceptions=True)
    await core.close()
    assert all(s.decode_seqs >= 60 for s in during[:-1])  # the decoders kept stepping throughout
    return max(s.duration_s for s in during), len(during)


async def test_chunked_prefill_keeps_decode_steps_under_50_ms() -> None:
    worst, n = await _long_prompt_among_decoders(512)
    assert worst < 0.050 and n > 16_000 // 512
    worst, n = await _long_prompt_among_decoders(16_384)
    assert worst == pytest.approx(0.360, rel=0.05) and n <= 2  # one step stalls every stream ~360 ms


async def test_coalescing_never_delays_the_first_token(engine: EngineCore) -> None:
    await _run(engine, _params(SYSTEM + [1, 2, 3], max_tokens=1))  # warm: the next prompt is one short step
    t0 = engine.clock.now()
    async for event in engine.generate(_params(SYSTEM + [1, 2, 3], max_tokens=50)):
        if isinstance(event, Delta):
            assert len(event.token_ids) == 1
            assert engine.clock.now() - t0 < 0.010  # one ~4.4 ms step, not the 25 ms flush interval
            break


class _FailingOnce(SimExecutor):
    """Raises on its first step, then works."""

    failed = False

    def execute(self, work: Sequence[SeqWork]) -> StepResult:
        if not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return super().execute(work)


async def test_a_failed_step_ends_its_sequences_with_error_and_the_engine_goes_on() -> None:
    codec = WordCodec()
    core = EngineCore(_FailingOnce(H100_FP8, codec.encode(PASSAGE), 32), BlockConfig(32, 256, 0),
                      SchedulerConfig(8, 512, 8), codec, clock=VirtualClock())
    await core.start()
    try:
        _, tokens, fin = await _run(core, _params(SYSTEM + [1, 2], max_tokens=3))
        assert fin.reason is FinishReason.ERROR and "RuntimeError" in fin.error and tokens == []
        _, tokens, fin = await _run(core, _params(SYSTEM + [1, 2], max_tokens=3))
        assert fin.reason is FinishReason.LENGTH and len(tokens) == 3
        assert core.stats().device.used == core.stats().device.cached
    finally:
        await core.close()


def test_host_onboarding_is_timed_at_pcie_bandwidth() -> None:
    sim = SimExecutor(H100_FP8, [1], 32)
    copies = [BlockCopy(Tier.HOST, i, Tier.DEVICE, i) for i in range(100)]
    # 100 blocks x 32 tokens x 20 KiB per GPU over a 50 GB/s link: 1.3 ms, a tenth of a decode step
    assert sim.copy_blocks(copies) == pytest.approx(100 * 32 * 20_480 / 50e9, rel=1e-9)
    assert sim.copy_blocks([]) == 0.0
