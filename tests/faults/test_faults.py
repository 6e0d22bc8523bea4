"""Faults without surprises, in the test command's short form: the real mesh as separate processes (three `sim`
engines, two chat processes, the store on SQLite and on PostgreSQL, Redis holding the gateway's limits), a load of
clients retrying the same turn id through the gateway's SSE route, a few fault kinds one at a time per database,
then the audit (bench/fault_mesh.py): 0 acknowledged turns lost, 0 turn ids with two replies, 0 acknowledged
texts that differ from the stored reply, 0 clients shown text the stored reply contradicts (the load samples, so
a takeover must continue, not regenerate), 0 turns stored stopped by a fault, 0 turns stored as blocked (the
load is benign, so only an outage could block it), and no traceback or unretrieved-exception line in any
service's log. Every turn is eventually
acknowledged. A turn interrupted by a chat crash completes through the other chat process before the killed one
is back; a restarted engine is served by the router and generates again. The long run with every fault kind is
bench/faults.py (BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text

from bench.faults import run
from chatmesh.store.db import make_engine
from tests.conftest import POSTGRES_URL, need, port_open

pytestmark = [pytest.mark.slow]

SQLITE_KINDS = ("kill:chat", "kill:engine", "kill:moderation", "client_disconnect")
POSTGRES_KINDS = ("term:chat", "kill:store", "redis_stop")


async def _run(database: str, kinds: tuple[str, ...], root: Path, url: str = "", schema: str = "") -> None:
    # Two turns per conversation: first turns (placed on the least-loaded replica, so a restarted engine gets
    # them at once) are half the load; later turns stay on their conversation's replica.
    result = await run(database, kinds, root, conversations=10, warmup_s=2.0, down_s=1.5, settle_s=2.5,
                       postgres_url=url, postgres_schema=schema, turns_per_conversation=2)
    a = result.audit
    summary = f"{a.row()} examples={a.examples} logs={a.log_problems[:5]} faults={result.faults}"
    assert a.acknowledged >= 20, summary  # the load made progress through the faults
    assert a.acknowledged == a.attempted, summary  # every turn was answered in the end (retries of one id)
    assert (a.lost, a.two_replies, a.text_differs, a.blocked) == (0, 0, 0, 0), summary
    # The load samples (temperature 0.7, a seed per turn): every client's text is a prefix of the stored reply,
    # and no turn is stored stopped that no client stopped (issue 33).
    assert (a.spliced, a.stopped_by_fault) == (0, 0), summary
    assert a.log_problems == [], summary
    by_kind = {f["kind"]: f for f in result.faults}
    # Orderings, not timings (the recovery times are bench/faults.py's, in BENCHMARKS.md; a loaded runner once
    # took 2.1 s where the bench's target is 2): a chat crash's turns complete through the other chat process,
    # before the killed one is back; a restarted engine is served by the router and generates again.
    if "kill:chat" in by_kind:
        chat = by_kind["kill:chat"]
        done = chat["crash_completions_s"]
        assert done and chat["healthy_s"] is not None and max(done) < chat["healthy_s"], summary
    if "kill:engine" in by_kind:
        engine = by_kind["kill:engine"]
        assert engine["router_serving_after_healthy_s"] is not None, summary
        assert engine["engine_first_generation_after_healthy_s"] is not None, summary
    for f in result.faults:
        assert f["affected_unacked"] == 0, summary


async def test_faults_on_sqlite(tmp_path: Path) -> None:
    need(shutil.which("redis-server") is not None, "redis-server")
    await _run("sqlite", SQLITE_KINDS, tmp_path)


@pytest.mark.services
async def test_faults_on_postgres(tmp_path: Path) -> None:
    need(port_open("127.0.0.1", 5432), "PostgreSQL at 127.0.0.1:5432")
    need(shutil.which("redis-server") is not None, "redis-server")
    schema = f"faults_{uuid.uuid4().hex[:12]}"
    admin = make_engine(POSTGRES_URL, pool_size=1)
    async with admin.begin() as conn:
        await conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        await _run("postgres", POSTGRES_KINDS, tmp_path, POSTGRES_URL, schema)
    finally:
        async with admin.begin() as conn:
            await conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        await admin.dispose()
        await asyncio.sleep(0)
