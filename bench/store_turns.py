"""Turn cycles per second through the conversation store core, on PostgreSQL and SQLite, side by side.

One cycle is what the chat service does per turn: BeginTurn (claim), ReadConversation of the newest 20
messages, FinishTurn (user message + reply + usage); with `--context` it is two calls, BeginTurn returning the
20 messages (`context_max_messages`) and FinishTurn. `--clients` asyncio tasks in total (default 32), each on
its own owner and conversation seeded with 20 messages, run cycles for `--seconds` after a warm-up; p50/p99
are per operation. PostgreSQL can be driven by several processes (`--processes`, the clients split between
them), as several stateless store replicas would; SQLite runs in one process (one writer at a time anyway).
`grpc` runs the same cycle against a `chatmesh serve store` process over loopback gRPC (PostgreSQL behind it),
which is what the chat service sees; its CPU column is then that server process's. `--postgres-url` picks the
transport (TCP loopback by default; `?host=/var/run/postgresql` for the Unix socket).

The machine is shared, so besides turns/s the bench reports CPU per turn, which a busy neighbour inflates
much less: the store core's (this process, including the SQLite worker threads) and, on PostgreSQL, the server
backends serving the bench's connections (/proc, found through pg_stat_activity). "Projected" is what two
idle cores would do at that CPU cost. Issue 3's target: at least 1,000 turns/s on PostgreSQL.

    .venv/bin/python -m bench.store_turns [--seconds 10] [--clients 32] [--processes 1]
        [--backends postgres,grpc,sqlite] [--context] [--postgres-url URL] [--append]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncEngine

from chatmesh.mesh import logs
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.store.core import ConversationStore
from chatmesh.store.db import make_engine
from chatmesh.store.rows import CONV, MSG
from chatmesh.store.sqlite import SQLITE_MAX_POOL
from chatmesh.store.migrate import upgrade
from chatmesh.store.values import Claimed, MessageStatus, Reply, Usage
from chatmesh.v1 import common_pb2, store_pb2, store_pb2_grpc

POSTGRES_URL = os.environ.get("CHATMESH_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
APP_NAME = "chatmesh-bench"
USER_TEXT = "Could you explain how a prefix cache saves prefill time? " * 8  # ~450 bytes
REPLY_TEXT = "A prefix cache keeps the KV blocks of a prompt's stable beginning. " * 25  # ~1.7 KB
REPLY = Reply(110, REPLY_TEXT, 400, MessageStatus.COMPLETE, Usage(1500, 1100, 400))
OPS = ("claim", "read20", "finish")
HISTORY = 20


@dataclass
class Result:
    """One worker's (or the merged) measurements."""

    turns: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    latencies_ms: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})

    def merge(self, other: Result) -> None:
        self.turns += other.turns
        self.seconds = max(self.seconds, other.seconds)
        self.cpu_s += other.cpu_s
        for op in OPS:
            self.latencies_ms[op].extend(other.latencies_ms[op])


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else float("nan")


async def seed(engine: AsyncEngine, first: int, clients: int) -> list[tuple[OwnerId, ConversationId]]:
    """Conversations with 20 stored messages each, written directly (seeding through turns is slow)."""
    now = int(time.time() * 1000)
    convs = [(OwnerId(f"bench-{uuid.uuid4().hex[:8]}-{first + i}"), ConversationId(str(uuid.uuid4())))
             for i in range(clients)]
    async with engine.begin() as conn:
        await conn.execute(insert(CONV), [dict(
            owner_id=o, conversation_id=c, title="bench", system_prompt_version="v1", created_at_ms=now,
            updated_at_ms=now, message_count=HISTORY, summary_covers_through=-1, summary_token_count=0,
            summary_created_at_ms=0) for o, c in convs])
        await conn.execute(insert(MSG), [dict(
            owner_id=o, conversation_id=c, message_index=i, role="user" if i % 2 == 0 else "assistant",
            content=USER_TEXT if i % 2 == 0 else REPLY_TEXT, token_count=100, status="complete",
            turn_id=str(uuid.uuid4()), created_at_ms=now, superseded=False) for o, c in convs for i in range(HISTORY)])
    return convs


