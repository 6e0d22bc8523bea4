"""Faults without surprises, the long run: the real mesh under a retrying load, every fault kind one at a time, on
SQLite and on PostgreSQL, then the audit of what clients were acknowledged against what the store holds (issue 18).

Fault kinds (`FAULTS`): `kill -9` and restart, and SIGTERM and restart, of one process of each service kind
(engine-0, chat, store, router, moderation, gateway); a batch of clients disconnecting mid-stream; PostgreSQL
restarted under load (a private cluster, `pg_ctlcluster restart -m fast`; PostgreSQL runs only); Redis, holding
the gateway's limits, stopped and started (turns are refused 503 while it is down, fail closed, README). Each
fault: inject, wait `--down-s`, restart, then `--settle-s` of load and until every turn the fault affected is
acknowledged (at most 20 s) before the next, so no turn's figure spans two faults.

The load samples (`--temperature`, default 0.7, a seed per turn): a turn taken over or retried after a fault must
continue what its client was shown, with the turn's own options, not regenerate it (issue 33; the audit's
`spliced` counts a client shown text the stored reply contradicts).

Figures per run: turns attempted / acknowledged / retried and the audit's zeros (bench/fault_mesh.py); per fault
the turns it affected, those of them stored stopped though no client stopped them (`stopped_by_fault`), the
signalled process's exit time, the time from the fault (or, for a restarted service with no peer, from its being healthy
again) to the first acknowledged turn and from the fault to the last affected turn acknowledged; for a killed
chat process, each interrupted turn's time to completion through the other; for a restarted engine, the time
from healthy to its first generation. `heartbeat` measures the store write a generating turn makes per progress
interval (UpdateTurnProgress: the reply so far and the lease renewal) on each database. `paused` measures how
long a SIGSTOPped lease holder's engine sequence goes on, taken over by a retry and with no retry (issue 33).

    flock /work/coord/heavy.lock .venv/bin/python -m bench.faults [--seconds 90] [--conversations 24]
        [--databases sqlite,postgres] [--kinds all] [--temperature 0.7] [--json out.json]
    flock /work/coord/heavy.lock .venv/bin/python -m bench.faults --paused
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.fault_mesh import FINALS, SERVICES, Audit, FaultMesh, Load, PrivatePostgres, Redis, audit, recovery
from chatmesh.mesh import identity as ident
from chatmesh.mesh.channels import open_channel
from chatmesh.mesh.up import MeshError
from chatmesh.mesh.trust import Trust
from chatmesh.v1 import (chat_pb2, chat_pb2_grpc, generate_pb2, generate_pb2_grpc, route_pb2, route_pb2_grpc, store_pb2,
                         store_pb2_grpc)
from tests.e2e.conftest import bind_failed
from tests.e2e.conftest import channel as e2e_channel

# The process of each service kind a fault hits: engine-0 (the one with a metrics port and GetStats reached at
# the standard address), the first chat process, the single store, router, moderation and gateway.
TARGET = {"engine": "engine", "chat": "chat", "store": "store", "router": "router", "moderation": "moderation",
          "gateway": "gateway"}
CHAT_DOWN_S = 3.5
LOCAL = "local"  # the development identity chatmesh's own routes act for (CHATMESH_AUTH=local)
FAULTS: tuple[str, ...] = (*(f"kill:{s}" for s in SERVICES), *(f"term:{s}" for s in SERVICES),
                           "client_disconnect", "postgres_restart", "redis_stop")


@dataclass
class Injected:
    kind: str
    at: float  # monotonic time of the fault
    healthy_at: float | None  # the hit service healthy again (None: a peer took over at once)
    extra: dict[str, Any]


async def engine_generations(trust: Trust, address: str) -> int:
    async with open_channel(trust, address, "engine") as channel:
        resp = await generate_pb2_grpc.GenerateServiceStub(channel).GetStats(generate_pb2.GetStatsRequest(),
                                                                              timeout=1)
        return int(resp.stats.generations)


async def first_generation_after(trust: Trust, address: str, since: float, timeout_s: float = 10.0
                                 ) -> float | None:
    """Seconds from `since` until the (restarted) engine at `address` has started a generation."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if await engine_generations(trust, address) > 0:
                return round(time.monotonic() - since, 3)
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.02)
    return None


