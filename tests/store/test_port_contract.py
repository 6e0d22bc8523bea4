"""The store port's contract: the same scenarios on the real store and on the chat tests' fake.

The chat core's unit tests run over `tests.chat.fakes.FakeStore`; they mean something only while the fake
answers as the real store does. So every scenario here runs three times, through the port chat uses
(`chatmesh.chat.ports.StorePort`): on the fake, and on the real chain (chat's gRPC client, `GrpcStore`, over
loopback to the real StoreService servicer and store core) on SQLite and on PostgreSQL. Trust is off on that
chain (no mesh TLS, the owner field believed): what is under test is the store's answers, not the trust layer,
which tests/store/test_service.py covers.

Each scenario acts in its own conversation, so one store per subject serves them all; the clock is each
subject's own (the fake's `Clock`, the real store's `FakeClock`) and scenarios only move it forward.

`test_the_contract_fails_a_fake_whose_lease_rule_drifts` changes the fake's lease rule by one millisecond (a
lease still held at its expiry) and shows that the scenarios catch it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio

from chatmesh.chat.clients import GrpcStore
from chatmesh.chat.ports import ClaimRequest, StorePort, TurnKey
from chatmesh.mesh.errors import FailedPrecondition, NotFound
from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, TurnId
from chatmesh.mesh.owner_guard import OwnerGuard
from chatmesh.store.core import ConversationStore
from chatmesh.store.migrate import upgrade
from chatmesh.store.service import StoreServicer
from chatmesh.store.values import (
    Claim, Claimed, Conflicted, Done, InProgress, MessageStatus, Reply, Role, Seed, ToolCall, ToolResult,
    TurnRecordState, Usage,
)
from chatmesh.v1 import store_pb2_grpc
from tests.chat.fakes import Clock, FakeStore, _Record
from tests.conftest import free_port
from tests.store.conftest import FakeClock, open_backend

pytestmark = pytest.mark.asyncio(loop_scope="module")

TTL = 1000


@dataclass
class Subject:
    name: str
    store: StorePort
    advance: Callable[[int], None]


def fake_subject(store: FakeStore | None = None) -> Subject:
    clock = Clock() if store is None else store.clock
    fake = store or FakeStore(clock)

    def advance(ms: int) -> None:
        clock.ms += ms

    return Subject("fake", fake, advance)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["fake", "sqlite", "postgres"])
async def subject(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                  ) -> AsyncIterator[Subject]:
    if request.param == "fake":
        yield fake_subject()
        return
    async with open_backend(request.param, tmp_path_factory.mktemp(request.param)) as backend:
        engine = backend.engine()
        await upgrade(engine)
        clock = FakeClock()
        core = ConversationStore(engine, clock=clock)
        server = grpc.aio.server()
        store_pb2_grpc.add_StoreServiceServicer_to_server(StoreServicer(core, OwnerGuard(None)), server)
        address = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(address)
        await server.start()
        channel = grpc.aio.insecure_channel(address)
        try:
            yield Subject(request.param, GrpcStore(channel), clock.advance)
        finally:
            await channel.close(None)
            await server.stop(None)
            await core.close()
            await engine.dispose()


# ---- the scenarios: each takes a subject, acts on a conversation of its own, asserts what the port answers ----

OWNER = OwnerId("contract-owner")


def reply(text: str = "hello back", status: MessageStatus = MessageStatus.COMPLETE) -> Reply:
    return Reply(user_token_count=3, text=text, token_count=2, status=status, usage=Usage(10, 4, 2))


async def conversation(s: Subject, seed: tuple[Seed, ...] = ()) -> ConversationId:
    made, created = await s.store.create_conversation(OWNER, None, "contract", "v1", seed)
    assert created
    return made.conversation_id


def key(conv: ConversationId) -> TurnKey:
    return TurnKey(OWNER, conv, TurnId(str(uuid.uuid4())))


async def claim(s: Subject, k: TurnKey, content: str = "hi", holder: str = "chat-1", ttl: int = TTL,
                regenerates: TurnId | None = None, context: int = 0, fingerprint: str = "") -> Claim:
    return await s.store.begin_turn(ClaimRequest(k, fingerprint or f"fp:{content}:{regenerates}", content, holder,
                                                 ttl, regenerates, context))


async def claimed(s: Subject, k: TurnKey, **kw: object) -> LeaseId:
    got = await claim(s, k, **kw)  # type: ignore[arg-type]
    assert isinstance(got, Claimed), got
    return got.lease_id


async def stored(s: Subject, conv: ConversationId, content: str = "hi", answer: str = "hello back") -> TurnKey:
    k = key(conv)
    await s.store.finish_turn(k, await claimed(s, k, content=content), reply(answer))
    return k


async def one_claim_per_turn_id(s: Subject) -> None:
    conv = await conversation(s)
    k = key(conv)
    first = await claim(s, k, holder="chat-1")
    assert isinstance(first, Claimed)
    again = await claim(s, k, holder="chat-2")
    assert isinstance(again, InProgress) and again.lease_holder == "chat-1"
    assert again.lease_expires_at_ms == first.lease_expires_at_ms
    other = await claim(s, k, content="something else")
    assert isinstance(other, Conflicted) and other.stored_fingerprint == "fp:hi:None"
    contended = key(conv)
    racing = await asyncio.gather(*[claim(s, contended, holder=f"chat-{i}") for i in range(8)])
    assert sum(isinstance(r, Claimed) for r in racing) == 1
    assert all(isinstance(r, (Claimed, InProgress)) for r in racing)


async def a_lease_lapses_at_its_expiry_and_is_taken_over_once(s: Subject) -> None:
    conv = await conversation(s)
    k = key(conv)
    first = await claimed(s, k, holder="chat-1")
    s.advance(TTL - 1)
    assert isinstance(await claim(s, k, holder="chat-2"), InProgress)  # still held a millisecond before expiry
    s.advance(1)
    racing = await asyncio.gather(*[claim(s, k, holder=f"chat-{i}") for i in range(2, 8)])
    winners = [r for r in racing if isinstance(r, Claimed)]
    assert len(winners) == 1 and winners[0].lease_id != first  # at the expiry it has lapsed: one takes it over
    assert all(isinstance(r, InProgress) for r in racing if not isinstance(r, Claimed))
    record = await s.store.read_turn(k)
    assert record.state is TurnRecordState.RECEIVED and record.partial_text == ""
    with pytest.raises(FailedPrecondition):  # the lapsed holder can no longer store the turn
        await s.store.finish_turn(k, first, reply("late"))
    assert not await s.store.fail_turn(k, first, "late")
    assert not (await s.store.update_turn_progress(k, first, "late", 1, TTL)).held
    finished = await s.store.finish_turn(k, winners[0].lease_id, reply())
    assert not finished.already_finished and finished.reply.index == 1


async def a_lapsed_lease_nobody_took_still_finishes(s: Subject) -> None:
    conv = await conversation(s)
    k = key(conv)
    lease = await claimed(s, k)
    s.advance(TTL * 5)
    finished = await s.store.finish_turn(k, lease, reply())
    assert not finished.already_finished


async def progress_renews_the_lease_and_is_read_back(s: Subject) -> None:
    conv = await conversation(s)
    k = key(conv)
    lease = await claimed(s, k)
    s.advance(TTL - 100)
    progress = await s.store.update_turn_progress(k, lease, "hel", 2, TTL)
    assert progress.held
    s.advance(TTL - 100)  # past the first expiry, inside the renewed one
    busy = await claim(s, k, holder="chat-2")
    assert isinstance(busy, InProgress) and busy.lease_expires_at_ms == progress.lease_expires_at_ms
    record = await s.store.read_turn(k)
    assert (record.state, record.partial_text, record.event_sequence, record.lease_holder) == (
        TurnRecordState.RUNNING, "hel", 2, "chat-1")
    assert record.lease_expires_at_ms == progress.lease_expires_at_ms and record.reply is None
    s.advance(200)
    taken = await claimed(s, k, holder="chat-2")
    refused = await s.store.update_turn_progress(k, lease, "hello", 3, TTL)
    assert not refused.held
    assert (await s.store.read_turn(k)).lease_expires_at_ms == refused.lease_expires_at_ms  # the taker's
    assert taken != lease


async def a_turn_is_stored_once(s: Subject) -> None:
    conv = await conversation(s)
    k = key(conv)
    lease = await claimed(s, k)
    first = await s.store.finish_turn(k, lease, reply())
    second = await s.store.finish_turn(k, lease, reply("other"))
    assert not first.already_finished and second.already_finished and second.reply == first.reply
    assert not await s.store.fail_turn(k, lease, "late")  # a stored turn's lease holds nothing any more
    assert not (await s.store.update_turn_progress(k, lease, "late", 9, TTL)).held
    done = await claim(s, k)
    assert isinstance(done, Done) and done.reply == first.reply and done.usage == Usage(10, 4, 2)
    history = await s.store.read_conversation(OWNER, conv)
    assert [(m.index, m.role, m.content, m.status) for m in history.messages] == [
        (0, Role.USER, "hi", MessageStatus.COMPLETE), (1, Role.ASSISTANT, "hello back", MessageStatus.COMPLETE)]
    assert history.conversation.message_count == 2
    record = await s.store.read_turn(k)
    assert record.state is TurnRecordState.STORED and record.reply == first.reply and record.usage == Usage(10, 4, 2)


async def a_stopped_reply_is_stored_as_stopped(s: Subject) -> None:
    conv = await conversation(s)
    k = key(conv)
    finished = await s.store.finish_turn(k, await claimed(s, k), reply("Par", MessageStatus.STOPPED))
    assert finished.reply.status is MessageStatus.STOPPED
    assert (await s.store.read_turn(k)).state is TurnRecordState.STOPPED


async def a_failed_turn_keeps_nothing_and_may_be_claimed_again(s: Subject) -> None:
    conv = await conversation(s)
    k = key(conv)
    lease = await claimed(s, k)
    assert await s.store.fail_turn(k, lease, "engine lost")
    assert not await s.store.fail_turn(k, lease, "again")
    assert (await s.store.read_turn(k)).state is TurnRecordState.FAILED
    with pytest.raises(FailedPrecondition):
        await s.store.finish_turn(k, lease, reply())
    assert (await s.store.read_conversation(OWNER, conv)).messages == []
    retry = await claimed(s, k)
    assert retry != lease
    assert (await s.store.finish_turn(k, retry, reply())).reply.index == 1


async def a_regenerate_supersedes_the_last_reply_only(s: Subject) -> None:
    conv = await conversation(s)
    first = await stored(s, conv, "one", "first answer")
    regen = key(conv)
    lease = await claimed(s, regen, content="", regenerates=first.turn)
    finished = await s.store.finish_turn(regen, lease, reply("second answer"))
    assert finished.reply.index == 2
    again = key(conv)
    await s.store.finish_turn(again, await claimed(s, again, content="", regenerates=regen.turn), reply("third"))
    history = await s.store.read_conversation(OWNER, conv)
    assert [(m.role, m.content, m.superseded) for m in history.messages] == [
        (Role.USER, "one", False), (Role.ASSISTANT, "first answer", True), (Role.ASSISTANT, "second answer", True),
        (Role.ASSISTANT, "third", False)]
    later = await stored(s, conv, "two", "later answer")
    with pytest.raises(FailedPrecondition):  # only the reply to the last user message
        await claim(s, key(conv), content="", regenerates=first.turn)
    stale = key(conv)
    lease = await claimed(s, stale, content="", regenerates=later.turn)
    await stored(s, conv, "three")  # a user message lands between the regenerate's claim and its finish
    with pytest.raises(FailedPrecondition):
        await s.store.finish_turn(stale, lease, reply("stale"))
    last = (await s.store.read_conversation(OWNER, conv)).messages[-1]
    assert last.role is Role.ASSISTANT
    regen = key(conv)  # regenerating the last turn supersedes its reply only, not the earlier exchanges'
    await s.store.finish_turn(regen, await claimed(s, regen, content="", regenerates=last.turn_id), reply("new"))
    history = await s.store.read_conversation(OWNER, conv)
    assert [(m.content, m.superseded) for m in history.messages if m.role is Role.ASSISTANT] == [
        ("first answer", True), ("second answer", True), ("third", False), ("later answer", False),
        ("hello back", True), ("new", False)]


async def a_claim_again_keeps_the_first_options_and_the_reply_shown(s: Subject) -> None:
    """A record claimed again hands the new attempt what it holds: the first claim's options (a retry's own are
    ignored) and the reply an earlier attempt showed, with `taken_over` only when a lapsed lease was taken."""
    conv = await conversation(s)
    k = key(conv)

    async def begin(options: str, holder: str) -> Claim:
        return await s.store.begin_turn(ClaimRequest(k, "fp:opts", "hi", holder, TTL, None, 0, options=options))

    first = await begin('{"seed": 1}', "chat-1")
    assert isinstance(first, Claimed) and first.options == "" and first.resume_text == "" and not first.taken_over
    assert await s.store.fail_turn(k, first.lease_id, "engine lost", shown="Hel")
    retry = await begin('{"seed": 2}', "chat-2")
    assert isinstance(retry, Claimed) and (retry.options, retry.resume_text, retry.taken_over) == (
        '{"seed": 1}', "Hel", False)
    assert (await s.store.update_turn_progress(k, retry.lease_id, "Hello", 4, TTL)).held
    s.advance(TTL)  # chat-2's lease lapses: chat-3 takes the turn over, continuing what chat-2 showed
    taken = await begin('{"seed": 3}', "chat-3")
    assert isinstance(taken, Claimed) and (taken.options, taken.resume_text, taken.taken_over) == (
        '{"seed": 1}', "Hello", True)


async def only_a_stored_turn_is_regenerated(s: Subject) -> None:
    conv = await conversation(s)
    with pytest.raises(NotFound):
        await claim(s, key(conv), content="", regenerates=TurnId(str(uuid.uuid4())))
    pending = key(conv)
    await claimed(s, pending)
    with pytest.raises(FailedPrecondition):
        await claim(s, key(conv), content="", regenerates=pending.turn)


async def unknown_conversations_and_turns_are_not_found(s: Subject) -> None:
    nowhere = ConversationId(str(uuid.uuid4()))
    with pytest.raises(NotFound):
        await claim(s, key(nowhere))
    with pytest.raises(NotFound):
        await s.store.read_conversation(OWNER, nowhere)
    conv = await conversation(s)
    with pytest.raises(NotFound):
        await s.store.read_turn(key(conv))
    with pytest.raises(NotFound):
        await s.store.finish_turn(key(conv), LeaseId(str(uuid.uuid4())), reply())
    with pytest.raises(NotFound):
        await s.store.fail_turn(key(conv), LeaseId(str(uuid.uuid4())), "x")


async def a_claim_carries_the_whole_context(s: Subject) -> None:
    seed = (Seed(Role.USER, "earlier question", 2), Seed(Role.ASSISTANT, "earlier answer", 2))
    conv = await conversation(s, seed)
    got = await claim(s, key(conv), context=10)
    assert isinstance(got, Claimed) and got.context is not None
    assert [(m.index, m.role, m.content) for m in got.context.messages] == [
        (0, Role.USER, "earlier question"), (1, Role.ASSISTANT, "earlier answer")]
    plain = await claim(s, key(conv))
    assert isinstance(plain, Claimed) and plain.context is None


async def a_claims_context_starts_after_the_summary(s: Subject) -> None:
    seed = tuple(Seed(Role.USER if i % 2 == 0 else Role.ASSISTANT, f"message {i}", 2) for i in range(4))
    conv = await conversation(s, seed)
    summary = await s.store.save_summary(OWNER, conv, "the first exchange", 1, 3)
    assert summary.covers_through_index == 1
    got = await claim(s, key(conv), context=10)
    assert isinstance(got, Claimed) and got.context is not None
    assert got.context.summary is not None and got.context.summary.text == "the first exchange"
    assert [(m.index, m.content) for m in got.context.messages] == [(2, "message 2"), (3, "message 3")]
    whole = await s.store.read_conversation(OWNER, conv)
    assert [m.index for m in whole.messages] == [0, 1, 2, 3] and whole.summary == got.context.summary


async def usage_counts_stored_turns(s: Subject) -> None:
    owner_conv = await conversation(s)
    before = await s.store.usage(OWNER, 30)
    await stored(s, owner_conv)
    await stored(s, owner_conv, "again")
    halted = key(owner_conv)  # a stopped reply is a stored turn too, billed for what it generated
    await s.store.finish_turn(halted, await claimed(s, halted, content="halt"), reply("Par", MessageStatus.STOPPED))
    failed = key(owner_conv)
    await s.store.fail_turn(failed, await claimed(s, failed), "gone")
    await claimed(s, key(owner_conv))  # still running
    after = await s.store.usage(OWNER, 30)
    turns = sum(d.turns for d in after) - sum(d.turns for d in before)
    output = sum(d.usage.output_tokens for d in after) - sum(d.usage.output_tokens for d in before)
    assert (turns, output) == (3, 6)


async def a_running_turn_is_not_deleted(s: Subject) -> None:
    conv = await conversation(s)
    k = key(conv)
    lease = await claimed(s, k)
    with pytest.raises(FailedPrecondition):
        await s.store.delete_turn(k)
    await s.store.finish_turn(k, lease, reply())
    assert await s.store.delete_turn(k) == [conv]
    assert (await s.store.read_conversation(OWNER, conv)).messages == []
    with pytest.raises(NotFound):
        await s.store.delete_turn(k)


async def deleting_reaches_every_record_of_what_it_deletes(s: Subject) -> None:
    """A conversation id is created once; deleting a turn takes its regenerations with it, a failed turn is not
    there to delete, and a deleted conversation's turn records go too: the same id created again starts clean."""
    conv = ConversationId(str(uuid.uuid4()))
    made, created = await s.store.create_conversation(OWNER, conv, "contract", "v1", (Seed(Role.USER, "seeded", 2),))
    assert created and made.conversation_id == conv
    again, created = await s.store.create_conversation(OWNER, conv, "other", "v2", ())
    assert not created and (again.title, again.system_prompt_version) == ("contract", "v1")
    seeded = (await s.store.read_conversation(OWNER, conv)).messages
    assert [(m.role, m.content, m.status) for m in seeded] == [(Role.USER, "seeded", MessageStatus.COMPLETE)]
    asked = await stored(s, conv, "question", "answer")
    regen = key(conv)
    await s.store.finish_turn(regen, await claimed(s, regen, content="", regenerates=asked.turn), reply("better"))
    failed = key(conv)
    assert await s.store.fail_turn(failed, await claimed(s, failed), "engine lost")
    with pytest.raises(NotFound):
        await s.store.delete_turn(failed)
    assert await s.store.delete_turn(asked) == [conv]
    assert [m.content for m in (await s.store.read_conversation(OWNER, conv)).messages] == ["seeded"]
    kept = await stored(s, conv, "kept", "kept answer")
    assert await s.store.delete_conversation(OWNER, conv) == [conv]
    with pytest.raises(NotFound):
        await s.store.read_conversation(OWNER, conv)
    _, created = await s.store.create_conversation(OWNER, conv, "contract", "v1", ())
    assert created
    fresh = await claim(s, kept, content="kept")  # the old record went with the conversation
    assert isinstance(fresh, Claimed)


