"""Scheduler + block-manager overhead per engine step at the reference's batch: 256 sequences decoding at
~3,200 tokens of context (target: under 1 ms of Python per step, against a 12.7 ms GPU step).

Runs schedule() + complete() with a stub executor result (the executor's own cost is excluded; the sim
executor's is reported separately), after warming the batch up to steady decode.

    .venv/bin/python -m bench.engine_step [--steps 400] [--batch 256] [--context 3200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from chatmesh.engine_adapter.backend import GenerateParams
from chatmesh.engine_adapter.block_manager import BlockConfig, BlockManager
from chatmesh.engine_adapter.executor import StepResult
from chatmesh.engine_adapter.roofline import H100_FP8
from chatmesh.engine_adapter.scheduler import Scheduler, SchedulerConfig
from chatmesh.engine_adapter.sim import SimExecutor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=3200)
    args = ap.parse_args()
    bs = 32
    per_seq = (args.context + args.steps + 64) // bs + 1
    blocks = BlockManager(BlockConfig(bs, args.batch * per_seq + 1024, 0))
    sched = Scheduler(SchedulerConfig(args.batch, 512, 4096), blocks)
    shared = list(range(1, args.context - 32))  # a platform prefix shared by all: warm-up prefill stays short
    for i in range(args.batch):
        prompt = shared + [10_000 + i] * 32
        sched.add(GenerateParams(tuple(prompt), 100_000, cache_salt=b"s%d" % i, platform_prefix_tokens=len(shared)))
    sim = SimExecutor(H100_FP8, list(range(100, 400)), bs)
    while len(sched.running) < args.batch or any(s.num_computed < len(s.tokens) - 1 for s in sched.running):
        step = sched.schedule()
        sched.complete(step, sim.execute(step.work))
    stub = StepResult({s.seq_id: 7 for s in sched.running}, 0.0)
    times, cpu_times, sim_times = [], [], []
    for _ in range(args.steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        step = sched.schedule()
        t1 = time.perf_counter()
        result = sim.execute(step.work)
        c2, t2 = time.thread_time(), time.perf_counter()
        sched.complete(step, stub)
        c3, t3 = time.thread_time(), time.perf_counter()
        times.append((t1 - t0) + (t3 - t2))
        cpu_times.append(c3 - c0 - (t2 - t1))
        sim_times.append(t2 - t1)
        assert len(step.work) == args.batch and result.duration_s > 0
    times.sort()
    cpu_times.sort()
    ms = 1e3
    print(f"engine_step: batch {args.batch}, context ~{args.context}, {args.steps} decode steps")
    print(f"  scheduler + block manager per step: mean {statistics.mean(times) * ms:.3f} ms, "
          f"p50 {times[len(times) // 2] * ms:.3f} ms, p99 {times[int(len(times) * 0.99)] * ms:.3f} ms")
    print(f"  the same in CPU time of this thread: p50 {cpu_times[len(cpu_times) // 2] * ms:.3f} ms; fastest step "
          f"(wall) {times[0] * ms:.3f} ms (wall time includes waiting for a CPU on a shared machine)")
    print(f"  sim executor (roofline + sampling) per step: mean {statistics.mean(sim_times) * ms:.3f} ms")
    print(f"  modelled GPU step: {result.duration_s * ms:.2f} ms")


if __name__ == "__main__":
    main()
