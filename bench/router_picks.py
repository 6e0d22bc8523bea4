"""Picks per second through the router: the ring core in-process, and RouteService over gRPC, one core each.

core: one `Ring` of 8 replicas (160 points each, eps 0.5), pinned to CPU 1. Each cycle picks for the next of
100,000 conversation ids and releases the lease opened `--in-flight` picks earlier (so 300 leases stay open,
the reference fleet's scale); `now` is the monotonic clock, read once per 1,000 picks. Also picks alone (no
releases: the open leases pile up). Rate = picks / the process's CPU time (and / wall time). The same for the
follow policy (follow.py, its defaults, over the same ring): there every eighth pick is a conversation it has
never seen (a first turn, placed by scanning the replicas' loads) and the rest return to their home, the
reference workload's mix; an engine residency report for 1,000 conversations is applied once per 1,000 picks
(far more than engines send: one per conversation per turn).

service: `chatmesh serve router` in its own process pinned to CPU 1 with taskset (health watching off, 8
configured replicas); this process, pinned to CPU 0, runs `--clients` asyncio tasks on one channel calling
PickReplica (and ReleaseLease in the cycle mode). Rate = picks / the server process's CPU time read from /proc
(all its threads), and / wall time; context switches per call are summed over the server's threads.

Baselines, so the router's own cost can be told from grpc's: grpc.health.v1 Check on the same router server,
and a bare grpc.aio server (this file with --bare-server, same CPU, same server options as the bootstrap)
answering a no-op unary method (bytes in, bytes out, no protobuf) and a PickReplica that returns one constant
response (protobuf, no router work); and grpc's threaded server (a pool of 4) with the same no-op method.

Every path runs `--rounds` times, interleaved; the table shows the median round. Issue 4's targets: core
>= 200,000 picks/s, service >= 5,000 picks/s (15x the reference fleet's 333 turns/s), one core each.

    .venv/bin/python -m bench.router_picks [--seconds 3] [--rounds 3] [--clients 64] [--core-only]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chatmesh.mesh.ids import ConversationId, LeaseId, ReplicaId
from chatmesh.router.follow import Follow
from chatmesh.router.ring import Replica, Ring
from chatmesh.v1 import route_pb2, route_pb2_grpc

REPLICAS = 8
CONVERSATIONS = [ConversationId(str(uuid.uuid4())) for _ in range(100_000)]
SERVER_CPU, CLIENT_CPU = 1, 0
NOOP_METHOD = "/chatmesh.bench.Bare/Noop"
SERVER_OPTIONS = [("grpc.so_reuseport", 0)]  # as chatmesh.mesh.server.serve
SYNC_THREADS = 4


@dataclass(frozen=True)
class Rate:
    wall: float          # calls per wall second
    cpu: float           # calls per CPU second (the core's process, or the server process)
    switches: float      # server context switches per call (nan for the core)


def pin(cpu: int) -> bool:
    """Moves every thread of this process to one CPU; False where that is not possible."""
    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return False
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {cpu})
        except (ProcessLookupError, PermissionError):
            pass
    return True


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def context_switches(pid: int) -> int:
    """Voluntary + involuntary context switches summed over a process's threads."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    total += int(line.split()[1])
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return total


