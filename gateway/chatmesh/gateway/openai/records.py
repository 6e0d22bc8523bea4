"""What the edge keeps of each OpenAI-surface turn, beside the history index (`history.py`), in the gateway's
database so every gateway sees it: the `openai_turns` table, rows keyed (owner_id, turn_id).

Two jobs:

- Idempotency (I2) across conversations. An `Idempotency-Key` (or Open WebUI's message id) names a turn,
  `uuid5(owner, key)`, and chat refuses that turn id with other content in the SAME conversation; a request with
  a different first message lands in a different conversation, where the same turn id is new. So before a keyed
  request opens its turn, the edge claims the key: the row binds the turn id to the request's digest (`Ask.
  request_digest`: its messages, options and where it continues). The same digest again is a retry and goes on
  (it replays or attaches); another digest is answered 409 `idempotency_key_reused`, with `x-should-retry: false`,
  before anything is stored. Two gateways claiming one key at once race on the primary key; the loser reads the
  winner's row and compares.
- The Response object. A response's request-side fields (created_at, the sampling values it ran with,
  instructions, metadata, user, store, background, the token cap...; `Recorded.body`) and, once it ends, the
  status `create` reported (and `completed_at`), so `GET /responses/{id}` on any gateway returns the object
  `create` did: `incomplete` for a reply cut by max_output_tokens, not `completed`. Chat's stored turn has the
  reply, usage and whether it was stopped or blocked; the finish reason and the cap live here.

A third, smaller one: an assistant message's Responses `phase` (commentary or final_answer), which chat's
messages have no field for, kept in `openai_phases` by (owner, conversation, message index) when a client's
history seeds a conversation with it, and echoed on the message when the conversation's items are listed.

Rows of a deleted conversation or response are deleted with it; rows older than the retention are purged with the
history index's (`HistoryIndex.record`).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from chatmesh.gateway.accounts import metadata
from chatmesh.gateway.openai.errors import OpenAIError
from chatmesh.gateway.openai.wire import Phase
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId

turns = sa.Table(
    "openai_turns", metadata,
    sa.Column("owner_id", sa.String(128), primary_key=True),
    sa.Column("turn_id", sa.String(36), primary_key=True),
    sa.Column("request_digest", sa.String(64), nullable=False),
    sa.Column("conversation_id", sa.String(36), nullable=True),
    sa.Column("body", sa.Text, nullable=False, default="{}"),  # JSON: the response object's request-side fields
    sa.Column("cap", sa.Integer, nullable=False, default=0),  # the reply's token cap (0: not a response)
    sa.Column("status", sa.String(16), nullable=True),  # the final status create reported; NULL while it runs
    sa.Column("reason", sa.String(32), nullable=True),  # incomplete_details.reason
    sa.Column("completed_at", sa.BigInteger, nullable=True),  # Unix seconds
    sa.Column("recorded_at_ms", sa.BigInteger, nullable=False, index=True),
    sa.Index("ix_openai_turns_owner_conversation", "owner_id", "conversation_id"),
)

phases = sa.Table(
    "openai_phases", metadata,
    sa.Column("owner_id", sa.String(128), primary_key=True),
    sa.Column("conversation_id", sa.String(36), primary_key=True),
    sa.Column("message_index", sa.Integer, primary_key=True),
    sa.Column("phase", sa.String(16), nullable=False),
    sa.Column("recorded_at_ms", sa.BigInteger, nullable=False, index=True),
)

CACHED = 20_000


class KeyReused(OpenAIError):
    def __init__(self) -> None:
        super().__init__(409, "idempotency_key_reused",
                         "this Idempotency-Key was already used for a different request; send a new key for a "
                         "new request (a retry must repeat the request exactly)", "Idempotency-Key")


@dataclass(frozen=True)
class Ended:
    """How a response ended, as create reported it."""

    status: str  # completed, incomplete, cancelled or failed
    reason: str | None  # incomplete_details.reason
    completed_at: int | None


@dataclass(frozen=True)
class Recorded:
    conversation: ConversationId | None
    request_digest: str
    body: dict[str, Any] = field(default_factory=dict)
    cap: int = 0
    ended: Ended | None = None


class TurnRecords:
    def __init__(self, engine: AsyncEngine, cached: int = CACHED):
        self._engine = engine
        self._cached = cached
        self._claimed: OrderedDict[tuple[OwnerId, TurnId], str] = OrderedDict()  # claims known to hold

    async def claim(self, owner: OwnerId, turn: TurnId, request_digest: str) -> None:
        """Binds a keyed turn id to the request's digest; KeyReused when it is bound to another one."""
        known = self._claimed.get((owner, turn))
        if known is None:
            try:
                async with self._engine.begin() as conn:
                    await conn.execute(turns.insert().values(
                        owner_id=owner, turn_id=turn, request_digest=request_digest, body="{}", cap=0,
                        recorded_at_ms=int(time.time() * 1000)))
                known = request_digest
            except sa.exc.IntegrityError:  # claimed before (a retry, or another request with this key)
                recorded = await self.get(owner, turn)
                known = recorded.request_digest if recorded is not None else request_digest
            self._remember(owner, turn, known)
        if known != request_digest:
            raise KeyReused()

    async def describe(self, owner: OwnerId, turn: TurnId, conversation: ConversationId, request_digest: str,
                       body: dict[str, Any], cap: int) -> None:
        """Records a response's request-side fields (its row is made here when its request named no key)."""
        values = {"conversation_id": conversation, "body": json.dumps(body, separators=(",", ":")), "cap": cap}
        async with self._engine.begin() as conn:
            updated = await conn.execute(turns.update().where(
                turns.c.owner_id == owner, turns.c.turn_id == turn, turns.c.status.is_(None)).values(**values))
            if updated.rowcount == 0:
                try:
                    async with conn.begin_nested():
                        await conn.execute(turns.insert().values(
                            owner_id=owner, turn_id=turn, request_digest=request_digest,
                            recorded_at_ms=int(time.time() * 1000), **values))
                except sa.exc.IntegrityError:  # a retry's row, already ended: it stays as it ended
                    pass

    async def end(self, owner: OwnerId, turn: TurnId, ended: Ended) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(turns.update().where(
                turns.c.owner_id == owner, turns.c.turn_id == turn, turns.c.status.is_(None)).values(
                status=ended.status, reason=ended.reason, completed_at=ended.completed_at))

    async def get(self, owner: OwnerId, turn: TurnId) -> Recorded | None:
        async with self._engine.connect() as conn:
            row = (await conn.execute(sa.select(
                turns.c.conversation_id, turns.c.request_digest, turns.c.body, turns.c.cap, turns.c.status,
                turns.c.reason, turns.c.completed_at).where(
                turns.c.owner_id == owner, turns.c.turn_id == turn))).first()
        if row is None:
            return None
        ended = Ended(row.status, row.reason, row.completed_at) if row.status is not None else None
        return Recorded(ConversationId(row.conversation_id) if row.conversation_id else None, row.request_digest,
                        json.loads(row.body or "{}"), row.cap or 0, ended)

    async def drop(self, owner: OwnerId, turn: TurnId) -> None:
        """A deleted response's row."""
        self._claimed.pop((owner, turn), None)
        async with self._engine.begin() as conn:
            await conn.execute(turns.delete().where(turns.c.owner_id == owner, turns.c.turn_id == turn))

    async def keep_phases(self, owner: OwnerId, conversation: ConversationId, kept: dict[int, Phase]) -> None:
        """The phases of a conversation's seeded messages, by message index (a retry's rows stay as they were)."""
        now_ms = int(time.time() * 1000)
        async with self._engine.begin() as conn:
            known = set((await conn.execute(sa.select(phases.c.message_index).where(
                phases.c.owner_id == owner, phases.c.conversation_id == conversation))).scalars().all())
            rows = [{"owner_id": owner, "conversation_id": conversation, "message_index": i, "phase": p.value,
                     "recorded_at_ms": now_ms} for i, p in kept.items() if i not in known]
            if rows:
                await conn.execute(phases.insert(), rows)

    async def phases(self, owner: OwnerId, conversation: ConversationId) -> dict[int, Phase]:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(sa.select(phases.c.message_index, phases.c.phase).where(
                phases.c.owner_id == owner, phases.c.conversation_id == conversation))).all()
        return {row.message_index: Phase(row.phase) for row in rows}

    async def forget(self, owner: OwnerId, conversation: ConversationId) -> None:
        """Every row of a deleted conversation. (A claim made before its turn opened has no conversation yet and
        lapses with the retention.)"""
        async with self._engine.begin() as conn:
            await conn.execute(phases.delete().where(phases.c.owner_id == owner,
                                                     phases.c.conversation_id == conversation))
            gone = (await conn.execute(sa.select(turns.c.turn_id).where(
                turns.c.owner_id == owner, turns.c.conversation_id == conversation))).scalars().all()
            await conn.execute(turns.delete().where(turns.c.owner_id == owner,
                                                    turns.c.conversation_id == conversation))
        for turn in gone:
            self._claimed.pop((owner, TurnId(turn)), None)

    def _remember(self, owner: OwnerId, turn: TurnId, digest: str) -> None:
        self._claimed[(owner, turn)] = digest
        self._claimed.move_to_end((owner, turn))
        while len(self._claimed) > self._cached:
            self._claimed.popitem(last=False)