async def router_serving_after(trust: Trust, address: str, replica: str, since: float, timeout_s: float = 10.0
                               ) -> float | None:
    """Seconds from `since` until the router at `address` lists `replica` as serving."""
    deadline = time.monotonic() + timeout_s
    async with open_channel(trust, address, "router") as channel:
        stub = route_pb2_grpc.RouteServiceStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.aio.AioRpcError):
                resp = await stub.ListReplicas(route_pb2.ListReplicasRequest(), timeout=1)
                if any(r.replica_id == replica and r.state == route_pb2.REPLICA_STATE_SERVING for r in resp.replicas):
                    return round(time.monotonic() - since, 3)
            await asyncio.sleep(0.02)
    return None


async def inject(kind: str, mesh: FaultMesh, load: Load, down_s: float, redis: Redis | None,
                 pg: PrivatePostgres | None) -> Injected:
    """One fault, and the service back; returns when it is healthy again."""
    at = time.monotonic()
    extra: dict[str, Any] = {}
    match kind.split(":"):
        case [("kill" | "term") as how, service]:
            name = TARGET[service]
            sig = signal.SIGKILL if how == "kill" else signal.SIGTERM
            extra["exit_code"] = await asyncio.to_thread(mesh.kill, name, sig)
            extra["exit_s"] = round(time.monotonic() - at, 3)  # a SIGTERM's drain: bounded by the grace
            # A chat process stays down long enough that its turns can only complete through the other one.
            await asyncio.sleep(max(down_s, CHAT_DOWN_S) if service == "chat" else down_s)
            await asyncio.to_thread(mesh.restart, name)
            healthy = time.monotonic()
            if service == "engine":
                address = mesh.procs[name].address
                router = mesh.procs["router"].address
                trust = mesh.mesh.trust()  # as the operator, over the mesh's mutual TLS
                serving, first = await asyncio.gather(router_serving_after(trust, router, "engine-0", healthy),
                                                      first_generation_after(trust, address, healthy))
                extra["router_serving_after_healthy_s"] = serving
                extra["engine_first_generation_after_healthy_s"] = first
            return Injected(kind, at, healthy, extra)
        case ["client_disconnect"]:
            load.disconnect = 6
            return Injected(kind, at, None, extra)
        case ["postgres_restart"]:
            assert pg is not None
            await asyncio.to_thread(pg.restart)
            return Injected(kind, at, time.monotonic(), extra)
        case ["redis_stop"]:
            assert redis is not None
            await asyncio.to_thread(redis.stop)
            await asyncio.sleep(down_s)
            await asyncio.to_thread(redis.start)
            return Injected(kind, at, time.monotonic(), extra)
        case _:
            raise ValueError(f"unknown fault kind {kind!r}")


