"""StoreService settings: where the database is, and the limits of what it keeps."""

from __future__ import annotations

from chatmesh.mesh.config import Setting

DATABASE_URL = Setting(
    "CHATMESH_DATABASE_URL", "",
    "SQLAlchemy async URL of the conversation store (postgresql+asyncpg://...); empty: embedded SQLite "
    "at <CHATMESH_DATA_DIR>/chatmesh.db", str)
DATABASE_POOL_SIZE = Setting("CHATMESH_DATABASE_POOL_SIZE", 20, "connections the store keeps open to PostgreSQL", int)
LEASE_TTL_MS = Setting("CHATMESH_STORE_LEASE_TTL_MS", 30_000,
                       "default turn lease, ms: a claim not finished or renewed by then is claimable again", int)
RETENTION_DAYS = Setting("CHATMESH_STORE_RETENTION_DAYS", 30,
                         "conversations idle for longer than this many days are purged", int)
PURGE_INTERVAL_S = Setting("CHATMESH_STORE_PURGE_INTERVAL_S", 3600.0,
                           "seconds between retention purges run by the store service (0: never)", float)
DATABASE_SCHEMA = Setting("CHATMESH_DATABASE_SCHEMA", "",
                          "PostgreSQL schema holding every chatmesh table, the store's and the gateway's auth_ "
                          "tables (sets search_path; the schema must exist; empty: the default)", str)
