"""The chat core on in-memory ports (tests/chat/fakes.py): every path of a turn through the state machine, in
milliseconds. Each scenario is a function that drives the core and asserts what the user saw, what the store holds
and what was freed; `test_every_transition_is_exercised` runs them all and checks that together they make every
move of `chatmesh.mesh.turn.TRANSITIONS` (so a new transition without a test fails here)."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from chatmesh.chat import context, prompt
from chatmesh.chat.core import DEFAULT_SYSTEM_PROMPTS, ChatCore, ChatOptions
from chatmesh.chat.options import TurnOptions
from chatmesh.chat.events import Blocked, Completed, TurnDelta, Failed, TurnStarted, Stopped, TurnEvent, TurnEventKind
from chatmesh.chat.ports import EngineDelta, EngineFinished, EngineStarted, FinishReason, PullSource, TurnKey
from chatmesh.mesh import errors
from chatmesh.mesh.ids import ConversationId, OwnerId, ReplicaId, TurnId
from chatmesh.mesh.turn import (
    TRANSITIONS, IllegalTransition, Move, TurnMachine, TurnRecordState, TurnState, Usage,
)
from chatmesh.store.values import MessageStatus, Role
from tests.chat.fakes import Clock, EngineLost, FakeEngine, FakeModeration, FakePeers, FakeRouter, FakeStore, \
    Script, WordRenderer, reply_script

OWNER = OwnerId("alice")
S = TurnState


@dataclass
class World:
    core: ChatCore
    store: FakeStore
    router: FakeRouter
    engine: FakeEngine
    moderation: FakeModeration
    peers: FakePeers
    clock: Clock
    moves: list[Move] = field(default_factory=list)

    async def conversation(self) -> ConversationId:
        return (await self.core.create_conversation(OWNER, "t")).conversation_id

    def key(self, conv: ConversationId, turn: str | None = None) -> TurnKey:
        return TurnKey(OWNER, conv, TurnId(turn or str(uuid.uuid4())))

    async def settled(self) -> None:
        """Every claimed turn's task has ended (its final event published, its leases freed)."""
        await asyncio.gather(*self.core.turns.tasks)

    async def turn(self, conv: ConversationId, content: str) -> list[TurnEvent]:
        """One turn under a new turn id, to its end."""
        events = await collect(self.core.send_turn(OWNER, conv, self.key(conv).turn, content))
        await self.settled()
        return events

    def idle(self) -> bool:
        return not self.router.open and self.engine.running == 0 and not self.core.turns.live


def world(**options: object) -> World:
    clock = Clock()
    store, router, engine, moderation, peers = FakeStore(clock), FakeRouter(), FakeEngine(), FakeModeration(), \
        FakePeers()
    renderer = WordRenderer()
    opt = ChatOptions(
        limits=context.PromptLimits(context_tokens=4096, prompt_cap_tokens=4096, reply_tokens=64),
        temperature=0.0, top_p=1.0, lease_ttl_ms=10_000, progress_interval_s=0.005, engine_deadline_s=5,
        instance_id="chat-a", system_prompts=dict(DEFAULT_SYSTEM_PROMPTS),
        default_prompt_version="v1", summary_threshold_tokens=10_000, keep_recent_messages=2,
        advertise_address="10.0.0.1:50051", follow_poll_s=0.001)
    for name, value in options.items():
        object.__setattr__(opt, name, value)
    moves: list[Move] = []
    core = ChatCore(store, router, engine, moderation, renderer, renderer.count, opt, peers, observe=moves.append,
                    now_ms=clock)
    return World(core, store, router, engine, moderation, peers, clock, moves)


async def fresh(**options: object) -> tuple[World, ConversationId]:
    w = world(**options)
    return w, await w.conversation()


async def collect(events: AsyncIterator[TurnEvent], stop: Callable[[list[TurnEvent]], bool] | None = None
                  ) -> list[TurnEvent]:
    out: list[TurnEvent] = []
    async for event in events:
        out.append(event)
        if stop is not None and stop(out):
            break
    return out


def held(w: World, key: TurnKey, chunks: tuple[str, ...], at: int, content: str = "Go"
         ) -> tuple[asyncio.Event, asyncio.Task[list[TurnEvent]]]:
    """Starts a turn whose engine waits before its event `at` until the returned gate is set."""
    gate = asyncio.Event()
    w.engine.scripts.append(Script(reply_script(*chunks).events, gates={at: gate}))
    return gate, asyncio.create_task(collect(w.core.send_turn(OWNER, key.conversation, key.turn, content)))


def text_of(events: list[TurnEvent]) -> str:
    return "".join(e.kind.text for e in events if isinstance(e.kind, TurnDelta))


def final_of(events: list[TurnEvent]) -> TurnEventKind:
    return events[-1].kind


def stored(w: World, conv: ConversationId) -> list[tuple[Role, str, MessageStatus]]:
    return [(m.role, m.content, m.status) for m in w.store.conversations[(OWNER, conv)].messages]


def path(w: World) -> list[tuple[TurnState, TurnState]]:
    return [(m.source, m.target) for m in w.moves]


Scenario = Callable[[], Awaitable[World]]
SCENARIOS: dict[str, Scenario] = {}


def scenario(fn: Scenario) -> Scenario:
    SCENARIOS[fn.__name__] = fn
    return fn


# ---- the happy path, replay and attach -------------------------------------------------------------------------


