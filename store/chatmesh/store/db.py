"""The store's database: engines for the two backends, the backend (`chatmesh.store.backend`) that goes with
each, and the transactions the SQLAlchemy statements run in.

Both backends run the SQLAlchemy statements as they are; the turn cycle's claim, read and finish are the
backend's (`postgres.py`, `sqlite.py`), whose SQL is written once per database. SQLite (embedded default): WAL,
`synchronous=NORMAL`, a busy timeout, foreign keys on, and every write transaction opened with `BEGIN
IMMEDIATE`, so a read-then-write takes the write lock up front instead of failing with SQLITE_BUSY when it
upgrades. Work made of statements that are each atomic runs without a transaction (see `autocommit`).
PostgreSQL: asyncpg, READ COMMITTED; atomicity comes from single conditional statements (INSERT .. ON
CONFLICT DO NOTHING, UPDATE .. WHERE lease_id = :old, the finish's one data-modifying statement) and row locks.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry, QueuePool

from chatmesh.store.backend import Backend, unavailable
from chatmesh.store.postgres import PostgresBackend
from chatmesh.store.sqlite import SQLITE_BUSY_TIMEOUT_MS, SQLITE_MAX_POOL, SQLITE_PRAGMAS, SqliteBackend, apply_pragmas

_BEGIN_OPTION = "chatmesh_sqlite_begin"
# SQLAlchemy's errors that mean the database cannot be reached or is shedding load (answered UNAVAILABLE).
# asyncpg's refused or dropped connections surface as OSError / TimeoutError, not as SQLAlchemy errors.
UNREACHABLE = (OperationalError, InterfaceError, OSError, TimeoutError)


def database_url(configured: str, data_dir: str) -> str:
    """The configured URL, or the embedded SQLite file in the data folder."""
    if configured:
        return configured
    os.makedirs(data_dir, exist_ok=True)
    return f"sqlite+aiosqlite:///{os.path.abspath(os.path.join(data_dir, 'chatmesh.db'))}"


def is_sqlite(url_or_engine: str | AsyncEngine) -> bool:
    if isinstance(url_or_engine, AsyncEngine):
        return url_or_engine.dialect.name == "sqlite"
    return url_or_engine.startswith("sqlite")


def make_engine(url: str, *, pool_size: int = 20, search_path: str | None = None,
                application_name: str = "chatmesh-store") -> AsyncEngine:
    """An async engine for `url`. PostgreSQL: `search_path` puts every table in that schema (tests use it);
    `application_name` names the connections in pg_stat_activity."""
    if is_sqlite(url):
        engine = create_async_engine(url, pool_size=min(pool_size, SQLITE_MAX_POOL), max_overflow=0,
                                     connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
        _sqlite_events(engine)
        return engine
    server_settings = {"application_name": application_name}
    if search_path is not None:
        server_settings["search_path"] = search_path
    connect_args: dict[str, Any] = {"server_settings": server_settings}
    return create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=False,
                               connect_args=connect_args)


def _sqlite_events(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _connect(dbapi_conn: Any, _record: ConnectionPoolEntry) -> None:
        dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
        cursor = dbapi_conn.cursor()
        apply_pragmas(cursor.execute, SQLITE_PRAGMAS)
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get(_BEGIN_OPTION, "IMMEDIATE")
        if mode is not None:
            conn.exec_driver_sql(f"BEGIN {mode}")


async def autocommit(conn: AsyncConnection) -> AsyncConnection:
    """Each statement on `conn` commits on its own: no BEGIN/COMMIT round trips, for work whose every
    statement is atomic by itself (the claim's INSERT .. ON CONFLICT and compare-and-swap UPDATE, reads)."""
    if conn.dialect.name == "sqlite":
        return await conn.execution_options(**{_BEGIN_OPTION: None})
    return await conn.execution_options(isolation_level="AUTOCOMMIT")


def backend_for(engine: AsyncEngine) -> Backend:
    """The turn cycle's one-round-trip-per-call claim, read and finish for this engine's database."""
    if not is_sqlite(engine):
        pool = engine.pool
        size = pool.size() if isinstance(pool, QueuePool) else 1
        return PostgresBackend(engine, keep=max(1, size))  # the pool's overflow stays for everything else
    path = engine.url.database
    if not path or path == ":memory:":
        raise ValueError("the embedded store needs a SQLite file, not an in-memory database")
    return SqliteBackend(path, SQLITE_MAX_POOL, SQLITE_PRAGMAS)


class Database:
    """One store database: the caller's engine, its backend, and the two ways SQLAlchemy statements run on it,
    both answering UNAVAILABLE when the database cannot be reached."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.backend = backend_for(engine)

    async def close(self) -> None:
        """Closes what the store opened itself (SQLite's backend connections); the engine is the caller's."""
        await self.backend.close()

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """One transaction (SQLite: BEGIN IMMEDIATE)."""
        try:
            async with self.engine.begin() as conn:
                yield conn
        except UNREACHABLE as err:
            raise unavailable(err) from err

    @asynccontextmanager
    async def single(self) -> AsyncIterator[AsyncConnection]:
        """A connection whose statements each commit alone (reads; the claim's takeover, an atomic
        compare-and-swap; fail and progress, each one conditional UPDATE)."""
        try:
            async with self.engine.connect() as conn:
                yield await autocommit(conn)
        except UNREACHABLE as err:
            raise unavailable(err) from err
