"""The turn record's life: BeginTurn (claim, or take over a failed or expired claim), UpdateTurnProgress (the
heartbeat), FailTurn, FinishTurn, ReadTurn. No gRPC here.

The turn record is the idempotency key of invariant I2, one row per (owner, conversation, turn id), and the
durable projection of the turn state machine (`chatmesh.mesh.turn`: its header shows the record's moves beside
chat's states; `require_record_move` guards them here). The rules a write must pass are written once, in
`chatmesh.store.guards` (`lease_held`, `later_user_message`), and every statement below or in the backends that
enforces or explains one renders it from there.

- BeginTurn answers exactly one of Claimed / InProgress / Done / Conflicted, atomically on both backends: the
  backend's claim (`INSERT .. SELECT .. ON CONFLICT DO NOTHING RETURNING`, one round trip, with the prompt's
  context when asked) creates the record only if the conversation exists for this owner and the turn id is new
  (a regenerate's, once the turn it regenerates is checked here: stored, and not `later_user_message`);
  otherwise the row is read here, and a failed or expired claim is taken over by a compare-and-swap `UPDATE ..
  WHERE state = :seen AND lease_id = :seen_lease`, which exactly one racer wins (PostgreSQL re-checks the WHERE
  on the locked row; SQLite runs writes under BEGIN IMMEDIATE).
- A record claimed again keeps what it holds for the new attempt (issue 33): its generation options (the first
  claim's: a retry's own are ignored) and its `partial_text`, the reply an earlier attempt showed (its last
  progress, or what FailTurn kept), returned as `Claimed.options` / `resume_text`, with `taken_over` when the
  claim took a lapsed lease from an active record (its holder may be paused, not dead).
- UpdateTurnProgress and FailTurn are each one `UPDATE .. WHERE lease_held`; FailTurn keeps the reply the
  attempt showed (or nothing, for a turn released before its client saw text).
- FinishTurn is the backend's guarded store of the messages, the final state and the usage (one statement on
  PostgreSQL, one transaction on SQLite; the conversation row hands out message indexes). When a guard does not
  match nothing is written and the record is read here to say why (`_why_refused`, which selects the guards'
  values): a second finish finds the final state and says `already_finished`; another lease, a stale
  regenerate or a missing row is an error; a record that no longer stands in the way (a racing write moved on)
  is tried again, that time after the conversation's lock (so a PostgreSQL regenerate is not refused for a
  racing finish twice).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Row, bindparam, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from chatmesh.mesh import logs
from chatmesh.mesh.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, TurnId, new_lease_id
from chatmesh.mesh.turn import RECORD_ACTIVE, RECORD_FINAL, require_record_move
from chatmesh.store.backend import FinishValues, NewTurn
from chatmesh.store.clock import Clock, utc_day
from chatmesh.store.conversations import conversation_row, message_at
from chatmesh.store.db import Database
from chatmesh.store.guards import later_user_message, lease_held
from chatmesh.store.limits import FieldLimits, check_count, check_len
from chatmesh.store.rows import TURN, key, parts_json, usage_of
from chatmesh.store.values import (
    Claim, Claimed, Conflicted, Done, Stored, History, InProgress, Message, MessageStatus, Progress, Reply, Role,
    ToolResult, TurnRecord, TurnRecordState,
)

log = logs.get("chatmesh.store")
CLAIM_ATTEMPTS = 5
MAX_CONTEXT_MESSAGES = 1000  # BeginTurn's context_max_messages is capped at this
LAST_EXCHANGE_ONLY = "only the reply to the conversation's last user message can be regenerated"

# Built once: constructing a statement costs more CPU than running it.
_TURN_KEY = "turns.owner_id = :owner AND turns.conversation_id = :conversation AND turns.turn_id = :turn"
_STALE = later_user_message(":owner", ":conversation", "turns.user_index")
TURN_ROW = select(TURN).where(key(TURN), TURN.c.turn_id == bindparam("turn"))
HELD = text(f"{_TURN_KEY} AND {lease_held(':lease')}")
# The turn a regenerate names: stored? its user message? still the last one?
REGENERATED = text(f"SELECT turns.state, turns.user_index, {_STALE} AS stale FROM turns WHERE {_TURN_KEY}")
# Why a finish wrote nothing: the guards' values on the record as it is now.
WHY_REFUSED = text(f"SELECT turns.state, turns.reply_index, turns.regenerates_turn_id, "
                   f"({lease_held(':lease')}) AS held, {_STALE} AS stale FROM turns WHERE {_TURN_KEY}")


def default_fingerprint(content: str, regenerates: TurnId | None) -> str:
    return hashlib.sha256(f"{regenerates or ''}\x00{content}".encode()).hexdigest()


class TurnRecords:
    """Turn records: claims, leases, progress, and the one store of each turn."""

    def __init__(self, db: Database, limits: FieldLimits, clock: Clock) -> None:
        self.db = db
        self.limits = limits
        self._clock = clock

    async def begin_turn(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, *, content: str,
                         lease_holder: str, fingerprint: str = "", lease_ttl_ms: int = 0,
                         regenerates: TurnId | None = None, context_messages: int = 0,
                         options: str = "", tool_results: Sequence[ToolResult] = ()) -> Claim:
        """Claims `turn` for generation, or says who has it, or returns its stored reply, or a conflict.
        With `context_messages` > 0 a NEW claim also carries the prompt's context (`Claimed.context`): the
        summary and the newest that many messages after it (capped at MAX_CONTEXT_MESSAGES). A new record keeps
        `options`; a record claimed again returns the ones it kept, and the reply an earlier attempt left. With
        `tool_results` the turn's input is those results (a tool message), not the user message `content`."""
        check_count("context_max_messages", context_messages)
        self.limits.check_options(options)
        context_messages = min(context_messages, MAX_CONTEXT_MESSAGES)
        if tool_results:
            self.limits.check_tools("tool_results", Role.TOOL, (), tool_results)
            if content or regenerates is not None:
                raise InvalidArgument("a turn answering tool calls has no content and regenerates nothing")
        self.limits.check_text("content", content, required=regenerates is None and not tool_results)
        check_len("fingerprint", fingerprint, self.limits.max_fingerprint_chars)
        check_len("lease_holder", lease_holder, self.limits.max_lease_holder_chars)
        if regenerates == turn:
            raise InvalidArgument("regenerates_turn_id must differ from turn_id")
        ttl = self.limits.ttl(lease_ttl_ms)
        fingerprint = fingerprint or default_fingerprint(content, regenerates)
        for _ in range(CLAIM_ATTEMPTS):
            outcome = await self._claim_once(owner, conversation, turn, content, lease_holder, fingerprint, ttl,
                                             regenerates, context_messages, options, parts_json((), tool_results))
            if outcome is not None:
                if isinstance(outcome, Claimed):
                    log.debug("turn_claimed", owner_id=owner, conversation_id=conversation, turn_id=turn)
                return outcome
        raise Unavailable(f"turn {turn}: claim contended {CLAIM_ATTEMPTS} times; retry")

    async def _claim_once(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, content: str,
                          lease_holder: str, fingerprint: str, ttl: int, regenerates: TurnId | None,
                          context_messages: int, options: str, input_parts: str | None) -> Claim | None:
        """A new record through the backend (one round trip, the common case), else the record read and, when
        its claim failed or expired, taken over. None: another racer moved the record on; look again."""
        now = self._clock()
        user_index = None
        if regenerates is not None:
            user_index = await self._regenerated_user_index(owner, conversation, regenerates)
        new = NewTurn(turn, fingerprint, content, new_lease_id(), lease_holder, now + ttl, now, regenerates,
                      user_index, options, input_parts)
        claimed, prompt_context = await self.db.backend.claim(owner, conversation, new, context_messages)
        if claimed:
            return Claimed(new.lease, new.lease_expires_at_ms, prompt_context)
        async with self.db.single() as conn:
            row = (await conn.execute(TURN_ROW, {"owner": owner, "conversation": conversation,
                                                 "turn": turn})).first()
            if row is None:
                raise NotFound(f"conversation {conversation} not found")
            if row.fingerprint != fingerprint:
                return Conflicted(row.fingerprint)
            state = TurnRecordState(row.state)
            if state in RECORD_FINAL:
                return Done(await message_at(conn, owner, conversation, row.reply_index), usage_of(row))
            if state in RECORD_ACTIVE and row.lease_expires_at_ms > now:
                return InProgress(row.lease_holder, row.lease_expires_at_ms)
            require_record_move(turn, state, TurnRecordState.RECEIVED)
            seen_lease = TURN.c.lease_id.is_(None) if row.lease_id is None else TURN.c.lease_id == row.lease_id
            kept = row.generation_options or options  # a record from before it kept options: the caller's
            taken = (await conn.execute(
                update(TURN).where(TURN.c.owner_id == owner, TURN.c.conversation_id == conversation,
                                   TURN.c.turn_id == turn, TURN.c.state == row.state, seen_lease)
                .values(state=TurnRecordState.RECEIVED.value, content=content, input_parts=input_parts,
                        lease_id=new.lease,
                        lease_holder=lease_holder, lease_expires_at_ms=new.lease_expires_at_ms,
                        generation_options=kept, updated_at_ms=now)
                .returning(TURN.c.turn_id))).first()
        if taken is None:
            return None  # another racer took it between our read and our update: look again
        log.info("turn_reclaimed", owner_id=owner, conversation_id=conversation, turn_id=turn,
                 previous_state=state.value)
        return Claimed(new.lease, new.lease_expires_at_ms, await self._context(owner, conversation, context_messages),
                       kept, row.partial_text, state in RECORD_ACTIVE)

    async def _context(self, owner: OwnerId, conversation: ConversationId, limit: int) -> History | None:
        if not limit:
            return None
        history = await self.db.backend.read(owner, conversation, None, limit)
        if history is None:
            raise NotFound(f"conversation {conversation} not found")
        return history

    async def _regenerated_user_index(self, owner: OwnerId, conversation: ConversationId,
                                      regenerates: TurnId) -> int:
        async with self.db.single() as conn:
            row = (await conn.execute(REGENERATED, {"owner": owner, "conversation": conversation,
                                                    "turn": regenerates})).first()
        if row is None:
            raise NotFound(f"turn {regenerates} (regenerates_turn_id) not found")
        if TurnRecordState(row.state) not in RECORD_FINAL or row.user_index is None:
            raise FailedPrecondition(f"turn {regenerates} (regenerates_turn_id) has no stored reply to regenerate")
        if row.stale:
            raise FailedPrecondition(LAST_EXCHANGE_ONLY)
        index: int = row.user_index
        return index

    async def finish_turn(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, lease: LeaseId,
                          reply: Reply) -> Stored:
        """Stores the turn's user message (unless it regenerates), its reply and its usage, once."""
        self.limits.check_text("reply", reply.text, required=False)
        self.limits.check_tools("reply", Role.ASSISTANT, reply.tool_calls, ())
        for field, value in (("user_token_count", reply.user_token_count), ("reply_token_count", reply.token_count),
                             ("usage.prompt_tokens", reply.usage.prompt_tokens),
                             ("usage.cached_prompt_tokens", reply.usage.cached_prompt_tokens),
                             ("usage.output_tokens", reply.usage.output_tokens)):
            check_count(field, value)
        now = self._clock()
        target = TurnRecordState.STOPPED if reply.status is MessageStatus.STOPPED else TurnRecordState.STORED
        usage = reply.usage
        values = FinishValues(target.value, reply.user_token_count, reply.user_status.value, reply.text,
                              reply.token_count, reply.status.value, usage.prompt_tokens, usage.cached_prompt_tokens,
                              usage.output_tokens, now, utc_day(now), parts_json(reply.tool_calls))
        for attempt in range(CLAIM_ATTEMPTS):
            reply_index = await self.db.backend.finish(owner, conversation, turn, lease, values,
                                                       serialized=attempt > 0)
            if reply_index is not None:
                log.info("turn_stored", owner_id=owner, conversation_id=conversation, turn_id=turn,
                         state=target.value, output_tokens=usage.output_tokens)
                return Stored(False, Message(reply_index, Role.ASSISTANT, reply.text, reply.token_count,
                                               reply.status, turn, now, tool_calls=reply.tool_calls))
            finished = await self._why_refused(owner, conversation, turn, lease, target)
            if finished is not None:
                return finished
        raise Unavailable(f"turn {turn}: finish contended {CLAIM_ATTEMPTS} times; retry")

    async def _why_refused(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, lease: LeaseId,
                           target: TurnRecordState) -> Stored | None:
        """Why the backend's finish wrote nothing: the stored reply when the turn is already final (a second
        finish), an error when the lease is not held, the regenerate is stale or a row is gone, or None when
        nothing stands in the way any more (a racing write moved on; the finish is tried again)."""
        async with self.db.single() as conn:
            await conversation_row(conn, owner, conversation)
            row = (await conn.execute(WHY_REFUSED, {"owner": owner, "conversation": conversation, "turn": turn,
                                                    "lease": lease})).first()
            if row is None:
                raise NotFound(f"turn {turn} not found")
            state = TurnRecordState(row.state)
            if state in RECORD_FINAL:
                return Stored(True, await message_at(conn, owner, conversation, row.reply_index))
        if not row.held:
            raise FailedPrecondition(f"turn {turn}: lease {lease} is not held (it failed, or expired and "
                                     f"was claimed again)")
        require_record_move(turn, state, target)
        if row.regenerates_turn_id is not None and row.stale:
            raise FailedPrecondition(LAST_EXCHANGE_ONLY)
        return None

    async def fail_turn(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, lease: LeaseId,
                        reason: str = "", partial_text: str = "") -> bool:
        """Releases a claim, so a retry may claim it; no message is stored, and the record keeps `partial_text`
        (the reply the attempt showed) for the next claim to continue. True when this lease was still held."""
        self.limits.check_text("partial_text", partial_text, required=False)
        now = self._clock()
        async with self.db.single() as conn:
            released = (await conn.execute(
                update(TURN).where(HELD)
                .values(state=TurnRecordState.FAILED.value, content=None, input_parts=None, partial_text=partial_text,
                        lease_id=None,
                        lease_expires_at_ms=0, updated_at_ms=now)
                .returning(TURN.c.turn_id),
                {"owner": owner, "conversation": conversation, "turn": turn, "lease": lease})).first()
            if released is None:
                await self._turn_row(conn, owner, conversation, turn)
        log.info("turn_failed", owner_id=owner, conversation_id=conversation, turn_id=turn,
                 released=released is not None, reason=reason[:200])
        return released is not None

    async def update_turn_progress(self, owner: OwnerId, conversation: ConversationId, turn: TurnId,
                                   lease: LeaseId, partial_text: str, event_sequence: int,
                                   lease_ttl_ms: int = 0) -> Progress:
        """Records the reply so far (for attaching from another process) and renews the lease."""
        self.limits.check_text("partial_text", partial_text, required=False)
        check_count("event_sequence", event_sequence)
        now = self._clock()
        expires = now + self.limits.ttl(lease_ttl_ms)
        async with self.db.single() as conn:
            held = (await conn.execute(
                update(TURN).where(HELD)
                .values(state=TurnRecordState.RUNNING.value, partial_text=partial_text, event_sequence=event_sequence,
                        lease_expires_at_ms=expires, updated_at_ms=now)
                .returning(TURN.c.turn_id),
                {"owner": owner, "conversation": conversation, "turn": turn, "lease": lease})).first()
            if held is None:
                row = await self._turn_row(conn, owner, conversation, turn)
                return Progress(False, row.lease_expires_at_ms)
        return Progress(True, expires)

    async def read_turn(self, owner: OwnerId, conversation: ConversationId, turn: TurnId) -> TurnRecord:
        async with self.db.single() as conn:
            row = await self._turn_row(conn, owner, conversation, turn)
            state = TurnRecordState(row.state)
            reply = None
            if state in RECORD_FINAL:
                reply = await message_at(conn, owner, conversation, row.reply_index)
        return TurnRecord(turn, state, row.fingerprint, row.lease_holder, row.lease_expires_at_ms,
                          row.partial_text, row.event_sequence,
                          TurnId(row.regenerates_turn_id) if row.regenerates_turn_id else None, reply, usage_of(row))

    @staticmethod
    async def _turn_row(conn: AsyncConnection, owner: OwnerId, conversation: ConversationId, turn: TurnId) -> Row[Any]:
        row = (await conn.execute(TURN_ROW, {"owner": owner, "conversation": conversation, "turn": turn})).first()
        if row is None:
            raise NotFound(f"turn {turn} not found")
        return row
