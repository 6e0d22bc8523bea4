"""PostgreSQL's statements for the turn cycle (asyncpg, a raw connection from SQLAlchemy's pool, asyncpg's
prepared-statement cache), one round trip per call (`chatmesh.store.backend`):

- the claim is one `INSERT .. SELECT .. ON CONFLICT DO NOTHING`, with the context read in the same statement
  (a CTE; the read sees the statement's snapshot);
- the read is one statement (conversation LEFT JOIN LATERAL its newest messages);
- the finish is ONE statement, so one implicit transaction and one commit, written twice: `PG_FINISH` for a
  plain turn, `PG_FINISH_REGENERATE` for a regenerate (the regenerate's guards and supersede step cost a plain
  turn ~0.05 ms of server CPU when they were one statement):
      conv       SELECT .. FROM conversations .. FOR NO KEY UPDATE   -- lock order: conversation, then turn
      turn       UPDATE turns SET state = stored, indexes from conv .. WHERE guards.lease_held AND
                 regenerates_turn_id IS (NOT) NULL  -- re-checked on the locked row; a regenerate also needs
                 NOT guards.later_user_message (after the one it answers), and that no finish committed since
                 the statement's snapshot (its reads below must see every message: else nothing is written,
                 and the retry runs the statement after taking the conversation's lock, so its snapshot follows)
      advanced   UPDATE conversations SET message_count = message_count + 2 (a regenerate: + 1) .. WHERE
                 EXISTS (turn)
      superseded (a regenerate) UPDATE messages SET superseded = true: the earlier replies to its user message
      stored     INSERT INTO messages (the user message unless a regenerate, the reply) .. FROM turn
      metered    INSERT INTO usage_days .. FROM turn ON CONFLICT DO UPDATE (add)
  Either all of it happens or none (one statement); when a guard does not match (already finished, another
  lease, a stale regenerate, unknown turn, a racing finish) nothing is written and the caller reads why. A
  FinishTurn does not say whether its turn is a regenerate: the leases of the regenerates this process
  claimed (a takeover's too: the takeover uses the lease offered here first) are remembered, and any other
  finish runs the plain statement, then (when it wrote nothing, e.g. a regenerate another replica claimed) the
  regenerate's.
"""

from __future__ import annotations

from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.util import greenlet_spawn

from chatmesh.mesh.errors import NotFound, Unavailable
from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, TurnId
from chatmesh.store.backend import Backend, FinishValues, NewTurn, unavailable
from chatmesh.store.guards import later_user_message, lease_held, superseded_replies
from chatmesh.store.rows import CONV_COLUMNS, MSG_COLUMNS, TURN_COLUMNS, history_from
from chatmesh.store.values import History

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
    "{now}::bigint, {now}::bigint, {options}::text, {parts}::text "
    "FROM conversations WHERE conversations.owner_id = $1 AND conversations.conversation_id = $2 "
    "ON CONFLICT (owner_id, conversation_id, turn_id) DO NOTHING RETURNING turns.turn_id")
PG_CLAIM = _PG_INSERT_TURN.format(turn="$3::varchar", fp="$4::varchar", content="$5::text", lease="$6::varchar",
                                  holder="$7::varchar", expires="$8", now="$9", regenerates="$10",
                                  user_index="$11", options="$12", parts="$13")
# With the context: the read runs in the same statement (same snapshot; the new turn is not a message yet).
PG_CLAIM_WITH_CONTEXT = (
    "WITH claimed AS (" + _PG_INSERT_TURN.format(
        turn="$4::varchar", fp="$5::varchar", content="$6::text", lease="$7::varchar", holder="$8::varchar",
        expires="$9", now="$10", regenerates="$11", user_index="$12", options="$13", parts="$14") + ") "
    "SELECT (SELECT count(*) FROM claimed), r.* FROM ("
    + _pg_read("conversations.summary_covers_through + 1") + ") AS r")
PG_READ = _pg_read("$4::integer")
PG_CONTEXT = _pg_read("conversations.summary_covers_through + 1")
_PG_OWN = "{t}.owner_id = $1 AND {t}.conversation_id = $2"
PG_LOCK_CONVERSATION = f"SELECT FROM conversations WHERE {_PG_OWN.format(t='conversations')} FOR NO KEY UPDATE"
_PG_CONV_LOCKED = ("WITH conv AS (SELECT conversations.message_count FROM conversations "
                   f"WHERE {_PG_OWN.format(t='conversations')} FOR NO KEY UPDATE), ")
_PG_TURN_STORED = ("turn AS (UPDATE turns SET state = $5::varchar, content = NULL, partial_text = '', "
                   "generation_options = '', input_parts = NULL, "
                   "{indexes}, prompt_tokens = $9::bigint, cached_prompt_tokens = $10::bigint, "
                   "output_tokens = $11::bigint, updated_at_ms = $12::bigint FROM turns AS prev "
                   f"WHERE {_PG_OWN.format(t='turns')} AND turns.turn_id = $3 AND {lease_held('$4')} "
                   "AND EXISTS (SELECT FROM conv) AND {kind} "
                   f"AND {_PG_OWN.format(t='prev')} AND prev.turn_id = $3 "
                   "RETURNING turns.user_index, turns.reply_index, prev.content, prev.input_parts), ")
