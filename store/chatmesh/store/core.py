"""The conversation store core: its three concerns over one database. No gRPC here.

- `conversations` (`chatmesh.store.conversations`): conversations, their messages and summaries;
- `turns` (`chatmesh.store.turns`): the turn record's life, claim to finish (I2);
- `lifecycle` (`chatmesh.store.lifecycle`): deletion, export, usage and retention of an owner's data.

Each runs its SQLAlchemy statements through `chatmesh.store.db.Database`; the turn cycle's claim, history
read and finish are the database's own statements (`chatmesh.store.backend`: `postgres.py`, `sqlite.py`). The
rules a write must pass are written once, in `chatmesh.store.guards`.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from chatmesh.store.clock import Clock, wall_clock_ms
from chatmesh.store.conversations import ConversationRecords
from chatmesh.store.db import Database
from chatmesh.store.lifecycle import OwnerData
from chatmesh.store.limits import FieldLimits
from chatmesh.store.turns import TurnRecords


class ConversationStore:
    """The store's concerns over one SQLAlchemy engine (SQLite or PostgreSQL), which stays the caller's."""

    def __init__(self, engine: AsyncEngine, limits: FieldLimits = FieldLimits(), clock: Clock = wall_clock_ms):
        self.engine = engine
        self.limits = limits
        self.db = Database(engine)
        self.conversations = ConversationRecords(self.db, limits, clock)
        self.turns = TurnRecords(self.db, limits, clock)
        self.lifecycle = OwnerData(self.db, limits, clock)

    async def close(self) -> None:
        """Closes what the store opened itself (SQLite's backend connections); the engine is the caller's."""
        await self.db.close()
