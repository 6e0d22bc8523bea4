"""Conversation continuity without the client's help: the per-owner history digest index.

OpenAI clients (the SDK, Open WebUI, LibreChat) resend the whole history with every request and name no
conversation. chatmesh keeps the history itself, replays it identically and so hits its prefix cache, but only if
the request is recognised as the next turn of a stored conversation. How:

- After a turn, the edge records `digest(owner, chat, history the client now has) -> (conversation, turn)`: the
  history is the request's messages plus the reply exactly as the client received it (after output sanitising).
- A request whose messages before its last one have a recorded digest continues that conversation: its last
  message is sent as the next turn, with `expect_last_turn_id` = the recorded turn, so ChatService refuses it
  (FAILED_PRECONDITION, nothing stored) when the stored conversation has moved on since (another request continued
  it, a reply was regenerated). Then, and when nothing matches (a first request, an edited earlier message), the
  request starts a new conversation seeded with its earlier messages (`turns.py` decides).

The digest is an HMAC-SHA256 keyed by CHATMESH_KEY_PEPPER (the edge's secret for stored digests) over the owner id, the client's chat id (Open
WebUI's `X-OpenWebUI-Chat-Id`, or none) and each message's role and whitespace-trimmed text, length-prefixed, and
its tool calls (id, name, arguments as canonical JSON) or the call a tool result answers.
The owner is both inside the digest and the first column of the key, so no lookup can match across owners; the
key makes a digest of a short message ("hi") impossible to reverse by trying candidates.

Storage: the `openai_history` table beside the gateway's auth_ tables (the same database; several gateways share
it), rows keyed (owner_id, digest). A bounded in-process map in front of it answers the common case (the next turn
reaches the gateway that recorded the last one) without a query; a stale entry there costs one refused send and
a re-read. Rows of a deleted conversation are deleted with it (both surfaces' delete routes); rows older than the
retention are purged when this process records, at most hourly (with `records.py`'s).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from chatmesh.gateway.accounts import metadata
from chatmesh.gateway.openai import records
from chatmesh.gateway.openai.wire import Message
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId

history = sa.Table(
    "openai_history", metadata,
    sa.Column("owner_id", sa.String(128), primary_key=True),
    sa.Column("digest", sa.String(64), primary_key=True),
    sa.Column("conversation_id", sa.String(36), nullable=False),
    sa.Column("turn_id", sa.String(36), nullable=False),
    sa.Column("recorded_at_ms", sa.BigInteger, nullable=False, index=True),
    sa.Index("ix_openai_history_owner_conversation", "owner_id", "conversation_id"),
)

CACHED = 20_000
PURGE_INTERVAL_S = 3600.0


def digest(secret: bytes, owner: OwnerId, chat: str, messages: Sequence[Message]) -> str:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (owner, chat):
        raw = part.encode()
        mac.update(len(raw).to_bytes(4, "big") + raw)
    for m in messages:
        raw = m.text.strip().encode()
        mac.update(m.role.value[0].encode() + len(raw).to_bytes(4, "big") + raw)
        for part in _tool_parts(m):  # nothing for a message without tools: such digests are as they were
            raw = part.encode()
            mac.update(b"c" + len(raw).to_bytes(4, "big") + raw)
    return mac.hexdigest()


def _tool_parts(m: Message) -> list[str]:
    """A message's calls (id, name, arguments as canonical JSON: a client may re-serialise them) or the call a
    tool result answers."""
    parts = [m.tool_call_id] if m.tool_call_id else []
    for c in m.tool_calls:
        try:
            arguments = json.dumps(json.loads(c.arguments), sort_keys=True, separators=(",", ":"))
        except ValueError:
            arguments = c.arguments
        parts += [c.id, c.name, arguments]
    return parts


@dataclass(frozen=True)
class Point:
    """Where a history stands in chatmesh: the conversation, and the turn whose reply ends it."""

    conversation: ConversationId
    turn: TurnId


class HistoryIndex:
    def __init__(self, engine: AsyncEngine, secret: bytes, retention_days: int, cached: int = CACHED):
        self._engine = engine
        self.secret = secret
        self._retention_ms = retention_days * 86_400_000
        self._cached = cached
        self._memo: OrderedDict[tuple[OwnerId, str], Point] = OrderedDict()
        self._purged_at = 0.0

    @property
    def engine(self) -> AsyncEngine:
        """The gateway's database (`records.py` keeps its table beside this one)."""
        return self._engine

    def digest(self, owner: OwnerId, chat: str, messages: Sequence[Message]) -> str:
        return digest(self.secret, owner, chat, messages)

    async def find(self, owner: OwnerId, key: str, *, fresh: bool = False) -> Point | None:
        """The point a history digest was recorded at; `fresh` skips the in-process map."""
        if not fresh and (point := self._memo.get((owner, key))) is not None:
            self._memo.move_to_end((owner, key))
            return point
        async with self._engine.connect() as conn:
            row = (await conn.execute(sa.select(history.c.conversation_id, history.c.turn_id).where(
                history.c.owner_id == owner, history.c.digest == key))).first()
        if row is None:
            self._memo.pop((owner, key), None)
            return None
        point = Point(ConversationId(row[0]), TurnId(row[1]))
        self._remember(owner, key, point)
        return point

    async def record(self, owner: OwnerId, key: str, point: Point) -> None:
        now_ms = int(time.time() * 1000)
        values = {"conversation_id": point.conversation, "turn_id": point.turn, "recorded_at_ms": now_ms}
        async with self._engine.begin() as conn:
            updated = await conn.execute(history.update().where(
                history.c.owner_id == owner, history.c.digest == key).values(**values))
            if updated.rowcount == 0:
                try:
                    async with conn.begin_nested():
                        await conn.execute(history.insert().values(owner_id=owner, digest=key, **values))
                except sa.exc.IntegrityError:  # another gateway recorded it at the same moment: same history
                    pass
            if time.monotonic() - self._purged_at > PURGE_INTERVAL_S:
                self._purged_at = time.monotonic()
                for table in (history, records.turns, records.phases):  # the surface's others share the retention
                    await conn.execute(table.delete().where(table.c.recorded_at_ms < now_ms - self._retention_ms))
        self._remember(owner, key, point)

    async def forget(self, owner: OwnerId, conversation: ConversationId) -> None:
        """Every recorded point of a conversation (it was deleted)."""
        for k in [k for k, p in self._memo.items() if k[0] == owner and p.conversation == conversation]:
            del self._memo[k]
        async with self._engine.begin() as conn:
            await conn.execute(history.delete().where(history.c.owner_id == owner,
                                                      history.c.conversation_id == conversation))

    def _remember(self, owner: OwnerId, key: str, point: Point) -> None:
        self._memo[(owner, key)] = point
        self._memo.move_to_end((owner, key))
        while len(self._memo) > self._cached:
            self._memo.popitem(last=False)
