"""The turn cycle's writes and reads, one database round trip per operation, written once per backend.

The chat service's per-turn store work is three calls: BeginTurn (the claim, optionally with the prompt's
context), the history read, FinishTurn. Through SQLAlchemy's async layer each of their ~10 statements cost
~0.4-0.6 ms of client CPU, which capped PostgreSQL at a few hundred turns/s on two cores. Here each call is one
round trip, and this module is the only place the store creates a turn record or stores a turn: plain turns and
regenerates alike, each backend's SQL written once. (The core, `chatmesh.store.core`, keeps the operations that
are one SQLAlchemy statement on both backends, e.g. a claim's compare-and-swap takeover, fail, progress; and
when a call here writes nothing it reads why.)

- PostgreSQL (asyncpg, a raw connection from SQLAlchemy's pool, asyncpg's prepared-statement cache):
  the claim is one `INSERT .. SELECT .. ON CONFLICT DO NOTHING`, with the context read in the same statement
  (a CTE; the read sees the statement's snapshot); the read is one statement (conversation LEFT JOIN LATERAL
  its newest messages); the finish is ONE statement, so one implicit transaction and one commit, written
  twice: `PG_FINISH` for a plain turn, `PG_FINISH_REGENERATE` for a regenerate (the regenerate's guards and
  supersede step cost a plain turn ~0.05 ms of server CPU when they were one statement):
      conv       SELECT .. FROM conversations .. FOR NO KEY UPDATE   -- lock order: conversation, then turn
      turn       UPDATE turns SET state = stored, indexes from conv .. WHERE lease_id = $lease AND state IN
                 (received, running) AND regenerates_turn_id IS (NOT) NULL  -- the guard, re-checked on the
                 locked row; a regenerate also needs that no user message follows the one it answers, and
                 that no finish committed since the statement's snapshot (its reads below must see every
                 message: else nothing is written, and the retry runs the statement after taking the
                 conversation's lock, so its snapshot follows)
      advanced   UPDATE conversations SET message_count = message_count + 2 (a regenerate: + 1) .. WHERE
                 EXISTS (turn)
      superseded (a regenerate) UPDATE messages SET superseded = true: the earlier replies to its user message
      stored     INSERT INTO messages (the user message unless a regenerate, the reply) .. FROM turn
      metered    INSERT INTO usage_days .. FROM turn ON CONFLICT DO UPDATE (add)
  Either all of it happens or none (one statement); when the guard does not match (already finished, another
  lease, a stale regenerate, unknown turn, a racing finish) nothing is written and the caller reads why. A
  FinishTurn does not say whether its turn is a regenerate: the leases of the regenerates this process
  claimed (a takeover's too: the core takes over with the lease offered here first) are remembered, and any
  other finish runs the plain statement, then (when it wrote nothing, e.g. a regenerate another replica
  claimed) the regenerate's.
- SQLite (its own connections, each used by one worker thread; WAL, BEGIN IMMEDIATE for writes): each call's
  statements run together in one hop to a worker thread (aiosqlite hopped per statement and per cursor call);
  the finish runs the same guard and writes in one transaction (BEGIN IMMEDIATE: no finish races it).

Every statement sent here passes `_observe`, so tests see (and check for the owner id) exactly what the hot
path sends, as they see SQLAlchemy's statements through its events.
"""

from __future__ import annotations

import abc
import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.util import greenlet_spawn

from chatmesh.mesh.errors import NotFound, Unavailable
from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, TurnId
from chatmesh.store.values import Conversation, History, Message, MessageStatus, Role, Summary

CONV_COLUMNS = ("owner_id", "conversation_id", "title", "system_prompt_version", "created_at_ms", "updated_at_ms",
                "message_count", "summary_covers_through", "summary_token_count", "summary_created_at_ms")
