"""Schema migrations (Alembic, scripts in `chatmesh/store/migrations`), driven through the async engine.

No alembic.ini: the script location is the package, and the connection is handed to env.py. On PostgreSQL
the run holds an advisory lock, so several store replicas starting at once migrate exactly once.
"""

from __future__ import annotations

from collections.abc import Callable

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from chatmesh.mesh import logs

log = logs.get("chatmesh.store.migrate")

SCRIPT_LOCATION = "chatmesh.store:migrations"
ADVISORY_LOCK = 0x63686D73  # "chms"


def alembic_config(connection: Connection | None = None) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    cfg.attributes["connection"] = connection
    return cfg


def head() -> str:
    revision = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert revision is not None
    return revision


async def current(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    await _run(engine, lambda cfg: command.upgrade(cfg, revision))
    log.info("store_migrated", revision=revision)


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    await _run(engine, lambda cfg: command.downgrade(cfg, revision))
    log.info("store_downgraded", revision=revision)


async def _run(engine: AsyncEngine, action: Callable[[AlembicConfig], None]) -> None:
    def run(sync_conn: Connection) -> None:
        if sync_conn.dialect.name == "postgresql":
            sync_conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADVISORY_LOCK})
        action(alembic_config(sync_conn))

    async with engine.begin() as conn:  # SQLite: BEGIN IMMEDIATE, so concurrent starters queue
        await conn.run_sync(run)


async def prepare_schema(engine: AsyncEngine) -> None:
    """At service start: bring the schema to head (a no-op when it is there already)."""
    await upgrade(engine, "head")
