"""Bringing a database's schema to what this code expects."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from chatmesh.store.core import create_schema
from chatmesh.store.db import is_sqlite


async def prepare_schema(engine: AsyncEngine) -> None:
    """At service start: the embedded SQLite creates its own schema; PostgreSQL is migrated by the operator
    (`chatmesh store migrate`), but missing tables are created so a fresh database works."""
    _ = is_sqlite(engine)
    await create_schema(engine)