MSG_COLUMNS = ("message_index", "role", "content", "token_count", "status", "turn_id", "created_at_ms", "superseded")
TURN_COLUMNS = ("owner_id", "conversation_id", "turn_id", "fingerprint", "state", "content", "lease_id",
                "lease_holder", "lease_expires_at_ms", "regenerates_turn_id", "user_index", "reply_index",
                "partial_text", "event_sequence", "prompt_tokens", "cached_prompt_tokens", "output_tokens",
                "created_at_ms", "updated_at_ms")
# Rows the reads return: the conversation's columns, its summary text (first row only), then one message's.
N_CONV = len(CONV_COLUMNS)
ROLES = {r.value: r for r in Role}
STATUSES = {s.value: s for s in MessageStatus}


@dataclass(frozen=True)
class NewTurn:
    """The values of a new turn record (state received, no progress, no usage). A regenerate names the turn
    it regenerates and that turn's user message index."""

    turn: TurnId
    fingerprint: str
    content: str
    lease: LeaseId
    lease_holder: str
    lease_expires_at_ms: int
    now_ms: int
    regenerates: TurnId | None = None
    user_index: int | None = None


@dataclass(frozen=True)
class FinishValues:
    """What a finish writes (a regenerate stores no user message: the user_* values are then unused)."""

    to_state: str
    user_token_count: int
    user_status: str
    reply_text: str
    reply_token_count: int
    reply_status: str
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    now_ms: int
    day: str


def history_from(rows: Sequence[Sequence[Any]]) -> History:
    """Rows of (conversation columns, summary text, message columns or NULLs), newest message first."""
    first = rows[0]
    conv = Conversation(ConversationId(first[1]), OwnerId(first[0]), first[2], first[3], first[4], first[5], first[6])
    text = first[N_CONV]
    summary = None if text is None else Summary(text, first[7], first[8], first[9])
    roles, statuses = ROLES, STATUSES  # dict lookups: calling an Enum by value costs ~1 us
    messages = [Message(r[N_CONV + 1], roles[r[N_CONV + 2]], r[N_CONV + 3], r[N_CONV + 4],
                        statuses[r[N_CONV + 5]], TurnId(r[N_CONV + 6]), r[N_CONV + 7], bool(r[N_CONV + 8]))
                for r in reversed(rows) if r[N_CONV + 1] is not None]
    return History(conv, messages, summary)


