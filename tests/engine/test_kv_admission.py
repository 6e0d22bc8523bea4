"""Admission by free blocks, checked against the capacity planner (issue 31): the scheduler says why its queue
waits (KV room, batch slots, the step's budget), and a sim replica holding the reference's KV room admits, at
32,000-token prompts, no more sequences than `chatmesh capacity` says fit (95, within one), with its metrics
saying that admission is memory-bound."""

from __future__ import annotations

import asyncio
import dataclasses

from chatmesh.engine_adapter.backend import EngineStats, GenerateParams
from chatmesh.engine_adapter.block_manager import BlockConfig, BlockManager
from chatmesh.engine_adapter.engine import EngineCore, StepReport, VirtualClock
from chatmesh.engine_adapter.executor import StepResult
from chatmesh.engine_adapter.observe import EngineMetrics
from chatmesh.engine_adapter.roofline import H100_FP8
from chatmesh.engine_adapter.scheduler import Scheduler, SchedulerConfig, Step, Waiting
from chatmesh.engine_adapter.sim import SimExecutor
from chatmesh.engine_adapter.text import PASSAGE, WordCodec
from chatmesh.mesh import metrics, status
from chatmesh.router import capacity


def _params(n: int, base: int) -> GenerateParams:
    return GenerateParams(tuple(range(base, base + n)), 4, cache_salt=b"s%d" % base)


def _done(step: Step) -> StepResult:
    return StepResult({w.seq_id: 9 for w in step.work if w.sample}, 0.01)


def test_the_scheduler_says_why_its_queue_waits() -> None:
    s = Scheduler(SchedulerConfig(max_batch=2, step_token_budget=64, queue_limit=8),
                  BlockManager(BlockConfig(4, 8, 0)), stop_ids={0})
    s.complete(step := s.schedule(), _done(step))
    assert s.counters().waiting_reason is Waiting.NONE
    s.add(_params(20, 100))  # 5 of the 8 blocks
    s.add(_params(20, 200))  # 5 more: does not fit beside the first
    s.complete(step := s.schedule(), _done(step))
    assert len(s.running) == 1
    c = s.counters()
    assert (c.waiting_reason, c.kv_stall_steps, c.batch_stall_steps) == (Waiting.KV_MEMORY, 1, 0)

    s = Scheduler(SchedulerConfig(max_batch=1, step_token_budget=64, queue_limit=8),
                  BlockManager(BlockConfig(4, 64, 0)), stop_ids={0})
    s.add(_params(8, 100))
    s.add(_params(8, 200))
    s.complete(step := s.schedule(), _done(step))
    assert s.waiting_reason is Waiting.BATCH_SLOTS and s.counters().batch_stall_steps == 1

    s = Scheduler(SchedulerConfig(max_batch=4, step_token_budget=8, queue_limit=8),
                  BlockManager(BlockConfig(4, 64, 0)), stop_ids={0})
    s.add(_params(8, 100))
    s.add(_params(8, 200))  # the first prompt takes the whole budget: the second goes in a later step
    s.complete(step := s.schedule(), _done(step))
    assert s.waiting_reason is Waiting.STEP_BUDGET
    assert s.counters().kv_stall_steps == s.counters().batch_stall_steps == 0


async def test_a_reference_replica_at_32k_prompts_admits_what_the_planner_says_fits() -> None:
    planned = capacity.plan(workload=dataclasses.replace(capacity.Workload(), prompt_tokens=32_000))
    assert planned.kv_tokens_per_replica == H100_FP8.kv_tokens  # the sim's node is the planner's replica
    fit = planned.fit_per_replica
    assert fit == 95 and planned.batch == fit < planned.hardware.max_batch
    codec = WordCodec()
    stats: list[EngineStats] = []
    # A budget of one prompt per step fills the KV room in ~100 steps (at the default 512 tokens a replica prefills
    # a 32k prompt in ~70 steps while earlier ones finish their 400-token replies, so it is prefill-bound instead);
    # admission is the same code: the head goes in when its first chunk's blocks fit.
    core = EngineCore(SimExecutor(H100_FP8, codec.encode(PASSAGE), 32),
                      BlockConfig(32, int(H100_FP8.kv_tokens // 32), 0),
                      SchedulerConfig(planned.hardware.max_batch, 32_768, 4096), codec, clock=VirtualClock(),
                      on_step=lambda _: stats.append(core.stats()))
    registry = metrics.Registry(process=False)
    EngineMetrics(registry, core)
    await core.start()

    async def turn(i: int) -> None:
        async for _ in core.generate(GenerateParams(tuple(range(i * 40_000 + 1, i * 40_000 + 32_001)),
                                                    planned.workload.output_tokens, cache_salt=b"o%d" % i)):
            pass

    turns = [asyncio.create_task(turn(i)) for i in range(fit + 25)]
    try:
        while len(stats) < 260:  # the ramp (~100 steps), then decoding, well before the first replies end (~400)
            await asyncio.sleep(0.005)
        got = status.parse(registry.exposition().decode())
        before = stats[:260]  # the steps before the turns are cancelled
    finally:
        for t in turns:
            t.cancel()
        await asyncio.gather(*turns, return_exceptions=True)
        await core.close()
    # The ramp admits one prompt a step; its last admission holds only a first chunk and is preempted at once as
    # the decoders grow (so one step shows fit + 2 running), then the batch stays at what the room holds: 96
    # while the contexts are ~32,050 tokens, 95 as they pass the planner's mean of 32,200.
    steady = before[100:]
    running = [s.running_sequences for s in steady]
    assert max(running) <= fit + 1 and min(running) >= fit - 1, (min(running), max(running))
    assert abs(sum(running) / len(running) - fit) <= 1
    assert max(s.running_sequences for s in before) <= fit + 2
    # and memory is what held it there: sequences waited for KV room, never for a batch slot
    assert all(s.queue_depth > 0 for s in steady)
    assert sum(1 for s in steady if s.waiting_kv == s.queue_depth) > len(steady) / 2
    last = before[-1]
    assert last.kv_stall_steps > len(steady) / 2 and last.batch_stall_steps == 0 and last.waiting_batch == 0
    assert got["chatmesh_engine_admission_stalls_total", (("reason", "kv_memory"),)] >= last.kv_stall_steps
    assert got["chatmesh_engine_admission_stalls_total", (("reason", "batch_slots"),)] == 0
    assert sum(got["chatmesh_engine_waiting_by_reason", (("reason", r),)]
               for r in ("kv_memory", "batch_slots", "step_budget")) == got["chatmesh_engine_waiting_sequences", ()]