async def settled(load: Load, since: float, timeout_s: float = 20.0) -> None:
    """Waits until every turn with an attempt that failed since `since` is acknowledged (at most `timeout_s`), so
    that the next fault starts on a recovered mesh and no turn's figure spans two faults."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
            t.acked_at is None and any(a.ended >= since and a.outcome not in FINALS for a in t.attempts)
            for t in load.turns):
        await asyncio.sleep(0.1)


def crash_completions(load: Load, at: float) -> list[float]:
    """For a killed chat process: each turn whose stream broke at the crash, seconds from the crash to its
    acknowledgement (through the other chat process)."""
    out = []
    for t in load.turns:
        broke = any(a.started < at <= a.ended + 0.5 and a.outcome not in ("turn.completed", "turn.stopped",
                                                                          "turn.blocked") for a in t.attempts)
        if broke and t.acked_at is not None:
            out.append(round(t.acked_at - at, 3))
    return out


@dataclass
class RunResult:
    database: str
    seconds: float
    audit: Audit
    faults: list[dict[str, Any]]
    rerouted: int = 0  # turns chat sent to another replica after theirs failed before its first event


async def run(database: str, kinds: Sequence[str], root: Path, conversations: int, warmup_s: float,
              down_s: float, settle_s: float, min_load_s: float = 0.0, postgres_url: str = "",
              postgres_schema: str = "", turns_per_conversation: int = 4, temperature: float | None = 0.7
              ) -> RunResult:
    """One mesh on `database` ('sqlite' or 'postgres'), the load, `kinds` in order, the audit."""
    redis = Redis(root / "redis")
    redis.start()
    pg: PrivatePostgres | None = None
    url, schema = "", ""
    if database == "postgres":
        if postgres_url:
            url, schema = postgres_url, postgres_schema
        else:
            pg = PrivatePostgres()
            pg.create()
            url = pg.url
    mesh = FaultMesh(root / "mesh", database_url=url, schema=schema, redis_url=redis.url)
    faults: list[dict[str, Any]] = []
    try:
        try:
            await asyncio.to_thread(mesh.start)
        except MeshError:
            if not bind_failed(mesh.root / "logs"):
                raise
            # a port picked free was taken before its service bound it: once more, on other ports
            mesh = FaultMesh(root / "mesh-again", database_url=url, schema=schema, redis_url=redis.url)
            await asyncio.to_thread(mesh.start)
        load = Load(mesh.url, conversations, turns_per_conversation=turns_per_conversation, temperature=temperature)
        await load.start()
        began = time.monotonic()
        await asyncio.sleep(warmup_s)
        injected: list[Injected] = []
        for kind in kinds:
            if kind == "postgres_restart" and pg is None:
                continue
            injected.append(await inject(kind, mesh, load, down_s, redis, pg))
            await asyncio.sleep(settle_s)
            await settled(load, injected[-1].at)
        if (left := min_load_s - (time.monotonic() - began)) > 0:
            await asyncio.sleep(left)
        seconds = time.monotonic() - began
        drained = await load.drain()
        for i, fault in enumerate(injected):
            until = injected[i + 1].at if i + 1 < len(injected) else time.monotonic()
            row = {"kind": fault.kind, **recovery(load.turns, fault.at, until, fault.healthy_at), **fault.extra}
            if fault.kind.endswith(":chat") and fault.kind.startswith("kill"):
                done = crash_completions(load, fault.at)
                row["crash_completions_s"] = done
            faults.append(row)
        result = await audit(mesh.url, load.turns, mesh)
        stopped = set(result.stopped_ids)
        for i, (fault, row) in enumerate(zip(injected, faults, strict=True)):
            until = injected[i + 1].at if i + 1 < len(injected) else time.monotonic()
            # a turn stored stopped that no client stopped, charged to the fault that broke one of its attempts
            row["stopped_by_fault"] = sum(1 for t in load.turns if t.turn_id in stopped and any(
                fault.at <= a.ended < until and a.outcome not in FINALS for a in t.attempts))
        if not drained:
            result.examples.append("some clients did not finish their last turn within the drain timeout")
        return RunResult(database, round(seconds, 1), result, faults, mesh.log_lines("engine_rerouted", "chat"))
    finally:
        await asyncio.to_thread(mesh.stop)
        redis.stop()
        if pg is not None:
            pg.drop()


# ---- a paused lease holder's engine sequence (issue 33, Deliver 6) ------------------------------------------------


async def _running(mesh: FaultMesh) -> int:
    total = 0
    for name in mesh.names("engine"):
        async with e2e_channel(mesh.mesh, "engine", address=mesh.procs[name].address) as ch:
            total += (await generate_pb2_grpc.GenerateServiceStub(ch).GetStats(
                generate_pb2.GetStatsRequest(), timeout=2)).stats.running_sequences
    return total


async def _record(mesh: FaultMesh, conv: str, turn: str) -> store_pb2.ReadTurnResponse:
    async with e2e_channel(mesh.mesh, "store", ident.CHAT, owner_tokens=True) as ch:
        return await store_pb2_grpc.StoreServiceStub(ch).ReadTurn(store_pb2.ReadTurnRequest(
            owner_id=LOCAL, conversation_id=conv, turn_id=turn), timeout=2)


def _cancelled_at(mesh: FaultMesh, turn: str) -> float | None:
    """The wall time (s) an engine logged cancelling `turn`'s generations (CancelTurn: its lease moved)."""
    for path in (mesh.root / "logs").glob("engine*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if "turn_cancelled" in line and turn in line:
                stamp = json.loads(line)["timestamp"]
                return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return None


async def paused_holder(root: Path, retry: bool, tokens: int = 3000) -> dict[str, Any]:
    """A turn's lease holder SIGSTOPped mid-reply: how long its engine sequence goes on. With `retry` (the
    client's retry reaches the other chat process at once, which follows the stored progress, takes the turn over
    when the lease lapses and cancels the turn on every replica before it generates): seconds from the pause to
    the lease's lapse and to the engine's cancel, and the engines' running sequences once the successor's own
    tokens arrive (1: never two at once). Without: seconds from the pause until the engines run no sequence
    (nothing tells them; the engine's keepalive drops the silent holder's connection, which cancels it). Replies
    of `tokens` tokens at 10 ms (30 s), so no sequence ends at its cap within the measurement."""
    mesh = FaultMesh(root, engines=2, chats=2, step_ms=10, reply_tokens=tokens,
                     env={"CHATMESH_SIM_REPLY_TOKENS": "0"})
    await asyncio.to_thread(mesh.start)
    out: dict[str, Any] = {"retry": retry}
    try:
        async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as client:
            conv = str((await client.post("/v1/conversations", json={})).json()["id"])
            turn, content = str(uuid.uuid4()), "Describe the willow by the river."
            shown: list[str] = []
            body = {"turn_id": turn, "content": content,
                    "options": {"temperature": 0.7, "seed": 5, "max_tokens": tokens}}

            async def first() -> None:
                with contextlib.suppress(httpx.HTTPError):
                    async with client.stream("POST", f"/v1/conversations/{conv}/turns", json=body) as r:
                        async for line in r.aiter_lines():
                            shown.append(line)

            stream = asyncio.create_task(first())
            deadline = time.monotonic() + 30
            while sum(line.startswith("event: turn.delta") for line in shown) < 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            holder = mesh.chat_holding((await _record(mesh, conv, turn)).lease_holder)
            pid = mesh.pid(holder)
            os.kill(pid, signal.SIGSTOP)
            paused_wall, paused = time.time(), time.monotonic()
            lease = (await _record(mesh, conv, turn)).lease_expires_at_ms  # its last renewal's
            out["lease_lapses_after_pause_s"] = round(lease / 1000 - paused_wall, 3)
            try:
                if retry:
                    successor = next(n for n in mesh.names("chat") if n != holder)
                    async with e2e_channel(mesh.mesh, "chat", ident.GATEWAY, owner_tokens=True,
                                           address=mesh.procs[successor].address) as ch:
                        call = chat_pb2_grpc.ChatServiceStub(ch).SendTurn(chat_pb2.SendTurnRequest(
                            owner_id=LOCAL, conversation_id=conv, turn_id=turn, content=content,
                            options=chat_pb2.TurnOptions(temperature=0.7, seed=5, max_tokens=tokens)), timeout=60)
                        text, progress, alone = "", None, None
                        async for resp in call:
                            if resp.event.WhichOneof("kind") != "delta":
                                continue
                            text += resp.event.delta.text
                            if progress is None:  # the paused holder's last progress, replayed by the follow
                                progress = text
                            elif len(text) > len(progress) and alone is None:  # the successor's own tokens
                                alone = await _running(mesh)
                                out["successor_generating_after_pause_s"] = round(time.monotonic() - paused, 3)
                                out["running_sequences_then"] = alone
                                break
                        call.cancel()
                    at = _cancelled_at(mesh, turn)
                    out["engine_cancelled_after_pause_s"] = round(at - paused_wall, 3) if at is not None else None
                else:
                    gone = None
                    while time.monotonic() - paused < 30:
                        if await _running(mesh) == 0:
                            gone = round(time.monotonic() - paused, 3)
                            break
                        await asyncio.sleep(0.05)
                    out["sequence_gone_after_pause_s"] = gone  # None: still running 30 s after the pause
            finally:
                os.kill(pid, signal.SIGCONT)
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
    finally:
        await asyncio.to_thread(mesh.stop)
    return out


# ---- heartbeat write cost ---------------------------------------------------------------------------------------


async def heartbeat_cost(database: str, url: str, turns: int = 32, rounds: int = 40) -> dict[str, Any]:
    """UpdateTurnProgress through the store core, as `turns` generating turns renew their leases: per-write
    latency (p50/p99) and the writes per second one core sustains."""
    from chatmesh.mesh.ids import OwnerId, TurnId
    from chatmesh.store.core import ConversationStore
    from chatmesh.store.db import make_engine
    from chatmesh.store.migrate import upgrade
    from chatmesh.store.values import Claimed

    engine = make_engine(url)
    await upgrade(engine)
    core = ConversationStore(engine)
    owner = OwnerId(f"hb-{uuid.uuid4().hex[:8]}")
    conv = (await core.conversations.insert_conversation(owner, "heartbeat")).conversation_id
    leases = []
    for _ in range(turns):
        turn = TurnId(str(uuid.uuid4()))
        claim = await core.turns.begin_turn(owner, conv, turn, content="hi", lease_holder="bench", fingerprint="fp",
                                     lease_ttl_ms=1500)
        assert isinstance(claim, Claimed)
        leases.append((turn, claim.lease_id))
    latencies: list[float] = []
    text = ""
    cpu0, t0 = time.process_time(), time.perf_counter()
    for r in range(rounds):
        text += "word " * 4
        for turn, lease in leases:
            s = time.perf_counter()
            await core.turns.update_turn_progress(owner, conv, turn, lease, text, 1 + len(text), lease_ttl_ms=1500)
            latencies.append(time.perf_counter() - s)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await engine.dispose()
    latencies.sort()
    n = len(latencies)
    return {"database": database, "writes": n, "p50_ms": round(latencies[n // 2] * 1000, 3),
            "p99_ms": round(latencies[int(n * 0.99)] * 1000, 3), "writes_per_s": round(n / wall),
            "store_cpu_ms_per_write": round(cpu / n * 1000, 3),
            "mean_ms": round(statistics.fmean(latencies) * 1000, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=90.0, help="least seconds of load per database")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--databases", default="sqlite,postgres")
    parser.add_argument("--kinds", default="all", help="comma-separated fault kinds (default: every one)")
    parser.add_argument("--down-s", type=float, default=2.0)
    parser.add_argument("--settle-s", type=float, default=4.0)
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="the load's sampling temperature (a seed per turn); negative: the mesh's greedy default")
    parser.add_argument("--heartbeat", action="store_true", help="measure the heartbeat write only")
    parser.add_argument("--paused", action="store_true",
                        help="measure only how long a paused lease holder's engine sequence runs (issue 33)")
    parser.add_argument("--json", default="", help="write the results here too")
    args = parser.parse_args(argv)
    kinds = FAULTS if args.kinds == "all" else tuple(args.kinds.split(","))
    out: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                           "machine": f"{platform.node()} {os.cpu_count()} CPUs", "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        if args.paused:
            out["paused"] = [asyncio.run(paused_holder(Path(tmp) / f"paused-{retry}", retry))
                             for retry in (True, False)]
        elif args.heartbeat:
            pg = PrivatePostgres() if PrivatePostgres.available() else None
            rows = [asyncio.run(heartbeat_cost("sqlite", f"sqlite+aiosqlite:///{tmp}/hb.db"))]
            if pg is not None:
                pg.create()
                try:
                    rows.append(asyncio.run(heartbeat_cost("postgres", pg.url)))
                finally:
                    pg.drop()
            out["heartbeat"] = rows
        else:
            runs = []
            for db in args.databases.split(","):
                result = asyncio.run(run(db, kinds, Path(tmp) / db, args.conversations, warmup_s=3.0,
                                         down_s=args.down_s, settle_s=args.settle_s, min_load_s=args.seconds,
                                         temperature=args.temperature if args.temperature >= 0 else None))
                runs.append({"database": db, "seconds": result.seconds, **result.audit.row(),
                             "rerouted": result.rerouted, "log_problem_lines": result.audit.log_problems[:10],
                             "examples": result.audit.examples[:10], "faults": result.faults})
                print(json.dumps(runs[-1], indent=1), flush=True)
            out["runs"] = runs
    out["load_after"] = os.getloadavg()[0]
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