@scenario
async def completed_turn_is_stored_once_and_frees_everything() -> World:
    w, conv = await fresh()
    events = await w.turn(conv, "What is a block?")
    assert isinstance(events[0].kind, TurnStarted) and not events[0].kind.replayed
    assert text_of(events) == "Hello there."
    final = final_of(events)
    assert isinstance(final, Completed) and final.replica_id == "engine-0"
    assert final.usage.output_tokens == 4 and final.usage.prompt_tokens == len(w.engine.generations[0].prompt_token_ids)
    # turn.started tells the edge the prompt's size before the engine runs (what a disconnect is charged)
    assert events[0].kind.prompt_tokens == len(w.engine.generations[0].prompt_token_ids)
    assert stored(w, conv) == [(Role.USER, "What is a block?", MessageStatus.COMPLETE),
                               (Role.ASSISTANT, "Hello there.", MessageStatus.COMPLETE)]
    assert path(w) == [(S.RECEIVED, S.QUEUED), (S.QUEUED, S.PREFILL), (S.PREFILL, S.DECODE), (S.DECODE, S.STORED)]
    assert w.idle() and w.engine.closed_early == 0 and all(s.closed for s in w.moderation.screens)
    return w


@scenario
async def retry_of_a_stored_turn_replays_it_without_generating() -> World:
    w, conv = await fresh()
    key = w.key(conv)
    first = await collect(w.core.send_turn(OWNER, conv, key.turn, "Hi"))
    await w.settled()
    w.moves.clear()
    again = await collect(w.core.send_turn(OWNER, conv, key.turn, "Hi"))
    assert len(w.engine.generations) == 1 and w.router.picks == 2 and w.idle()  # the early pick was released
    assert isinstance(again[0].kind, TurnStarted) and again[0].kind.replayed and again[0].kind.prompt_tokens is None
    assert text_of(again) == text_of(first) and isinstance(final_of(again), Completed)
    assert final_of(again).usage == final_of(first).usage  # type: ignore[union-attr]
    assert path(w) == [(S.RECEIVED, S.REPLAYED)]
    assert len(stored(w, conv)) == 2
    return w


@scenario
async def retry_reaching_the_generating_process_attaches_to_the_live_stream() -> World:
    w, conv = await fresh()
    key = w.key(conv)
    gate, first = held(w, key, ("one", " two"), 2, "Count")
    while not w.core.turns.live or not w.core.turns.live[key].text:
        await asyncio.sleep(0)
    second = asyncio.create_task(collect(w.core.send_turn(OWNER, conv, key.turn, "Count")))
    attached = asyncio.create_task(collect(w.core.attach(OWNER, conv, key.turn, 1 + len("one"))))
    while w.core.turns.live[key].attached < 2:  # both follow the live stream before it goes on
        await asyncio.sleep(0)
    gate.set()
    a, b, c = await first, await second, await attached
    await w.settled()
    assert text_of(a) == text_of(b) == "one two" and len(w.engine.generations) == 1
    assert text_of(c) == " two" and c[0].sequence > 4  # resumed after what the client had seen
    assert isinstance(b[0].kind, TurnStarted) and b[0].kind.replayed and b[0].kind.prompt_tokens is None
    assert isinstance(a[0].kind, TurnStarted) and a[0].kind.prompt_tokens == len(w.engine.generations[0].prompt_token_ids)
    assert (S.RECEIVED, S.ATTACHED) in path(w) and path(w).count((S.RECEIVED, S.ATTACHED)) == 2
    assert w.idle()
    return w


@scenario
async def attach_to_a_stored_turn_after_a_sequence_sends_only_the_rest() -> World:
    w, conv = await fresh()
    key = w.key(conv)
    await collect(w.core.send_turn(OWNER, conv, key.turn, "Hi"))
    await w.settled()
    w.moves.clear()
    rest = await collect(w.core.attach(OWNER, conv, key.turn, 1 + len("Hello")))
    assert text_of(rest) == " there." and isinstance(final_of(rest), Completed)
    assert path(w) == [(S.RECEIVED, S.ATTACHED)]
    with pytest.raises(errors.InvalidArgument):
        await collect(w.core.attach(OWNER, conv, key.turn, -1))
    assert path(w)[-1] == (S.RECEIVED, S.REJECTED)
    return w


# ---- another process holds the turn ----------------------------------------------------------------------------


async def _held_elsewhere(w: World, conv: ConversationId, key: TurnKey, content: str, ttl_ms: int) -> None:
    """Another chat process claimed `key` (same content) and has written some progress."""
    from chatmesh.chat.ports import ClaimRequest
    from chatmesh.chat.turns import fingerprint
    claim = await w.store.begin_turn(ClaimRequest(key, fingerprint("send", content), content, "chat-b@10.0.0.2:1",
                                                  ttl_ms, None, 0))
    record = w.store.records[key]
    record.partial, record.state = "Part", TurnRecordState.RUNNING
    assert claim is not None


@scenario
async def retry_while_another_process_generates_follows_its_stored_progress() -> World:
    w, conv = await fresh()
    key = w.key(conv)
    await _held_elsewhere(w, conv, key, "Hello?", ttl_ms=60_000)
    follow = asyncio.create_task(collect(w.core.send_turn(OWNER, conv, key.turn, "Hello?")))
    for _ in range(50):
        await asyncio.sleep(0.001)
    record = w.store.records[key]
    # The holder finishes: the follower replays the stored reply from where it was.
    assert record.lease is not None
    from chatmesh.store.values import Reply
    await w.store.finish_turn(key, record.lease, Reply(1, "Part and whole", 3, MessageStatus.COMPLETE, Usage(5, 0, 3)))
    events = await follow
    assert text_of(events) == "Part and whole" and isinstance(final_of(events), Completed)
    assert events[1].kind == TurnDelta("Part")  # streamed while it was being generated
    assert len(w.engine.generations) == 0 and w.idle()
    assert path(w) == [(S.RECEIVED, S.ATTACHED)]
    return w


