"""Partitioning by owner (issue 3 item 2): every statement on an owner table filters on owner_id, and every
primary key leads with it, so the schema distributes unchanged on Citus."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event, inspect
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from chatmesh.mesh.ids import OwnerId, TurnId
from chatmesh.store.core import ConversationStore
from chatmesh.store.schema import Base
from chatmesh.store.values import Claimed, MessageStatus, Reply, Usage

OWNER_TABLES = {"conversations", "messages", "turns", "usage_days"}
TABLE_REF = re.compile(r"\b(FROM|INTO|UPDATE|JOIN)\s+\"?(\w+)\"?(?:\s+AS\s+(\w+))?", re.IGNORECASE)
CTE = re.compile(r"\s*(\w+)\s+AS\s+\(", re.IGNORECASE)


@contextmanager
def recorded(engine: AsyncEngine, store: ConversationStore) -> Iterator[list[str]]:
    """Every statement sent: SQLAlchemy's (its cursor events) and the backend's (sent through the driver)."""
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(" ".join(statement.split()))

    def record_hot(statement: str) -> None:
        statements.append("HOT " + " ".join(statement.split()))

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    store.db.backend.listeners.append(record_hot)
    try:
        yield statements
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", record)
        store.db.backend.listeners.remove(record_hot)


def strip(statement: str) -> str:
    return statement.removeprefix("HOT ")


def parts(statement: str) -> list[str]:
    """A statement, or a WITH statement's CTE bodies and its main statement: each is checked on its own."""
    if not statement.upper().startswith("WITH "):
        return [statement]
    found, at = [], 5
    while (cte := CTE.match(statement, at)) is not None:
        depth, end = 1, cte.end()
        while depth:  # the backends' SQL has no parentheses inside string literals
            depth += {"(": 1, ")": -1}.get(statement[end], 0)
            end += 1
        found.append(statement[cte.end():end - 1])
        comma = re.compile(r"\s*,").match(statement, end)
        at = comma.end() if comma else end
        if comma is None:
            break
    return [*found, statement[at:].strip()]


def owner_violations(statement: str) -> list[str]:
    """Why `statement` is not owner-scoped, or [] when it is: an INSERT must lead its columns with owner_id, and
    every owner table it reads, updates or deletes from (by name or alias) must have <name>.owner_id = in a WHERE."""
    problems = []
    for part in parts(statement):
        where = re.split(r"\bWHERE\b", part, maxsplit=1, flags=re.IGNORECASE)
        for ref in TABLE_REF.finditer(part):
            keyword, table, alias = ref.group(1).upper(), ref.group(2).lower(), ref.group(3)
            if table not in OWNER_TABLES:
                continue
            if keyword == "INTO":
                columns = part[part.index("(", ref.end()) + 1:part.index(")", ref.end())]
                if columns.split(",")[0].strip() != "owner_id":
                    problems.append(f"INSERT without owner_id leading its columns: {part[:120]}")
                continue
            name = alias or table
            if len(where) < 2 or not re.search(rf"\b{name}\.owner_id = ", where[1]):
                problems.append(f"{keyword} {table} without {name}.owner_id in its WHERE: {part[:160]}")
    return problems


def test_checker_catches_unscoped_statements() -> None:
    assert owner_violations("SELECT turns.state FROM turns WHERE turns.turn_id = ?")
    assert owner_violations("DELETE FROM messages WHERE messages.conversation_id = ?")
    assert owner_violations("UPDATE conversations SET title=?")
    assert owner_violations("INSERT INTO usage_days (day, owner_id) VALUES (?, ?)")
    assert owner_violations("WITH a AS (UPDATE turns SET state = 1 WHERE turns.turn_id = $1) SELECT 1")
    assert owner_violations("WITH a AS (SELECT 1 FROM turns WHERE turns.owner_id = $1), "
                            "b AS (INSERT INTO usage_days (day, owner_id) SELECT $2, $1 FROM a) SELECT 1")
    assert owner_violations("UPDATE turns SET state = 1 FROM turns AS prev WHERE turns.owner_id = $1 "
                            "AND prev.turn_id = $2")
    assert owner_violations("SELECT 1 FROM conversations WHERE conversations.owner_id = $1 UNION ALL "
                            "SELECT 1 FROM messages AS m WHERE m.conversation_id = $2")
    assert not owner_violations("SELECT turns.state FROM turns WHERE turns.owner_id = ? AND turns.turn_id = ?")
    assert not owner_violations("WITH a AS (SELECT 1 FROM turns WHERE turns.owner_id = $1), "
                                "b AS (INSERT INTO usage_days (owner_id, day) SELECT $1, $2 FROM a) SELECT 1 FROM b")
    assert not owner_violations("BEGIN IMMEDIATE")