_PG_ADVANCED = ("advanced AS (UPDATE conversations SET message_count = conversations.message_count + {n}, "
                f"updated_at_ms = $12::bigint WHERE {_PG_OWN.format(t='conversations')} "
                "AND EXISTS (SELECT FROM turn)), ")
_PG_REPLY = ("SELECT $1, $2, turn.reply_index, 'assistant', $6::text, $7::integer, $8::varchar, $3, $12::bigint, "
             "false, $14::text FROM turn")
_PG_METERED = (
    "metered AS (INSERT INTO usage_days (owner_id, day, prompt_tokens, cached_prompt_tokens, output_tokens, turns) "
    "SELECT $1, $13::varchar, $9::bigint, $10::bigint, $11::bigint, 1 FROM turn "
    "ON CONFLICT (owner_id, day) DO UPDATE SET prompt_tokens = usage_days.prompt_tokens + excluded.prompt_tokens, "
    "cached_prompt_tokens = usage_days.cached_prompt_tokens + excluded.cached_prompt_tokens, "
    "output_tokens = usage_days.output_tokens + excluded.output_tokens, turns = usage_days.turns + 1) "
    "SELECT turn.reply_index FROM turn")
_PG_STORED = ("stored AS (INSERT INTO messages (owner_id, conversation_id, message_index, role, content, "
              "token_count, status, turn_id, created_at_ms, superseded, parts) ")
# A plain turn (no regenerate): its user message at message_count, its reply after it.
PG_FINISH = (
    _PG_CONV_LOCKED
    + _PG_TURN_STORED.format(indexes="user_index = (SELECT conv.message_count FROM conv), "
                             "reply_index = (SELECT conv.message_count + 1 FROM conv)",
                             kind="turns.regenerates_turn_id IS NULL")
    + _PG_ADVANCED.format(n=2)
    + _PG_STORED + "SELECT $1, $2, turn.user_index, "
    "CASE WHEN turn.input_parts IS NULL THEN 'user' ELSE 'tool' END, turn.content, $15::integer, $16::varchar, $3, "
    "$12::bigint, false, turn.input_parts FROM turn UNION ALL " + _PG_REPLY + "), "
    + _PG_METERED)
# A regenerate: no user message; the reply at message_count; the earlier replies to its user message
# superseded; only if no user message followed that one and no finish committed since the statement's snapshot
# (its reads must see every message: the locked message_count equals the snapshot's).
PG_FINISH_REGENERATE = (
    _PG_CONV_LOCKED
    + _PG_TURN_STORED.format(
        indexes="reply_index = (SELECT conv.message_count FROM conv)",
        kind="turns.regenerates_turn_id IS NOT NULL "
        f"AND NOT {later_user_message('$1', '$2', 'turns.user_index')} "
        f"AND (SELECT conversations.message_count FROM conversations WHERE {_PG_OWN.format(t='conversations')}) "
        "= (SELECT conv.message_count FROM conv)")
    + _PG_ADVANCED.format(n=1)
    # A scalar bound: joining `turn` made the planner filter every message of the conversation (ba49066).
    + "superseded AS (UPDATE messages SET superseded = true "
    f"WHERE {superseded_replies('$1', '$2', '(SELECT turn.user_index FROM turn)')}), "
    + _PG_STORED + _PG_REPLY + "), "
    + _PG_METERED)
# How many regenerate leases a PostgreSQL backend remembers from its claims (a hint; see `finish`).
REGENERATE_HINTS = 1024

# The driver's errors that mean "the database is unreachable or shedding load" (answered UNAVAILABLE).
PG_UNREACHABLE = (OSError, TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
                  asyncpg.CannotConnectNowError, asyncpg.TooManyConnectionsError)
PG_RETRYABLE = (asyncpg.DeadlockDetectedError, asyncpg.SerializationError)


class PostgresBackend(Backend):
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
                raise unavailable(err) from err
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
            raise unavailable(err) from err
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
            # Before the round trip: when the insert finds the record, `turns.py` may take it over with this lease.
            self._regenerates[new.lease] = None
            if len(self._regenerates) > REGENERATE_HINTS:
                del self._regenerates[next(iter(self._regenerates))]
        if not context_limit:
            rows = await self._fetch(PG_CLAIM, owner, conversation, new.turn, new.fingerprint, new.content,
                                     new.lease, new.lease_holder, new.lease_expires_at_ms, new.now_ms,
                                     new.regenerates, new.user_index, new.options, new.input_parts)
            return bool(rows), None
        rows = await self._fetch(PG_CLAIM_WITH_CONTEXT, owner, conversation, context_limit, new.turn,
                                 new.fingerprint, new.content, new.lease, new.lease_holder,
                                 new.lease_expires_at_ms, new.now_ms, new.regenerates, new.user_index, new.options,
                                 new.input_parts)
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
                v.prompt_tokens, v.cached_prompt_tokens, v.output_tokens, v.now_ms, v.day, v.reply_parts)
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