async def cycle(store: ConversationStore, owner: OwnerId, conv: ConversationId,
                latencies: dict[str, list[float]] | None, context: bool = False) -> None:
    """claim, read 20, finish; with `context` the claim returns the 20 messages (BeginTurn's
    context_max_messages) and there is no separate read."""
    turn = TurnId(str(uuid.uuid4()))
    t0 = time.perf_counter()
    claim = await store.turns.begin_turn(owner, conv, turn, content=USER_TEXT, lease_holder="bench",
                                   context_messages=HISTORY if context else 0)
    t1 = time.perf_counter()
    assert isinstance(claim, Claimed)
    if context:
        assert claim.context is not None and len(claim.context.messages) == HISTORY
    else:
        history = await store.conversations.read_conversation(owner, conv, max_messages=HISTORY)
        assert len(history.messages) == HISTORY
    t2 = time.perf_counter()
    await store.turns.finish_turn(owner, conv, turn, claim.lease_id, REPLY)
    t3 = time.perf_counter()
    if latencies is not None:
        record(latencies, t0, t1, t2, t3, context)


def record(latencies: dict[str, list[float]], t0: float, t1: float, t2: float, t3: float, context: bool) -> None:
    latencies["claim"].append((t1 - t0) * 1e3)
    if not context:
        latencies["read20"].append((t2 - t1) * 1e3)
    latencies["finish"].append((t3 - t2) * 1e3)


async def drive(engine: AsyncEngine, first: int, clients: int, start_at: float, warmup: float,
                seconds: float, context: bool) -> Result:
    store = ConversationStore(engine)
    try:
        return await drive_store(store, engine, first, clients, start_at, warmup, seconds, context)
    finally:
        await store.close()


async def drive_store(store: ConversationStore, engine: AsyncEngine, first: int, clients: int, start_at: float,
                      warmup: float, seconds: float, context: bool) -> Result:
    convs = await seed(engine, first, clients)
    result = Result()
    measure_from, stop_at = start_at + warmup, start_at + warmup + seconds
    await asyncio.sleep(max(0.0, start_at - time.time()))
    cpu = 0.0

    async def client(owner: OwnerId, conv: ConversationId) -> None:
        while time.time() < stop_at:
            measuring = time.time() >= measure_from
            await cycle(store, owner, conv, result.latencies_ms if measuring else None, context)
            if measuring:
                result.turns += 1

    async def cpu_clock() -> None:
        nonlocal cpu
        await asyncio.sleep(max(0.0, measure_from - time.time()))
        cpu = time.process_time()

    tasks = [asyncio.create_task(client(o, c)) for o, c in convs]
    await asyncio.gather(cpu_clock(), *tasks)
    result.cpu_s = time.process_time() - cpu
    result.seconds = time.time() - measure_from
    return result


def pg_worker(url: str, schema: str, first: int, clients: int, start_at: float, warmup: float, seconds: float,
              context: bool) -> Result:
    quiet_logs()

    async def main() -> Result:
        engine = make_engine(url, pool_size=clients, search_path=schema, application_name=APP_NAME)
        try:
            return await drive(engine, first, clients, start_at, warmup, seconds, context)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def quiet_logs() -> None:
    """JSON logs as the service writes them, at warning: the bench measures the store, not the terminal."""
    logs.configure("store", "warning", json=True)


