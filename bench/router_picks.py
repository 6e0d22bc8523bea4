"""Picks per second through the router: the ring core in-process, and RouteService over gRPC.

core: one `Ring` of 8 replicas (160 points each, eps 0.5); each cycle picks for one of 100,000 conversation
ids and releases the lease opened `--in-flight` picks earlier (so ~300 leases are open, the reference fleet's
scale); also picks alone (no releases). service: `chatmesh serve router` in its own process pinned to one CPU
(taskset when present), health watching off, 8 configured replicas; this process runs `--clients` asyncio
tasks on one channel calling PickReplica (and ReleaseLease in the cycle mode). Issue 4's targets: core
>= 200,000 picks/s, service >= 5,000 picks/s (15x the reference fleet's 333 turns/s), one core each.

    .venv/bin/python -m bench.router_picks [--seconds 5] [--clients 64] [--append]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chatmesh.mesh.ids import ConversationId, LeaseId, ReplicaId
from chatmesh.router.ring import Replica, Ring
from chatmesh.v1 import route_pb2, route_pb2_grpc

REPLICAS = 8
CONVERSATIONS = [ConversationId(str(uuid.uuid4())) for _ in range(100_000)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def core(seconds: float, in_flight: int, release: bool) -> tuple[float, float]:
    """(picks per wall second, picks per CPU second)."""
    ring = Ring([Replica(ReplicaId(f"engine-{i}"), f"127.0.0.1:{50054 + 10 * i}") for i in range(REPLICAS)])
    window: list[LeaseId] = []
    n, now = 0, 0.0
    deadline = time.perf_counter() + seconds
    start, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() < deadline:
        for _ in range(1000):
            pick = ring.pick(CONVERSATIONS[n % len(CONVERSATIONS)], now)
            n += 1
            if release:
                window.append(pick.lease_id)
                if len(window) > in_flight:
                    ring.release(window[-in_flight - 1])
        if release:
            del window[:-in_flight]
    return n / (time.perf_counter() - start), n / (time.process_time() - cpu0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def service(address: str, server_pid: int, seconds: float, clients: int,
                  release: bool, baseline: bool = False) -> tuple[float, float]:
    """(picks per wall second, picks per server CPU second). `baseline`: grpc.health.v1 Check on the same
    server instead, the cost of a trivial unary rpc in grpc's Python server on this machine."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = route_pb2_grpc.RouteServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        await stub.ListReplicas(route_pb2.ListReplicasRequest(), wait_for_ready=True, timeout=30)
        count = 0
        stop_at = time.perf_counter() + seconds

        async def client(k: int) -> None:
            nonlocal count
            i = k
            while time.perf_counter() < stop_at:
                if baseline:
                    await health.Check(health_pb2.HealthCheckRequest(service=""))
                    count += 1
                    continue
                resp = await stub.PickReplica(route_pb2.PickReplicaRequest(
                    conversation_id=CONVERSATIONS[i % len(CONVERSATIONS)]))
                if release:
                    await stub.ReleaseLease(route_pb2.ReleaseLeaseRequest(lease_id=resp.lease_id))
                count += 1
                i += clients

        start, cpu0 = time.perf_counter(), cpu_seconds(server_pid)
        await asyncio.gather(*(client(k) for k in range(clients)))
        return count / (time.perf_counter() - start), count / max(1e-9, cpu_seconds(server_pid) - cpu0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=300)
    ap.add_argument("--append", action="store_true", help="append the results to BENCHMARKS.md")
    args = ap.parse_args()

    load = os.getloadavg()[0]
    core_cycle = core(args.seconds, args.in_flight, release=True)
    core_pick = core(args.seconds, args.in_flight, release=False)

    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "CHATMESH_REPLICAS": ",".join(f"engine-{i}=127.0.0.1:{50054 + 10 * i}"
                                                        for i in range(REPLICAS)),
           "CHATMESH_ROUTER_HEALTH": "false", "CHATMESH_LOG_LEVEL": "warning"}
    cmd = [sys.executable, "-m", "chatmesh.mesh.cli", "serve", "router", "--listen", address]
    pinned = shutil.which("taskset") is not None and (os.cpu_count() or 1) > 1
    if pinned:
        cmd = ["taskset", "-c", "1", *cmd]
    server = subprocess.Popen(cmd, env=env)
    try:
        svc_pick = asyncio.run(service(address, server.pid, args.seconds, args.clients, release=False))
        svc_cycle = asyncio.run(service(address, server.pid, args.seconds, args.clients, release=True))
        svc_base = asyncio.run(service(address, server.pid, args.seconds, args.clients, release=False,
                                       baseline=True))
    finally:
        server.terminate()
        server.wait(timeout=30)

    rows = [
        ("core: pick + release", core_cycle, 200_000),
        ("core: pick only", core_pick, 200_000),
        ("service: PickReplica", svc_pick, 5_000),
        ("service: PickReplica + ReleaseLease", svc_cycle, 5_000),
    ]
    base = ("baseline: grpc.health.v1 Check, same server", svc_base)
    table = ["| path | picks/s (wall) | picks per CPU-second | target |", "|---|---:|---:|---:|"]
    table += [f"| {name} | {wall:,.0f} | {cpu:,.0f} | {target:,} |" for name, (wall, cpu), target in rows]
    table.append(f"| {base[0]} (rpcs/s) | {base[1][0]:,.0f} | {base[1][1]:,.0f} | |")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    text = "\n".join([
        f"\n## Router picks (issue 4), {datetime.date.today().isoformat()}\n",
        f"Machine: {machine}, shared with other engineers' jobs. `python -m bench.router_picks --seconds "
        f"{args.seconds:g} --clients {args.clients}`: ring of {REPLICAS} replicas, 100,000 conversation ids, "
        f"{args.in_flight} leases open in the core cycle; the service is one `chatmesh serve router` process"
        f"{' pinned to one CPU' if pinned else ''}, the client one process with {args.clients} asyncio tasks "
        "on one channel. Picks per CPU-second: the core's own process time, the server process's CPU time "
        "(from /proc); less sensitive than wall time to other jobs on the machine but not immune (shared caches, "
        f"SMT siblings). Load average at start: {load:.1f}.\n",
        *table, "",
    ])
    print(text)
    if args.append:
        with Path("BENCHMARKS.md").open("a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