async def a_tool_round_trip_is_stored_turn_by_turn(s: Subject) -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    result = ToolResult("call_1", '{"celsius": 21}')
    conv = await conversation(s, (Seed(Role.USER, "Weather?"), Seed(Role.ASSISTANT, "", tool_calls=(call,)),
                                  Seed(Role.TOOL, "", tool_results=(result,)), Seed(Role.ASSISTANT, "21.")))
    asks = key(conv)
    await s.store.finish_turn(asks, await claimed(s, asks, content="And Rome?"),
                              Reply(3, "", 5, MessageStatus.COMPLETE, Usage(10, 0, 5), tool_calls=(call,)))
    answers = key(conv)
    got = await s.store.begin_turn(ClaimRequest(answers, "fp:tool", "", "chat-1", TTL, None, 0,
                                                tool_results=(result,)))
    assert isinstance(got, Claimed)
    await s.store.finish_turn(answers, got.lease_id, reply("22."))
    view = await s.store.read_conversation(OWNER, conv)
    assert [(m.role, m.tool_calls, m.tool_results) for m in view.messages] == [
        (Role.USER, (), ()), (Role.ASSISTANT, (call,), ()), (Role.TOOL, (), (result,)), (Role.ASSISTANT, (), ()),
        (Role.USER, (), ()), (Role.ASSISTANT, (call,), ()), (Role.TOOL, (), (result,)), (Role.ASSISTANT, (), ())]
    done = await claim(s, asks, content="And Rome?")
    assert isinstance(done, Done) and done.reply.tool_calls == (call,)
    with pytest.raises(FailedPrecondition):  # a tool message came after that reply's question
        await claim(s, key(conv), content="", regenerates=asks.turn)