class HotPath(abc.ABC):
    """One backend's round-trip-per-call implementation of the claim, the read and the finish."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[str], None]] = []

    def _observe(self, sql: str) -> None:
        for listener in self.listeners:
            listener(sql)

    @abc.abstractmethod
    async def claim(self, owner: OwnerId, conversation: ConversationId, new: NewTurn,
                    context_limit: int) -> tuple[bool, History | None]:
        """Creates the turn record when the conversation is the owner's and the turn id is new. Returns whether
        it did, and (context_limit > 0, the conversation exists) the conversation, its summary and its newest
        `context_limit` messages after the summary."""

    @abc.abstractmethod
    async def read(self, owner: OwnerId, conversation: ConversationId, from_index: int | None,
                   limit: int) -> History | None:
        """The conversation, its summary and its messages from `from_index` (None: those after the summary;
        the newest `limit` of them when limit > 0), or None when the owner has no such conversation."""

    @abc.abstractmethod
    async def finish(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, lease: LeaseId,
                     values: FinishValues, serialized: bool = False) -> int | None:
        """Stores a turn whose lease is held and which is received/running, atomically: the user message (a
        regenerate: none, and its earlier replies marked superseded, provided no user message followed the one
        it answers), the reply, the turn's final state, the usage. Returns the reply's index, or None when the
        guard did not match (nothing written). `serialized` (a retry): the conversation's row lock is taken
        before the finish reads anything, so no finish committed before it can be missed (SQLite's finish
        always is: BEGIN IMMEDIATE)."""

    @abc.abstractmethod
    async def close(self) -> None: ...


# --- PostgreSQL ----------------------------------------------------------------------------------------------

_PG_CONV = ", ".join(f"conversations.{c}" for c in CONV_COLUMNS)
_PG_MSG = ", ".join(f"m.{c}" for c in MSG_COLUMNS)


def _pg_read(bound: str) -> str:
    """The conversation LEFT JOIN LATERAL its newest messages with index >= `bound`; the summary text only on
    the first (newest) row."""
    return (
        f"SELECT {_PG_CONV}, CASE WHEN m.rn IS NULL OR m.rn = 1 THEN conversations.summary_text END, {_PG_MSG} "
        "FROM conversations LEFT JOIN LATERAL ("
        f"SELECT {', '.join(f'messages.{c}' for c in MSG_COLUMNS)}, "
        "row_number() OVER (ORDER BY messages.message_index DESC) AS rn FROM messages "
        "WHERE messages.owner_id = $1 AND messages.conversation_id = $2 "
        f"AND messages.message_index >= {bound} ORDER BY messages.message_index DESC LIMIT $3) AS m ON true "
        "WHERE conversations.owner_id = $1 AND conversations.conversation_id = $2")


_PG_INSERT_TURN = (
    f"INSERT INTO turns ({', '.join(TURN_COLUMNS)}) "
    "SELECT conversations.owner_id, conversations.conversation_id, {turn}, {fp}, 'received', {content}, {lease}, "
    "{holder}, {expires}::bigint, {regenerates}::varchar, {user_index}::integer, NULL, '', 0, 0, 0, 0, "
    "{now}::bigint, {now}::bigint "
    "FROM conversations WHERE conversations.owner_id = $1 AND conversations.conversation_id = $2 "
    "ON CONFLICT (owner_id, conversation_id, turn_id) DO NOTHING RETURNING turns.turn_id")
PG_CLAIM = _PG_INSERT_TURN.format(turn="$3::varchar", fp="$4::varchar", content="$5::text", lease="$6::varchar",
                                  holder="$7::varchar", expires="$8", now="$9", regenerates="$10",
                                  user_index="$11")
# With the context: the read runs in the same statement (same snapshot; the new turn is not a message yet).
PG_CLAIM_WITH_CONTEXT = (
    "WITH claimed AS (" + _PG_INSERT_TURN.format(
        turn="$4::varchar", fp="$5::varchar", content="$6::text", lease="$7::varchar", holder="$8::varchar",
        expires="$9", now="$10", regenerates="$11", user_index="$12") + ") "
    "SELECT (SELECT count(*) FROM claimed), r.* FROM ("
    + _pg_read("conversations.summary_covers_through + 1") + ") AS r")
PG_READ = _pg_read("$4::integer")
PG_CONTEXT = _pg_read("conversations.summary_covers_through + 1")
_PG_OWN = "{t}.owner_id = $1 AND {t}.conversation_id = $2"
PG_LOCK_CONVERSATION = f"SELECT FROM conversations WHERE {_PG_OWN.format(t='conversations')} FOR NO KEY UPDATE"
_PG_CONV_LOCKED = ("WITH conv AS (SELECT conversations.message_count FROM conversations "
                   f"WHERE {_PG_OWN.format(t='conversations')} FOR NO KEY UPDATE), ")
_PG_TURN_STORED = ("turn AS (UPDATE turns SET state = $5::varchar, content = NULL, partial_text = '', "
                   "{indexes}, prompt_tokens = $9::bigint, cached_prompt_tokens = $10::bigint, "
                   "output_tokens = $11::bigint, updated_at_ms = $12::bigint FROM turns AS prev "
                   f"WHERE {_PG_OWN.format(t='turns')} AND turns.turn_id = $3 AND turns.lease_id = $4 "
                   "AND turns.state IN ('received', 'running') AND EXISTS (SELECT FROM conv) AND {kind} "
                   f"AND {_PG_OWN.format(t='prev')} AND prev.turn_id = $3 "
                   "RETURNING turns.user_index, turns.reply_index, prev.content), ")
_PG_ADVANCED = ("advanced AS (UPDATE conversations SET message_count = conversations.message_count + {n}, "
                f"updated_at_ms = $12::bigint WHERE {_PG_OWN.format(t='conversations')} "
                "AND EXISTS (SELECT FROM turn)), ")
_PG_REPLY = ("SELECT $1, $2, turn.reply_index, 'assistant', $6::text, $7::integer, $8::varchar, $3, $12::bigint, "
             "false FROM turn")
_PG_METERED = (
    "metered AS (INSERT INTO usage_days (owner_id, day, prompt_tokens, cached_prompt_tokens, output_tokens, turns) "
    "SELECT $1, $13::varchar, $9::bigint, $10::bigint, $11::bigint, 1 FROM turn "
    "ON CONFLICT (owner_id, day) DO UPDATE SET prompt_tokens = usage_days.prompt_tokens + excluded.prompt_tokens, "
    "cached_prompt_tokens = usage_days.cached_prompt_tokens + excluded.cached_prompt_tokens, "
    "output_tokens = usage_days.output_tokens + excluded.output_tokens, turns = usage_days.turns + 1) "
    "SELECT turn.reply_index FROM turn")
_PG_STORED = ("stored AS (INSERT INTO messages (owner_id, conversation_id, message_index, role, content, "
              "token_count, status, turn_id, created_at_ms, superseded) ")
# A plain turn (no regenerate): its user message at message_count, its reply after it.
PG_FINISH = (
    _PG_CONV_LOCKED
    + _PG_TURN_STORED.format(indexes="user_index = (SELECT conv.message_count FROM conv), "
                             "reply_index = (SELECT conv.message_count + 1 FROM conv)",
                             kind="turns.regenerates_turn_id IS NULL")
    + _PG_ADVANCED.format(n=2)
    + _PG_STORED + "SELECT $1, $2, turn.user_index, 'user', turn.content, $14::integer, $15::varchar, $3, "
    "$12::bigint, false FROM turn UNION ALL " + _PG_REPLY + "), "
    + _PG_METERED)
# A regenerate: no user message; the reply at message_count; the earlier replies to its user message
# superseded; only if no user message followed that one and no finish committed since the statement's snapshot
# (its reads must see every message: the locked message_count equals the snapshot's).
PG_FINISH_REGENERATE = (
    _PG_CONV_LOCKED
    + _PG_TURN_STORED.format(
        indexes="reply_index = (SELECT conv.message_count FROM conv)",
        kind="turns.regenerates_turn_id IS NOT NULL "
        f"AND NOT EXISTS (SELECT FROM messages WHERE {_PG_OWN.format(t='messages')} "
        "AND messages.message_index > turns.user_index AND messages.role = 'user') "
        f"AND (SELECT conversations.message_count FROM conversations WHERE {_PG_OWN.format(t='conversations')}) "
        "= (SELECT conv.message_count FROM conv)")
    + _PG_ADVANCED.format(n=1)
    # A scalar bound: joining `turn` made the planner filter every message of the conversation (ba49066).
    + "superseded AS (UPDATE messages SET superseded = true "
    f"WHERE {_PG_OWN.format(t='messages')} AND messages.message_index > (SELECT turn.user_index FROM turn) "
    "AND messages.role = 'assistant' AND NOT messages.superseded), "
    + _PG_STORED + _PG_REPLY + "), "
    + _PG_METERED)
# How many regenerate leases a PostgreSQL hot path remembers from its claims (a hint; see `finish`).
REGENERATE_HINTS = 1024

# The driver's errors that mean "the database is unreachable or shedding load" (answered UNAVAILABLE).
PG_UNREACHABLE = (OSError, TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
                  asyncpg.CannotConnectNowError, asyncpg.TooManyConnectionsError)
PG_RETRYABLE = (asyncpg.DeadlockDetectedError, asyncpg.SerializationError)


class PostgresHotPath(HotPath):
    """asyncpg under SQLAlchemy's pool: the same connections (and search_path), without the per-statement
    SQLAlchemy layers; asyncpg prepares each statement once per connection and caches it. Connections taken from
    the pool are kept (up to `keep`) in a free list between calls: a pool checkout and checkin cost ~0.15 ms of
    CPU (two greenlet hops), more than the statement itself."""

    def __init__(self, engine: AsyncEngine, keep: int) -> None:
        super().__init__()
        self.engine = engine
        self._keep = keep
        self._idle: list[PoolProxiedConnection] = []
        self._closed = False
        # Leases of the regenerates this process claimed, oldest first: their finish runs PG_FINISH_REGENERATE
        # at once (a hint only: any other finish tries PG_FINISH first, see `finish`).
        self._regenerates: dict[LeaseId, None] = {}

    async def _fetch(self, sql: str, *args: Any, serialized: bool = False) -> list[Any]:
        """`sql`'s rows; `serialized`: in one transaction, after the conversation's row lock ($1, $2), so the
        statement's snapshot is taken once every finish holding that lock has committed."""
        if self._idle:
            fairy = self._idle.pop()
        else:
            try:
                fairy = await self.engine.raw_connection()
            except Exception as err:  # SQLAlchemy wraps the driver's connect errors
                raise Unavailable("the conversation store's database is unavailable; retry") from err
        conn: asyncpg.Connection = fairy.driver_connection
        try:
            if serialized:
                async with conn.transaction():
                    self._observe(PG_LOCK_CONVERSATION)
                    await conn.execute(PG_LOCK_CONVERSATION, args[0], args[1])
                    self._observe(sql)
                    rows: list[Any] = await conn.fetch(sql, *args)
            else:
                self._observe(sql)
                rows = await conn.fetch(sql, *args)
        except PG_UNREACHABLE as err:  # the connection is gone: not reused
            fairy.invalidate(err)
            await greenlet_spawn(fairy.close)
            raise Unavailable("the conversation store's database is unavailable; retry") from err
        except BaseException as err:
            # A server error leaves the connection usable (autocommit, or the transaction rolled back). A
            # cancelled call (the caller went away) too: asyncpg has asked the server to cancel the statement,
            # and the connection's next call waits for that; closing it instead would leave the statement running.
            # One still inside a transaction (a rollback that did not finish) is closed by _put_back.
            await self._put_back(fairy)
            if isinstance(err, PG_RETRYABLE):
                raise Unavailable("the conversation store's database is busy; retry") from err
            if isinstance(err, asyncpg.ForeignKeyViolationError):  # the conversation was deleted under us
                raise NotFound("conversation not found") from None
            raise
        await self._put_back(fairy)
        return rows

    async def _put_back(self, fairy: PoolProxiedConnection) -> None:
        conn: asyncpg.Connection = fairy.driver_connection
        if self._closed or len(self._idle) >= self._keep or conn.is_closed() or conn.is_in_transaction():
            await greenlet_spawn(fairy.close)
        else:
            self._idle.append(fairy)

    async def claim(self, owner: OwnerId, conversation: ConversationId, new: NewTurn,
                    context_limit: int) -> tuple[bool, History | None]:
        if new.regenerates is not None:
            # Before the round trip: when the insert finds the record, the core may take it over with this lease.
            self._regenerates[new.lease] = None
            if len(self._regenerates) > REGENERATE_HINTS:
                del self._regenerates[next(iter(self._regenerates))]
        if not context_limit:
            rows = await self._fetch(PG_CLAIM, owner, conversation, new.turn, new.fingerprint, new.content,
                                     new.lease, new.lease_holder, new.lease_expires_at_ms, new.now_ms,
                                     new.regenerates, new.user_index)
            return bool(rows), None
        rows = await self._fetch(PG_CLAIM_WITH_CONTEXT, owner, conversation, context_limit, new.turn,
                                 new.fingerprint, new.content, new.lease, new.lease_holder,
                                 new.lease_expires_at_ms, new.now_ms, new.regenerates, new.user_index)
        if not rows:
            return False, None
        return bool(rows[0][0]), history_from([tuple(r)[1:] for r in rows])

    async def read(self, owner: OwnerId, conversation: ConversationId, from_index: int | None,
                   limit: int) -> History | None:
        if from_index is None:
            rows = await self._fetch(PG_CONTEXT, owner, conversation, limit or None)
        else:
            rows = await self._fetch(PG_READ, owner, conversation, limit or None, from_index)
        return history_from(rows) if rows else None

    async def finish(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, lease: LeaseId,
                     v: FinishValues, serialized: bool = False) -> int | None:
        """A plain turn's statement (the common case: no regenerate guards to evaluate), or a regenerate's;
        the request does not say which the turn is, so a lease this process did not claim as a regenerate's
        (another replica's claim or takeover) tries the plain one first and, when it writes nothing, the
        regenerate's. A turn refused by both is the caller's to explain."""
        args = (owner, conversation, turn, lease, v.to_state, v.reply_text, v.reply_token_count, v.reply_status,
                v.prompt_tokens, v.cached_prompt_tokens, v.output_tokens, v.now_ms, v.day)
        if lease in self._regenerates:
            rows = await self._fetch(PG_FINISH_REGENERATE, *args, serialized=serialized)
        else:
            rows = await self._fetch(PG_FINISH, *args, v.user_token_count, v.user_status, serialized=serialized)
            if not rows:
                rows = await self._fetch(PG_FINISH_REGENERATE, *args, serialized=serialized)
        if not rows:
            return None
        self._regenerates.pop(lease, None)
        return int(rows[0][0])

    async def close(self) -> None:
        """Hands the kept connections back to the engine's pool (before the engine is disposed)."""
        self._closed = True
        while self._idle:
            await greenlet_spawn(self._idle.pop().close)


