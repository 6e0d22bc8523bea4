"""The scheduler alone: the step token budget mixes decode with prefill chunks, the batch and queue are bounded,
cancellation frees at the next step, preemption recomputes, and the plan it hands the executor is exact."""

from __future__ import annotations

import dataclasses

import pytest

from chatmesh.engine_adapter.backend import FinishReason, GenerateParams
from chatmesh.engine_adapter.block_manager import BlockConfig, BlockManager
from chatmesh.engine_adapter.executor import SamplingParams, SeqWork, StepResult
from chatmesh.engine_adapter.scheduler import Scheduler, SchedulerConfig, SeqState, Step, _work
from chatmesh.mesh.errors import InvalidArgument, ResourceExhausted


def _sched(max_batch: int = 4, budget: int = 64, queue: int = 8, device: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_batch, budget, queue), BlockManager(BlockConfig(4, device, 0)), stop_ids={0})


def _params(n: int, max_tokens: int = 4, base: int = 1, salt: bytes = b"") -> GenerateParams:
    return GenerateParams(tuple(range(base, base + n)), max_tokens, cache_salt=salt)


def _result(step: Step, token: int = 9) -> StepResult:
    return StepResult({w.seq_id: token for w in step.work if w.sample}, 0.01)


def test_fast_seq_work_equals_the_constructor() -> None:
    args = (3, [1, 2], 5, [7, 8], True, SamplingParams(0.5, 0.9, 4))
    fast = _work(*args)
    assert fast == SeqWork(*args) and repr(fast) == repr(SeqWork(*args))
    assert dataclasses.asdict(fast) == dataclasses.asdict(SeqWork(*args))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.start_pos = 1  # type: ignore[misc]


def test_budget_puts_decodes_first_then_prefill_chunks() -> None:
    s = _sched(budget=16)
    a = s.add(_params(5, max_tokens=10, base=100))
    step = s.schedule()
    assert [len(w.token_ids) for w in step.work] == [5] and step.work[0].sample and step.admitted == [a]
    s.complete(step, _result(step))
    b = s.add(_params(40, base=200))
    step = s.schedule()
    assert [(w.seq_id, len(w.token_ids), w.sample) for w in step.work] == [(a.seq_id, 1, True), (b.seq_id, 15, False)]
    s.complete(step, _result(step))
    step = s.schedule()
    assert [(w.seq_id, w.start_pos, len(w.token_ids)) for w in step.work] == [(a.seq_id, 6, 1), (b.seq_id, 15, 15)]
    assert all(len(w.block_table) * 4 >= w.start_pos + len(w.token_ids) for w in step.work)


def test_generation_ends_at_max_tokens_or_stop() -> None:
    s = _sched()
    a = s.add(_params(3, max_tokens=1))
    b = s.add(_params(3, max_tokens=5, base=50))
    for token in (9, 0):  # 0 is a stop id
        step = s.schedule()
        s.complete(step, _result(step, token))
    assert a.finish is FinishReason.LENGTH and a.output_tokens == 1 and a.take_new() == [9]
    assert b.finish is FinishReason.STOP and b.output_tokens == 2 and b.take_new() == [9]
    assert s.running == [] and s.blocks.available_blocks == 64


def test_max_batch_and_queue_limit() -> None:
    s = _sched(max_batch=2, queue=3)
    for i in range(3):
        s.add(_params(3, base=i * 10))
    with pytest.raises(ResourceExhausted):
        s.add(_params(3))
    step = s.schedule()
    assert len(s.running) == 2 and len(step.work) == 2 and s.counters().queue_depth == 1
    with pytest.raises(InvalidArgument):
        s.add(_params(64 * 4))  # longer than the whole device tier


def test_cancel_frees_blocks_at_the_next_step() -> None:
    s = _sched()
    a = s.add(_params(30, max_tokens=100))
    step = s.schedule()
    s.complete(step, _result(step))
    assert s.blocks.stats().device_free < 64
    s.cancel(a)
    assert a.state is SeqState.RUNNING  # nothing happens until the next step
    step = s.schedule()
    assert step.finished == [a] and a.finish is FinishReason.CANCELLED and step.work == []
    assert s.blocks.stats().device_free + s.blocks.stats().device_cached == 64
    queued = s.add(_params(3))
    s.cancel(queued)
    s.schedule()
    assert queued.finish is FinishReason.CANCELLED and not s.waiting


def test_preemption_recomputes_the_newest_sequence() -> None:
    s = _sched(max_batch=4, budget=64, device=8)
    a = s.add(_params(11, max_tokens=15, base=100, salt=b"a"))  # 26 tokens: 7 blocks each, 8 in the tier
    b = s.add(_params(11, max_tokens=15, base=200, salt=b"b"))
    produced: dict[int, list[int]] = {a.seq_id: [], b.seq_id: []}
    while s.running or s.waiting:
        step = s.schedule()
        result = StepResult({w.seq_id: 1000 + w.start_pos + len(w.token_ids) for w in step.work if w.sample}, 0.0)
        for seq in s.complete(step, result):
            produced[seq.seq_id] += seq.take_new()
    assert s.preemptions > 0
    for seq in (a, b):  # each token is a function of its position: recompute must not shift or repeat any
        assert produced[seq.seq_id] == [1000 + 11 + i for i in range(15)]
        assert seq.finish is FinishReason.LENGTH and seq.output_tokens == 15
    assert s.blocks.available_blocks == 8