@scenario
async def retry_takes_over_a_turn_whose_holder_died() -> World:
    w, conv = await fresh()
    key = w.key(conv)
    await _held_elsewhere(w, conv, key, "Hello?", ttl_ms=60_000)
    w.store.records[key].partial = "Part one"
    w.engine.scripts.append(reply_script(" one", " and", " whole."))  # the last word shown is generated again
    retry = asyncio.create_task(collect(w.core.send_turn(OWNER, conv, key.turn, "Hello?")))
    while w.store.calls.count("read_turn") < 3:  # following the holder's progress
        await asyncio.sleep(0.001)
    w.clock.ms += 60_001  # the holder died: its lease lapses, unrenewed
    events = await retry
    await w.settled()
    assert isinstance(final_of(events), Completed) and len(w.engine.generations) == 1
    # The takeover continues the reply the client already has ("Part one", sent once): what it received is what
    # is stored, and the engine was asked to continue that text from its last word boundary.
    assert text_of(events) == "Part one and whole." and [e.kind for e in events[:2]] == [
        TurnStarted(True), TurnDelta("Part one")]
    assert stored(w, conv)[-1] == (Role.ASSISTANT, "Part one and whole.", MessageStatus.COMPLETE)
    assert w.engine.generations[0].prompt_token_ids[-1:] == WordRenderer.continuation("Part")
    assert [e.sequence for e in events] == sorted({e.sequence for e in events})
    assert path(w)[:2] == [(S.RECEIVED, S.ATTACHED), (S.RECEIVED, S.QUEUED)]  # the follow, then a new attempt
    assert w.idle()
    return w


@scenario
async def follower_ends_retryably_rather_than_splice_a_reply_generated_afresh() -> World:
    w, conv = await fresh()
    key = w.key(conv)
    await _held_elsewhere(w, conv, key, "Hello?", ttl_ms=60_000)
    follow = asyncio.create_task(collect(w.core.send_turn(OWNER, conv, key.turn, "Hello?")))
    while w.store.calls.count("read_turn") < 3:  # the client has "Part"
        await asyncio.sleep(0.001)
    # The holder died and a third process, whose client had nothing, re-claimed the turn and stored another reply.
    w.clock.ms += 60_001
    from chatmesh.chat.ports import ClaimRequest
    from chatmesh.chat.turns import fingerprint
    from chatmesh.store.values import Claimed, Reply
    claim = await w.store.begin_turn(ClaimRequest(key, fingerprint("send", "Hello?"), "Hello?", "chat-c@10.0.0.3:1",
                                                  60_000, None, 0))
    assert isinstance(claim, Claimed)
    await w.store.finish_turn(key, claim.lease_id, Reply(1, "Other words", 2, MessageStatus.COMPLETE, Usage(5, 0, 2)))
    events = await follow
    final = final_of(events)
    assert isinstance(final, Failed) and final.retryable and text_of(events) == "Part"  # never "PartOther words"
    assert len(w.engine.generations) == 0
    again = await collect(w.core.send_turn(OWNER, conv, key.turn, "Hello?"))  # the retry: the one stored reply
    assert text_of(again) == "Other words" and isinstance(final_of(again), Completed)
    assert path(w) == [(S.RECEIVED, S.ATTACHED), (S.RECEIVED, S.REPLAYED)] and w.idle()
    return w


@scenario
async def attach_to_a_failed_turn_elsewhere_reports_a_retryable_failure() -> World:
    w, conv = await fresh()
    key = w.key(conv)
    await _held_elsewhere(w, conv, key, "Hello?", ttl_ms=60_000)
    record = w.store.records[key]
    assert record.lease is not None
    await w.store.fail_turn(key, record.lease, "Unavailable")
    events = await collect(w.core.attach(OWNER, conv, key.turn, 0))
    final = final_of(events)
    assert isinstance(final, Failed) and final.retryable and len(w.engine.generations) == 0
    return w


# ---- rejections ------------------------------------------------------------------------------------------------


@scenario
async def bad_input_conflicts_and_nothing_to_regenerate_are_rejected_and_store_nothing() -> World:
    w, conv = await fresh()
    key = w.key(conv)
    with pytest.raises(errors.InvalidArgument):
        await collect(w.core.send_turn(OWNER, conv, key.turn, "   "))
    with pytest.raises(errors.FailedPrecondition):
        await collect(w.core.regenerate(OWNER, conv, key.turn))  # no reply yet
    await collect(w.core.send_turn(OWNER, conv, key.turn, "First"))
    await w.settled()
    with pytest.raises(errors.Conflict):
        await collect(w.core.send_turn(OWNER, conv, key.turn, "Other content"))
    with pytest.raises(errors.NotFound):
        await collect(w.core.send_turn(OWNER, ConversationId(str(uuid.uuid4())), key.turn, "Hi"))
    assert path(w).count((S.RECEIVED, S.REJECTED)) == 4
    assert len(stored(w, conv)) == 2 and len(w.engine.generations) == 1 and w.idle()
    return w


@scenario
async def store_down_at_the_claim_fails_the_attempt_and_holds_nothing() -> World:
    w, conv = await fresh()
    w.store.down.add("begin_turn")
    with pytest.raises(errors.Unavailable):
        await collect(w.core.send_turn(OWNER, conv, w.key(conv).turn, "Hi"))
    assert path(w) == [(S.RECEIVED, S.FAILED)]
    assert w.idle() and w.moderation.inputs_checked <= 1 and len(w.engine.generations) == 0
    return w


# ---- moderation ------------------------------------------------------------------------------------------------


@scenario
async def blocked_input_is_stored_as_blocked_and_never_reaches_an_engine() -> World:
    w, conv = await fresh()
    events = await w.turn(conv, "please BLOCKME now")
    final = final_of(events)
    assert isinstance(final, Blocked) and final.stage == "input" and final.category == "abuse"
    assert [e.kind for e in events] == [TurnStarted(False), final]  # no prompt was built: no size to report
    assert len(w.engine.generations) == 0 and w.idle()
    assert stored(w, conv) == [(Role.USER, "please BLOCKME now", MessageStatus.COMPLETE),
                               (Role.ASSISTANT, "", MessageStatus.BLOCKED)]
    assert path(w) == [(S.RECEIVED, S.BLOCKED)]
    return w


