"""What the Triton hop costs: the same sim engine and workload, in-process vs behind tritonserver.

Both sides run chatmesh's EngineCore with the sim executor at a fixed 1 ms step (so the engine's own time is
the same and small), streams flushed every token (one Delta per token: the hop's worst case). The `triton` side
adds tritonclient's asyncio gRPC stream -> Triton's gRPC frontend -> the Python backend's shared-memory IPC to
the stub process -> the model's engine loop thread, and back per response.

Reported per mode, over `--requests` generations (`--concurrency` at a time): TTFT (call to the first Delta) and
per-token time (first Delta to Finished, divided by the tokens after the first); the added cost is the difference.

    .venv/bin/python -m bench.triton_hop [--requests 40] [--tokens 64] [--concurrency 1] [--flush-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from chatmesh.engine_adapter.backend import Backend, Delta, Finished, GenerateParams
from chatmesh.engine_adapter.executor import SamplingParams
from chatmesh.engine_adapter.service import build_backend
from chatmesh.engine_adapter.triton.backend import TritonBackend, TritonOptions
from chatmesh.engine_adapter.triton.render import Deployment, local_server
from chatmesh.mesh.config import Config

ENV = {"CHATMESH_SIM_STEP_MS": "1", "CHATMESH_SIM_TEXT": "words", "CHATMESH_FLUSH_INTERVAL_MS": "0",
       "CHATMESH_BLOCK_SIZE": "32", "CHATMESH_DEVICE_BLOCKS": "4096", "CHATMESH_HOST_BLOCKS": "0"}
SYSTEM = tuple(range(100, 164))


async def one(backend: Backend, i: int, tokens: int) -> tuple[float, float, int]:
    params = GenerateParams(SYSTEM + tuple(range(300 + i, 364 + i)), tokens, cache_salt=b"o%d" % i,
                            platform_prefix_tokens=len(SYSTEM), sampling=SamplingParams(seed=i))
    t0 = time.perf_counter()
    first = end = 0.0
    n = 0
    async for event in backend.generate(params):
        if isinstance(event, Delta):
            n += len(event.token_ids)
            if not first:
                first = time.perf_counter()
        elif isinstance(event, Finished):
            end = time.perf_counter()
    return first - t0, (end - first) / max(n - 1, 1), n


async def run(backend: Backend, requests: int, tokens: int, concurrency: int) -> tuple[list[float], list[float]]:
    ttft: list[float] = []
    per_token: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def task(i: int) -> None:
        async with gate:
            a, b, _ = await one(backend, i, tokens)
            ttft.append(a)
            per_token.append(b)

    await one(backend, 10_000, 4)  # warm-up
    await asyncio.gather(*(task(i) for i in range(requests)))
    return ttft, per_token


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--flush-ms", type=float, default=0.0, help="stream flush interval (0: a Delta per token)")
    ap.add_argument("--cancel-check-ms", type=int, default=50, help="the model's cancellation poll period")
    args = ap.parse_args()
    env = {**ENV, "CHATMESH_FLUSH_INTERVAL_MS": str(args.flush_ms)}

    local = build_backend(Config(env={**env, "CHATMESH_ENGINE": "sim"}))
    await local.start()
    try:
        results = {"in-process": await run(local, args.requests, args.tokens, args.concurrency)}
    finally:
        await local.close()

    with tempfile.TemporaryDirectory() as tmp:
        deployment = Deployment(engine="sim", engine_env=env, cancel_check_ms=args.cancel_check_ms)
        server = local_server(deployment, Path(tmp) / "repository")
        await server.start_async()
        try:
            remote = TritonBackend(TritonOptions(address=server.address))
            await remote.start()
            try:
                results["triton"] = await run(remote, args.requests, args.tokens, args.concurrency)
            finally:
                await remote.close()
        finally:
            server.stop()

    print(f"{args.requests} generations x {args.tokens} tokens, concurrency {args.concurrency}, sim step 1 ms, "
          f"flush {args.flush_ms:g} ms")
    print(f"{'mode':<11} {'TTFT p50':>9} {'TTFT p90':>9} {'per-token p50':>14} {'per-token p90':>14}")
    for mode, (ttft, per_token) in results.items():
        print(f"{mode:<11} {p(ttft, 50) * 1e3:8.2f}ms {p(ttft, 90) * 1e3:8.2f}ms "
              f"{p(per_token, 50) * 1e3:13.3f}ms {p(per_token, 90) * 1e3:13.3f}ms")
    (lt, lp), (tt, tp) = results["in-process"], results["triton"]
    print(f"added by the Triton hop: TTFT {(statistics.median(tt) - statistics.median(lt)) * 1e3:+.2f} ms (p50), "
          f"per token {(statistics.median(tp) - statistics.median(lp)) * 1e3:+.3f} ms (p50)")


if __name__ == "__main__":
    asyncio.run(main())