def core(seconds: float, in_flight: int, release: bool, policy: str = "ring") -> Rate:
    replicas = [Replica(ReplicaId(f"engine-{i}"), f"127.0.0.1:{50054 + 10 * i}") for i in range(REPLICAS)]
    kv = Follow(replicas) if policy == "follow" else None
    ring = kv if kv is not None else Ring(replicas)
    pick, free = ring.pick, ring.release
    window: list[LeaseId] = [pick(c, time.monotonic()).lease_id for c in CONVERSATIONS[-in_flight:]]
    # follow: 7 of 8 picks go to conversations it has placed before, 1 in 8 to one it has never seen
    known = CONVERSATIONS[:len(CONVERSATIONS) * 7 // 8]
    fresh = iter([ConversationId(str(uuid.uuid4())) for _ in range(200_000)] if kv is not None else [])
    if kv is not None:
        for c in known:
            free(pick(c, time.monotonic()).lease_id)
    ids = [r.replica.id for r in ring.loads()]
    n, batch = 0, 1000
    deadline = time.perf_counter() + seconds
    start, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() < deadline:
        now = time.monotonic()
        if kv is None:
            first = n % len(CONVERSATIONS)
            todo = CONVERSATIONS[first:first + batch]
        else:
            first = n % len(known)
            todo = [next(fresh) if i % 8 == 7 else c for i, c in enumerate(known[first:first + batch])]
        picked: dict[ReplicaId, list[tuple[ConversationId, int]]] = {rid: [] for rid in ids}
        for conversation in todo:
            p = pick(conversation, now)
            if kv is not None:
                picked[p.replica.id].append((conversation, 3000))
            if release:
                k = n % in_flight
                free(window[k])
                window[k] = p.lease_id
            n += 1
        if kv is not None:  # the engines' residency reports for what this batch stored
            for rid, items in picked.items():
                kv.placement.report(rid, items)
    return Rate(n / (time.perf_counter() - start), n / (time.process_time() - cpu0), float("nan"))


async def drive(address: str, server_pid: int, seconds: float, clients: int,
                call: Callable[[grpc.aio.Channel], Callable[[int], Awaitable[Any]]]) -> Rate:
    """`clients` tasks calling `call(channel)(i)` back to back for `seconds`, i = the call's index."""
    async with grpc.aio.insecure_channel(address) as channel:
        one = call(channel)
        await one(0)  # connected and warm
        count = 0
        stop_at = time.perf_counter() + seconds

        async def client(k: int) -> None:
            nonlocal count
            i = k
            while time.perf_counter() < stop_at:
                await one(i)
                count += 1
                i += clients

        start, cpu0, csw0 = time.perf_counter(), cpu_seconds(server_pid), context_switches(server_pid)
        await asyncio.gather(*(client(k) for k in range(clients)))
        wall = time.perf_counter() - start
        cpu, csw = cpu_seconds(server_pid) - cpu0, context_switches(server_pid) - csw0
        return Rate(count / wall, count / max(1e-9, cpu), csw / max(1, count))


def pick_call(release: bool) -> Callable[[grpc.aio.Channel], Callable[[int], Awaitable[Any]]]:
    def make(channel: grpc.aio.Channel) -> Callable[[int], Awaitable[Any]]:
        stub = route_pb2_grpc.RouteServiceStub(channel)

        async def one(i: int) -> None:
            resp = await stub.PickReplica(route_pb2.PickReplicaRequest(
                conversation_id=CONVERSATIONS[i % len(CONVERSATIONS)]))
            if release:
                await stub.ReleaseLease(route_pb2.ReleaseLeaseRequest(lease_id=resp.lease_id))
        return one
    return make


def health_call(channel: grpc.aio.Channel) -> Callable[[int], Awaitable[Any]]:
    stub = health_pb2_grpc.HealthStub(channel)
    return lambda i: stub.Check(health_pb2.HealthCheckRequest(service=""))


def noop_call(channel: grpc.aio.Channel) -> Callable[[int], Awaitable[Any]]:
    method = channel.unary_unary(NOOP_METHOD, request_serializer=None, response_deserializer=None)
    return lambda i: method(b"")


# ---- the bare server (runs as its own process: python -m bench.router_picks --bare-server ADDRESS) -----------

class ConstantRoute(route_pb2_grpc.RouteServiceServicer):
    """PickReplica answered with one prebuilt response: grpc and protobuf, no router work."""

    RESPONSE = route_pb2.PickReplicaResponse(
        replica_id="engine-0", address="127.0.0.1:50054", lease_id=str(uuid.uuid4()),
        outcome=route_pb2.PICK_OUTCOME_HOME, home_replica_id="engine-0", lease_expires_at_ms=1)

    async def PickReplica(self, request: route_pb2.PickReplicaRequest,
                          context: grpc.aio.ServicerContext[Any, Any]) -> route_pb2.PickReplicaResponse:
        return self.RESPONSE

    async def ReleaseLease(self, request: route_pb2.ReleaseLeaseRequest,
                           context: grpc.aio.ServicerContext[Any, Any]) -> route_pb2.ReleaseLeaseResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in the bare server")
        raise AssertionError("abort raises")

    async def ListReplicas(self, request: route_pb2.ListReplicasRequest,
                           context: grpc.aio.ServicerContext[Any, Any]) -> route_pb2.ListReplicasResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in the bare server")
        raise AssertionError("abort raises")


def sync_bare_server(address: str, threads: int) -> None:
    """grpc's threaded (non-asyncio) server with a pool of `threads`, the same no-op method."""
    from concurrent import futures

    def noop(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(threads), options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "chatmesh.bench.Bare", {"Noop": grpc.unary_unary_rpc_method_handler(noop)}),))
    server.add_insecure_port(address)
    server.start()
    server.wait_for_termination()