@scenario
async def moderation_down_fails_the_turn_retryably_and_stores_nothing() -> World:
    w, conv = await fresh()
    key = w.key(conv)
    w.moderation.input_down = True
    events = await collect(w.core.send_turn(OWNER, conv, key.turn, "Hi"))
    await w.settled()
    final = final_of(events)
    assert isinstance(final, Failed) and final.retryable, final  # an outage is not a verdict
    assert stored(w, conv) == [] and w.store.records[key].state is TurnRecordState.FAILED
    assert len(w.engine.generations) == 0 and w.store.records[key].usage == Usage() and w.idle()
    w.moderation.input_down = False  # back: the retry of the same turn id is checked and answered
    again = await collect(w.core.send_turn(OWNER, conv, key.turn, "Hi"))
    await w.settled()
    assert isinstance(final_of(again), Completed) and stored(w, conv)[-1][2] is MessageStatus.COMPLETE
    assert path(w) == [(S.RECEIVED, S.FAILED), (S.RECEIVED, S.QUEUED), (S.QUEUED, S.PREFILL), (S.PREFILL, S.DECODE),
                       (S.DECODE, S.STORED)]
    return w


@scenario
async def moderation_down_mid_reply_fails_the_turn_instead_of_blocking_it() -> World:
    w, conv = await fresh()
    w.moderation.output_down = True  # the output direction configured to fail closed, and the service down
    events = await w.turn(conv, "Say it")
    final = final_of(events)
    assert isinstance(final, Failed) and final.retryable and stored(w, conv) == []
    assert path(w)[-1] == (S.DECODE, S.FAILED) and w.idle() and w.engine.closed_early == 1
    return w


@scenario
async def blocked_output_stops_the_stream_and_stores_only_what_was_shown() -> World:
    w, conv = await fresh()
    w.engine.scripts.append(reply_script("Fine", " then", " BADWORD", " more"))
    events = await w.turn(conv, "Say it")
    final = final_of(events)
    assert isinstance(final, Blocked) and final.stage == "output"
    assert text_of(events) == "Fine then" and stored(w, conv)[-1] == (Role.ASSISTANT, "Fine then",
                                                                      MessageStatus.BLOCKED)
    assert path(w)[-1] == (S.DECODE, S.BLOCKED)
    assert w.idle() and w.engine.closed_early == 1  # the engine sequence was cancelled
    return w


# ---- stop and disconnect ---------------------------------------------------------------------------------------


async def _stopped_at(gate_index: int) -> tuple[World, ConversationId, list[TurnEvent]]:
    w, conv = await fresh()
    key = w.key(conv)
    gate, task = held(w, key, ("a", " b", " c"), gate_index, "Go")
    while w.engine.running == 0:
        await asyncio.sleep(0)
    for _ in range(5):
        await asyncio.sleep(0)
    assert await w.core.stop(OWNER, conv, key.turn)
    events = await task
    await w.settled()
    assert not await w.core.stop(OWNER, conv, key.turn)  # nothing left to stop
    final = final_of(events)
    assert isinstance(final, Stopped)
    assert stored(w, conv)[-1] == (Role.ASSISTANT, text_of(events), MessageStatus.STOPPED)
    assert w.idle() and w.engine.closed_early == 1
    return w, conv, events


def _stop_scenario(name: str, gate_index: int, shown: str, source: TurnState) -> None:
    """A stop at one point of the stream: before the engine admits the prompt, during prefill, mid-reply."""

    async def run() -> World:
        w, _, events = await _stopped_at(gate_index)
        assert text_of(events) == shown and path(w)[-1] == (source, S.STOPPED)
        return w

    SCENARIOS[name] = run


_stop_scenario("stop_before_the_engine_admits_the_prompt", 0, "", S.QUEUED)
_stop_scenario("stop_during_prefill", 1, "", S.PREFILL)
_stop_scenario("stop_mid_reply_stores_what_the_user_saw", 2, "a", S.DECODE)


@scenario
async def engine_cancelling_the_sequence_counts_as_stopped() -> World:
    w, conv = await fresh()
    w.engine.scripts.append(reply_script("partial", reason=FinishReason.CANCELLED))
    events = await w.turn(conv, "Go")
    assert isinstance(final_of(events), Stopped) and stored(w, conv)[-1][2] is MessageStatus.STOPPED
    assert path(w)[-1] == (S.DECODE, S.STOPPED)
    return w


@scenario
async def client_disconnect_stops_the_turn_and_frees_the_sequence() -> World:
    w, conv = await fresh()
    gate = asyncio.Event()
    w.engine.scripts.append(Script(reply_script("x", " y").events, gates={2: gate}))
    stream = w.core.send_turn(OWNER, conv, w.key(conv).turn, "Go")
    seen = await collect(stream, stop=lambda got: isinstance(got[-1].kind, TurnDelta))
    await stream.aclose()  # type: ignore[attr-defined]  # the client went away
    await w.settled()
    assert text_of(seen) == "x" and stored(w, conv)[-1] == (Role.ASSISTANT, "x", MessageStatus.STOPPED)
    assert path(w)[-1] == (S.DECODE, S.STOPPED) and w.idle() and w.engine.closed_early == 1
    return w