# --- SQLite --------------------------------------------------------------------------------------------------

_SQ_CONV = ", ".join(f"conversations.{c}" for c in CONV_COLUMNS)
SQ_CONVERSATION = (f"SELECT {_SQ_CONV}, conversations.summary_text FROM conversations "
                   "WHERE conversations.owner_id = ? AND conversations.conversation_id = ?")
SQ_MESSAGES = (f"SELECT {', '.join(f'messages.{c}' for c in MSG_COLUMNS)} FROM messages "
               "WHERE messages.owner_id = ? AND messages.conversation_id = ? AND messages.message_index >= ? "
               "ORDER BY messages.message_index DESC LIMIT ?")
SQ_CLAIM = (
    f"INSERT INTO turns ({', '.join(TURN_COLUMNS)}) "
    "SELECT conversations.owner_id, conversations.conversation_id, ?, ?, 'received', ?, ?, ?, ?, ?, ?, NULL, "
    "'', 0, 0, 0, 0, ?, ? FROM conversations WHERE conversations.owner_id = ? AND conversations.conversation_id = ? "
    "ON CONFLICT (owner_id, conversation_id, turn_id) DO NOTHING RETURNING turns.turn_id")
SQ_TURN_FOR_FINISH = (
    "SELECT turns.content, turns.regenerates_turn_id, turns.user_index FROM turns WHERE turns.owner_id = ? "
    "AND turns.conversation_id = ? AND turns.turn_id = ? AND turns.lease_id = ? "
    "AND turns.state IN ('received', 'running')")
