"""An owner's data over time: deleting a stored turn, a conversation or everything of an owner, exporting it,
reading its usage, and the retention purge. No gRPC here.

Deletes lock the conversation row first (a racing finish then waits, or has committed and its messages are
seen), then remove children before the conversation. Usage totals outlive the conversations they count, until
the owner's data is deleted. Partitioning: every statement filters on `owner_id`, except the purge's candidate
scans, which by nature look across owners; each of its deletes is then owner-scoped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncConnection

from chatmesh.mesh import logs
from chatmesh.mesh.errors import FailedPrecondition, NotFound
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.mesh.turn import RECORD_ACTIVE
from chatmesh.store.clock import DAY_MS, Clock, utc_day
from chatmesh.store.db import Database
from chatmesh.store.limits import FieldLimits
from chatmesh.store.rows import CONV, MSG, TURN, USAGE, message_of, parts_of
from chatmesh.store.values import DailyUsage, Purged, ToolCall, ToolResult, TurnRecordState, Usage

log = logs.get("chatmesh.store")
PURGE_BATCH = 500


class OwnerData:
    """Deletion, export, usage and retention of an owner's stored data."""

    def __init__(self, db: Database, limits: FieldLimits, clock: Clock) -> None:
        self.db = db
        self.limits = limits
        self._clock = clock

    async def delete_turn(self, owner: OwnerId, conversation: ConversationId, turn: TurnId
                          ) -> tuple[list[ConversationId], int]:
        """Deletes one stored turn: its user message, its reply, the replies regenerating it and their turn
        records (usage totals stay). Returns the ids engines must evict and how many messages went."""
        async with self.db.write() as conn:
            lock = select(CONV.c.conversation_id).where(CONV.c.owner_id == owner,
                                                        CONV.c.conversation_id == conversation)
            if (await conn.execute(lock.with_for_update())).first() is None:
                raise NotFound(f"turn {turn} not found")
            row = (await conn.execute(select(TURN.c.state).where(
                TURN.c.owner_id == owner, TURN.c.conversation_id == conversation, TURN.c.turn_id == turn))).first()
            if row is None or TurnRecordState(row.state) is TurnRecordState.FAILED:
                raise NotFound(f"turn {turn} not found")
            if TurnRecordState(row.state) in RECORD_ACTIVE:
                raise FailedPrecondition(f"turn {turn} is still running; stop it first")
            regenerations = select(TURN.c.turn_id).where(
                TURN.c.owner_id == owner, TURN.c.conversation_id == conversation, TURN.c.regenerates_turn_id == turn)
            turns = [turn, *[TurnId(r.turn_id) for r in await conn.execute(regenerations)]]
            gone = await conn.execute(delete(MSG).where(
                MSG.c.owner_id == owner, MSG.c.conversation_id == conversation, MSG.c.turn_id.in_(turns)))
            await conn.execute(delete(TURN).where(
                TURN.c.owner_id == owner, TURN.c.conversation_id == conversation, TURN.c.turn_id.in_(turns)))
        log.info("turn_deleted", owner_id=owner, conversation_id=conversation, turn_id=turn,
                 messages=gone.rowcount)
        return [conversation], gone.rowcount

    async def delete_conversation(self, owner: OwnerId, conversation: ConversationId) -> list[ConversationId]:
        """Deletes every row of the conversation (usage totals stay). Returns the ids engines must evict."""
        async with self.db.write() as conn:
            if not await self._delete_rows(conn, owner, conversation):
                raise NotFound(f"conversation {conversation} not found")
        log.info("conversation_deleted", owner_id=owner, conversation_id=conversation)
        return [conversation]

    async def _delete_rows(self, conn: AsyncConnection, owner: OwnerId, conversation: ConversationId,
                           idle_before_ms: int | None = None) -> bool:
        """The conversation row locked first (a racing finish then waits, or has committed and its messages are
        seen), children, then the conversation (whose FK cascade catches a turn a racing claim just added)."""
        lock = select(CONV.c.conversation_id).where(CONV.c.owner_id == owner, CONV.c.conversation_id == conversation)
        if idle_before_ms is not None:  # purge: only if it is still idle now that we hold the lock
            lock = lock.where(CONV.c.updated_at_ms < idle_before_ms)
        if (await conn.execute(lock.with_for_update())).first() is None:
            return False
        await conn.execute(delete(MSG).where(MSG.c.owner_id == owner, MSG.c.conversation_id == conversation))
        await conn.execute(delete(TURN).where(TURN.c.owner_id == owner, TURN.c.conversation_id == conversation))
        done = await conn.execute(delete(CONV).where(CONV.c.owner_id == owner, CONV.c.conversation_id == conversation)
                                  .returning(CONV.c.conversation_id))
        return done.first() is not None

    async def delete_user_data(self, owner: OwnerId) -> list[ConversationId]:
        """Deletes all of an owner's data, usage included. Returns the conversation ids engines must evict."""
        async with self.db.write() as conn:
            await conn.execute(select(CONV.c.conversation_id).where(CONV.c.owner_id == owner).with_for_update())
            await conn.execute(delete(MSG).where(MSG.c.owner_id == owner))
            await conn.execute(delete(TURN).where(TURN.c.owner_id == owner))
            ids = [ConversationId(r[0]) for r in (await conn.execute(
                delete(CONV).where(CONV.c.owner_id == owner).returning(CONV.c.conversation_id))).all()]
            await conn.execute(delete(USAGE).where(USAGE.c.owner_id == owner))
        log.info("user_data_deleted", owner_id=owner, conversations=len(ids))
        return ids

    async def export_user_data(self, owner: OwnerId) -> dict[str, Any]:
        """Everything stored for the owner as a JSON-ready document."""
        async with self.db.single() as conn:
            convs = (await conn.execute(select(CONV).where(CONV.c.owner_id == owner).order_by(CONV.c.created_at_ms))).all()
            msgs = (await conn.execute(select(MSG).where(MSG.c.owner_id == owner)
                                       .order_by(MSG.c.conversation_id, MSG.c.message_index))).all()
            days = (await conn.execute(select(USAGE).where(USAGE.c.owner_id == owner).order_by(USAGE.c.day))).all()
            pending = (await conn.execute(
                select(TURN.c.conversation_id, TURN.c.turn_id, TURN.c.state, TURN.c.content, TURN.c.partial_text,
                       TURN.c.input_parts)
                .where(TURN.c.owner_id == owner, TURN.c.content.is_not(None))
                .order_by(TURN.c.conversation_id, TURN.c.created_at_ms))).all()
        unfinished: dict[str, list[dict[str, Any]]] = {}
        for t in pending:  # user text held by turns not (yet) stored is the owner's data too
            unfinished.setdefault(t.conversation_id, []).append({
                "turn_id": t.turn_id, "state": t.state, "content": t.content, "partial_reply": t.partial_text,
                **_tools_json(*parts_of(t.input_parts))})
        by_conv: dict[str, list[dict[str, Any]]] = {}
        for m in msgs:
            msg = message_of(m)
            by_conv.setdefault(m.conversation_id, []).append({
                "index": msg.index, "role": msg.role.value, "content": msg.content, "token_count": msg.token_count,
                "status": msg.status.value, "turn_id": msg.turn_id, "created_at_ms": msg.created_at_ms,
                "superseded": msg.superseded, **_tools_json(msg.tool_calls, msg.tool_results)})
        conversations = []
        for c in convs:
            summary = None if c.summary_text is None else {
                "text": c.summary_text, "covers_through_index": c.summary_covers_through,
                "token_count": c.summary_token_count}
            conversations.append({
                "conversation_id": c.conversation_id, "title": c.title,
                "system_prompt_version": c.system_prompt_version, "created_at_ms": c.created_at_ms,
                "updated_at_ms": c.updated_at_ms, "summary": summary,
                "messages": by_conv.get(c.conversation_id, []),
                "unfinished_turns": unfinished.get(c.conversation_id, [])})
        usage = [{"day": d.day, "prompt_tokens": d.prompt_tokens, "cached_prompt_tokens": d.cached_prompt_tokens,
                  "output_tokens": d.output_tokens, "turns": d.turns} for d in days]
        return {"owner_id": owner, "conversations": conversations, "usage": usage}

    async def usage(self, owner: OwnerId, days: int = 30) -> list[DailyUsage]:
        """Per-day usage for the last `days` UTC days including today, newest first."""
        if days <= 0:
            days = 30
        days = min(days, 3660)
        first = utc_day(self._clock() - (days - 1) * DAY_MS)
        async with self.db.single() as conn:
            rows = (await conn.execute(select(USAGE).where(USAGE.c.owner_id == owner, USAGE.c.day >= first)
                                       .order_by(USAGE.c.day.desc()))).all()
        return [DailyUsage(r.day, Usage(r.prompt_tokens, r.cached_prompt_tokens, r.output_tokens), r.turns)
                for r in rows]

    async def purge_expired(self) -> Purged:
        """Deletes conversations idle past the retention period, and unfinished turn records (which hold
        user text) older than it. The candidate scans cross owners; each delete is owner-scoped."""
        cutoff = self._clock() - self.limits.retention_days * DAY_MS
        purged: list[tuple[OwnerId, ConversationId]] = []
        while True:
            async with self.db.single() as conn:
                batch = (await conn.execute(select(CONV.c.owner_id, CONV.c.conversation_id)
                                            .where(CONV.c.updated_at_ms < cutoff).limit(PURGE_BATCH))).all()
            if not batch:
                break
            for owner, conversation in batch:
                async with self.db.write() as conn:
                    if await self._delete_rows(conn, OwnerId(owner), ConversationId(conversation), cutoff):
                        purged.append((OwnerId(owner), ConversationId(conversation)))
            if len(batch) < PURGE_BATCH:
                break
        abandoned = 0
        unfinished = [s.value for s in (*RECORD_ACTIVE, TurnRecordState.FAILED)]
        while True:
            async with self.db.single() as conn:
                turns = (await conn.execute(select(TURN.c.owner_id, TURN.c.conversation_id, TURN.c.turn_id).where(
                    TURN.c.updated_at_ms < cutoff, TURN.c.state.in_(unfinished)).limit(PURGE_BATCH))).all()
            for owner, conversation, turn in turns:
                async with self.db.write() as conn:
                    gone = await conn.execute(delete(TURN).where(
                        TURN.c.owner_id == owner, TURN.c.conversation_id == conversation, TURN.c.turn_id == turn,
                        TURN.c.updated_at_ms < cutoff, TURN.c.state.in_(unfinished)).returning(TURN.c.turn_id))
                    abandoned += len(gone.all())
            if len(turns) < PURGE_BATCH:
                break
        log.info("purged", conversations=len(purged), abandoned_turns=abandoned)
        return Purged(purged, abandoned)


def _tools_json(calls: Sequence[ToolCall], results: Sequence[ToolResult]) -> dict[str, Any]:
    """A message's tool calls or results in the export (absent when it has none)."""
    out: dict[str, Any] = {}
    if calls:
        out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]
    if results:
        out["tool_results"] = [{"tool_call_id": r.tool_call_id, "content": r.content} for r in results]
    return out