@scenario
async def shutdown_releases_a_turn_it_cuts_off_for_the_retry_elsewhere() -> World:
    w, conv = await fresh()
    key = w.key(conv)
    gate = asyncio.Event()
    w.engine.scripts.append(Script(reply_script("x", " y").events, gates={2: gate}))
    stream = w.core.send_turn(OWNER, conv, key.turn, "Go")
    seen = await collect(stream, stop=lambda got: isinstance(got[-1].kind, TurnDelta))
    w.core.mark_draining()  # SIGTERM: the grace ran out with the turn still streaming; its RPC is cancelled
    await stream.aclose()  # type: ignore[attr-defined]
    await w.settled()
    assert text_of(seen) == "x" and stored(w, conv) == []  # not stored cut short as stopped
    assert w.store.records[key].state is TurnRecordState.FAILED and w.store.records[key].lease is None
    assert path(w)[-1] == (S.DECODE, S.FAILED) and w.idle() and w.engine.closed_early == 1
    return w


@scenario
async def stop_reaching_another_process_is_forwarded_to_the_lease_holder() -> World:
    w, conv = await fresh()
    key = w.key(conv)
    await _held_elsewhere(w, conv, key, "Hello?", ttl_ms=60_000)
    assert await w.core.stop(OWNER, conv, key.turn)
    assert w.peers.stops == [("10.0.0.2:1", key)]
    return w


# ---- failures --------------------------------------------------------------------------------------------------


async def _failing(script: Script) -> tuple[World, ConversationId, TurnKey, list[TurnEvent]]:
    w, conv = await fresh()
    key = w.key(conv)
    w.engine.scripts.append(script)
    events = await collect(w.core.send_turn(OWNER, conv, key.turn, "Go"))
    await w.settled()
    final = final_of(events)
    assert isinstance(final, Failed) and final.retryable
    assert stored(w, conv) == [] and w.store.records[key].state is TurnRecordState.FAILED and w.idle()
    return w, conv, key, events


@scenario
async def engine_lost_before_admitting_fails_and_the_retry_generates_once() -> World:
    w, conv, key, _ = await _failing(Script([EngineLost()]))
    assert path(w)[-1] == (S.QUEUED, S.FAILED)
    retry = await collect(w.core.send_turn(OWNER, conv, key.turn, "Go"))
    await w.settled()
    assert isinstance(final_of(retry), Completed) and len(w.engine.generations) == 2
    assert len(stored(w, conv)) == 2
    return w


@scenario
async def replica_unreachable_before_its_first_event_is_left_for_another_within_the_turn() -> World:
    """A replica chat cannot reach (restarted and not reconnected to yet, or dead) generated nothing and sent
    nothing: the turn asks the router again without it and completes there, one attempt, no retry needed."""
    w, conv = await fresh()
    w.router.replica_ids.append(ReplicaId("engine-1"))
    w.engine.unreachable.add("addr-engine-0")
    events = await w.turn(conv, "Go")
    final = final_of(events)
    assert isinstance(final, Completed) and final.replica_id == "engine-1" and text_of(events) == "Hello there."
    assert w.engine.addresses == ["addr-engine-0", "addr-engine-1"] and len(w.engine.generations) == 1
    assert w.router.excluded == [(), (ReplicaId("engine-0"),)]
    assert sum(isinstance(e.kind, TurnStarted) for e in events) == 1  # one attempt, as the client sees it
    assert path(w) == [(S.RECEIVED, S.QUEUED), (S.QUEUED, S.PREFILL), (S.PREFILL, S.DECODE), (S.DECODE, S.STORED)]
    assert stored(w, conv)[-1] == (Role.ASSISTANT, "Hello there.", MessageStatus.COMPLETE)
    assert w.idle()  # both router leases released
    return w


@scenario
async def a_pull_source_the_router_names_goes_to_the_engine_with_the_pick_that_named_it() -> World:
    """The router names a source when the turn moves off the replica caching its prefix (issue 29): the engine
    call carries the source of the pick it runs on; a reroute carries its own pick's source, not the first's."""
    w, conv = await fresh()
    e0, e1 = ReplicaId("engine-0"), ReplicaId("engine-1")
    w.router.replica_ids.append(e1)
    w.router.sources = {e0: PullSource(ReplicaId("engine-9"), "addr-engine-9"), e1: PullSource(e0, "addr-engine-0")}
    w.engine.unreachable.add("addr-engine-0")
    final = final_of(await w.turn(conv, "Go"))
    assert isinstance(final, Completed) and final.replica_id == "engine-1"
    assert [g.source for g in w.engine.generations] == [PullSource(e0, "addr-engine-0")]
    w.engine.unreachable.clear()
    w.router.sources = {}
    assert isinstance(final_of(await w.turn(conv, "Again")), Completed)
    assert w.engine.generations[-1].source is None  # a pick that names none: the engine prefills what it lacks
    return w


@scenario
async def every_replica_unreachable_fails_the_turn_retryably_after_trying_each() -> World:
    w, conv = await fresh()
    w.router.replica_ids += [ReplicaId("engine-1"), ReplicaId("engine-2"), ReplicaId("engine-3")]
    w.engine.unreachable |= {f"addr-engine-{i}" for i in range(4)}
    key = w.key(conv)
    events = await collect(w.core.send_turn(OWNER, conv, key.turn, "Go"))
    await w.settled()
    final = final_of(events)
    assert isinstance(final, Failed) and final.retryable and "engine-2" in final.message
    # the first pick and MAX_REROUTES more, each without the replicas tried before
    assert w.router.excluded == [(), ("engine-0",), ("engine-0", "engine-1")]
    assert stored(w, conv) == [] and w.store.records[key].state is TurnRecordState.FAILED
    assert path(w) == [(S.RECEIVED, S.QUEUED), (S.QUEUED, S.FAILED)] and w.idle()
    w.engine.unreachable.clear()  # back: the retry of the same turn id generates it
    retry = await collect(w.core.send_turn(OWNER, conv, key.turn, "Go"))
    await w.settled()
    assert isinstance(final_of(retry), Completed) and len(w.engine.generations) == 1
    return w