async def bare_server(address: str) -> None:
    async def noop(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return b""

    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "chatmesh.bench.Bare", {"Noop": grpc.unary_unary_rpc_method_handler(noop)}),))
    route_pb2_grpc.add_RouteServiceServicer_to_server(ConstantRoute(), server)
    server.add_insecure_port(address)
    await server.start()
    await server.wait_for_termination()


# ---- main ------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def ready(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)


def start_server(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], bool]:
    pinned = shutil.which("taskset") is not None and (os.cpu_count() or 1) > 1
    if pinned:
        cmd = ["taskset", "-c", str(SERVER_CPU), *cmd]
    return subprocess.Popen(cmd, env=env), pinned


def core_paths(args: argparse.Namespace) -> list[tuple[str, int | None, Callable[[], Rate]]]:
    s = args.seconds
    return [
        ("core: pick + release", 200_000, lambda: core(s, args.in_flight, release=True)),
        ("core: pick only", 200_000, lambda: core(s, args.in_flight, release=False)),
        ("core, follow policy: pick + release", 200_000,
         lambda: core(s, args.in_flight, release=True, policy="follow")),
        ("core, follow policy: pick only", 200_000, lambda: core(s, args.in_flight, release=False, policy="follow")),
    ]


def report_core(args: argparse.Namespace, load_start: tuple[float, float, float]) -> int:
    """--core-only: the in-process paths alone, interleaved over the rounds, pinned to one CPU."""
    paths = core_paths(args)
    results: dict[str, list[Rate]] = {name: [] for name, _, _ in paths}
    for _ in range(args.rounds):
        for name, _, run in paths:
            pin(SERVER_CPU)
            results[name].append(run())
    load_end = os.getloadavg()
    print(f"Router core picks, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.machine()}, Python {platform.python_version()}; load {load_start[0]:.2f} -> {load_end[0]:.2f}")
    print("| path | picks/s (wall) | picks per CPU-second (range) | target |\n|---|---:|---:|---:|")
    for name, target, _ in paths:
        rates = sorted(results[name], key=lambda r: r.cpu)
        mid = rates[len(rates) // 2]
        print(f"| {name} | {mid.wall:,.0f} | {mid.cpu:,.0f} ({rates[0].cpu:,.0f}-{rates[-1].cpu:,.0f}) | "
              f"{target:,} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0, help="per path and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=300)
    ap.add_argument("--core-only", action="store_true", help="only the in-process core paths (no servers)")
    ap.add_argument("--bare-server", metavar="ADDRESS", help=argparse.SUPPRESS)
    ap.add_argument("--sync-bare-server", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_server:
        asyncio.run(bare_server(args.bare_server))
        return 0
    if args.sync_bare_server:
        sync_bare_server(args.sync_bare_server, SYNC_THREADS)
        return 0

    load_start = os.getloadavg()
    if args.core_only:
        return report_core(args, load_start)
    router_address, bare_address, sync_address = (f"127.0.0.1:{free_port()}" for _ in range(3))
    env = {**os.environ, "CHATMESH_REPLICAS": ",".join(f"engine-{i}=127.0.0.1:{50054 + 10 * i}"
                                                        for i in range(REPLICAS)),
           "CHATMESH_ROUTER_HEALTH": "false", "CHATMESH_LOG_LEVEL": "warning",
           "CHATMESH_MESH_PLAINTEXT": "true"}  # loopback, like the bare servers it is compared with
    router, pinned = start_server([sys.executable, "-m", "chatmesh.mesh.cli", "serve", "router", "--listen",
                                   router_address], env)
    bare, _ = start_server([sys.executable, "-m", "bench.router_picks", "--bare-server", bare_address], env)
    sync, _ = start_server([sys.executable, "-m", "bench.router_picks", "--sync-bare-server", sync_address], env)
    for address in (router_address, bare_address, sync_address):  # both up before anything is timed on their CPU
        asyncio.run(ready(address))
    s, c = args.seconds, args.clients
    paths: list[tuple[str, int | None, Callable[[], Rate]]] = [
        *core_paths(args),
        ("service: PickReplica", 5_000,
         lambda: asyncio.run(drive(router_address, router.pid, s, c, pick_call(release=False)))),
        ("service: PickReplica + ReleaseLease (per pair)", 5_000,
         lambda: asyncio.run(drive(router_address, router.pid, s, c, pick_call(release=True)))),
        ("baseline: grpc.health.v1 Check, same router server", None,
         lambda: asyncio.run(drive(router_address, router.pid, s, c, health_call))),
        ("baseline: bare grpc.aio server, PickReplica returning a constant", None,
         lambda: asyncio.run(drive(bare_address, bare.pid, s, c, pick_call(release=False)))),
        ("baseline: bare grpc.aio server, no-op unary (bytes, no protobuf)", None,
         lambda: asyncio.run(drive(bare_address, bare.pid, s, c, noop_call))),
        (f"baseline: bare threaded grpc.server ({SYNC_THREADS} threads), no-op unary", None,
         lambda: asyncio.run(drive(sync_address, sync.pid, s, c, noop_call))),
    ]
    results: dict[str, list[Rate]] = {name: [] for name, _, _ in paths}
    try:
        for _ in range(args.rounds):
            for name, _, run in paths:
                pin(SERVER_CPU if name.startswith("core") else CLIENT_CPU)
                results[name].append(run())
    finally:
        for server in (router, bare, sync):
            server.terminate()
            server.wait(timeout=30)
    load_end = os.getloadavg()

    def median(rates: list[Rate]) -> Rate:
        return sorted(rates, key=lambda r: r.cpu)[len(rates) // 2]

    table = ["| path | calls/s (wall) | calls per CPU-second | server context switches per call | target |",
             "|---|---:|---:|---:|---:|"]
    for name, target, _ in paths:
        r = median(results[name])
        spread = f" ({min(x.cpu for x in results[name]):,.0f}-{max(x.cpu for x in results[name]):,.0f})"
        switches = "" if name.startswith("core") else f"{r.switches:.1f}"
        table.append(f"| {name} | {r.wall:,.0f} | {r.cpu:,.0f}{spread if args.rounds > 1 else ''} | {switches} | "
                     f"{f'{target:,}' if target else ''} |")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, grpcio {grpc.__version__}"
    print("\n".join([
        f"Router picks, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Machine: {machine}.",
        f"Command: python -m bench.router_picks --seconds {s:g} --rounds {args.rounds} --clients {c}. "
        f"Servers pinned to CPU {SERVER_CPU}: {pinned}; client and core pinned as described in the script.",
        f"Load average (1, 5, 15 min) at start: {', '.join(f'{x:.2f}' for x in load_start)}; "
        f"at end: {', '.join(f'{x:.2f}' for x in load_end)}. Median of {args.rounds} rounds (range of the "
        "per-CPU-second rate in brackets).",
        "", *table,
    ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
