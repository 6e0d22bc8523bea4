"""Alembic migrations run up from empty and down again on both backends, and head matches the models."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

from chatmesh.mesh import cli, logs
from chatmesh.store import migrate
from chatmesh.store.schema import Base
from tests.store.conftest import Backend

TABLES = {"conversations", "messages", "turns", "usage_days"}


def tables(conn: Connection) -> set[str]:
    return set(inspect(conn).get_table_names()) - {"alembic_version"}


def drift(conn: Connection) -> list[object]:
    return list(compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata))


async def test_up_from_empty_down_and_up_again(backend: Backend) -> None:
    engine = backend.engine(pool_size=2)
    try:
        async with engine.connect() as conn:
            assert await conn.run_sync(tables) == set()
        assert await migrate.current(engine) is None
        await migrate.upgrade(engine)
        assert await migrate.current(engine) == migrate.head()
        async with engine.connect() as conn:
            assert await conn.run_sync(tables) == TABLES
            assert await conn.run_sync(drift) == []
        await migrate.upgrade(engine)  # idempotent at head
        await migrate.downgrade(engine, "base")
        assert await migrate.current(engine) is None
        async with engine.connect() as conn:
            assert await conn.run_sync(tables) == set()
        await migrate.upgrade(engine)
        async with engine.connect() as conn:
            assert await conn.run_sync(tables) == TABLES
    finally:
        await engine.dispose()


def test_cli_migrate_current_downgrade(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(logs, "configure", lambda *_a, **_k: None)  # keep pytest's log capture intact
    monkeypatch.setenv("CHATMESH_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("CHATMESH_DATABASE_URL", raising=False)
    assert cli.main(["store", "migrate"]) == 0
    assert cli.main(["store", "current"]) == 0
    assert cli.main(["store", "purge"]) == 0
    assert cli.main(["store", "downgrade", "--revision", "base"]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert lines.count(migrate.head()) == 2 and lines.count("base") == 1
    assert any(line.startswith("purged 0 conversations") for line in lines)
    assert (tmp_path / "chatmesh.db").exists()


@pytest.mark.timeout(60)  # without the lock, concurrent DDL on PostgreSQL can wait forever
async def test_replicas_starting_together_migrate_once(backend: Backend) -> None:
    engines = [backend.engine(pool_size=1) for _ in range(3)]
    try:
        await asyncio.gather(*[migrate.prepare_schema(e) for e in engines])
        assert {await migrate.current(e) for e in engines} == {migrate.head()}
        async with engines[0].connect() as conn:
            assert await conn.run_sync(tables) == TABLES
    finally:
        for engine in engines:
            await engine.dispose()