@scenario
async def a_turn_stopped_while_its_replica_is_unreachable_ends_stopped() -> World:
    """The caller went away as the replica failed: the turn is rerouted but stops at once (nothing was shown,
    nothing generated), as a stop before any engine admits the prompt does."""
    w, conv = await fresh()
    w.router.replica_ids.append(ReplicaId("engine-1"))
    w.engine.unreachable.add("addr-engine-0")
    key = w.key(conv)
    w.engine.on_unreachable = lambda: w.core.turns.live[key].stop_requested.set()
    events = await collect(w.core.send_turn(OWNER, conv, key.turn, "Go"))
    await w.settled()
    assert isinstance(final_of(events), Stopped) and text_of(events) == ""
    assert stored(w, conv)[-1] == (Role.ASSISTANT, "", MessageStatus.STOPPED)
    assert path(w)[-1] == (S.QUEUED, S.STOPPED) and w.idle()
    return w


@scenario
async def engine_error_during_prefill_fails_the_turn() -> World:
    w, *_ = await _failing(Script([EngineStarted(0), EngineFinished(FinishReason.ERROR, 0, "out of memory")]))
    assert path(w)[-1] == (S.PREFILL, S.FAILED)
    return w


@scenario
async def engine_lost_mid_reply_stores_nothing() -> World:
    w, _, _, events = await _failing(Script([EngineStarted(0), EngineDelta("half", 1), EngineLost()]))
    assert text_of(events) == "half" and path(w)[-1] == (S.DECODE, S.FAILED)
    return w


@scenario
async def stream_ending_without_a_finish_fails_the_turn() -> World:
    w, *_ = await _failing(Script([EngineStarted(0), EngineDelta("half", 1)]))
    assert path(w)[-1] == (S.DECODE, S.FAILED)
    return w


@scenario
async def lease_taken_over_stops_the_stream_and_stores_nothing_here() -> World:
    w, conv = await fresh()
    key = w.key(conv)
    gate, task = held(w, key, ("x", " y"), 2, "Go")
    while not w.store.calls.count("update_turn_progress"):
        await asyncio.sleep(0.001)
    w.store.renew_refused = True
    events = await task
    await w.settled()
    final = final_of(events)
    assert isinstance(final, Failed) and final.retryable and stored(w, conv) == []
    assert "fail_turn" not in w.store.calls  # the new holder's claim is not ours to release
    assert path(w)[-1] == (S.DECODE, S.FAILED) and w.idle()
    return w


@scenario
async def store_down_at_the_finish_fails_the_turn_instead_of_storing_it() -> World:
    w, conv = await fresh()
    w.store.down.add("finish_turn")
    events = await w.turn(conv, "Go")
    assert isinstance(final_of(events), Failed) and path(w)[-1] == (S.DECODE, S.FAILED)
    assert stored(w, conv) == [] and w.idle()
    return w


# ---- replies without text, regenerate, summaries, deletion -------------------------------------------------------


@scenario
async def reply_with_no_text_is_stored_from_prefill() -> World:
    w, conv = await fresh()
    w.engine.scripts.append(Script([EngineStarted(0), EngineFinished(FinishReason.STOP, 1)]))
    events = await w.turn(conv, "Say nothing")
    assert isinstance(final_of(events), Completed) and path(w)[-1] == (S.PREFILL, S.STORED)
    assert stored(w, conv)[-1] == (Role.ASSISTANT, "", MessageStatus.COMPLETE)
    return w


@scenario
async def regenerate_replaces_the_last_reply_and_its_retry_replays() -> World:
    w, conv = await fresh()
    await collect(w.core.send_turn(OWNER, conv, w.key(conv).turn, "Question"))
    w.engine.scripts.append(reply_script("Another", " answer"))
    regen = w.key(conv)
    events = await collect(w.core.regenerate(OWNER, conv, regen.turn))
    await w.settled()
    assert text_of(events) == "Another answer"
    # The regenerated prompt ends after the user message: the old reply is not replayed.
    assert w.engine.generations[1].prompt_token_ids == w.engine.generations[0].prompt_token_ids
    messages = w.store.conversations[(OWNER, conv)].messages
    assert [(m.content, m.superseded) for m in messages] == [("Question", False), ("Hello there.", True),
                                                            ("Another answer", False)]
    again = await collect(w.core.regenerate(OWNER, conv, regen.turn))
    assert text_of(again) == "Another answer" and len(w.engine.generations) == 2
    return w


@scenario
async def summary_is_made_at_the_boundary_and_prompts_stay_stable_after_it() -> World:
    w, conv = await fresh(summary_threshold_tokens=8, keep_recent_messages=2)
    for n in range(3):
        await collect(w.core.send_turn(OWNER, conv, w.key(conv).turn, f"message number {n} with words"))
    await w.settled()
    summary = w.store.conversations[(OWNER, conv)].summary
    assert summary is not None and summary.text == "Hello there."  # the engine's reply to the summary prompt
    summaries = [g for g in w.engine.generations if g.request_id.startswith("summary-")]
    assert len(summaries) == 1 and summaries[0].turn is None
    # Two builds of the next prompt agree, and it starts with the system prompt and the summary.
    a = await w.core.next_prompt(OWNER, conv, "next")
    b = await w.core.next_prompt(OWNER, conv, "next")
    sp = context.Speaker
    assert a == b == WordRenderer().render([
        (sp.SYSTEM, DEFAULT_SYSTEM_PROMPTS["v1"]), (sp.SYSTEM, context.SUMMARY_HEADER + "Hello there."),
        (sp.USER, "message number 1 with words"), (sp.ASSISTANT, "Hello there."),
        (sp.USER, "message number 2 with words"), (sp.ASSISTANT, "Hello there."), (sp.USER, "next")])
    assert summary.covers_through_index == 1  # the first exchange; the last two messages stay verbatim
    assert w.idle()
    return w


