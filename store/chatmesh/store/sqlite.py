"""SQLite's statements for the turn cycle, one hop to a worker thread per call (`chatmesh.store.backend`):
its own connections, each used by one worker thread; WAL, BEGIN IMMEDIATE for writes. Each call's statements
run together in one hop (aiosqlite hopped per statement and per cursor call); the finish runs the same guards
as PostgreSQL's (`chatmesh.store.guards`) and its writes in one transaction (BEGIN IMMEDIATE: no finish races
it). Also the pragmas every SQLite connection of the store opens with (the SQLAlchemy pool's too, `db.py`).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, TurnId
from chatmesh.store.backend import Backend, FinishValues, NewTurn, unavailable
from chatmesh.store.guards import later_user_message, lease_held, superseded_replies
from chatmesh.store.rows import CONV_COLUMNS, MSG_COLUMNS, TURN_COLUMNS, history_from
from chatmesh.store.values import History

SQLITE_BUSY_TIMEOUT_MS = 30_000
SQLITE_MAX_POOL = 4  # writers serialize on one lock; past a few connections they only wait on each other
SQLITE_PRAGMAS = (f"busy_timeout={SQLITE_BUSY_TIMEOUT_MS}", "journal_mode=WAL", "synchronous=NORMAL",
                  "foreign_keys=ON")

_SQ_CONV = ", ".join(f"conversations.{c}" for c in CONV_COLUMNS)
SQ_CONVERSATION = (f"SELECT {_SQ_CONV}, conversations.summary_text FROM conversations "
                   "WHERE conversations.owner_id = ? AND conversations.conversation_id = ?")
SQ_MESSAGES = (f"SELECT {', '.join(f'messages.{c}' for c in MSG_COLUMNS)} FROM messages "
               "WHERE messages.owner_id = ? AND messages.conversation_id = ? AND messages.message_index >= ? "
               "ORDER BY messages.message_index DESC LIMIT ?")
SQ_CLAIM = (
    f"INSERT INTO turns ({', '.join(TURN_COLUMNS)}) "
    "SELECT conversations.owner_id, conversations.conversation_id, ?, ?, 'received', ?, ?, ?, ?, ?, ?, NULL, "
    "'', 0, 0, 0, 0, ?, ?, ?, ? FROM conversations WHERE conversations.owner_id = ? "
    "AND conversations.conversation_id = ? "
    "ON CONFLICT (owner_id, conversation_id, turn_id) DO NOTHING RETURNING turns.turn_id")
SQ_TURN_FOR_FINISH = (
    "SELECT turns.content, turns.regenerates_turn_id, turns.user_index, turns.input_parts FROM turns "
    "WHERE turns.owner_id = ? "
    f"AND turns.conversation_id = ? AND turns.turn_id = ? AND {lease_held('?')}")
SQ_LATER_USER_MESSAGE = f"SELECT {later_user_message('?', '?', '?')}"
SQ_ADVANCE = ("UPDATE conversations SET message_count = conversations.message_count + ?, updated_at_ms = ? "
              "WHERE conversations.owner_id = ? AND conversations.conversation_id = ? "
              "RETURNING conversations.message_count")
SQ_SUPERSEDE = f"UPDATE messages SET superseded = 1 WHERE {superseded_replies('?', '?', '?')}"
SQ_INSERT_MESSAGE = ("INSERT INTO messages (owner_id, conversation_id, message_index, role, content, token_count, "
                     "status, turn_id, created_at_ms, superseded, parts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)")
SQ_STORE_TURN = ("UPDATE turns SET state = ?, content = NULL, partial_text = '', generation_options = '', "
                 "input_parts = NULL, "
                 "user_index = ?, reply_index = ?, "
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
    """Runs each `PRAGMA` on a new SQLite connection (the SQLAlchemy pool's and the backend's alike).

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


class SqliteBackend(Backend):
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
            raise unavailable(err) from err

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
                new.regenerates, new.user_index, new.now_ms, new.now_ms, new.options, new.input_parts, owner,
                conversation)

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
            if regenerate and self._exec(conn, SQ_LATER_USER_MESSAGE, (owner, conversation, row[2])).fetchone()[0]:
                row = None  # a user message followed the one it answers
            advanced = [] if row is None else self._exec(
                conn, SQ_ADVANCE, (1 if regenerate else 2, v.now_ms, owner, conversation)).fetchall()
            if row is None or not advanced:
                self._exec(conn, "ROLLBACK")
                return None
            reply_index = int(advanced[0][0]) - 1
            reply = (owner, conversation, reply_index, "assistant", v.reply_text, v.reply_token_count,
                     v.reply_status, turn, v.now_ms, v.reply_parts)
            if regenerate:
                user_index = int(row[2])
                self._exec(conn, SQ_SUPERSEDE, (owner, conversation, user_index))
                self._exec(conn, SQ_INSERT_MESSAGE, reply)
            else:
                user_index = reply_index - 1
                self._observe(SQ_INSERT_MESSAGE)
                conn.executemany(SQ_INSERT_MESSAGE, (
                    (owner, conversation, user_index, "user" if row[3] is None else "tool", row[0],
                     v.user_token_count, v.user_status, turn, v.now_ms, row[3]), reply))
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