SCENARIOS: list[Callable[[Subject], Awaitable[None]]] = [
    one_claim_per_turn_id, a_lease_lapses_at_its_expiry_and_is_taken_over_once,
    a_lapsed_lease_nobody_took_still_finishes, progress_renews_the_lease_and_is_read_back, a_turn_is_stored_once,
    a_stopped_reply_is_stored_as_stopped, a_failed_turn_keeps_nothing_and_may_be_claimed_again,
    a_claim_again_keeps_the_first_options_and_the_reply_shown,
    a_regenerate_supersedes_the_last_reply_only, only_a_stored_turn_is_regenerated,
    unknown_conversations_and_turns_are_not_found, a_claim_carries_the_whole_context,
    a_claims_context_starts_after_the_summary, usage_counts_stored_turns,
    a_running_turn_is_not_deleted, deleting_reaches_every_record_of_what_it_deletes,
    a_tool_round_trip_is_stored_turn_by_turn,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
async def test_the_port_answers_alike(subject: Subject, scenario: Callable[[Subject], Awaitable[None]]) -> None:
    await scenario(subject)


class DriftedLease(FakeStore):
    """The fake with its lease rule off by one millisecond: a lease still held AT its expiry."""

    @staticmethod
    def live(record: _Record, now: float) -> bool:
        return record.state in (TurnRecordState.RECEIVED, TurnRecordState.RUNNING) and record.expires_ms >= now


async def test_the_contract_fails_a_fake_whose_lease_rule_drifts() -> None:
    await a_lease_lapses_at_its_expiry_and_is_taken_over_once(fake_subject())  # the fake as it is passes
    with pytest.raises(AssertionError):
        await a_lease_lapses_at_its_expiry_and_is_taken_over_once(fake_subject(DriftedLease(Clock())))