SQ_LATER_USER_MESSAGE = ("SELECT 1 FROM messages WHERE messages.owner_id = ? AND messages.conversation_id = ? "
                         "AND messages.message_index > ? AND messages.role = 'user' LIMIT 1")
SQ_ADVANCE = ("UPDATE conversations SET message_count = conversations.message_count + ?, updated_at_ms = ? "
              "WHERE conversations.owner_id = ? AND conversations.conversation_id = ? "
              "RETURNING conversations.message_count")
SQ_SUPERSEDE = ("UPDATE messages SET superseded = 1 WHERE messages.owner_id = ? AND messages.conversation_id = ? "
                "AND messages.message_index > ? AND messages.role = 'assistant' AND messages.superseded = 0")
SQ_INSERT_MESSAGE = ("INSERT INTO messages (owner_id, conversation_id, message_index, role, content, token_count, "
                     "status, turn_id, created_at_ms, superseded) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0)")
SQ_STORE_TURN = ("UPDATE turns SET state = ?, content = NULL, partial_text = '', user_index = ?, reply_index = ?, "
                 "prompt_tokens = ?, cached_prompt_tokens = ?, output_tokens = ?, updated_at_ms = ? "
                 "WHERE turns.owner_id = ? AND turns.conversation_id = ? AND turns.turn_id = ?")
