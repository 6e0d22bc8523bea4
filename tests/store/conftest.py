"""Store fixtures: the same tests run on SQLite (a temporary file) and on the real PostgreSQL, each
PostgreSQL test in a schema of its own so parallel runs do not collide."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from chatmesh.store.core import ConversationStore
from chatmesh.store.limits import FieldLimits
from chatmesh.store.db import make_engine
from chatmesh.store.migrate import upgrade
from tests.conftest import POSTGRES_URL, need, port_open


@dataclass
class Backend:
    """Where a test's database lives: a URL plus (PostgreSQL) the schema to put in the search path."""

    name: str
    url: str
    schema: str | None

    def engine(self, pool_size: int = 20) -> AsyncEngine:
        return make_engine(self.url, pool_size=pool_size, search_path=self.schema)


class FakeClock:
    """A settable clock, ms since the epoch."""

    def __init__(self, now_ms: int = 1_800_000_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


@asynccontextmanager
async def open_backend(name: str, folder: Path) -> AsyncIterator[Backend]:
    """A fresh database: a SQLite file in `folder`, or a PostgreSQL schema of its own (dropped after)."""
    if name == "sqlite":
        yield Backend("sqlite", f"sqlite+aiosqlite:///{folder / 'store.db'}", None)
        return
    need(port_open("127.0.0.1", 5432), "PostgreSQL at 127.0.0.1:5432")
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = make_engine(POSTGRES_URL, pool_size=1)
    async with admin.begin() as conn:
        await conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield Backend("postgres", POSTGRES_URL, schema)
    finally:
        async with admin.begin() as conn:
            await conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        await admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    async with open_backend(request.param, tmp_path) as opened:
        yield opened


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def engine(backend: Backend) -> AsyncIterator[AsyncEngine]:
    eng = backend.engine()
    await upgrade(eng)
    yield eng
    await eng.dispose()


@pytest.fixture
async def make_store(engine: AsyncEngine, clock: FakeClock) -> AsyncIterator[Callable[..., ConversationStore]]:
    made: list[ConversationStore] = []

    def make(**limits: int) -> ConversationStore:
        made.append(ConversationStore(engine, FieldLimits(**limits), clock))
        return made[-1]

    yield make
    for store in made:
        await store.close()


@pytest.fixture
def store(make_store: Callable[..., ConversationStore]) -> ConversationStore:
    return make_store()
