"""The store's tables as SQLAlchemy Core tables, the column orders the backends' own statements use, and rows
turned into the store's values (`chatmesh.store.values`) and back. Core tables, not the ORM classes: ORM-enabled
DML costs several times the CPU per statement."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Row, Table, and_, bindparam

from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.store.schema import Base, ConversationRow, MessageRow, TurnRow, UsageRow
from chatmesh.store.values import (
    Conversation, History, Message, MessageStatus, Role, Summary, ToolCall, ToolResult, Usage,
)

CONV = Base.metadata.tables[ConversationRow.__tablename__]
MSG = Base.metadata.tables[MessageRow.__tablename__]
TURN = Base.metadata.tables[TurnRow.__tablename__]
USAGE = Base.metadata.tables[UsageRow.__tablename__]

CONV_COLUMNS = ("owner_id", "conversation_id", "title", "system_prompt_version", "created_at_ms", "updated_at_ms",
                "message_count", "summary_covers_through", "summary_token_count", "summary_created_at_ms")
MSG_COLUMNS = ("message_index", "role", "content", "token_count", "status", "turn_id", "created_at_ms", "superseded",
               "parts")
TURN_COLUMNS = ("owner_id", "conversation_id", "turn_id", "fingerprint", "state", "content", "lease_id",
                "lease_holder", "lease_expires_at_ms", "regenerates_turn_id", "user_index", "reply_index",
                "partial_text", "event_sequence", "prompt_tokens", "cached_prompt_tokens", "output_tokens",
                "created_at_ms", "updated_at_ms", "generation_options", "input_parts")
# Rows the backends' reads return: the conversation's columns, its summary text (first row only), then one message's.
N_CONV = len(CONV_COLUMNS)
ROLES = {r.value: r for r in Role}
STATUSES = {s.value: s for s in MessageStatus}


def parts_json(calls: Sequence[ToolCall] = (), results: Sequence[ToolResult] = ()) -> str | None:
    """A message's tool calls or results as the `parts` column holds them (NULL for a message with neither)."""
    if calls:
        return json.dumps({"tool_calls": [[c.id, c.name, c.arguments] for c in calls]}, ensure_ascii=False)
    if results:
        return json.dumps({"tool_results": [[r.tool_call_id, r.content] for r in results]}, ensure_ascii=False)
    return None


def parts_of(text: str | None) -> tuple[tuple[ToolCall, ...], tuple[ToolResult, ...]]:
    if not text:
        return (), ()
    parts = json.loads(text)
    return (tuple(ToolCall(*c) for c in parts.get("tool_calls", ())),
            tuple(ToolResult(*r) for r in parts.get("tool_results", ())))


def key(table: Table) -> ColumnElement[bool]:
    """The conversation's key in `table`, as bind parameters :owner and :conversation."""
    return and_(table.c.owner_id == bindparam("owner"), table.c.conversation_id == bindparam("conversation"))


def history_from(rows: Sequence[Sequence[Any]]) -> History:
    """Rows of (conversation columns, summary text, message columns or NULLs), newest message first."""
    first = rows[0]
    conv = Conversation(ConversationId(first[1]), OwnerId(first[0]), first[2], first[3], first[4], first[5], first[6])
    text = first[N_CONV]
    summary = None if text is None else Summary(text, first[7], first[8], first[9])
    roles, statuses = ROLES, STATUSES  # dict lookups: calling an Enum by value costs ~1 us
    messages = [Message(r[N_CONV + 1], roles[r[N_CONV + 2]], r[N_CONV + 3], r[N_CONV + 4],
                        statuses[r[N_CONV + 5]], TurnId(r[N_CONV + 6]), r[N_CONV + 7], bool(r[N_CONV + 8]),
                        *parts_of(r[N_CONV + 9]))
                for r in reversed(rows) if r[N_CONV + 1] is not None]
    return History(conv, messages, summary)


def usage_of(row: Row[Any]) -> Usage:
    return Usage(row.prompt_tokens, row.cached_prompt_tokens, row.output_tokens)


def conversation_of(row: Row[Any]) -> Conversation:
    return Conversation(ConversationId(row.conversation_id), OwnerId(row.owner_id), row.title,
                        row.system_prompt_version, row.created_at_ms, row.updated_at_ms, row.message_count)


def message_of(row: Row[Any]) -> Message:
    return Message(row.message_index, Role(row.role), row.content, row.token_count, MessageStatus(row.status),
                   TurnId(row.turn_id), row.created_at_ms, bool(row.superseded), *parts_of(row.parts))


def message_values(owner: OwnerId, conversation: ConversationId, m: Message) -> dict[str, Any]:
    return dict(owner_id=owner, conversation_id=conversation, message_index=m.index, role=m.role.value,
                content=m.content, token_count=m.token_count, status=m.status.value, turn_id=m.turn_id,
                created_at_ms=m.created_at_ms, superseded=m.superseded, parts=parts_json(m.tool_calls, m.tool_results))
