"""Deletion reaches every row (checked by direct SQL), purge removes exactly what is past retention, export,
usage per day, and summaries."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from chatmesh.mesh.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, TurnId
from chatmesh.store.clock import DAY_MS
from chatmesh.store.core import ConversationStore
from chatmesh.store.db import make_engine
from chatmesh.store.values import Claimed, MessageStatus, Reply, Usage
from tests.store.conftest import FakeClock

ALICE, BOB = OwnerId("alice"), OwnerId("bob")
TABLES = ("conversations", "messages", "turns")


async def stored_turn(store: ConversationStore, owner: OwnerId, conv: ConversationId, content: str = "hi",
                      reply: str = "hello") -> TurnId:
    turn = TurnId(str(uuid.uuid4()))
    claim = await store.turns.begin_turn(owner, conv, turn, content=content, lease_holder="chat-1")
    assert isinstance(claim, Claimed)
    await store.turns.finish_turn(owner, conv, turn, claim.lease_id,
                            Reply(2, reply, 3, MessageStatus.COMPLETE, Usage(10, 4, 3)))
    return turn


async def pending_turn(store: ConversationStore, owner: OwnerId, conv: ConversationId) -> TurnId:
    turn = TurnId(str(uuid.uuid4()))
    assert isinstance(await store.turns.begin_turn(owner, conv, turn, content="pending", lease_holder="c"), Claimed)
    return turn


async def rows(engine: AsyncEngine, table: str, column: str, value: str) -> int:
    async with engine.connect() as conn:
        count: int = (await conn.execute(text(f"SELECT count(*) FROM {table} WHERE {column} = :v"),
                                         {"v": value})).scalar_one()
    return count


async def test_delete_conversation_leaves_no_row(store: ConversationStore, engine: AsyncEngine) -> None:
    gone = (await store.conversations.insert_conversation(ALICE)).conversation_id
    kept = (await store.conversations.insert_conversation(ALICE)).conversation_id
    for conv in (gone, kept):
        await stored_turn(store, ALICE, conv)
        await pending_turn(store, ALICE, conv)
    await store.conversations.save_summary(ALICE, gone, "a summary", 0, 2)
    assert [await rows(engine, t, "conversation_id", gone) for t in TABLES] == [1, 2, 2]
    assert await store.lifecycle.delete_conversation(ALICE, gone) == [gone]
    assert [await rows(engine, t, "conversation_id", gone) for t in TABLES] == [0, 0, 0]
    assert [await rows(engine, t, "conversation_id", kept) for t in TABLES] == [1, 2, 2]
    assert await rows(engine, "usage_days", "owner_id", ALICE) == 1  # numbers only, kept
    with pytest.raises(NotFound):
        await store.lifecycle.delete_conversation(ALICE, gone)


async def test_delete_user_data_leaves_no_row_of_the_owner(store: ConversationStore, engine: AsyncEngine) -> None:
    mine = [(await store.conversations.insert_conversation(ALICE)).conversation_id for _ in range(3)]
    theirs = (await store.conversations.insert_conversation(BOB)).conversation_id
    for conv in mine:
        await stored_turn(store, ALICE, conv)
    await pending_turn(store, ALICE, mine[0])
    await stored_turn(store, BOB, theirs)
    assert sorted(await store.lifecycle.delete_user_data(ALICE)) == sorted(mine)
    for table in (*TABLES, "usage_days"):
        assert await rows(engine, table, "owner_id", ALICE) == 0
        assert await rows(engine, table, "owner_id", BOB) >= 1
    assert await store.lifecycle.delete_user_data(ALICE) == []


async def test_purge_removes_exactly_what_is_past_retention(store: ConversationStore, engine: AsyncEngine,
                                                            clock: FakeClock) -> None:
    old = (await store.conversations.insert_conversation(ALICE)).conversation_id
    await stored_turn(store, ALICE, old)
    abandoned = await pending_turn(store, BOB, (bob_conv := (await store.conversations.insert_conversation(BOB)).conversation_id))
    clock.advance(1)
    boundary = (await store.conversations.insert_conversation(ALICE)).conversation_id  # idle exactly the retention period
    clock.advance(10 * DAY_MS)
    fresh_turn = await stored_turn(store, BOB, bob_conv)  # bob's conversation is active again
    clock.advance(20 * DAY_MS)
    purged = await store.lifecycle.purge_expired()
    assert purged.conversations == [(ALICE, old)]
    assert purged.abandoned_turns == 1
    assert [await rows(engine, t, "conversation_id", old) for t in TABLES] == [0, 0, 0]
    assert await rows(engine, "turns", "turn_id", abandoned) == 0
    assert await rows(engine, "turns", "turn_id", fresh_turn) == 1
    assert await rows(engine, "conversations", "conversation_id", boundary) == 1
    assert await rows(engine, "messages", "conversation_id", bob_conv) == 2
    clock.advance(1)
    assert (await store.lifecycle.purge_expired()).conversations == [(ALICE, boundary)]
    assert (await store.lifecycle.purge_expired()).conversations == []


async def test_export_is_the_owners_data_only(store: ConversationStore) -> None:
    conv = (await store.conversations.insert_conversation(ALICE, "greetings", "v1")).conversation_id
    await stored_turn(store, ALICE, conv, "héllo", "hi!")
    await store.conversations.save_summary(ALICE, conv, "a greeting", 1, 3)
    pending = await pending_turn(store, ALICE, conv)
    other = (await store.conversations.insert_conversation(BOB)).conversation_id
    await stored_turn(store, BOB, other, "secret", "shh")
    document = json.loads(json.dumps(await store.lifecycle.export_user_data(ALICE)))
    assert document["owner_id"] == "alice" and len(document["conversations"]) == 1
    [exported] = document["conversations"]
    assert exported["conversation_id"] == conv and exported["title"] == "greetings"
    assert [(m["role"], m["content"]) for m in exported["messages"]] == [("user", "héllo"), ("assistant", "hi!")]
    assert exported["summary"]["text"] == "a greeting"
    assert [(t["turn_id"], t["content"]) for t in exported["unfinished_turns"]] == [(pending, "pending")]
    assert document["usage"][0]["turns"] == 1
    assert "secret" not in json.dumps(document)


async def test_usage_per_day_newest_first(store: ConversationStore, clock: FakeClock) -> None:
    conv = (await store.conversations.insert_conversation(ALICE)).conversation_id
    await stored_turn(store, ALICE, conv)
    clock.advance(DAY_MS)
    await stored_turn(store, ALICE, conv)
    await stored_turn(store, ALICE, conv)
    days = await store.lifecycle.usage(ALICE, days=2)
    assert [(d.turns, d.usage) for d in days] == [(2, Usage(20, 8, 6)), (1, Usage(10, 4, 3))]
    assert days[0].day > days[1].day
    assert len(await store.lifecycle.usage(ALICE, days=1)) == 1
    assert await store.lifecycle.usage(BOB) == []


async def test_summary_and_windowed_reads(store: ConversationStore) -> None:
    conv = (await store.conversations.insert_conversation(ALICE)).conversation_id
    for i in range(3):
        await stored_turn(store, ALICE, conv, f"q{i}", f"a{i}")
    assert (await store.conversations.read_conversation(ALICE, conv)).summary is None
    await store.conversations.save_summary(ALICE, conv, "q0 and q1 were asked", 3, 7)
    history = await store.conversations.read_conversation(ALICE, conv, from_index=4)
    assert history.summary is not None and history.summary.covers_through_index == 3
    assert [m.content for m in history.messages] == ["q2", "a2"]
    assert [m.index for m in (await store.conversations.read_conversation(ALICE, conv, max_messages=3)).messages] == [3, 4, 5]
    with pytest.raises(FailedPrecondition):
        await store.conversations.save_summary(ALICE, conv, "older", 1, 2)
    with pytest.raises(InvalidArgument, match="past the last message"):
        await store.conversations.save_summary(ALICE, conv, "future", 6, 2)
    with pytest.raises(NotFound):
        await store.conversations.save_summary(BOB, conv, "not yours", 1, 2)
    listed = await store.conversations.list_conversations(ALICE)
    assert [c.conversation_id for c in listed] == [conv] and listed[0].message_count == 6


async def test_an_unreachable_database_is_unavailable() -> None:
    engine = make_engine("postgresql+asyncpg://postgres@127.0.0.1:1/test", pool_size=1)  # nothing listens there
    store = ConversationStore(engine)
    try:
        with pytest.raises(Unavailable):
            await store.conversations.list_conversations(ALICE)
        with pytest.raises(Unavailable):
            await store.conversations.insert_conversation(ALICE)
        conv, turn = ConversationId(str(uuid.uuid4())), TurnId(str(uuid.uuid4()))
        with pytest.raises(Unavailable):  # the backend's calls, through the driver
            await store.turns.begin_turn(ALICE, conv, turn, content="hi", lease_holder="c", context_messages=5)
        with pytest.raises(Unavailable):
            await store.conversations.read_conversation(ALICE, conv, max_messages=20)
        with pytest.raises(Unavailable):
            await store.turns.finish_turn(ALICE, conv, turn, LeaseId(str(uuid.uuid4())),
                                    Reply(1, "r", 1, MessageStatus.COMPLETE, Usage()))
    finally:
        await store.close()
        await engine.dispose()