SQ_ADD_USAGE = (
    "INSERT INTO usage_days (owner_id, day, prompt_tokens, cached_prompt_tokens, output_tokens, turns) "
    "VALUES (?, ?, ?, ?, ?, 1) ON CONFLICT (owner_id, day) DO UPDATE SET "
    "prompt_tokens = usage_days.prompt_tokens + excluded.prompt_tokens, "
    "cached_prompt_tokens = usage_days.cached_prompt_tokens + excluded.cached_prompt_tokens, "
    "output_tokens = usage_days.output_tokens + excluded.output_tokens, turns = usage_days.turns + 1")
SQLITE_UNREACHABLE = (sqlite3.OperationalError, sqlite3.InterfaceError)  # locked past the busy timeout, I/O


def apply_pragmas(execute: Callable[[str], object], pragmas: Sequence[str]) -> None:
    """Runs each `PRAGMA` on a new SQLite connection (the SQLAlchemy pool's and the hot path's alike).

    Switching a new file to WAL takes an exclusive lock, and when several connections open the file at the same
    moment (store replicas starting together) SQLite can answer "database is locked" at once instead of waiting
    out busy_timeout; such a pragma is retried for up to ~5 s."""
    for pragma in pragmas:
        for attempt in range(100):
            try:
                execute(f"PRAGMA {pragma}")
                break
            except Exception as err:  # sqlite3's, or SQLAlchemy's adapted OperationalError
                if "locked" not in str(err) or attempt == 99:
                    raise
                time.sleep(0.05)