async def test_a_turn_over_its_allowance_is_refused_before_its_summary_is_written() -> None:
    """chat.proto: over its allowance, a turn fails before any engine work. A turn that would summarise first
    (its conversation past the threshold) is checked before the summary is written, the summary counted as long
    as one can be (prompt.STAND_IN): refused, no generation at all, no summary stored, the claim released; with
    the size the refusal named as its allowance, the same turn id summarises and runs, its prompt within it."""
    w, conv = await fresh(summary_threshold_tokens=8, keep_recent_messages=2)
    for n in range(2):
        await w.turn(conv, f"message number {n} with words")
    before = len(w.engine.generations)
    turn = w.key(conv).turn
    with pytest.raises(errors.PromptOverAllowance) as refused:
        await collect(w.core.send_turn(OWNER, conv, turn, "message number 2 with words", allowance=30))
    await w.settled()
    assert len(w.engine.generations) == before  # no summary generated (before the fix: one, then the refusal)
    assert w.store.conversations[(OWNER, conv)].summary is None and len(stored(w, conv)) == 4 and w.idle()
    bound = refused.value.prompt_tokens
    assert bound > 30 and refused.value.trailing_metadata() == ((errors.PROMPT_TOKENS_TRAILER, str(bound)),)
    events = await collect(w.core.send_turn(OWNER, conv, turn, "message number 2 with words", allowance=bound))
    await w.settled()
    summary = w.store.conversations[(OWNER, conv)].summary
    assert summary is not None and isinstance(final_of(events), Completed)
    started = next(e.kind for e in events if isinstance(e.kind, TurnStarted))
    assert started.prompt_tokens is not None and started.prompt_tokens <= bound
    # the bound is the prompt with the longest summary in its place: the real one is shorter by the difference
    words = len(prompt.STAND_IN.split()) - len(summary.text.split())
    assert started.prompt_tokens == bound - words


async def test_a_turn_whose_prompt_outgrows_the_room_is_refused_over_its_allowance_before_folding() -> None:
    """A turn that must summarise the whole conversation to fit the room (a long paste before it): with the
    summary as long as one can be it would not fit at all, so only the least its prompt can be is certain (the
    summary empty). Under that, refused with no generation; above it, the turn folds and runs."""
    limits = context.PromptLimits(context_tokens=240, prompt_cap_tokens=240, reply_tokens=20)
    w, conv = await fresh(limits=limits, keep_recent_messages=2)
    await w.turn(conv, " ".join(["pasted"] * 150))
    await w.turn(conv, "short one")
    before = len(w.engine.generations)
    new = " ".join(["asking"] * 60)
    least = len(w.core.prompts.render(await w.store.read_conversation(OWNER, conv),
                                      context.PromptSummary("", 4), new).token_ids)
    turn = w.key(conv).turn
    with pytest.raises(errors.PromptOverAllowance) as refused:
        await collect(w.core.send_turn(OWNER, conv, turn, new, allowance=least - 1))
    await w.settled()
    assert refused.value.prompt_tokens == least and len(w.engine.generations) == before
    assert w.store.conversations[(OWNER, conv)].summary is None and w.idle()
    events = await collect(w.core.send_turn(OWNER, conv, turn, new, allowance=least + 10))
    await w.settled()
    assert isinstance(final_of(events), Completed) and w.store.conversations[(OWNER, conv)].summary is not None


@scenario
async def compaction_stores_the_summary_through_the_last_reply_and_the_next_prompt_starts_from_it() -> World:
    """The Responses API's compaction (Prompts.compact): the whole conversation summarised and stored as its
    summary; the next turn's prompt is the system prompt, the stored summary and the new message, built as after
    any summary (I3); compacting again with nothing new generates nothing; a point the conversation has moved on
    from is refused and stores nothing."""
    w, conv = await fresh()
    first = await w.turn(conv, "remember the number seven")
    await w.turn(conv, "and the colour blue")
    last = w.store.conversations[(OWNER, conv)].messages[-1]
    with pytest.raises(errors.FailedPrecondition):  # the first turn is no longer the conversation's last
        await w.core.compact(OWNER, conv, w.store.conversations[(OWNER, conv)].messages[1].turn_id)
    assert w.store.conversations[(OWNER, conv)].summary is None and first
    done = await w.core.compact(OWNER, conv, last.turn_id)
    stored_summary = w.store.conversations[(OWNER, conv)].summary
    assert stored_summary is not None and stored_summary.covers_through_index == last.index
    assert done.summary.text == stored_summary.text == "Hello there." and done.prompt_tokens > 0
    again = await w.core.compact(OWNER, conv, None)
    assert again.summary == done.summary and again.prompt_tokens == 0
    assert len([g for g in w.engine.generations if g.turn is None]) == 1
    # the next turn continues the point the compaction summarised (the claim's context is the summary alone)
    await collect(w.core.send_turn(OWNER, conv, w.key(conv).turn, "next", expect_last=last.turn_id))
    await w.settled()
    sp = context.Speaker
    assert w.engine.generations[-1].prompt_token_ids == WordRenderer().render([
        (sp.SYSTEM, DEFAULT_SYSTEM_PROMPTS["v1"]), (sp.SYSTEM, context.SUMMARY_HEADER + "Hello there."),
        (sp.USER, "next")]).token_ids
    assert w.idle()
    return w


@scenario
async def a_turns_compact_threshold_summarises_before_the_services_would() -> World:
    """TurnOptions.compact_threshold_tokens (Responses' context_management): that turn summarises past its own
    threshold, here far below the service's 10,000."""
    w, conv = await fresh(keep_recent_messages=2)
    for n in range(3):
        await collect(w.core.send_turn(OWNER, conv, w.key(conv).turn, f"message number {n} with words",
                                       TurnOptions(compact_threshold_tokens=8 if n == 2 else None)))
        await w.settled()
        summary = w.store.conversations[(OWNER, conv)].summary
        assert (summary is not None) == (n == 2)
    return w