async def test_every_statement_of_a_turn_delete_and_export_is_owner_scoped(
        store: ConversationStore, engine: AsyncEngine) -> None:
    owner = OwnerId("alice")
    with recorded(engine, store) as statements:
        conv = (await store.conversations.insert_conversation(owner, "t", "v1")).conversation_id
        turn = TurnId(str(uuid.uuid4()))
        claim = await store.turns.begin_turn(owner, conv, turn, content="hi", lease_holder="chat-1")
        assert isinstance(claim, Claimed)
        await store.turns.begin_turn(owner, conv, turn, content="hi", lease_holder="chat-2")
        await store.turns.update_turn_progress(owner, conv, turn, claim.lease_id, "hel", 1)
        await store.turns.read_turn(owner, conv, turn)
        reply = Reply(1, "hello", 1, MessageStatus.COMPLETE, Usage(5, 0, 1))
        await store.turns.finish_turn(owner, conv, turn, claim.lease_id, reply)
        await store.turns.finish_turn(owner, conv, turn, claim.lease_id, reply)
        await store.turns.begin_turn(owner, conv, turn, content="hi", lease_holder="chat-2")
        regen = TurnId(str(uuid.uuid4()))
        again = await store.turns.begin_turn(owner, conv, regen, content="", lease_holder="c", regenerates=turn)
        assert isinstance(again, Claimed)
        await store.turns.finish_turn(owner, conv, regen, again.lease_id, reply)
        failed = TurnId(str(uuid.uuid4()))
        lost = await store.turns.begin_turn(owner, conv, failed, content="x", lease_holder="c")
        assert isinstance(lost, Claimed)
        await store.turns.fail_turn(owner, conv, failed, lost.lease_id)
        await store.conversations.save_summary(owner, conv, "they greeted", 1, 3)
        await store.conversations.read_conversation(owner, conv, max_messages=20)
        with_context = await store.turns.begin_turn(owner, conv, TurnId(str(uuid.uuid4())), content="more",
                                              lease_holder="c", context_messages=20)
        assert isinstance(with_context, Claimed) and with_context.context is not None
        await store.conversations.list_conversations(owner)
        await store.lifecycle.usage(owner)
        await store.lifecycle.export_user_data(owner)
        await store.lifecycle.delete_conversation(owner, conv)
        await store.lifecycle.delete_user_data(owner)
    touched = {m.group(2).lower() for s in statements for m in TABLE_REF.finditer(s)} & OWNER_TABLES
    assert touched == OWNER_TABLES
    assert len(statements) > 30
    hot = {strip(s) for s in statements if s.startswith("HOT ")}
    # the claim (plain and with context), the read and the finish went through the driver and were seen
    assert any(s.startswith("INSERT INTO turns") for s in hot) and any("INSERT INTO messages" in s for s in hot)
    assert any("FROM messages" in s for s in hot) and len(hot) >= 4
    assert [p for s in statements for p in owner_violations(strip(s))] == []


def primary_keys(conn: Connection) -> dict[str, list[str]]:
    found = inspect(conn)
    return {t: found.get_pk_constraint(t)["constrained_columns"] for t in found.get_table_names()
            if t != "alembic_version"}


async def test_every_primary_key_leads_with_owner_id(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        keys = await conn.run_sync(primary_keys)
    assert set(keys) == OWNER_TABLES
    assert {t: cols[0] for t, cols in keys.items()} == {t: "owner_id" for t in OWNER_TABLES}
    assert all(table.primary_key.columns.values()[0].name == "owner_id" for table in Base.metadata.sorted_tables)