def proc_cpu_s(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


async def bench_backends(admin: AsyncEngine) -> list[int]:
    async with admin.connect() as conn:
        rows = await conn.execute(text("SELECT pid FROM pg_stat_activity WHERE application_name = :n"),
                                  {"n": APP_NAME})
        return [int(r[0]) for r in rows]


async def on_postgres(url: str, clients: int, processes: int, seconds: float, warmup: float,
                      context: bool) -> tuple[str, Result, float]:
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = make_engine(POSTGRES_URL, pool_size=1)
    async with admin.begin() as conn:
        await conn.execute(text(f"CREATE SCHEMA {schema}"))
    engine = make_engine(POSTGRES_URL, pool_size=1, search_path=schema)
    await upgrade(engine)
    await engine.dispose()
    merged = Result()
    db_cpu = 0.0
    try:
        start_at = time.time() + 10.0 + 3.0 * processes  # time for the workers to start and seed (busy box)
        share = [clients // processes + (1 if i < clients % processes else 0) for i in range(processes)]
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(pg_worker, url, schema, sum(share[:i]), n, start_at, warmup, seconds, context)
                       for i, n in enumerate(share)]
            await asyncio.sleep(max(0.0, start_at + warmup - time.time()))
            pids = await bench_backends(admin)
            before = proc_cpu_s(pids)
            await asyncio.sleep(max(0.0, start_at + warmup + seconds - time.time()))
            db_cpu = proc_cpu_s(pids) - before
            for future in futures:
                merged.merge(future.result())
    finally:
        async with admin.begin() as conn:
            await conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        await admin.dispose()
    transport = "Unix socket" if "host=/" in url else "TCP loopback"
    return (f"PostgreSQL 15, core + asyncpg, {transport}, {processes} process(es), {len(pids)} backends",
            merged, db_cpu)


async def on_sqlite(clients: int, seconds: float, warmup: float, context: bool) -> tuple[str, Result, float]:
    with tempfile.TemporaryDirectory() as folder:
        engine = make_engine(f"sqlite+aiosqlite:///{Path(folder) / 'bench.db'}")
        try:
            await upgrade(engine)
            result = await drive(engine, 0, clients, time.time() + 1.0, warmup, seconds, context)
        finally:
            await engine.dispose()
    return f"SQLite WAL, core (sqlite3 in {SQLITE_MAX_POOL} worker threads), 1 process", result, 0.0


async def grpc_cycle(stub: Any, owner: str, conv: str, latencies: dict[str, list[float]] | None,
                     context: bool = False) -> None:
    turn = str(uuid.uuid4())
    t0 = time.perf_counter()
    claim = await stub.BeginTurn(store_pb2.BeginTurnRequest(owner_id=owner, conversation_id=conv, turn_id=turn,
                                                            content=USER_TEXT, lease_holder="bench",
                                                            context_max_messages=HISTORY if context else 0))
    t1 = time.perf_counter()
    assert claim.WhichOneof("outcome") == "claimed"
    if context:
        assert len(claim.claimed.context.messages) == HISTORY
    else:
        history = await stub.ReadConversation(store_pb2.ReadConversationRequest(
            owner_id=owner, conversation_id=conv, max_messages=HISTORY))
        assert len(history.messages) == HISTORY
    t2 = time.perf_counter()
    await stub.FinishTurn(store_pb2.FinishTurnRequest(
        owner_id=owner, conversation_id=conv, turn_id=turn, lease_id=claim.claimed.lease_id,
        user_token_count=REPLY.user_token_count, reply=REPLY.text, reply_token_count=REPLY.token_count,
        usage=common_pb2.Usage(prompt_tokens=1500, cached_prompt_tokens=1100, output_tokens=400)))
    t3 = time.perf_counter()
    if latencies is not None:
        record(latencies, t0, t1, t2, t3, context)


async def on_postgres_grpc(url: str, clients: int, seconds: float, warmup: float,
                           context: bool) -> tuple[str, Result, float]:
    """The same cycle through a `chatmesh serve store` process over loopback gRPC; "store-core CPU" is then
    that server process's CPU (gRPC included)."""
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = make_engine(POSTGRES_URL, pool_size=1)
    async with admin.begin() as conn:
        await conn.execute(text(f"CREATE SCHEMA {schema}"))
    port = _free_port()
    env = os.environ | {"CHATMESH_DATABASE_URL": url, "CHATMESH_DATABASE_SCHEMA": schema,
                        "CHATMESH_LOG_LEVEL": "warning", "CHATMESH_STORE_PURGE_INTERVAL_S": "0",
                        "CHATMESH_DATABASE_POOL_SIZE": str(clients)}
    server = subprocess.Popen([sys.executable, "-m", "chatmesh.mesh.cli", "serve", "store", "--listen",
                               f"127.0.0.1:{port}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = Result()
    db_cpu = 0.0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 60)
            stub = store_pb2_grpc.StoreServiceStub(channel)
            await asyncio.sleep(1.0)  # the schema is migrated before the port opens; let start-up settle
            engine = make_engine(POSTGRES_URL, pool_size=1, search_path=schema)
            convs = await seed(engine, 0, clients)
            await engine.dispose()
            measure_from = time.time() + warmup
            stop_at = measure_from + seconds

            async def client(owner: str, conv: str) -> None:
                while time.time() < stop_at:
                    measuring = time.time() >= measure_from
                    await grpc_cycle(stub, owner, conv, result.latencies_ms if measuring else None, context)
                    if measuring:
                        result.turns += 1

            tasks = [asyncio.create_task(client(o, c)) for o, c in convs]
            await asyncio.sleep(max(0.0, measure_from - time.time()))
            async with admin.connect() as conn:
                pids = [int(r[0]) for r in await conn.execute(text(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = 'chatmesh-store' "
                    "AND query NOT ILIKE '%pg_stat_activity%'"))]
            db_before, server_before = proc_cpu_s(pids), proc_cpu_s([server.pid])
            await asyncio.gather(*tasks)
            db_cpu = proc_cpu_s(pids) - db_before
            result.cpu_s = proc_cpu_s([server.pid]) - server_before
            result.seconds = time.time() - measure_from
    finally:
        server.terminate()
        server.wait(30)
        async with admin.begin() as conn:
            await conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        await admin.dispose()
    transport = "Unix socket" if "host=/" in url else "TCP loopback"
    return f"PostgreSQL 15 ({transport}) via StoreService (gRPC, 1 server process)", result, db_cpu


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def table(rows: list[tuple[str, Result, float]], clients: int) -> str:
    lines = [f"| backend | turns/s ({clients} clients) | "
             + " | ".join(f"{op} p50 / p99 ms" for op in OPS)
             + " | store-core CPU ms/turn | DB server CPU ms/turn | projected turns/s, 2 idle cores |",
             "|---|---|" + "---|" * len(OPS) + "---|---|---|"]
    for name, r, db_cpu in rows:
        cells = " | ".join(f"{pct(r.latencies_ms[op], 50):.1f} / {pct(r.latencies_ms[op], 99):.1f}"
                           if r.latencies_ms[op] else "(in claim)" for op in OPS)
        core_ms, db_ms = 1000 * r.cpu_s / max(r.turns, 1), 1000 * db_cpu / max(r.turns, 1)
        lines.append(f"| {name} | {r.turns / r.seconds:,.0f} | {cells} | {core_ms:.2f} | "
                     f"{db_ms:.2f} | {2000 / (core_ms + db_ms):,.0f} |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> str:
    rows = []
    for backend in args.backends.split(","):
        if backend == "postgres":
            rows.append(await on_postgres(args.postgres_url, args.clients, args.processes, args.seconds, args.warmup,
                                          args.context))
        elif backend == "grpc":
            rows.append(await on_postgres_grpc(args.postgres_url, args.clients, args.seconds, args.warmup,
                                               args.context))
        elif backend == "sqlite":
            rows.append(await on_sqlite(args.clients, args.seconds, args.warmup, args.context))
        else:
            raise SystemExit(f"unknown backend {backend}")
    return table(rows, args.clients)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--processes", type=int, default=1, help="PostgreSQL driver processes")
    parser.add_argument("--postgres-url", default=POSTGRES_URL,
                        help="e.g. postgresql+asyncpg://postgres@/test?host=/var/run/postgresql (Unix socket)")
    parser.add_argument("--context", action="store_true",
                        help="two calls per turn: BeginTurn returns the 20 messages (context_max_messages), then "
                             "FinishTurn; no separate read")
    parser.add_argument("--backends", default="postgres,sqlite",
                        help="comma-separated: postgres, sqlite, grpc (PostgreSQL behind a StoreService process)")
    parser.add_argument("--append", action="store_true", help="append the results to BENCHMARKS.md")
    args = parser.parse_args()
    quiet_logs()
    load_before = os.getloadavg()[0]
    body = asyncio.run(main_async(args))
    header = (f"\n### store_turns, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n\n"
              f"{platform.machine()}, {os.cpu_count()} cores shared with other work (1-minute load "
              f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after), Python {platform.python_version()}; "
              f"{args.seconds:.0f} s per backend after {args.warmup:.0f} s warm-up; a cycle = "
              + ("claim returning the newest 20 messages + finish" if args.context
                 else "claim + read 20 messages + finish")
              + " (user message, ~1.7 KB reply, usage).\n\n")
    print(header + body)
    if args.append:
        with open(Path(__file__).resolve().parents[1] / "BENCHMARKS.md", "a") as out:
            out.write(header + body + "\n")


if __name__ == "__main__":
    main()
