"""How many concurrent SSE turn streams one gateway process holds, and the latency the edge adds per event.

    .venv/bin/python -m bench.edge_sse --streams 2000 --interval-ms 1000 --hold-s 20

Three processes: a paced ChatService (below) that streams every turn like the sim engine behind chat does
(`turn.started`, then a delta every `interval_ms` until `hold_s` is over, then `turn.completed`), the gateway
(`chatmesh serve gateway`, the production unit, local identity, limits raised out of the way), and this client,
which opens `streams` turns over raw HTTP/1.1 connections (no client library in the measured path) at `ramp`
per second and holds them.

Latency: each delta's text is the ChatService's wall-clock send time in nanoseconds; the client subtracts it from
its receive time. That is the gRPC hop + the gateway (auth, relay, sanitiser, SSE framing) + the HTTP hop, on one
machine, so it is an upper bound of what the edge adds. Only events received after every stream is open count
(steady state). The machine's load is reported because the 2 cores are shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from chatmesh.gateway.app import tune_gc
from chatmesh.v1 import chat_pb2, chat_pb2_grpc, common_pb2

_TEXT = re.compile(rb'"text":"(\d+)\|"')


class PacedChat(chat_pb2_grpc.ChatServiceServicer):
    """Only the two rpcs the bench drives; the rest are the generated base's UNIMPLEMENTED."""

    def __init__(self, interval_s: float, hold_s: float):
        self.interval_s = interval_s
        self.hold_s = hold_s

    async def CreateConversation(self, request: chat_pb2.CreateConversationRequest,
                                 context: object) -> chat_pb2.CreateConversationResponse:
        return chat_pb2.CreateConversationResponse(conversation=common_pb2.Conversation(
            conversation_id=str(uuid.uuid4()), owner_id=request.owner_id))

    async def SendTurn(self, request: chat_pb2.SendTurnRequest,
                       context: object) -> AsyncIterator[chat_pb2.SendTurnResponse]:
        seq = 1
        yield chat_pb2.SendTurnResponse(event=chat_pb2.TurnEvent(
            sequence=seq, started=chat_pb2.TurnStarted(turn_id=request.turn_id)))
        end = time.monotonic() + self.hold_s
        await asyncio.sleep(self.interval_s * (hash(request.turn_id) % 1000) / 1000)  # spread the phases
        while time.monotonic() < end:
            seq += 1
            yield chat_pb2.SendTurnResponse(event=chat_pb2.TurnEvent(
                sequence=seq, delta=chat_pb2.TurnDelta(text=f"{time.time_ns()}|")))
            await asyncio.sleep(self.interval_s)
        yield chat_pb2.SendTurnResponse(event=chat_pb2.TurnEvent(
            sequence=seq + 1, completed=chat_pb2.TurnCompleted(usage=common_pb2.Usage(prompt_tokens=10))))


async def serve_chat(port: int, interval_s: float, hold_s: float) -> None:
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100_000)])
    chat_pb2_grpc.add_ChatServiceServicer_to_server(PacedChat(interval_s, hold_s), server)  # type: ignore[abstract]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


@dataclass
class Stats:
    opened: int = 0
    failed: int = 0
    open_now: int = 0
    peak_open: int = 0
    completed: int = 0
    steady: bool = False
    latencies_ms: list[float] = field(default_factory=list)


