"""What each database does its own way: the turn cycle's claim, history read and finish, one round trip each
(`postgres.py`, `sqlite.py`), and what it means when the database cannot be reached.

The chat service's per-turn store work is three calls: BeginTurn (the claim, optionally with the prompt's
context), the history read, FinishTurn. Through SQLAlchemy's async layer each of their ~10 statements cost
~0.4-0.6 ms of client CPU, which capped PostgreSQL at a few hundred turns/s on two cores. So each of the three is
one round trip written per database, and it is the only place the store creates a turn record or stores a turn
(plain turns and regenerates alike). The rest of a turn's life (`chatmesh.store.turns`: the takeover, progress,
fail, the explanation of a refused finish) is SQLAlchemy statements both databases run as they are.

Every statement a backend sends passes `_observe`, so tests see (and check for the owner id) exactly what it
sends, as they see SQLAlchemy's statements through its events.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

from chatmesh.mesh import logs
from chatmesh.mesh.errors import Unavailable
from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, TurnId
from chatmesh.store.values import History

log = logs.get("chatmesh.store")


def unavailable(err: BaseException) -> Unavailable:
    """The answer when the database cannot be reached or is shedding load (UNAVAILABLE: the caller retries);
    each driver's errors that mean so are listed beside it (`db.py`, `postgres.py`, `sqlite.py`)."""
    log.warning("database_unavailable", error=type(err).__name__)
    return Unavailable("the conversation store's database is unavailable; retry")


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
    options: str = ""  # the turn's generation options (the caller's JSON)
    input_parts: str | None = None  # a tool turn's results (rows.parts_json): its input is a tool message


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
    reply_parts: str | None = None  # the reply's tool calls (rows.parts_json)


class Backend(abc.ABC):
    """One database's round-trip-per-call claim, read and finish."""

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
        """Stores a turn while `guards.lease_held`, atomically: the user message (or a tool turn's tool message,
        from the record's `input_parts`; a regenerate: none, and its
        earlier replies marked superseded, provided not `guards.later_user_message`), the reply, the turn's
        final state, the usage. Returns the reply's index, or None when a guard did not match (nothing
        written). `serialized` (a retry): the conversation's row lock is taken before the finish reads anything,
        so no finish committed before it can be missed (SQLite's finish always is: BEGIN IMMEDIATE)."""

    @abc.abstractmethod
    async def close(self) -> None: ...
