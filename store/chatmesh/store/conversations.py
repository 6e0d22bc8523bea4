"""Conversations and their messages: creating one (with a client's earlier history as seed messages), reading
its history (the backend's one-round-trip read), listing an owner's, storing its rolling summary (I3), and the
row reads the turn operations share (a conversation's row, the message at an index).

Messages are written here only as a conversation's seed; a turn's user message and reply are stored by its
finish (`chatmesh.store.turns`, through the backend). Partitioning: every statement filters on `owner_id`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Row, bindparam, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from chatmesh.mesh import logs
from chatmesh.mesh.errors import FailedPrecondition, InvalidArgument, NotFound
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId, new_conversation_id
from chatmesh.store.clock import Clock
from chatmesh.store.db import Database
from chatmesh.store.limits import FieldLimits, check_count, check_len
from chatmesh.store.rows import CONV, MSG, conversation_of, key, message_of, message_values
from chatmesh.store.values import Conversation, History, Message, MessageStatus, Role, Seed, Summary

log = logs.get("chatmesh.store")
MAX_SEED_MESSAGES = 10_000  # messages a conversation may be created with (a client's own history)

# Built once: constructing a statement costs more CPU than running it.
CONVERSATION_ROW = select(CONV).where(key(CONV))
MESSAGE_AT = select(MSG).where(key(MSG), MSG.c.message_index == bindparam("index"))
INSERT_MESSAGES = insert(MSG)


async def conversation_row(conn: AsyncConnection, owner: OwnerId, conversation: ConversationId,
                           for_update: bool = False) -> Row[Any]:
    query = CONVERSATION_ROW.with_for_update() if for_update else CONVERSATION_ROW
    row = (await conn.execute(query, {"owner": owner, "conversation": conversation})).first()
    if row is None:
        raise NotFound(f"conversation {conversation} not found")
    return row


async def message_at(conn: AsyncConnection, owner: OwnerId, conversation: ConversationId,
                     index: int | None) -> Message:
    row = None
    if index is not None:
        row = (await conn.execute(MESSAGE_AT, {"owner": owner, "conversation": conversation,
                                               "index": index})).first()
    if row is None:
        raise NotFound(f"message {index} of conversation {conversation} not found")
    return message_of(row)


class ConversationRecords:
    """An owner's conversations, their messages and summaries."""

    def __init__(self, db: Database, limits: FieldLimits, clock: Clock) -> None:
        self.db = db
        self.limits = limits
        self._clock = clock

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
        check_len("title", title, self.limits.max_title_chars)
        check_len("system_prompt_version", system_prompt_version, self.limits.max_system_prompt_version_chars)
        if len(seed) > MAX_SEED_MESSAGES:
            raise InvalidArgument(f"messages: at most {MAX_SEED_MESSAGES} seed messages")
        for i, m in enumerate(seed):
            self.limits.check_tools(f"messages[{i}]", m.role, m.tool_calls, m.tool_results)
            self.limits.check_text(f"messages[{i}].content", m.content,
                                   required=not (m.tool_calls or m.role is Role.TOOL))
            check_count(f"messages[{i}].token_count", m.token_count)
        now = self._clock()
        conv = Conversation(conversation or new_conversation_id(), owner, title, system_prompt_version, now, now,
                            len(seed))
        rows = [message_values(owner, conv.conversation_id, Message(
            i, m.role, m.content, m.token_count, MessageStatus.COMPLETE, TurnId(str(uuid.uuid4())), now, False,
            m.tool_calls, m.tool_results))
            for i, m in enumerate(seed)]
        try:
            async with self.db.write() as conn:
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
            async with self.db.single() as conn:
                row = await conversation_row(conn, owner, conversation)
            return conversation_of(row), False
        log.info("conversation_created", owner_id=owner, conversation_id=conv.conversation_id, seeded=len(seed))
        return conv, True

    async def read_conversation(self, owner: OwnerId, conversation: ConversationId, *, from_index: int = 0,
                                max_messages: int = 0) -> History:
        """The conversation, its summary, and its messages with index >= `from_index` in order; with
        `max_messages` > 0 only the newest that many of those."""
        check_count("from_index", from_index)
        check_count("max_messages", max_messages)
        history = await self.db.backend.read(owner, conversation, from_index, max_messages)
        if history is None:
            raise NotFound(f"conversation {conversation} not found")
        return history

    async def list_conversations(self, owner: OwnerId, limit: int = 50) -> list[Conversation]:
        """The owner's conversations, most recently updated first."""
        if limit <= 0:
            limit = 50
        limit = min(limit, 500)
        async with self.db.single() as conn:
            rows = (await conn.execute(select(CONV).where(CONV.c.owner_id == owner)
                                       .order_by(CONV.c.updated_at_ms.desc(), CONV.c.conversation_id)
                                       .limit(limit))).all()
        return [conversation_of(r) for r in rows]

    async def save_summary(self, owner: OwnerId, conversation: ConversationId, text: str,
                           covers_through_index: int, token_count: int) -> Summary:
        """Stores the rolling summary of messages 0..covers_through_index (I3). A summary never moves back."""
        self.limits.check_text("summary", text, required=True)
        check_count("covers_through_index", covers_through_index)
        check_count("token_count", token_count)
        now = self._clock()
        async with self.db.write() as conn:
            row = await conversation_row(conn, owner, conversation, for_update=True)
            if covers_through_index >= row.message_count:
                raise InvalidArgument(f"covers_through_index {covers_through_index} is past the last message "
                                      f"(the conversation has {row.message_count})")
            if covers_through_index < row.summary_covers_through:
                raise FailedPrecondition(f"a summary through message {row.summary_covers_through} is already "
                                         f"stored; summaries only move forward")
            await conn.execute(update(CONV).where(CONV.c.owner_id == owner, CONV.c.conversation_id == conversation)
                               .values(summary_text=text, summary_covers_through=covers_through_index,
                                       summary_token_count=token_count, summary_created_at_ms=now))
        return Summary(text, covers_through_index, token_count, now)