async def one_stream(host: str, port: int, conv: str, stats: Stats) -> None:
    body = json.dumps({"turn_id": str(uuid.uuid4()), "content": "bench"}).encode()
    try:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 16)
    except OSError:
        stats.failed += 1
        return
    try:
        writer.write(b"POST /v1/conversations/%s/turns HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (conv.encode(), host.encode(), len(body), body))
        status = await reader.readline()
        if b" 200 " not in status:
            stats.failed += 1
            return
        stats.opened += 1
        stats.open_now += 1
        stats.peak_open = max(stats.peak_open, stats.open_now)
        try:
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                now = time.time_ns()
                if stats.steady:
                    for m in _TEXT.finditer(chunk):
                        stats.latencies_ms.append((now - int(m.group(1))) / 1e6)
                if b"turn.completed" in chunk:
                    stats.completed += 1
                    break
        finally:
            stats.open_now -= 1
    except OSError:
        stats.failed += 1
    finally:
        writer.close()


async def wait_http(host: str, port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            if b"200" in await reader.readline():
                writer.close()
                return
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise SystemExit("gateway did not start")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def client(args: argparse.Namespace, port: int, gateway_pid: int, chat_pid: int) -> dict[str, object]:
    await wait_http("127.0.0.1", port)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/conversations HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    conv = json.loads((await reader.read()).split(b"\r\n\r\n", 1)[1])["id"]
    writer.close()
    stats = Stats()
    tasks = []
    t0 = time.monotonic()
    for i in range(args.streams):
        tasks.append(asyncio.create_task(one_stream("127.0.0.1", port, conv, stats)))
        if (i + 1) % max(1, args.ramp // 10) == 0:
            await asyncio.sleep(0.1)
    while stats.opened + stats.failed < args.streams and time.monotonic() - t0 < args.hold_s:
        await asyncio.sleep(0.1)
    ramp_s = time.monotonic() - t0
    stats.steady = True
    pids = (gateway_pid, chat_pid, os.getpid())
    cpu0, w0 = [cpu_seconds(p) for p in pids], time.monotonic()
    await asyncio.sleep(args.measure_s)
    cpu1, w1 = [cpu_seconds(p) for p in pids], time.monotonic()
    cpu_pct = [round(100 * (b - a) / (w1 - w0)) for a, b in zip(cpu0, cpu1)]
    stats.steady = False
    held_during_measure = stats.open_now
    await asyncio.gather(*tasks)
    lat = sorted(stats.latencies_ms)

    def pct(p: float) -> float:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))], 2) if lat else float("nan")

    return {
        "streams_requested": args.streams, "opened": stats.opened, "failed": stats.failed,
        "peak_open": stats.peak_open, "open_at_end_of_measure": held_during_measure,
        "completed": stats.completed, "ramp_s": round(ramp_s, 1),
        "events_measured": len(lat), "events_per_s": round(len(lat) / args.measure_s),
        "latency_ms_p50": pct(0.50), "latency_ms_p95": pct(0.95), "latency_ms_p99": pct(0.99),
        "latency_ms_mean": round(statistics.fmean(lat), 2) if lat else None,
        "cpu_pct_gateway_chat_client": cpu_pct,
        "load_avg": os.getloadavg()[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--interval-ms", type=float, default=1000.0, help="per-stream gap between deltas")
    parser.add_argument("--hold-s", type=float, default=40.0, help="how long each turn streams")
    parser.add_argument("--measure-s", type=float, default=10.0, help="steady-state window after the ramp")
    parser.add_argument("--ramp", type=int, default=400, help="new streams per second")
    parser.add_argument("--role", choices=("run", "chat"), default="run")
    parser.add_argument("--chat-port", type=int, default=0)
    parser.add_argument("--gc-threshold", type=int, default=0, help="experiment: gateway gen0 GC threshold")
    parser.add_argument("--profile", default="", help="write a cProfile of the gateway process to this file")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tune_gc()  # the load generator and the paced chat hold 2,000 streams too: same tuning as the gateway
    if args.role == "chat":
        asyncio.run(serve_chat(args.chat_port, args.interval_ms / 1000, args.hold_s))
        return 0
    chat_port, gw_port = free_port(), free_port()
    env = {**os.environ, "CHATMESH_CHAT_ADDRESS": f"127.0.0.1:{chat_port}", "CHATMESH_GATEWAY_PORT": str(gw_port),
           "CHATMESH_LIMIT_OPEN_STREAMS": str(args.streams * 2), "CHATMESH_LIMIT_TURNS_PER_MINUTE": "1000000",
           "CHATMESH_LOG_LEVEL": "warning", "CHATMESH_DATA_DIR": f"/tmp/chatmesh-bench-{os.getpid()}"}
    chat = subprocess.Popen([sys.executable, "-m", "bench.edge_sse", "--role", "chat", "--chat-port",
                             str(chat_port), "--interval-ms", str(args.interval_ms), "--hold-s", str(args.hold_s)])
    profile = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    entry = ["-c", f"import gc, sys; gc.set_threshold({max(0, args.gc_threshold)}, 10, 10); from chatmesh.mesh.cli import main; "
                   "sys.exit(main(['serve', 'gateway']))"] if args.gc_threshold else \
        ["-m", "chatmesh.mesh.cli", "serve", "gateway"]
    gateway = subprocess.Popen([sys.executable, *profile, *entry], env=env)
    try:
        result = asyncio.run(client(args, gw_port, gateway.pid, chat.pid))
    finally:
        for proc in (gateway, chat):
            proc.send_signal(signal.SIGTERM)
        for proc in (gateway, chat):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps({"interval_ms": args.interval_ms, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