class SqliteHotPath(HotPath):
    """`connections` worker threads, each with its own sqlite3 connection; a call runs all its statements in
    one worker and comes back to the event loop once."""

    def __init__(self, path: str, connections: int, pragmas: Sequence[str]) -> None:
        super().__init__()
        self._path, self._pragmas = path, tuple(pragmas)
        self._local = threading.local()  # each worker thread's connection, opened on its first call
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(connections, thread_name_prefix="chatmesh-sqlite")

    def _connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
            apply_pragmas(conn.execute, self._pragmas)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    async def _run(self, work: Callable[[sqlite3.Connection], Any]) -> Any:
        def call() -> Any:
            conn = self._connection()
            try:
                return work(conn)
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

        try:
            return await asyncio.get_running_loop().run_in_executor(self._threads, call)
        except SQLITE_UNREACHABLE as err:
            raise Unavailable("the conversation store's database is unavailable; retry") from err

    def _exec(self, conn: sqlite3.Connection, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        self._observe(sql)
        return conn.execute(sql, args)

    def _history(self, conn: sqlite3.Connection, owner: str, conversation: str, from_index: int | None,
                 limit: int) -> History | None:
        conv = self._exec(conn, SQ_CONVERSATION, (owner, conversation)).fetchone()
        if conv is None:
            return None
        bound = conv[7] + 1 if from_index is None else from_index  # None: after the summary
        messages = self._exec(conn, SQ_MESSAGES, (owner, conversation, bound, limit or -1)).fetchall()
        if not messages:
            return history_from([conv + (None,) * len(MSG_COLUMNS)])
        return history_from([conv + m for m in messages])

    async def claim(self, owner: OwnerId, conversation: ConversationId, new: NewTurn,
                    context_limit: int) -> tuple[bool, History | None]:
        args = (new.turn, new.fingerprint, new.content, new.lease, new.lease_holder, new.lease_expires_at_ms,
                new.regenerates, new.user_index, new.now_ms, new.now_ms, owner, conversation)

        def work(conn: sqlite3.Connection) -> tuple[bool, History | None]:
            if not context_limit:
                return bool(self._exec(conn, SQ_CLAIM, args).fetchall()), None
            self._exec(conn, "BEGIN IMMEDIATE")  # the context read sees the state the claim was made in
            claimed = bool(self._exec(conn, SQ_CLAIM, args).fetchall())
            context = self._history(conn, owner, conversation, None, context_limit)
            self._exec(conn, "COMMIT")
            return claimed, context

        result: tuple[bool, History | None] = await self._run(work)
        return result

    async def read(self, owner: OwnerId, conversation: ConversationId, from_index: int | None,
                   limit: int) -> History | None:
        def work(conn: sqlite3.Connection) -> History | None:
            self._exec(conn, "BEGIN")  # one snapshot for the conversation row and its messages
            history = self._history(conn, owner, conversation, from_index, limit)
            self._exec(conn, "COMMIT")
            return history

        result: History | None = await self._run(work)
        return result

    async def finish(self, owner: OwnerId, conversation: ConversationId, turn: TurnId, lease: LeaseId,
                     v: FinishValues, serialized: bool = False) -> int | None:
        def work(conn: sqlite3.Connection) -> int | None:
            self._exec(conn, "BEGIN IMMEDIATE")
            row = self._exec(conn, SQ_TURN_FOR_FINISH, (owner, conversation, turn, lease)).fetchone()
            regenerate = row is not None and row[1] is not None
            if regenerate and self._exec(conn, SQ_LATER_USER_MESSAGE,
                                         (owner, conversation, row[2])).fetchone() is not None:
                row = None  # a user message followed the one it answers
            advanced = [] if row is None else self._exec(
                conn, SQ_ADVANCE, (1 if regenerate else 2, v.now_ms, owner, conversation)).fetchall()
            if row is None or not advanced:
                self._exec(conn, "ROLLBACK")
                return None
            reply_index = int(advanced[0][0]) - 1
            reply = (owner, conversation, reply_index, "assistant", v.reply_text, v.reply_token_count,
                     v.reply_status, turn, v.now_ms)
            if regenerate:
                user_index = int(row[2])
                self._exec(conn, SQ_SUPERSEDE, (owner, conversation, user_index))
                self._exec(conn, SQ_INSERT_MESSAGE, reply)
            else:
                user_index = reply_index - 1
                self._observe(SQ_INSERT_MESSAGE)
                conn.executemany(SQ_INSERT_MESSAGE, (
                    (owner, conversation, user_index, "user", row[0], v.user_token_count, v.user_status, turn,
                     v.now_ms), reply))
            self._exec(conn, SQ_STORE_TURN, (v.to_state, user_index, reply_index, v.prompt_tokens,
                                             v.cached_prompt_tokens, v.output_tokens, v.now_ms, owner,
                                             conversation, turn))
            self._exec(conn, SQ_ADD_USAGE, (owner, v.day, v.prompt_tokens, v.cached_prompt_tokens,
                                            v.output_tokens))
            self._exec(conn, "COMMIT")
            return reply_index

        result: int | None = await self._run(work)
        return result

    async def close(self) -> None:
        self._threads.shutdown(wait=True)
        for conn in self._all:
            conn.close()
