"""One `sim` replica at the reference's per-node load, over real gRPC: does one process keep up, and what CPU
does it need?

Starts `chatmesh serve engine` (sim, 8 x H100 FP8 preset, speed 1) in a child process and drives it from this
process with `--streams` concurrent conversations (default 256, the reference's batch): each turn sends the
conversation so far (a shared ~2,900-token platform prefix, its history, a new message) and streams a
~400-token reply; the next turn follows at once. At batch 256 and ~3,200 tokens of context the roofline step
is ~12.7 ms, so a replica that keeps up streams ~20,000 output tokens/s. Reports achieved tokens/s and
messages/s against that, and the CPU seconds per second of the server and of the client.

    .venv/bin/python -m bench.engine_sim_node [--streams 256] [--seconds 20] [--flush-ms 25]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import cast

import grpc
from chatmesh.v1 import generate_pb2, generate_pb2_grpc

from chatmesh.engine_adapter.roofline import H100_FP8
from chatmesh.mesh import logs
from tests.conftest import free_port

PREFIX = 2_900
REPLY = 400


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Load:
    def __init__(self) -> None:
        self.tokens = 0
        self.messages = 0
        self.turns = 0
        self.cached = 0
        self.prompt = 0


async def _conversation(stub: generate_pb2_grpc.GenerateServiceAsyncStub, n: int, load: Load,
                        stop: asyncio.Event) -> None:
    rng = random.Random(n)
    conv = str(uuid.uuid4())
    history = list(range(1, PREFIX + 1)) + [rng.randrange(1000, 40_000) for _ in range(rng.randrange(50, 250))]
    while not stop.is_set():
        history += [rng.randrange(1000, 40_000) for _ in range(40)]
        req = generate_pb2.GenerateRequest(
            request_id=str(uuid.uuid4()), conversation_id=conv, turn_id=str(uuid.uuid4()),
            prompt_token_ids=history, cache_salt=b"owner-%d" % n, platform_prefix_tokens=PREFIX,
            max_tokens=rng.randrange(REPLY // 2, REPLY * 3 // 2), seed=n)
        call = stub.Generate(req)
        async for resp in call:
            load.messages += 1
            match resp.WhichOneof("event"):
                case "started":
                    load.cached += resp.started.cached_prompt_tokens
                    load.prompt += len(history)
                case "delta":
                    load.tokens += len(resp.delta.token_ids)
                    history += resp.delta.token_ids
                case _:
                    load.turns += 1
            if stop.is_set():
                call.cancel()
                return
        if len(history) > 3_600:  # keep the context near the reference's ~3,200 tokens: a new conversation
            history = history[:PREFIX + 100]
            conv = str(uuid.uuid4())


async def _drive(address: str, streams: int, seconds: float, warmup: float, pid: int) -> None:
    load = Load()
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        tasks = [asyncio.create_task(_conversation(stub, i, load, stop)) for i in range(streams)]
        await asyncio.sleep(warmup)
        t0, tok0, msg0, turns0 = time.perf_counter(), load.tokens, load.messages, load.turns
        srv0, cli0 = _cpu_s(pid), _self_cpu()
        await asyncio.sleep(seconds)
        dt = time.perf_counter() - t0
        srv, cli = (_cpu_s(pid) - srv0) / dt, (_self_cpu() - cli0) / dt
        tokens, messages, turns = load.tokens - tok0, load.messages - msg0, load.turns - turns0
        stats = (await stub.GetStats(generate_pb2.GetStatsRequest())).stats
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    step = H100_FP8.memory_s(streams * 3_200)
    target = streams / step
    print(f"engine_sim_node: {streams} streams, {seconds:.0f} s measured after {warmup:.0f} s warm-up")
    print(f"  output tokens/s {tokens / dt:,.0f} vs roofline {target:,.0f} at batch {streams} "
          f"({tokens / dt / target:.0%}); messages/s {messages / dt:,.0f}; turns/s {turns / dt:.1f}")
    print(f"  CPU: server {srv:.2f} cores, client {cli:.2f} cores; machine has {os.cpu_count()} "
          f"(load average {os.getloadavg()[0]:.1f})")
    per_k = srv / max(tokens / dt, 1) * 1000
    print(f"  server CPU per 1,000 output tokens {per_k * 1000:.0f} ms: {per_k * target / 1000:.2f} cores to stream "
          f"{target:,.0f} tokens/s at this machine's speed")
    print(f"  engine: running {stats.running_sequences}, queued {stats.queue_depth}, prompt hit rate "
          f"{load.cached / max(load.prompt, 1):.0%}, preemptions {stats.preemptions}")


async def _in_process(streams: int) -> None:
    """The engine core alone (no gRPC, virtual time): its CPU per 1,000 output tokens."""
    from chatmesh.engine_adapter.backend import Delta, GenerateParams
    from chatmesh.engine_adapter.block_manager import BlockConfig
    from chatmesh.engine_adapter.engine import EngineCore, VirtualClock
    from chatmesh.engine_adapter.scheduler import SchedulerConfig
    from chatmesh.engine_adapter.sim import SimExecutor
    from chatmesh.engine_adapter.text import PASSAGE, WordCodec

    logs.configure("bench", "warning", json=False)
    codec = WordCodec()
    core = EngineCore(SimExecutor(H100_FP8, codec.encode(PASSAGE), 32), BlockConfig(32, streams * 140, 0),
                      SchedulerConfig(streams, 512, 4096), codec, clock=VirtualClock())
    await core.start()
    shared = tuple(range(1, PREFIX + 1))
    counts = [0, 0]

    async def one(i: int) -> None:
        params = GenerateParams(shared + (5000 + i,) * 200, REPLY, cache_salt=b"%d" % i,
                                platform_prefix_tokens=PREFIX)
        async for event in core.generate(params):
            counts[1] += 1
            if isinstance(event, Delta):
                counts[0] += len(event.token_ids)

    await one(0)
    c0, v0 = _self_cpu(), core.clock.now()
    await asyncio.gather(*(one(i) for i in range(1, streams + 1)))
    cpu, virtual = _self_cpu() - c0, core.clock.now() - v0
    await core.close()
    print(f"engine core in-process ({streams} streams x {REPLY} tokens, virtual time, no gRPC): {counts[0]:,} tokens, "
          f"{counts[1]:,} events, {cpu:.2f} s CPU = {cpu / counts[0] * 1e6:.0f} ms per 1,000 tokens; "
          f"{counts[0] / virtual:,.0f} tokens/s of modelled time")


async def _message_cost(streams: int = 32, per_stream: int = 2_000) -> None:
    """gRPC's own CPU per streamed message (server and client in this process): a servicer yielding one prebuilt
    message vs GenerateServicer over a backend yielding Deltas, so the servicer's own layers show up as the gap."""
    from chatmesh.engine_adapter.backend import (
        Backend,
        Delta,
        Finished,
        FinishReason,
        GenerateEvent,
        GenerateParams,
        Started,
        Usage,
    )
    from chatmesh.engine_adapter.service import GenerateServicer

    class Fake:
        name = "fake"

        async def generate(self, params: GenerateParams) -> AsyncIterator[GenerateEvent]:
            yield Started(0, 0)
            for _ in range(per_stream):
                yield Delta((1, 2), "ab")
            yield Finished(FinishReason.LENGTH, Usage(1, 0, per_stream))

    class Raw(GenerateServicer):
        async def Generate(self, request: generate_pb2.GenerateRequest,
                           context: object) -> AsyncIterator[generate_pb2.GenerateResponse]:
            msg = generate_pb2.GenerateResponse(delta=generate_pb2.GenerateDelta(token_ids=[1, 2], text="ab"))
            for _ in range(per_stream + 2):
                yield msg

    fake = cast(Backend, Fake())
    servicers = [("prebuilt messages", Raw(fake, "r")), ("GenerateServicer", GenerateServicer(fake, "r"))]
    for name, servicer in servicers:
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)

            async def one() -> int:
                req = generate_pb2.GenerateRequest(prompt_token_ids=[1], max_tokens=1)
                return len([r async for r in stub.Generate(req)])

            await one()
            c0 = _self_cpu()
            n = sum(await asyncio.gather(*(one() for _ in range(streams))))
            cpu = _self_cpu() - c0
        await server.stop(0)
        print(f"{name}: {n:,} messages over {streams} streams, {cpu / n * 1e6:.0f} us CPU per message "
              f"(server + client)")


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--warmup", type=float, default=8)
    ap.add_argument("--flush-ms", type=float, default=25)
    ap.add_argument("--text", default="words", choices=("words", "tokenizer"))
    ap.add_argument("--profile", default="", help="write the server's cProfile stats to this file")
    ap.add_argument("--pin", action="store_true", help="server on CPU 0, this client on CPU 1")
    ap.add_argument("--in-process", action="store_true", help="measure the engine core alone, no gRPC")
    ap.add_argument("--message-cost", action="store_true", help="measure gRPC's CPU per streamed message")
    args = ap.parse_args()
    if args.message_cost:
        asyncio.run(_message_cost())
        return
    if args.in_process:
        asyncio.run(_in_process(args.streams))
        return
    port = free_port()
    env = {**os.environ, "CHATMESH_ENGINE": "sim", "CHATMESH_LISTEN": f"127.0.0.1:{port}",
           "CHATMESH_LOG_LEVEL": "warning", "CHATMESH_FLUSH_INTERVAL_MS": str(args.flush_ms),
           "CHATMESH_SIM_TEXT": args.text, "CHATMESH_MAX_BATCH": str(args.streams)}
    prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    pin = ["taskset", "-c", "0"] if args.pin else []
    if args.pin:
        os.sched_setaffinity(0, {1})
    server = subprocess.Popen([*pin, sys.executable, *prof, "-m", "chatmesh.mesh.cli", "serve", "engine"], env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    generate_pb2_grpc.GenerateServiceStub(ch).GetStats(generate_pb2.GetStatsRequest(), timeout=1)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("engine did not start") from None
                time.sleep(0.5)
        asyncio.run(_drive(f"127.0.0.1:{port}", args.streams, args.seconds, args.warmup, server.pid))
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