@scenario
async def prompt_n_plus_one_extends_prompt_n_with_reply_n() -> World:
    w, conv = await fresh()
    for n in range(4):
        await collect(w.core.send_turn(OWNER, conv, w.key(conv).turn, f"turn {n}"))
    await w.settled()
    prompts = [g.prompt_token_ids for g in w.engine.generations]
    renderer = WordRenderer()
    for before, after in zip(prompts, prompts[1:]):
        reply = renderer.render([(context.Speaker.ASSISTANT, "Hello there.")]).token_ids[:-1]
        assert after[:len(before) - 1] == before[:-1]  # everything but the generation prompt is kept
        assert after[len(before) - 1:len(before) - 1 + len(reply)] == reply
    # every generation names its owner: the engine salts the cache by it, so these turns share their prefix
    assert {g.owner for g in w.engine.generations} == {OWNER}
    return w


@scenario
async def each_owners_generations_and_evictions_name_that_owner() -> World:
    """The engine derives the cache salt from the owner a generation names (I1): two owners' turns, summaries
    included, name their own owner, and deleting a conversation evicts it as its owner."""
    w = world(summary_threshold_tokens=8, keep_recent_messages=2)
    bob = OwnerId("bob")
    alices = await w.conversation()
    bobs = (await w.core.create_conversation(bob, "b")).conversation_id
    for n in range(3):
        await collect(w.core.send_turn(OWNER, alices, w.key(alices).turn, f"alice asks question number {n}"))
        await collect(w.core.send_turn(bob, bobs, TurnId(str(uuid.uuid4())), f"bob asks question number {n}"))
        await w.settled()
    by_conversation = {(g.conversation, g.owner) for g in w.engine.generations}
    assert by_conversation == {(alices, OWNER), (bobs, bob)}
    assert {g.owner for g in w.engine.generations if g.turn is None} == {OWNER, bob}  # the summaries too
    await w.core.delete_conversation(bob, bobs)
    assert w.engine.evicted == [("addr-engine-0", bob, bobs)]
    return w


@scenario
async def delete_stops_live_turns_and_evicts_on_every_replica() -> World:
    w, conv = await fresh()
    w.router.replica_ids.append(ReplicaId("engine-1"))
    _, task = held(w, w.key(conv), ("x", " y"), 2)
    while not w.core.turns.live:
        await asyncio.sleep(0)
    evicted = await w.core.delete_conversation(OWNER, conv)
    events = await task
    await w.settled()
    assert isinstance(final_of(events), (Stopped, Failed))  # stopped; its store write finds no conversation
    assert evicted == 2 and sorted(a for a, _, _ in w.engine.evicted) == ["addr-engine-0", "addr-engine-1"]
    assert (OWNER, conv) not in w.store.conversations and w.idle()
    return w


# ---- the tests -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_scenario(name: str) -> None:
    await asyncio.wait_for(SCENARIOS[name](), 5)


async def test_every_transition_is_exercised() -> None:
    made: set[tuple[TurnState, TurnState]] = set()
    for run in SCENARIOS.values():
        made.update(path(await asyncio.wait_for(run(), 5)))
    table = {(source, target) for source, targets in TRANSITIONS.items() for target in targets}
    assert made <= table
    assert table - made == set(), f"transitions no test exercises: {sorted((a.value, b.value) for a, b in table - made)}"
    assert {target for _, target in made} | {S.RECEIVED} == set(TurnState)


def test_illegal_moves_raise() -> None:
    machine = TurnMachine()
    with pytest.raises(IllegalTransition):
        machine.advance(S.DECODE)
    machine.advance(S.QUEUED)
    machine.advance(S.STOPPED)
    for target in TurnState:
        with pytest.raises(IllegalTransition):
            machine.advance(target)
    assert machine.state is S.STOPPED


async def test_conversation_pages_and_limits() -> None:
    w, conv = await fresh()
    assert [c.conversation_id for c in await w.core.list_conversations(OWNER, 0)] == [conv]
    with pytest.raises(errors.InvalidArgument):
        await w.core.list_conversations(OWNER, 501)
    with pytest.raises(errors.InvalidArgument):
        await w.core.create_conversation(OWNER, "x" * 201)
    with pytest.raises(errors.InvalidArgument):
        await w.core.usage(OWNER, 367)
    await collect(w.core.send_turn(OWNER, conv, w.key(conv).turn, "Hi"))
    await w.settled()
    (day,) = await w.core.usage(OWNER, 0)
    assert day.usage.output_tokens == 4 and conv in await w.core.export(OWNER)


CORE_MODULES = ["admission", "claimed", "context", "conversations", "core", "events", "follow", "observe",
                "options", "ports", "prompt", "stream", "turns"]


def test_no_chat_core_module_imports_grpc_or_protobuf() -> None:
    folder = Path(__file__).parents[2] / "chat" / "chatmesh" / "chat"
    edges = {"clients", "service", "settings", "prompting", "__init__"}
    assert sorted(p.stem for p in folder.glob("*.py") if p.stem not in edges) == sorted(CORE_MODULES)
    for name in CORE_MODULES:
        tree = ast.parse((folder / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                imported = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for module in imported:
                assert not (module == "grpc" or module.startswith(("grpc.", "chatmesh.v1", "google.protobuf"))), \
                    f"chat/{name}.py imports {module}"
    # ... and not through what they import either.
    probe = "; ".join(f"import chatmesh.chat.{m}" for m in CORE_MODULES)
    check = (f"{probe}; import sys; bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', "
             "'chatmesh.v1', 'google.protobuf'))); print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
