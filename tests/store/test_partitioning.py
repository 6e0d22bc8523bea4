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
TABLE_REF = re.compile(r"\b(?:FROM|INTO|UPDATE|JOIN)\s+\"?(\w+)\"?", re.IGNORECASE)


@contextmanager
def recorded(engine: AsyncEngine) -> Iterator[list[str]]:
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(" ".join(statement.split()))

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", record)


def owner_violations(statement: str) -> list[str]:
    """Why `statement` is not owner-scoped, or [] when it is."""
    tables = {t.lower() for t in TABLE_REF.findall(statement)} & OWNER_TABLES
    if not tables:
        return []
    verb = statement.split()[0].upper()
    problems = []
    if verb == "INSERT":
        columns = statement[statement.index("(") + 1:statement.index(")")]
        if "owner_id" not in columns.split(", ")[0]:
            problems.append(f"INSERT without owner_id leading its columns: {statement[:120]}")
    where = re.split(r"\bWHERE\b", statement, maxsplit=1, flags=re.IGNORECASE)
    read_tables = tables if verb != "INSERT" else {t.lower() for t in re.findall(
        r"\bFROM\s+\"?(\w+)\"?", statement, re.IGNORECASE)} & OWNER_TABLES
    for table in read_tables:
        if len(where) < 2 or not re.search(rf"\b{table}\.owner_id = ", where[1]):
            problems.append(f"{verb} on {table} without {table}.owner_id in its WHERE: {statement[:160]}")
    return problems


def test_checker_catches_unscoped_statements() -> None:
    assert owner_violations("SELECT turns.state FROM turns WHERE turns.turn_id = ?")
    assert owner_violations("DELETE FROM messages WHERE messages.conversation_id = ?")
    assert owner_violations("UPDATE conversations SET title=?")
    assert owner_violations("INSERT INTO usage_days (day, owner_id) VALUES (?, ?)")
    assert not owner_violations("SELECT turns.state FROM turns WHERE turns.owner_id = ? AND turns.turn_id = ?")
    assert not owner_violations("BEGIN IMMEDIATE")


async def test_every_statement_of_a_turn_delete_and_export_is_owner_scoped(
        store: ConversationStore, engine: AsyncEngine) -> None:
    owner = OwnerId("alice")
    with recorded(engine) as statements:
        conv = (await store.insert_conversation(owner, "t", "v1")).conversation_id
        turn = TurnId(str(uuid.uuid4()))
        claim = await store.begin_turn(owner, conv, turn, content="hi", lease_holder="chat-1")
        assert isinstance(claim, Claimed)
        await store.begin_turn(owner, conv, turn, content="hi", lease_holder="chat-2")
        await store.update_turn_progress(owner, conv, turn, claim.lease_id, "hel", 1)
        await store.read_turn(owner, conv, turn)
        reply = Reply(1, "hello", 1, MessageStatus.COMPLETE, Usage(5, 0, 1))
        await store.finish_turn(owner, conv, turn, claim.lease_id, reply)
        await store.finish_turn(owner, conv, turn, claim.lease_id, reply)
        await store.begin_turn(owner, conv, turn, content="hi", lease_holder="chat-2")
        regen = TurnId(str(uuid.uuid4()))
        again = await store.begin_turn(owner, conv, regen, content="", lease_holder="c", regenerates=turn)
        assert isinstance(again, Claimed)
        await store.finish_turn(owner, conv, regen, again.lease_id, reply)
        failed = TurnId(str(uuid.uuid4()))
        lost = await store.begin_turn(owner, conv, failed, content="x", lease_holder="c")
        assert isinstance(lost, Claimed)
        await store.fail_turn(owner, conv, failed, lost.lease_id)
        await store.save_summary(owner, conv, "they greeted", 1, 3)
        await store.read_conversation(owner, conv, max_messages=20)
        await store.list_conversations(owner)
        await store.usage(owner)
        await store.export_user_data(owner)
        await store.delete_conversation(owner, conv)
        await store.delete_user_data(owner)
    touched = {t.lower() for s in statements for t in TABLE_REF.findall(s)} & OWNER_TABLES
    assert touched == OWNER_TABLES
    assert len(statements) > 30
    assert [p for s in statements for p in owner_violations(s)] == []


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
