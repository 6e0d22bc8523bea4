"""The conversation store core: conversations, messages, summaries, turn records, usage. No gRPC here.

The turn record is the idempotency key of invariant I2, one row per (owner, conversation, turn id), and the
durable projection of the turn state machine (`chatmesh.mesh.turn`: its header shows the record's moves beside
chat's states; `require_record_move` guards them here).

Each turn operation has one implementation per backend. Creating a turn record and storing a turn are the
hot path's (`chatmesh.store.hot`: one round trip, SQL written per backend); the rest of the turn's life is
one SQLAlchemy statement here that both backends run as it is:

- BeginTurn answers exactly one of Claimed / InProgress / Done / Conflicted, atomically on both backends:
  the hot path's `INSERT .. SELECT .. ON CONFLICT DO NOTHING RETURNING` creates the record only if the
  conversation exists for this owner and the turn id is new (a regenerate's, once the turn it regenerates is
  checked here); otherwise the row is read here, and a failed or expired claim is taken over by a
  compare-and-swap `UPDATE .. WHERE state = :seen AND lease_id = :seen_lease`, which exactly one racer wins
  (PostgreSQL re-checks the WHERE on the locked row; SQLite runs writes under BEGIN IMMEDIATE).
- UpdateTurnProgress (the heartbeat) and FailTurn are each one `UPDATE .. WHERE lease_id = :held AND state
  IN (received, running)`.
- FinishTurn is the hot path's guarded store of the messages, the final state and the usage (one
  statement on PostgreSQL, one transaction on SQLite; the conversation row hands out message indexes). When
  its guard does not match nothing is written and the record is read here to say why: a second finish
  finds the final state and says `already_finished`; another lease, a stale regenerate or a missing row
  is an error; a record that no longer stands in the way (a racing write moved on) is tried again, that
  time after the conversation's lock (so a PostgreSQL regenerate is not refused for a racing finish twice).

Partitioning: every statement on an owner table filters on `owner_id` (tests record the SQL to prove it),
except the retention purge's candidate scan, which by nature looks across owners and then deletes owner by
owner.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Row, Table, and_, bindparam, delete, insert, select, update
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from chatmesh.mesh import logs
from chatmesh.mesh.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, TurnId, new_conversation_id, new_lease_id
from chatmesh.mesh.turn import RECORD_ACTIVE, RECORD_FINAL, require_record_move
from chatmesh.store.db import autocommit, hot_path
from chatmesh.store.hot import FinishValues, NewTurn
from chatmesh.store.schema import Base, ConversationRow, MessageRow, TurnRow, UsageRow
from chatmesh.store.values import (
    Claim, Claimed, Conflicted, Conversation, DailyUsage, Done, Finished, History, InProgress, Message,
    MessageStatus, Progress, Purged, Reply, Role, Seed, Summary, TurnRecord, TurnRecordState, Usage,
)

log = logs.get("chatmesh.store")
MAX_SEED_MESSAGES = 10_000  # messages a conversation may be created with (a client's own history)

# Core tables, not the ORM classes: ORM-enabled DML costs several times the CPU per statement.
CONV = Base.metadata.tables[ConversationRow.__tablename__]
MSG = Base.metadata.tables[MessageRow.__tablename__]
TURN = Base.metadata.tables[TurnRow.__tablename__]
USAGE = Base.metadata.tables[UsageRow.__tablename__]


# --- statements used per turn, built once: constructing a statement costs more CPU than running it ---

def _key(table: Table) -> ColumnElement[bool]:
    return and_(table.c.owner_id == bindparam("owner"), table.c.conversation_id == bindparam("conversation"))


CONVERSATION_ROW = select(CONV).where(_key(CONV))
TURN_ROW = select(TURN).where(_key(TURN), TURN.c.turn_id == bindparam("turn"))
MESSAGE_AT = select(MSG).where(_key(MSG), MSG.c.message_index == bindparam("index"))
INSERT_MESSAGES = insert(MSG)

Clock = Callable[[], int]
DAY_MS = 86_400_000
CLAIM_ATTEMPTS = 5
PURGE_BATCH = 500
MAX_LEASE_TTL_MS = 86_400_000
MAX_CONTEXT_MESSAGES = 1000  # BeginTurn's context_max_messages is capped at this
# Errors that mean "the database cannot be reached or is shedding load": answered UNAVAILABLE (retryable).
# asyncpg's refused or dropped connections surface as OSError / TimeoutError, not as SQLAlchemy errors.
UNREACHABLE = (OperationalError, InterfaceError, OSError, TimeoutError)

def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def utc_day(ms: int) -> str:
    return _utc_day(ms // DAY_MS)


@functools.lru_cache(maxsize=8)
def _utc_day(day_number: int) -> str:
    return datetime.datetime.fromtimestamp(day_number * 86_400, tz=datetime.UTC).strftime("%Y-%m-%d")


def default_fingerprint(content: str, regenerates: TurnId | None) -> str:
    return hashlib.sha256(f"{regenerates or ''}\x00{content}".encode()).hexdigest()


@dataclass(frozen=True)
class FieldLimits:
    max_content_bytes: int = 1024 * 1024  # the message size policy's CHATMESH_MAX_MESSAGE_BYTES
    lease_ttl_ms: int = 30_000
    retention_days: int = 30
    max_title_chars: int = 200
    max_system_prompt_version_chars: int = 64
    max_fingerprint_chars: int = 128
    max_lease_holder_chars: int = 128


class ConversationStore:
    """Async store core over one SQLAlchemy engine (SQLite or PostgreSQL): SQLAlchemy Core statements that both
    backends run as they are, and the hot path (`self.hot`) for the turn cycle's claim, read and finish."""

    def __init__(self, engine: AsyncEngine, limits: FieldLimits = FieldLimits(), clock: Clock = wall_clock_ms):
        self.engine = engine
        self.limits = limits
        self._clock = clock
        self.hot = hot_path(engine)  # the turn cycle's writes and reads, one round trip per call

    async def close(self) -> None:
        """Closes what the store opened itself (SQLite's hot-path connections); the engine is the caller's."""
        await self.hot.close()

    # --- transactions ---

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        try:
            async with self.engine.begin() as conn:  # SQLite: BEGIN IMMEDIATE
                yield conn
        except UNREACHABLE as err:
            log.warning("database_unavailable", error=type(err).__name__)
            raise Unavailable("the conversation store's database is unavailable; retry") from err

    @asynccontextmanager
    async def _single(self) -> AsyncIterator[AsyncConnection]:
        """A connection whose statements each commit alone (reads; the claim, whose statements are each
        atomic: insert-if-absent and compare-and-swap)."""
        try:
            async with self.engine.connect() as conn:
                yield await autocommit(conn)
        except UNREACHABLE as err:
            log.warning("database_unavailable", error=type(err).__name__)
            raise Unavailable("the conversation store's database is unavailable; retry") from err

    # --- validation ---

    def _check_text(self, field: str, text: str, *, required: bool) -> None:
        if required and not text:
            raise InvalidArgument(f"{field} must not be empty")
        size = len(text.encode())
        if size > self.limits.max_content_bytes:
            raise InvalidArgument(f"{field} is {size} bytes, over the limit of {self.limits.max_content_bytes} "
                                  f"bytes (CHATMESH_MAX_MESSAGE_BYTES)")

    @staticmethod
    def _check_len(field: str, text: str, limit: int) -> None:
        if len(text) > limit:
            raise InvalidArgument(f"{field} is {len(text)} characters, over the limit of {limit}")

    @staticmethod
    def _check_count(field: str, value: int) -> None:
        if value < 0:
            raise InvalidArgument(f"{field} must not be negative, got {value}")

    def _ttl(self, lease_ttl_ms: int) -> int:
        if not 0 <= lease_ttl_ms <= MAX_LEASE_TTL_MS:
            raise InvalidArgument(f"lease_ttl_ms must be 0 (the default) to {MAX_LEASE_TTL_MS}, got {lease_ttl_ms}")
        return lease_ttl_ms or self.limits.lease_ttl_ms

    # --- conversations ---

    async def insert_conversation(self, owner: OwnerId, title: str = "",
                                  system_prompt_version: str = "") -> Conversation:
        conv, _ = await self.create_conversation(owner, title, system_prompt_version)
        return conv

    async def create_conversation(self, owner: OwnerId, title: str = "", system_prompt_version: str = "", *,
                                  conversation: ConversationId | None = None, seed: Sequence[Seed] = ()
                                  ) -> tuple[Conversation, bool]:
        """A new conversation, with `seed` messages stored in order (a client's own earlier history, each message
        under a turn id of its own). With `conversation` set and already the owner's, that one is returned as it
        is and nothing is stored (False): a retry of the creating request finds the first one's conversation."""
        self._check_len("title", title, self.limits.max_title_chars)
        self._check_len("system_prompt_version", system_prompt_version,
                        self.limits.max_system_prompt_version_chars)
        if len(seed) > MAX_SEED_MESSAGES:
            raise InvalidArgument(f"messages: at most {MAX_SEED_MESSAGES} seed messages")
        for i, m in enumerate(seed):
            self._check_text(f"messages[{i}].content", m.content, required=True)
            self._check_count(f"messages[{i}].token_count", m.token_count)
        now = self._clock()
        conv = Conversation(conversation or new_conversation_id(), owner, title, system_prompt_version, now, now,
                            len(seed))
        rows = [_message_values(owner, conv.conversation_id, Message(
            i, m.role, m.content, m.token_count, MessageStatus.COMPLETE, TurnId(str(uuid.uuid4())), now))
            for i, m in enumerate(seed)]
        try:
            async with self._write() as conn:
                await conn.execute(insert(CONV).values(
                    owner_id=owner, conversation_id=conv.conversation_id, title=title,
                    system_prompt_version=system_prompt_version, created_at_ms=now, updated_at_ms=now,
                    message_count=len(seed), summary_covers_through=-1, summary_token_count=0,
                    summary_created_at_ms=0))
                if rows:
                    await conn.execute(INSERT_MESSAGES, rows)
        except IntegrityError:
            if conversation is None:
                raise
            async with self._single() as conn:
                row = await self._conversation_row(conn, owner, conversation)
            return _conversation(row), False
        log.info("conversation_created", owner_id=owner, conversation_id=conv.conversation_id, seeded=len(seed))
        return conv, True

    async def read_conversation(self, owner: OwnerId, conversation: ConversationId, *, from_index: int = 0,
                                max_messages: int = 0) -> History:
        """The conversation, its summary, and its messages with index >= `from_index` in order; with
        `max_messages` > 0 only the newest that many of those."""
        self._check_count("from_index", from_index)
        self._check_count("max_messages", max_messages)
        history = await self.hot.read(owner, conversation, from_index, max_messages)
        if history is None:
            raise NotFound(f"conversation {conversation} not found")
        return history

    async def list_conversations(self, owner: OwnerId, limit: int = 50) -> list[Conversation]:
        """The owner's conversations, most recently updated first."""
        if limit <= 0:
            limit = 50
        limit = min(limit, 500)
        async with self._single() as conn:
            rows = (await conn.execute(select(CONV).where(CONV.c.owner_id == owner)
                                       .order_by(CONV.c.updated_at_ms.desc(), CONV.c.conversation_id).limit(limit))).all()
        return [_conversation(r) for r in rows]

    async def save_summary(self, owner: OwnerId, conversation: ConversationId, text: str,
                           covers_through_index: int, token_count: int) -> Summary:
        """Stores the rolling summary of messages 0..covers_through_index (I3). A summary never moves back."""
        self._check_text("summary", text, required=True)
        self._check_count("covers_through_index", covers_through_index)
        self._check_count("token_count", token_count)
        now = self._clock()
        async with self._write() as conn:
            row = await self._conversation_row(conn, owner, conversation, for_update=True)
            if covers_through_index >= row.message_count:
                raise InvalidArgument(f"covers_through_index {covers_through_index} is past the last message "
                                      f"(the conversation has {row.message_count})")
            if covers_through_index < row.summary_covers_through:
                raise FailedPrecondition(f"a summary through message {row.summary_covers_through} is already "
                                         f"stored; summaries only move forward")
            await conn.execute(update(CONV).where(CONV.c.owner_id == owner, CONV.c.conversation_id == conversation).values(
                summary_text=text, summary_covers_through=covers_through_index, summary_token_count=token_count,
                summary_created_at_ms=now))
        return Summary(text, covers_through_index, token_count, now)

    async def _conversation_row(self, conn: AsyncConnection, owner: OwnerId, conversation: ConversationId,
                                for_update: bool = False) -> Row[Any]:
        query = CONVERSATION_ROW.with_for_update() if for_update else CONVERSATION_ROW
        row = (await conn.execute(query, {"owner": owner, "conversation": conversation})).first()
        if row is None:
            raise NotFound(f"conversation {conversation} not found")
        return row

    # --- turns ---

    async def begin_turn(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, *, content: str,
                         lease_holder: str, fingerprint: str = "", lease_ttl_ms: int = 0,
                         regenerates: TurnId | None = None, context_messages: int = 0) -> Claim:
        """Claims `turn` for generation, or says who has it, or returns its stored reply, or a conflict.
        With `context_messages` > 0 a NEW claim also carries the prompt's context (`Claimed.context`): the
        summary and the newest that many messages after it (capped at MAX_CONTEXT_MESSAGES)."""
        self._check_count("context_max_messages", context_messages)
        context_messages = min(context_messages, MAX_CONTEXT_MESSAGES)
        self._check_text("content", content, required=regenerates is None)
        self._check_len("fingerprint", fingerprint, self.limits.max_fingerprint_chars)
        self._check_len("lease_holder", lease_holder, self.limits.max_lease_holder_chars)
        if regenerates == turn:
            raise InvalidArgument("regenerates_turn_id must differ from turn_id")
        ttl = self._ttl(lease_ttl_ms)
        fingerprint = fingerprint or default_fingerprint(content, regenerates)
        for _ in range(CLAIM_ATTEMPTS):
            outcome = await self._claim_once(owner, conversation, turn, content, lease_holder, fingerprint, ttl,
                                             regenerates, context_messages)
            if outcome is not None:
                if isinstance(outcome, Claimed):
                    log.debug("turn_claimed", owner_id=owner, conversation_id=conversation, turn_id=turn)
                return outcome
        raise Unavailable(f"turn {turn}: claim contended {CLAIM_ATTEMPTS} times; retry")

    async def _claim_once(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, content: str,
                          lease_holder: str, fingerprint: str, ttl: int, regenerates: TurnId | None,
                          context_messages: int) -> Claim | None:
        """A new record through the hot path (one round trip, the common case), else the record read and, when
        its claim failed or expired, taken over. None: another racer moved the record on; look again."""
        now = self._clock()
        user_index = None
        if regenerates is not None:
            async with self._single() as conn:
                user_index = await self._regenerated_user_index(conn, owner, conversation, regenerates)
        new = NewTurn(turn, fingerprint, content, new_lease_id(), lease_holder, now + ttl, now, regenerates,
                      user_index)
        claimed, prompt_context = await self.hot.claim(owner, conversation, new, context_messages)
        if claimed:
            return Claimed(new.lease, new.lease_expires_at_ms, prompt_context)
        async with self._single() as conn:
            row = (await conn.execute(TURN_ROW, {"owner": owner, "conversation": conversation,
                                                 "turn": turn})).first()
            if row is None:
                raise NotFound(f"conversation {conversation} not found")
            if row.fingerprint != fingerprint:
                return Conflicted(row.fingerprint)
            state = TurnRecordState(row.state)
            if state in RECORD_FINAL:
                return Done(await self._message(conn, owner, conversation, row.reply_index), _usage(row))
            if state in RECORD_ACTIVE and row.lease_expires_at_ms > now:
                return InProgress(row.lease_holder, row.lease_expires_at_ms)
            require_record_move(turn, state, TurnRecordState.RECEIVED)
            seen_lease = TURN.c.lease_id.is_(None) if row.lease_id is None else TURN.c.lease_id == row.lease_id
            taken = (await conn.execute(
                update(TURN).where(TURN.c.owner_id == owner, TURN.c.conversation_id == conversation, TURN.c.turn_id == turn,
                                TURN.c.state == row.state, seen_lease)
                .values(state=TurnRecordState.RECEIVED.value, content=content, lease_id=new.lease,
                        lease_holder=lease_holder, lease_expires_at_ms=new.lease_expires_at_ms, partial_text="",
                        event_sequence=0, updated_at_ms=now)
                .returning(TURN.c.turn_id))).first()
        if taken is None:
            return None  # another racer took it between our read and our update: look again
        log.info("turn_reclaimed", owner_id=owner, conversation_id=conversation, turn_id=turn,
                 previous_state=state.value)
        return Claimed(new.lease, new.lease_expires_at_ms, await self._context(owner, conversation,
                                                                                context_messages))

    async def _context(self, owner: OwnerId, conversation: ConversationId, limit: int) -> History | None:
        if not limit:
            return None
        history = await self.hot.read(owner, conversation, None, limit)
        if history is None:
            raise NotFound(f"conversation {conversation} not found")
        return history

    async def _regenerated_user_index(self, conn: AsyncConnection, owner: OwnerId, conversation: ConversationId,
                                      regenerates: TurnId) -> int:
        row = (await conn.execute(select(TURN.c.state, TURN.c.user_index).where(
            TURN.c.owner_id == owner, TURN.c.conversation_id == conversation, TURN.c.turn_id == regenerates))).first()
        if row is None:
            raise NotFound(f"turn {regenerates} (regenerates_turn_id) not found")
        if TurnRecordState(row.state) not in RECORD_FINAL or row.user_index is None:
            raise FailedPrecondition(f"turn {regenerates} (regenerates_turn_id) has no stored reply to regenerate")
        index: int = row.user_index
        await self._require_last_exchange(conn, owner, conversation, index)
        return index

    async def _require_last_exchange(self, conn: AsyncConnection, owner: OwnerId, conversation: ConversationId,
                                     user_index: int) -> None:
        """Only the reply to the last user message can be regenerated."""
        later = (await conn.execute(select(MSG.c.message_index).where(
            MSG.c.owner_id == owner, MSG.c.conversation_id == conversation, MSG.c.message_index > user_index,
            MSG.c.role == Role.USER.value).limit(1))).first()
        if later is not None:
            raise FailedPrecondition("only the reply to the conversation's last user message can be regenerated")

    async def finish_turn(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, lease: LeaseId,
                          reply: Reply) -> Finished:
        """Stores the turn's user message (unless it regenerates), its reply and its usage, once."""
        self._check_text("reply", reply.text, required=False)
        for field, value in (("user_token_count", reply.user_token_count), ("reply_token_count", reply.token_count),
                             ("usage.prompt_tokens", reply.usage.prompt_tokens),
                             ("usage.cached_prompt_tokens", reply.usage.cached_prompt_tokens),
                             ("usage.output_tokens", reply.usage.output_tokens)):
            self._check_count(field, value)
        now = self._clock()
        target = TurnRecordState.STOPPED if reply.status is MessageStatus.STOPPED else TurnRecordState.STORED
        usage = reply.usage
        values = FinishValues(target.value, reply.user_token_count, reply.user_status.value, reply.text,
                              reply.token_count, reply.status.value, usage.prompt_tokens, usage.cached_prompt_tokens,
                              usage.output_tokens, now, utc_day(now))
        for attempt in range(CLAIM_ATTEMPTS):
            reply_index = await self.hot.finish(owner, conversation, turn, lease, values, serialized=attempt > 0)
            if reply_index is not None:
                log.info("turn_stored", owner_id=owner, conversation_id=conversation, turn_id=turn,
                         state=target.value, output_tokens=usage.output_tokens)
                return Finished(False, Message(reply_index, Role.ASSISTANT, reply.text, reply.token_count,
                                               reply.status, turn, now))
            finished = await self._finish_refused(owner, conversation, turn, lease, target)
            if finished is not None:
                return finished
        raise Unavailable(f"turn {turn}: finish contended {CLAIM_ATTEMPTS} times; retry")

    async def _finish_refused(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, lease: LeaseId,
                              target: TurnRecordState) -> Finished | None:
        """Why the hot path's finish wrote nothing: the stored reply when the turn is already final (a second
        finish), an error when the lease is not held, the regenerate is stale or a row is gone, or None when
        nothing stands in the way any more (a racing write moved on; the finish is tried again)."""
        async with self._single() as conn:
            key = {"owner": owner, "conversation": conversation}
            if (await conn.execute(CONVERSATION_ROW, key)).first() is None:
                raise NotFound(f"conversation {conversation} not found")
            row = (await conn.execute(TURN_ROW, key | {"turn": turn})).first()
            if row is None:
                raise NotFound(f"turn {turn} not found")
            state = TurnRecordState(row.state)
            if state in RECORD_FINAL:
                return Finished(True, await self._message(conn, owner, conversation, row.reply_index))
            if row.lease_id != lease:
                raise FailedPrecondition(f"turn {turn}: lease {lease} is not held (it failed, or expired and "
                                         f"was claimed again)")
            require_record_move(turn, state, target)
            if row.regenerates_turn_id is not None:
                await self._require_last_exchange(conn, owner, conversation, row.user_index)
        return None

    async def fail_turn(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, lease: LeaseId,
                        reason: str = "") -> bool:
        """Releases a claim; nothing of the turn is kept but its record, so a retry may claim it. True when
        this lease was still held."""
        now = self._clock()
        async with self._single() as conn:
            released = (await conn.execute(
                update(TURN).where(TURN.c.owner_id == owner, TURN.c.conversation_id == conversation, TURN.c.turn_id == turn,
                                TURN.c.lease_id == lease, TURN.c.state.in_([s.value for s in RECORD_ACTIVE]))
                .values(state=TurnRecordState.FAILED.value, content=None, partial_text="", lease_id=None,
                        lease_expires_at_ms=0, updated_at_ms=now)
                .returning(TURN.c.turn_id))).first()
            if released is None:
                await self._turn_row(conn, owner, conversation, turn)
        log.info("turn_failed", owner_id=owner, conversation_id=conversation, turn_id=turn,
                 released=released is not None, reason=reason[:200])
        return released is not None

    async def update_turn_progress(self, owner: OwnerId, conversation: ConversationId, turn: TurnId,
                                   lease: LeaseId, partial_text: str, event_sequence: int,
                                   lease_ttl_ms: int = 0) -> Progress:
        """Records the reply so far (for attaching from another process) and renews the lease."""
        self._check_text("partial_text", partial_text, required=False)
        self._check_count("event_sequence", event_sequence)
        now = self._clock()
        expires = now + self._ttl(lease_ttl_ms)
        async with self._single() as conn:
            held = (await conn.execute(
                update(TURN).where(TURN.c.owner_id == owner, TURN.c.conversation_id == conversation, TURN.c.turn_id == turn,
                                TURN.c.lease_id == lease, TURN.c.state.in_([s.value for s in RECORD_ACTIVE]))
                .values(state=TurnRecordState.RUNNING.value, partial_text=partial_text, event_sequence=event_sequence,
                        lease_expires_at_ms=expires, updated_at_ms=now)
                .returning(TURN.c.turn_id))).first()
            if held is None:
                row = await self._turn_row(conn, owner, conversation, turn)
                return Progress(False, row.lease_expires_at_ms)
        return Progress(True, expires)

    async def read_turn(self, owner: OwnerId, conversation: ConversationId, turn: TurnId) -> TurnRecord:
        async with self._single() as conn:
            row = await self._turn_row(conn, owner, conversation, turn)
            state = TurnRecordState(row.state)
            reply = None
            if state in RECORD_FINAL:
                reply = await self._message(conn, owner, conversation, row.reply_index)
        return TurnRecord(turn, state, row.fingerprint, row.lease_holder, row.lease_expires_at_ms,
                          row.partial_text, row.event_sequence,
                          TurnId(row.regenerates_turn_id) if row.regenerates_turn_id else None, reply, _usage(row))

    async def _turn_row(self, conn: AsyncConnection, owner: OwnerId, conversation: ConversationId,
                        turn: TurnId) -> Row[Any]:
        row = (await conn.execute(TURN_ROW, {"owner": owner, "conversation": conversation, "turn": turn})).first()
        if row is None:
            raise NotFound(f"turn {turn} not found")
        return row

    async def _message(self, conn: AsyncConnection, owner: OwnerId, conversation: ConversationId,
                       index: int | None) -> Message:
        row = None
        if index is not None:
            row = (await conn.execute(MESSAGE_AT, {"owner": owner, "conversation": conversation,
                                                   "index": index})).first()
        if row is None:
            raise NotFound(f"message {index} of conversation {conversation} not found")
        return _message(row)

    # --- deletion, export, usage, retention ---

    async def delete_turn(self, owner: OwnerId, conversation: ConversationId, turn: TurnId
                          ) -> tuple[list[ConversationId], int]:
        """Deletes one stored turn: its user message, its reply, the replies regenerating it and their turn
        records (usage totals stay). Returns the ids engines must evict and how many messages went."""
        async with self._write() as conn:
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
        async with self._write() as conn:
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
        async with self._write() as conn:
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
        async with self._single() as conn:
            convs = (await conn.execute(select(CONV).where(CONV.c.owner_id == owner).order_by(CONV.c.created_at_ms))).all()
            msgs = (await conn.execute(select(MSG).where(MSG.c.owner_id == owner)
                                       .order_by(MSG.c.conversation_id, MSG.c.message_index))).all()
            days = (await conn.execute(select(USAGE).where(USAGE.c.owner_id == owner).order_by(USAGE.c.day))).all()
            pending = (await conn.execute(
                select(TURN.c.conversation_id, TURN.c.turn_id, TURN.c.state, TURN.c.content, TURN.c.partial_text)
                .where(TURN.c.owner_id == owner, TURN.c.content.is_not(None))
                .order_by(TURN.c.conversation_id, TURN.c.created_at_ms))).all()
        unfinished: dict[str, list[dict[str, Any]]] = {}
        for t in pending:  # user text held by turns not (yet) stored is the owner's data too
            unfinished.setdefault(t.conversation_id, []).append({
                "turn_id": t.turn_id, "state": t.state, "content": t.content, "partial_reply": t.partial_text})
        by_conv: dict[str, list[dict[str, Any]]] = {}
        for m in msgs:
            msg = _message(m)
            by_conv.setdefault(m.conversation_id, []).append({
                "index": msg.index, "role": msg.role.value, "content": msg.content, "token_count": msg.token_count,
                "status": msg.status.value, "turn_id": msg.turn_id, "created_at_ms": msg.created_at_ms,
                "superseded": msg.superseded})
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
        async with self._single() as conn:
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
            async with self._single() as conn:
                batch = (await conn.execute(select(CONV.c.owner_id, CONV.c.conversation_id)
                                            .where(CONV.c.updated_at_ms < cutoff).limit(PURGE_BATCH))).all()
            if not batch:
                break
            for owner, conversation in batch:
                async with self._write() as conn:
                    if await self._delete_rows(conn, OwnerId(owner), ConversationId(conversation), cutoff):
                        purged.append((OwnerId(owner), ConversationId(conversation)))
            if len(batch) < PURGE_BATCH:
                break
        abandoned = 0
        unfinished = [s.value for s in (*RECORD_ACTIVE, TurnRecordState.FAILED)]
        while True:
            async with self._single() as conn:
                turns = (await conn.execute(select(TURN.c.owner_id, TURN.c.conversation_id, TURN.c.turn_id).where(
                    TURN.c.updated_at_ms < cutoff, TURN.c.state.in_(unfinished)).limit(PURGE_BATCH))).all()
            for owner, conversation, turn in turns:
                async with self._write() as conn:
                    gone = await conn.execute(delete(TURN).where(
                        TURN.c.owner_id == owner, TURN.c.conversation_id == conversation, TURN.c.turn_id == turn,
                        TURN.c.updated_at_ms < cutoff, TURN.c.state.in_(unfinished)).returning(TURN.c.turn_id))
                    abandoned += len(gone.all())
            if len(turns) < PURGE_BATCH:
                break
        log.info("purged", conversations=len(purged), abandoned_turns=abandoned)
        return Purged(purged, abandoned)


def _usage(row: Row[Any]) -> Usage:
    return Usage(row.prompt_tokens, row.cached_prompt_tokens, row.output_tokens)


def _conversation(row: Row[Any]) -> Conversation:
    return Conversation(ConversationId(row.conversation_id), OwnerId(row.owner_id), row.title,
                        row.system_prompt_version, row.created_at_ms, row.updated_at_ms, row.message_count)


def _message(row: Row[Any]) -> Message:
    return Message(row.message_index, Role(row.role), row.content, row.token_count, MessageStatus(row.status),
                   TurnId(row.turn_id), row.created_at_ms, bool(row.superseded))


def _message_values(owner: OwnerId, conversation: ConversationId, m: Message) -> dict[str, Any]:
    return dict(owner_id=owner, conversation_id=conversation, message_index=m.index, role=m.role.value,
                content=m.content, token_count=m.token_count, status=m.status.value, turn_id=m.turn_id,
                created_at_ms=m.created_at_ms, superseded=m.superseded)
