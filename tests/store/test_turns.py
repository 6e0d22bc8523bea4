"""The turn claim (I2) on both backends: exactly one winner under concurrent retries, conflicts, expired
leases, finish-once, fail-then-retry, regenerate."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from chatmesh.mesh.errors import FailedPrecondition, InvalidArgument, NotFound
from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, TurnId
from chatmesh.store.core import ConversationStore
from chatmesh.store.values import (
    Claim, Claimed, Conflicted, Done, InProgress, MessageStatus, Reply, Role, TurnRecordState, Usage,
)
from tests.store.conftest import Backend, FakeClock

OWNER = OwnerId("alice")


def new_turn() -> TurnId:
    return TurnId(str(uuid.uuid4()))


def reply(text: str = "hello back", status: MessageStatus = MessageStatus.COMPLETE) -> Reply:
    return Reply(user_token_count=3, text=text, token_count=2, status=status,
                 usage=Usage(prompt_tokens=10, cached_prompt_tokens=4, output_tokens=2))


async def conversation(store: ConversationStore, owner: OwnerId = OWNER) -> ConversationId:
    return (await store.conversations.insert_conversation(owner, "t", "v1")).conversation_id


async def claim(store: ConversationStore, conv: ConversationId, turn: TurnId, content: str = "hi",
                holder: str = "chat-1", **kw: object) -> Claim:
    return await store.turns.begin_turn(OWNER, conv, turn, content=content, lease_holder=holder, **kw)  # type: ignore[arg-type]


async def test_fifty_concurrent_claims_one_winner(store: ConversationStore) -> None:
    conv = await conversation(store)
    turn = new_turn()
    outcomes = await asyncio.gather(*[claim(store, conv, turn, holder=f"chat-{i}") for i in range(50)])
    claimed = [o for o in outcomes if isinstance(o, Claimed)]
    assert len(claimed) == 1
    assert all(isinstance(o, InProgress) for o in outcomes if not isinstance(o, Claimed))
    finished = await store.turns.finish_turn(OWNER, conv, turn, claimed[0].lease_id, reply())
    assert not finished.already_finished
    after = await asyncio.gather(*[claim(store, conv, turn) for _ in range(50)])
    assert all(isinstance(o, Done) and o.reply.content == "hello back" for o in after)
    done = after[0]
    assert isinstance(done, Done) and done.usage == Usage(10, 4, 2)


async def test_same_turn_other_content_conflicts(store: ConversationStore) -> None:
    conv = await conversation(store)
    turn = new_turn()
    assert isinstance(await claim(store, conv, turn, "hi"), Claimed)
    outcome = await claim(store, conv, turn, "something else")
    assert isinstance(outcome, Conflicted) and outcome.stored_fingerprint


async def test_expired_lease_won_by_exactly_one_racer(store: ConversationStore, clock: FakeClock) -> None:
    conv = await conversation(store)
    turn = new_turn()
    first = await claim(store, conv, turn, lease_ttl_ms=1000)
    assert isinstance(first, Claimed)
    clock.advance(1001)
    outcomes = await asyncio.gather(*[claim(store, conv, turn, holder=f"chat-{i}") for i in range(20)])
    winners = [o for o in outcomes if isinstance(o, Claimed)]
    assert len(winners) == 1 and winners[0].lease_id != first.lease_id
    assert all(isinstance(o, InProgress) for o in outcomes if not isinstance(o, Claimed))
    with pytest.raises(FailedPrecondition):  # the crashed holder's lease is gone
        await store.turns.finish_turn(OWNER, conv, turn, first.lease_id, reply())
    assert not (await store.turns.finish_turn(OWNER, conv, turn, winners[0].lease_id, reply())).already_finished


async def test_finish_twice_is_a_noop_that_says_so(store: ConversationStore) -> None:
    conv = await conversation(store)
    turn = new_turn()
    c = await claim(store, conv, turn)
    assert isinstance(c, Claimed)
    first, second = await asyncio.gather(store.turns.finish_turn(OWNER, conv, turn, c.lease_id, reply()),
                                         store.turns.finish_turn(OWNER, conv, turn, c.lease_id, reply("other")))
    assert sorted([first.already_finished, second.already_finished]) == [False, True]
    assert first.reply == second.reply
    history = await store.conversations.read_conversation(OWNER, conv)
    assert [(m.index, m.role, m.content) for m in history.messages] == [
        (0, Role.USER, "hi"), (1, Role.ASSISTANT, first.reply.content)]
    [day] = await store.lifecycle.usage(OWNER)
    assert day.turns == 1 and day.usage == Usage(10, 4, 2)


async def test_fail_releases_for_retry(store: ConversationStore) -> None:
    conv = await conversation(store)
    turn = new_turn()
    c = await claim(store, conv, turn)
    assert isinstance(c, Claimed)
    assert await store.turns.fail_turn(OWNER, conv, turn, c.lease_id, "engine lost")
    assert not await store.turns.fail_turn(OWNER, conv, turn, c.lease_id, "again")
    assert (await store.turns.read_turn(OWNER, conv, turn)).state is TurnRecordState.FAILED
    assert (await store.conversations.read_conversation(OWNER, conv)).messages == []
    retry = await claim(store, conv, turn)
    assert isinstance(retry, Claimed) and retry.lease_id != c.lease_id
    await store.turns.finish_turn(OWNER, conv, turn, retry.lease_id, reply())
    assert len((await store.conversations.read_conversation(OWNER, conv)).messages) == 2


async def test_progress_and_read_turn(store: ConversationStore, clock: FakeClock) -> None:
    conv = await conversation(store)
    turn = new_turn()
    c = await claim(store, conv, turn, lease_ttl_ms=1000)
    assert isinstance(c, Claimed)
    clock.advance(900)
    p = await store.turns.update_turn_progress(OWNER, conv, turn, c.lease_id, "hel", 2, lease_ttl_ms=1000)
    assert p.held and p.lease_expires_at_ms == clock.now_ms + 1000
    clock.advance(500)  # past the first expiry, within the renewed one
    assert isinstance(await claim(store, conv, turn), InProgress)
    record = await store.turns.read_turn(OWNER, conv, turn)
    assert (record.state, record.partial_text, record.event_sequence) == (TurnRecordState.RUNNING, "hel", 2)
    assert not (await store.turns.update_turn_progress(OWNER, conv, turn, LeaseId(str(uuid.uuid4())), "x", 3)).held
    await store.turns.finish_turn(OWNER, conv, turn, c.lease_id, reply("hello", MessageStatus.STOPPED))
    record = await store.turns.read_turn(OWNER, conv, turn)
    assert record.state is TurnRecordState.STOPPED and record.reply is not None
    assert record.reply.status is MessageStatus.STOPPED and record.partial_text == ""


async def test_regenerate_supersedes_earlier_reply(store: ConversationStore) -> None:
    conv = await conversation(store)
    first = new_turn()
    c = await claim(store, conv, first)
    assert isinstance(c, Claimed)
    await store.turns.finish_turn(OWNER, conv, first, c.lease_id, reply("first answer"))
    regen = new_turn()
    r = await store.turns.begin_turn(OWNER, conv, regen, content="", lease_holder="chat-1", regenerates=first)
    assert isinstance(r, Claimed)
    await store.turns.finish_turn(OWNER, conv, regen, r.lease_id, reply("second answer"))
    again = new_turn()
    r2 = await store.turns.begin_turn(OWNER, conv, again, content="", lease_holder="chat-1", regenerates=regen)
    assert isinstance(r2, Claimed)
    await store.turns.finish_turn(OWNER, conv, again, r2.lease_id, reply("third answer"))
    messages = (await store.conversations.read_conversation(OWNER, conv)).messages
    assert [(m.role, m.content, m.superseded) for m in messages] == [
        (Role.USER, "hi", False), (Role.ASSISTANT, "first answer", True),
        (Role.ASSISTANT, "second answer", True), (Role.ASSISTANT, "third answer", False)]
    [day] = await store.lifecycle.usage(OWNER)
    assert day.turns == 3


async def stored_turn(store: ConversationStore, conv: ConversationId, answer: str) -> TurnId:
    turn = new_turn()
    c = await claim(store, conv, turn)
    assert isinstance(c, Claimed)
    await store.turns.finish_turn(OWNER, conv, turn, c.lease_id, reply(answer))
    return turn


async def test_concurrent_regenerates_of_one_reply_leave_one_current(store: ConversationStore) -> None:
    """Regenerates of the same reply finishing at once: each is stored once, at its own index, and every
    earlier reply is superseded, whichever order they commit in (each finish must see the others' replies)."""
    conv = await conversation(store)
    first = await stored_turn(store, conv, "original")
    regens = [new_turn() for _ in range(8)]  # more than a finish's attempts
    claims = [await store.turns.begin_turn(OWNER, conv, t, content="", lease_holder="c", regenerates=first)
              for t in regens]
    leases = [r.lease_id for r in claims if isinstance(r, Claimed)]
    assert len(leases) == len(regens)
    finished = await asyncio.gather(*[store.turns.finish_turn(OWNER, conv, t, lease, reply(f"again {i}"))
                                      for i, (t, lease) in enumerate(zip(regens, leases))])
    assert not any(f.already_finished for f in finished)
    messages = (await store.conversations.read_conversation(OWNER, conv)).messages
    assert [m.index for m in messages] == list(range(10))
    assert sorted(f.reply.index for f in finished) == list(range(2, 10))
    assert [m.superseded for m in messages[1:]] == [True] * 8 + [False]
    for t, f in zip(regens, finished):
        record = await store.turns.read_turn(OWNER, conv, t)
        assert record.state is TurnRecordState.STORED and record.reply is not None
        assert (record.reply.index, record.reply.content) == (f.reply.index, f.reply.content)
    [day] = await store.lifecycle.usage(OWNER)
    assert day.turns == 9


async def test_a_regenerate_finished_by_another_replica_or_after_a_takeover(
        make_store: Callable[..., ConversationStore], clock: FakeClock) -> None:
    """A finish does not say whether its turn is a regenerate: a store replica that did not make the claim, and a
    claim taken over after its lease expired, still store it as one (no user message, earlier replies
    superseded), once."""
    claimer, finisher = make_store(), make_store()
    conv = await conversation(claimer)
    first = await stored_turn(claimer, conv, "original")
    regen = new_turn()
    r = await claimer.turns.begin_turn(OWNER, conv, regen, content="", lease_holder="c", regenerates=first)
    assert isinstance(r, Claimed)
    finished = await finisher.turns.finish_turn(OWNER, conv, regen, r.lease_id, reply("regenerated"))
    assert not finished.already_finished and finished.reply.index == 2
    again = await finisher.turns.finish_turn(OWNER, conv, regen, r.lease_id, reply("other"))
    assert again.already_finished and again.reply == finished.reply
    taken_over = new_turn()
    expired = await claimer.turns.begin_turn(OWNER, conv, taken_over, content="", lease_holder="c", regenerates=regen,
                                       lease_ttl_ms=1000)
    assert isinstance(expired, Claimed)
    clock.advance(1001)
    r2 = await claimer.turns.begin_turn(OWNER, conv, taken_over, content="", lease_holder="d", regenerates=regen)
    assert isinstance(r2, Claimed) and r2.lease_id != expired.lease_id
    with pytest.raises(FailedPrecondition):  # the expired claim's lease is gone
        await claimer.turns.finish_turn(OWNER, conv, taken_over, expired.lease_id, reply("late"))
    assert (await claimer.turns.finish_turn(OWNER, conv, taken_over, r2.lease_id, reply("third"))).reply.index == 3
    messages = (await finisher.conversations.read_conversation(OWNER, conv)).messages
    assert [(m.role, m.content, m.superseded) for m in messages] == [
        (Role.USER, "hi", False), (Role.ASSISTANT, "original", True), (Role.ASSISTANT, "regenerated", True),
        (Role.ASSISTANT, "third", False)]
    assert (await finisher.conversations.read_conversation(OWNER, conv)).conversation.message_count == 4
    [day] = await finisher.lifecycle.usage(OWNER)
    assert day.turns == 3


async def test_regenerate_needs_a_stored_turn(store: ConversationStore) -> None:
    conv = await conversation(store)
    pending = new_turn()
    assert isinstance(await claim(store, conv, pending), Claimed)
    with pytest.raises(FailedPrecondition):
        await store.turns.begin_turn(OWNER, conv, new_turn(), content="", lease_holder="c", regenerates=pending)
    with pytest.raises(NotFound):
        await store.turns.begin_turn(OWNER, conv, new_turn(), content="", lease_holder="c", regenerates=new_turn())


async def test_bad_input_and_ownership(make_store: object, store: ConversationStore) -> None:
    conv = await conversation(store)
    with pytest.raises(InvalidArgument, match="content must not be empty"):
        await claim(store, conv, new_turn(), "")
    small = make_store(max_content_bytes=10)  # type: ignore[operator]
    with pytest.raises(InvalidArgument, match="limit of 10 bytes"):
        await claim(small, conv, new_turn(), "x" * 11)
    with pytest.raises(NotFound):  # another owner's conversation: not found, never a hint
        await store.turns.begin_turn(OwnerId("mallory"), conv, new_turn(), content="hi", lease_holder="c")
    with pytest.raises(NotFound):
        await store.conversations.read_conversation(OwnerId("mallory"), conv)
    with pytest.raises(NotFound):
        await store.lifecycle.delete_conversation(OwnerId("mallory"), conv)
    with pytest.raises(NotFound):
        await claim(store, ConversationId(str(uuid.uuid4())), new_turn())
    with pytest.raises(InvalidArgument, match="title"):
        await store.conversations.insert_conversation(OWNER, "t" * 201)


async def test_a_failed_finish_leaves_nothing_half_stored(store: ConversationStore, engine: AsyncEngine,
                                                          backend: Backend) -> None:
    conv = await conversation(store)
    turn = new_turn()
    c = await claim(store, conv, turn)
    assert isinstance(c, Claimed)
    # The database itself fails the finish's last write (the usage), whichever path sent it.
    async with engine.begin() as conn:
        if backend.name == "sqlite":
            await conn.execute(text("CREATE TRIGGER usage_fails BEFORE INSERT ON usage_days "
                                    "BEGIN SELECT RAISE(ABORT, 'disk full'); END"))
        else:
            await conn.execute(text("CREATE FUNCTION usage_fails() RETURNS trigger LANGUAGE plpgsql AS "
                                    "$$ BEGIN RAISE EXCEPTION 'disk full'; END $$"))
            await conn.execute(text("CREATE TRIGGER usage_fails BEFORE INSERT ON usage_days "
                                    "FOR EACH ROW EXECUTE FUNCTION usage_fails()"))
    with pytest.raises(Exception, match="disk full"):
        await store.turns.finish_turn(OWNER, conv, turn, c.lease_id, reply())
    history = await store.conversations.read_conversation(OWNER, conv)
    assert history.messages == [] and history.conversation.message_count == 0
    assert (await store.turns.read_turn(OWNER, conv, turn)).state is TurnRecordState.RECEIVED
    assert await store.lifecycle.usage(OWNER) == []
    async with engine.begin() as conn:
        await conn.execute(text("DROP TRIGGER usage_fails" + ("" if backend.name == "sqlite" else " ON usage_days")))
    assert not (await store.turns.finish_turn(OWNER, conv, turn, c.lease_id, reply())).already_finished
    assert len((await store.conversations.read_conversation(OWNER, conv)).messages) == 2


async def test_only_the_last_reply_can_be_regenerated(store: ConversationStore) -> None:
    conv = await conversation(store)
    first = new_turn()
    c = await claim(store, conv, first, "one")
    assert isinstance(c, Claimed)
    await store.turns.finish_turn(OWNER, conv, first, c.lease_id, reply("r1"))
    regen = new_turn()
    r = await store.turns.begin_turn(OWNER, conv, regen, content="", lease_holder="c", regenerates=first)
    assert isinstance(r, Claimed)
    second = new_turn()  # a new message is stored while the regenerate runs
    c2 = await claim(store, conv, second, "two")
    assert isinstance(c2, Claimed)
    await store.turns.finish_turn(OWNER, conv, second, c2.lease_id, reply("r2"))
    with pytest.raises(FailedPrecondition, match="last user message"):
        await store.turns.finish_turn(OWNER, conv, regen, r.lease_id, reply("r1 again"))
    with pytest.raises(FailedPrecondition, match="last user message"):
        await store.turns.begin_turn(OWNER, conv, new_turn(), content="", lease_holder="c", regenerates=first)
    assert [m.superseded for m in (await store.conversations.read_conversation(OWNER, conv)).messages] == [False] * 4
    with pytest.raises(InvalidArgument, match="lease_ttl_ms"):
        await claim(store, conv, new_turn(), lease_ttl_ms=10**18)


async def test_claim_with_context(store: ConversationStore, monkeypatch: pytest.MonkeyPatch) -> None:
    conv = await conversation(store)
    for i in range(3):
        t = new_turn()
        c = await claim(store, conv, t, f"q{i}")
        assert isinstance(c, Claimed) and c.context is None  # not asked for
        await store.turns.finish_turn(OWNER, conv, t, c.lease_id, reply(f"a{i}"))
    turn = new_turn()
    first = await claim(store, conv, turn, "q3", context_messages=4)
    assert isinstance(first, Claimed) and first.context is not None
    assert first.context.summary is None and first.context.conversation.message_count == 6
    assert [(m.index, m.content) for m in first.context.messages] == [(2, "q1"), (3, "a1"), (4, "q2"), (5, "a2")]
    again = await claim(store, conv, turn, "q3", context_messages=4)
    assert isinstance(again, InProgress)  # only a NEW claim carries context
    assert await store.turns.fail_turn(OWNER, conv, turn, first.lease_id)
    await store.conversations.save_summary(OWNER, conv, "they asked q0 and q1", 2, 7)
    retaken = await claim(store, conv, turn, "q3", context_messages=1000)  # a failed turn claimed again
    assert isinstance(retaken, Claimed) and retaken.context is not None
    assert retaken.context.summary is not None and retaken.context.summary.covers_through_index == 2
    assert [m.index for m in retaken.context.messages] == [3, 4, 5]  # only what follows the summary
    await store.turns.finish_turn(OWNER, conv, turn, retaken.lease_id, reply("a3"))
    monkeypatch.setattr("chatmesh.store.turns.MAX_CONTEXT_MESSAGES", 2)
    capped = await claim(store, conv, new_turn(), "q4", context_messages=50)
    assert isinstance(capped, Claimed) and capped.context is not None
    assert [m.content for m in capped.context.messages] == ["q3", "a3"]
    with pytest.raises(InvalidArgument, match="context_max_messages"):
        await claim(store, conv, new_turn(), "q5", context_messages=-1)
    with pytest.raises(NotFound):
        await store.turns.begin_turn(OwnerId("mallory"), conv, new_turn(), content="x", lease_holder="c",
                               context_messages=5)


async def test_concurrent_finishes_in_one_conversation_keep_indexes_dense(store: ConversationStore) -> None:
    conv = await conversation(store)
    turns = [new_turn() for _ in range(12)]
    claims = [await claim(store, conv, t, f"q-{t}") for t in turns]
    leases = [c.lease_id for c in claims if isinstance(c, Claimed)]
    assert len(leases) == len(turns)
    finished = await asyncio.gather(*[store.turns.finish_turn(OWNER, conv, t, lease, reply(f"a-{t}"))
                                      for t, lease in zip(turns, leases)])
    assert not any(f.already_finished for f in finished)
    history = await store.conversations.read_conversation(OWNER, conv)
    assert history.conversation.message_count == 24
    assert [m.index for m in history.messages] == list(range(24))
    for user, answer in zip(history.messages[::2], history.messages[1::2]):  # each turn's pair is adjacent
        assert (user.role, answer.role) == (Role.USER, Role.ASSISTANT) and user.turn_id == answer.turn_id
        assert (user.content, answer.content) == (f"q-{user.turn_id}", f"a-{user.turn_id}")
    for t, f in zip(turns, finished):
        record = await store.turns.read_turn(OWNER, conv, t)
        assert record.reply is not None and record.reply.index == f.reply.index
    [day] = await store.lifecycle.usage(OWNER)
    assert day.turns == 12 and day.usage == Usage(120, 48, 24)


async def test_a_delete_racing_finishes_leaves_no_row(store: ConversationStore, engine: AsyncEngine) -> None:
    conv = await conversation(store)
    turns = [new_turn() for _ in range(6)]
    claims = [await claim(store, conv, t) for t in turns]
    outcomes = await asyncio.gather(
        *[store.turns.finish_turn(OWNER, conv, t, c.lease_id, reply()) for t, c in zip(turns, claims)
          if isinstance(c, Claimed)],
        store.lifecycle.delete_conversation(OWNER, conv), return_exceptions=True)
    assert outcomes[-1] == [conv]
    assert all(isinstance(o, NotFound) or not isinstance(o, BaseException) for o in outcomes)
    async with engine.connect() as conn:
        for table in ("conversations", "messages", "turns"):
            left = (await conn.execute(text(f"SELECT count(*) FROM {table} WHERE conversation_id = :c"),
                                       {"c": conv})).scalar_one()
            assert left == 0, table


# PostgreSQL only: a SQLite call runs to its end in its worker thread, so nothing is cancelled mid-statement.
@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_a_call_cancelled_mid_statement_leaves_the_store_usable(
        store: ConversationStore, engine: AsyncEngine, backend: Backend) -> None:
    assert backend.name == "postgres"
    conv = await conversation(store)
    turn = new_turn()
    c = await claim(store, conv, turn)
    assert isinstance(c, Claimed)
    async with engine.begin() as conn:  # the finish's last write waits, so the cancel lands mid-statement
        await conn.execute(text("CREATE FUNCTION usage_waits() RETURNS trigger LANGUAGE plpgsql AS "
                                "$$ BEGIN PERFORM pg_sleep(2); RETURN NEW; END $$"))
        await conn.execute(text("CREATE TRIGGER usage_waits BEFORE INSERT ON usage_days "
                                "FOR EACH ROW EXECUTE FUNCTION usage_waits()"))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(store.turns.finish_turn(OWNER, conv, turn, c.lease_id, reply()), 0.3)
    async with engine.begin() as conn:
        await conn.execute(text("DROP TRIGGER usage_waits ON usage_days"))
    finished = await store.turns.finish_turn(OWNER, conv, turn, c.lease_id, reply())
    assert finished.reply.index == 1  # stored once, whether or not the cancelled statement had committed
    for _ in range(3):  # the connections the PostgreSQL backend keeps still work
        t = new_turn()
        again = await claim(store, conv, t, "next", context_messages=2)
        assert isinstance(again, Claimed) and again.context is not None
        await store.turns.finish_turn(OWNER, conv, t, again.lease_id, reply())
    assert (await store.conversations.read_conversation(OWNER, conv)).conversation.message_count == 8


# PostgreSQL only: a SQLite finish takes the write lock (BEGIN IMMEDIATE) before it reads, so nothing commits
# between its reads and its writes.
@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_a_regenerate_refused_for_a_racing_finish_is_stored_after_the_lock(
        store: ConversationStore, engine: AsyncEngine, backend: Backend) -> None:
    assert backend.name == "postgres"
    conv = await conversation(store)
    first = await stored_turn(store, conv, "original")
    regen = new_turn()
    r = await store.turns.begin_turn(OWNER, conv, regen, content="", lease_holder="c", regenerates=first)
    assert isinstance(r, Claimed)
    sent: list[str] = []
    store.db.backend.listeners.append(sent.append)
    key = {"o": OWNER, "c": conv}
    async with engine.begin() as racer:  # holds the conversation while the finish's statement waits on it
        racer_pid = (await racer.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        await racer.execute(text("SELECT 1 FROM conversations WHERE owner_id = :o AND conversation_id = :c "
                                 "FOR UPDATE"), key)
        finishing = asyncio.create_task(store.turns.finish_turn(OWNER, conv, regen, r.lease_id, reply("regenerated")))
        async with engine.connect() as watch:
            for _ in range(200):
                waiting = (await watch.execute(text(
                    "SELECT count(*) FROM pg_stat_activity WHERE :p = ANY(pg_blocking_pids(pid))"),
                    {"p": racer_pid})).scalar_one()
                if waiting:
                    break
                await asyncio.sleep(0.025)
            assert waiting == 1
        # what a racing regenerate's finish writes, committed after the waiting statement's snapshot
        await racer.execute(text(
            "INSERT INTO messages (owner_id, conversation_id, message_index, role, content, token_count, status, "
            "turn_id, created_at_ms, superseded) VALUES (:o, :c, 2, 'assistant', 'racing', 1, 'complete', :t, 0, "
            "false)"), key | {"t": new_turn()})
        await racer.execute(text("UPDATE conversations SET message_count = 3 WHERE owner_id = :o "
                                 "AND conversation_id = :c"), key)
    finished = await finishing
    store.db.backend.listeners.remove(sent.append)
    assert not finished.already_finished and finished.reply.index == 3
    kinds = ["lock" if s.startswith("SELECT FROM conversations") and s.endswith("FOR NO KEY UPDATE")
             else "finish" if s.startswith("WITH conv AS") else "other" for s in sent]
    assert kinds == ["finish", "lock", "finish"]  # refused (a finish committed after its snapshot), then stored
    messages = (await store.conversations.read_conversation(OWNER, conv)).messages
    assert [(m.content, m.superseded) for m in messages] == [
        ("hi", False), ("original", True), ("racing", True), ("regenerated", False)]


async def test_a_record_claimed_again_keeps_its_options_and_the_reply_shown(store: ConversationStore,
                                                                              clock: FakeClock) -> None:
    """Issue 33: every attempt at a turn generates with the first claim's options and continues what an earlier
    attempt showed: its last progress (a lapsed lease: taken over) or what it failed with; none once stored."""
    conv = await conversation(store)
    turn = new_turn()
    first = await claim(store, conv, turn, lease_ttl_ms=1000, options='{"seed":7,"temperature":0.7}')
    assert isinstance(first, Claimed) and (first.options, first.resume_text, first.taken_over) == ("", "", False)
    await store.turns.update_turn_progress(OWNER, conv, turn, first.lease_id, "Once upon", 10, lease_ttl_ms=1000)
    clock.advance(1001)  # the holder stopped renewing
    second = await claim(store, conv, turn, holder="chat-2", lease_ttl_ms=1000, options='{"seed":1}')
    assert isinstance(second, Claimed)
    assert (second.options, second.resume_text, second.taken_over) == (
        '{"seed":7,"temperature":0.7}', "Once upon", True)
    assert not (await store.turns.update_turn_progress(OWNER, conv, turn, first.lease_id, "Once upon a", 12)).held
    assert await store.turns.fail_turn(OWNER, conv, turn, second.lease_id, "engine lost", "Once upon a time")
    third = await claim(store, conv, turn, holder="chat-3")
    assert isinstance(third, Claimed)
    assert (third.options, third.resume_text, third.taken_over) == (
        '{"seed":7,"temperature":0.7}', "Once upon a time", False)
    assert await store.turns.fail_turn(OWNER, conv, turn, third.lease_id, "released")  # nothing shown
    fourth = await claim(store, conv, turn)
    assert isinstance(fourth, Claimed) and fourth.resume_text == "" and fourth.options != ""
    await store.turns.finish_turn(OWNER, conv, turn, fourth.lease_id, reply())
    async with store.db.single() as conn:
        kept = (await conn.execute(text("SELECT generation_options, partial_text FROM turns WHERE turn_id = :t"),
                                   {"t": turn})).one()
    assert tuple(kept) == ("", "")  # cleared with the stored turn
    with pytest.raises(InvalidArgument):
        await claim(store, conv, new_turn(), options="x" * (store.turns.limits.max_content_bytes + 65 * 1024))
