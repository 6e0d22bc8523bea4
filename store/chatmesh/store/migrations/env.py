"""Alembic environment: runs on the connection `chatmesh.store.migrate` hands over (sync facade of the async
engine), inside its transaction; there is no alembic.ini and no URL here."""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from chatmesh.store.schema import Base

connection = context.config.attributes.get("connection")
if not isinstance(connection, Connection):
    raise RuntimeError("run store migrations with `chatmesh store migrate` (chatmesh.store.migrate)")


def _store_owned(obj: object, name: str | None, type_: str, reflected: bool, compare_to: object) -> bool:
    """The gateway keeps its `auth_*` tables in the same database; they are not the store's to migrate."""
    return not (type_ == "table" and name is not None and name.startswith("auth_"))


context.configure(connection=connection, target_metadata=Base.metadata, include_object=_store_owned,
                  render_as_batch=connection.dialect.name == "sqlite", compare_type=True)
with context.begin_transaction():
    context.run_migrations()
