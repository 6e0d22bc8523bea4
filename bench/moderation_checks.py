"""Output-check latency per 25 ms chunk and checks per second on one core.

A 25 ms chunk of a reply streamed at ~100 tokens/s is 2-3 tokens, about 12 characters. Replies are built from
the evaluation set's outputs (mostly benign text, some violations) and cut into 12-character chunks.

1. core: `OutputCheck.check` called in a loop in this process (no transport): p50/p95 per chunk, and checks
   per second of check time on one core.
2. service: `chatmesh serve moderation` in a child process pinned to one core (taskset), with N concurrent
   output streams driven by `ModerationClient` sessions from this process (pinned to the other core). Each
   stream sends a chunk and awaits its verdict, as chat does. Reports the round trip p50/p95 per chunk, checks/s,
   and checks per CPU-second the server process used (from /proc), the fair "one core" figure on a shared
   machine. The service batches the checks of all streams per event-loop turn.

Run: .venv/bin/python -m bench.moderation_checks [--seconds 5] [--streams 1,64,256] [--rate 40]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time

import grpc

from chatmesh.mesh.config import Config
from chatmesh.moderation.classifier import profanity_model
from chatmesh.moderation.client import ModerationClient
from chatmesh.moderation.evaluation import load_examples
from chatmesh.moderation.moderator import Moderator
from chatmesh.moderation.policy import Direction, load
from chatmesh.v1 import moderate_pb2, moderate_pb2_grpc

CHUNK_CHARS = 12


def replies() -> list[list[str]]:
    out = []
    for e in load_examples():
        if e.direction is Direction.OUTPUT:
            text = "".join(e.chunks) + " " + "".join(e.chunks)
            out.append([text[i:i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)])
    return out


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def bench_core(seconds: float) -> None:
    moderator = Moderator(load(), profanity_model())
    chunks_of = replies()
    times: list[float] = []
    start, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        for reply in chunks_of:
            check = moderator.open_output()
            for chunk in reply:
                t = time.perf_counter()
                check.check(chunk)
                times.append(time.perf_counter() - t)
    cpu = time.process_time() - cpu0
    print(f"core: {len(times)} checks, p50 {pct(times, 50) * 1e6:.0f} us, p95 {pct(times, 95) * 1e6:.0f} us "
          f"(wall, preemption included), {len(times) / cpu:,.0f} checks per CPU-second "
          f"({cpu / len(times) * 1e6:.0f} us CPU per check, timing overhead included)")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_ready(address: str, limit_s: float = 120) -> None:
    end = time.monotonic() + limit_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = moderate_pb2_grpc.ModerateServiceStub(channel)
        while True:
            try:
                await stub.CheckInput(moderate_pb2.CheckInputRequest(text="ready?"), timeout=2)
                return
            except grpc.aio.AioRpcError:
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.5)


async def drive(address: str, streams: int, seconds: float, rate: float,
                batch_ms: float = 1.0) -> tuple[list[float], int]:
    """`streams` replies at once; each sends its next chunk when the verdict is back (rate 0) or every
    1/rate seconds (paced, like a real reply), and starts a new reply when one ends."""
    env = {"CHATMESH_MODERATION_ADDRESS": address, "CHATMESH_MODERATION_CLIENT_TIMEOUT_MS": "5000",
           "CHATMESH_MODERATION_CLIENT_BATCH_MS": str(batch_ms)}
    client = ModerationClient.from_config(Config(env=env))
    chunks_of = replies()
    times: list[float] = []
    fallbacks = 0
    deadline = time.perf_counter() + seconds

    async def one(n: int) -> None:
        nonlocal fallbacks
        if rate:
            await asyncio.sleep(n / streams / rate)  # spread the streams over one chunk interval
        while time.perf_counter() < deadline:
            async with client.output(f"bench-{n}") as session:
                for chunk in chunks_of[n % len(chunks_of)]:
                    t = time.perf_counter()
                    outcome = await session.check(chunk)
                    times.append(time.perf_counter() - t)
                    fallbacks += outcome.fallback
                    if time.perf_counter() >= deadline:
                        break
                    if rate:
                        await asyncio.sleep(max(0.0, 1 / rate - (time.perf_counter() - t)))

    await asyncio.gather(*(one(n) for n in range(streams)))
    await client.close()
    return times, fallbacks


def bench_service(seconds: float, streams_list: list[int], extra_env: dict[str, str], rate: float,
                  batch_ms: float) -> None:
    port = 50900 + os.getpid() % 90
    address = f"127.0.0.1:{port}"
    pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    cmd = [sys.executable, "-m", "chatmesh.mesh.cli", "serve", "moderation", "--listen", address,
           "--log-level", "warning"]
    server = subprocess.Popen((["taskset", "-c", "0"] if pin else []) + cmd, env={**os.environ, **extra_env})
    if pin:
        os.sched_setaffinity(0, {1})
    try:
        asyncio.run(wait_ready(address))
        for streams in streams_list:
            cpu0 = cpu_seconds(server.pid)
            t0 = time.perf_counter()
            times, fallbacks = asyncio.run(drive(address, streams, seconds, rate, batch_ms))
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(server.pid) - cpu0
            mode = (f"paced {rate:g} chunks/s each" if rate else "closed loop") + f", client batch {batch_ms:g} ms"
            print(f"service {extra_env or ''}, {streams} streams, {mode}: {len(times) / wall:,.0f} checks/s "
                  f"({len(times) / max(cpu, 1e-9):,.0f} per server CPU-second, server CPU {cpu / wall:.0%}); "
                  f"round trip p50 {pct(times, 50) * 1e3:.2f} ms, p95 {pct(times, 95) * 1e3:.2f} ms; "
                  f"fallbacks {fallbacks}")
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--streams", default="1,64,256")
    parser.add_argument("--skip-service", action="store_true")
    parser.add_argument("--threaded", action="store_true", help="also run the service with a check thread")
    parser.add_argument("--batch-ms", default="1", help="client batch linger(s) to compare, ms, comma-separated")
    parser.add_argument("--rate", type=float, default=0.0, help="chunks/s per stream (0: as fast as verdicts come)")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores; chunk {CHUNK_CHARS} chars (~25 ms of tokens)")
    bench_core(args.seconds)
    if not args.skip_service:
        streams = [int(s) for s in args.streams.split(",")]
        for batch_ms in args.batch_ms.split(","):
            bench_service(args.seconds, streams, {}, args.rate, float(batch_ms))
        if args.threaded:
            bench_service(args.seconds, streams, {"CHATMESH_MODERATION_CHECK_THREAD": "1"}, args.rate, 1.0)


if __name__ == "__main__":
    main()
