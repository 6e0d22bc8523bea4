"""A turn keeps its word across attempts (issue 33), on in-memory ports (tests/chat/fakes.py): every attempt that
claims a turn again generates with the options its record kept and continues the reply an earlier attempt showed
(a takeover, a failure mid-reply), billing the reply once; a client that went away having been shown nothing
releases its turn instead of storing an empty stopped reply; a backend that cannot continue a reply exactly fails
the turn retryable and the retry generates afresh, never a splice. A conversation longer than the model's context
is summarised before its turns (the threshold derived from the model's room), so every turn answers."""

from __future__ import annotations

import asyncio

import pytest

from chatmesh.chat import context
from chatmesh.chat.events import Completed, TurnDelta, Failed, TurnStarted, TurnEvent
from chatmesh.chat.options import TurnOptions
from chatmesh.chat.ports import ClaimRequest, EngineDelta, EngineStarted, TurnKey
from chatmesh.chat.prompt import SUMMARY_MAX_TOKENS, ThresholdRefused, summary_threshold
from chatmesh.chat.turns import fingerprint
from chatmesh.mesh.turn import TurnRecordState
from chatmesh.store.values import MessageStatus, Role
from tests.chat.fakes import EngineLost, Script, WordRenderer, reply_script
from tests.chat.test_core import OWNER, World, collect, final_of, fresh, held, stored, text_of


async def _claimed_elsewhere(w: World, key: TurnKey, content: str, options: TurnOptions, partial: str) -> None:
    """Another chat process claimed `key` with `options`, showed `partial`, and went quiet (its lease runs on)."""
    await w.store.begin_turn(ClaimRequest(key, fingerprint("send", content), content, "chat-b@10.0.0.2:1", 60_000,
                                          None, 0, options.to_json()))
    record = w.store.records[key]
    record.partial, record.state = partial, TurnRecordState.RUNNING


async def _taken_over(w: World, key: TurnKey, content: str, options: TurnOptions = TurnOptions()) -> list[TurnEvent]:
    """A retry of `key` that follows the holder's progress until its lease lapses, then takes the turn over."""
    retry = asyncio.create_task(collect(w.core.send_turn(OWNER, key.conversation, key.turn, content, options)))
    while w.store.calls.count("read_turn") < 3:
        await asyncio.sleep(0.001)
    w.clock.ms += 60_001  # the holder stopped renewing: paused or dead
    events = await retry
    await w.settled()
    return events


async def test_a_takeover_generates_with_the_stored_options_and_bills_the_reply_once() -> None:
    w, conv = await fresh()
    key = w.key(conv)
    asked = TurnOptions(temperature=0.7, top_p=0.9, seed=7, max_tokens=20)
    await _claimed_elsewhere(w, key, "Hello?", asked, "Part one")
    w.engine.scripts.append(reply_script(" one", " and", " whole.", cached=3))  # its last word generated again
    # The retry reaching this process names other options (a client that changed them, or none at all): the
    # record's win, so the rest of the reply is sampled as its first part was.
    events = await _taken_over(w, key, "Hello?", TurnOptions(temperature=0.1, seed=1, max_tokens=64))
    assert text_of(events) == "Part one and whole." and isinstance(final_of(events), Completed)
    g = w.engine.generations[0]
    resumed = WordRenderer.continuation("Part")  # up to the last word boundary (claimed.resumable)
    assert (g.temperature, g.top_p, g.seed) == (0.7, 0.9, 7)
    assert g.resumed_tokens == len(resumed) and g.prompt_token_ids[-len(resumed):] == resumed
    assert g.max_tokens == 20 - len(resumed)  # the cap covers the whole reply, the part already shown included
    assert stored(w, conv)[-1] == (Role.ASSISTANT, "Part one and whole.", MessageStatus.COMPLETE)
    final = final_of(events)
    assert isinstance(final, Completed)
    # One bill: the shown part is output (generated once, by the first holder), not prompt.
    new_output = sum(1 + c.count(" ") for c in (" one", " and", " whole."))
    assert final.usage.output_tokens == len(resumed) + new_output
    assert final.usage.prompt_tokens == len(g.prompt_token_ids) - len(resumed)
    assert final.usage.cached_prompt_tokens == 3
    assert w.store.records[key].usage == final.usage and w.store.records[key].options == ""  # cleared when stored
    # The holder whose lease lapsed may only be paused: its sequence was cancelled on every replica first.
    assert w.engine.cancelled_turns == [("addr-engine-0", key.turn)]
    assert w.idle()


async def test_a_turn_failed_mid_reply_is_continued_by_its_retry_with_its_own_seed() -> None:
    w, conv = await fresh()
    key = w.key(conv)
    w.engine.scripts.append(Script([EngineStarted(0), EngineDelta("Half way", 2), EngineLost()]))
    first = await collect(w.core.send_turn(OWNER, conv, key.turn, "Go", TurnOptions(temperature=0.9)))
    await w.settled()
    final = final_of(first)
    assert isinstance(final, Failed) and final.retryable and text_of(first) == "Half way"
    record = w.store.records[key]
    assert record.state is TurnRecordState.FAILED and record.partial == "Half way"  # what the client was shown
    seed = w.engine.generations[0].seed
    assert TurnOptions.from_json(record.options).seed == seed  # a sampled turn got a seed, stored with it
    w.engine.scripts.append(reply_script(" way", " done."))
    again = await collect(w.core.send_turn(OWNER, conv, key.turn, "Go"))  # the retry sends no options
    await w.settled()
    assert text_of(again) == "Half way done." and isinstance(final_of(again), Completed)
    g = w.engine.generations[1]
    assert (g.seed, g.temperature) == (seed, 0.9) and g.resumed_tokens == 1
    assert stored(w, conv)[-1] == (Role.ASSISTANT, "Half way done.", MessageStatus.COMPLETE)
    assert w.engine.cancelled_turns == []  # a failed attempt left no sequence behind: nothing to cancel
    assert w.idle()


async def test_greedy_turns_get_no_seed_and_sampled_ones_a_seed_each() -> None:
    w, conv = await fresh()
    await w.turn(conv, "Greedy")
    assert w.engine.generations[0].seed == 0
    w, conv = await fresh(temperature=0.8)  # sampling by default
    await w.turn(conv, "Sampled")
    await w.turn(conv, "Sampled again")
    seeds = [g.seed for g in w.engine.generations]
    assert all(seeds) and seeds[0] != seeds[1]  # two sends of a prompt are not the same draw


async def test_a_disconnect_before_any_text_releases_the_turn_and_the_retry_generates() -> None:
    w, conv = await fresh()
    key = w.key(conv)
    gate = asyncio.Event()
    w.engine.scripts.append(Script(reply_script("x", " y").events, gates={1: gate}))  # held before any text
    stream = w.core.send_turn(OWNER, conv, key.turn, "Go")
    seen = await collect(stream, stop=lambda got: isinstance(got[-1].kind, TurnStarted))
    await stream.aclose()  # type: ignore[attr-defined]  # the stream was cut at the response headers
    await w.settled()
    assert text_of(seen) == "" and stored(w, conv) == []  # no empty stopped reply to replay
    record = w.store.records[key]
    assert record.state is TurnRecordState.FAILED and record.partial == "" and w.idle()
    retry = await collect(w.core.send_turn(OWNER, conv, key.turn, "Go"))
    await w.settled()
    assert text_of(retry) == "Hello there." and isinstance(final_of(retry), Completed)
    assert w.engine.generations[1].resumed_tokens == 0 and len(stored(w, conv)) == 2


async def test_the_edge_releases_a_turn_whose_client_saw_none_of_the_text_published() -> None:
    w, conv = await fresh()
    key = w.key(conv)
    gate = asyncio.Event()
    w.engine.scripts.append(Script(reply_script("x", " y").events, gates={2: gate}))
    stream = w.core.send_turn(OWNER, conv, key.turn, "Go")
    seen = await collect(stream, stop=lambda got: isinstance(got[-1].kind, TurnDelta))
    assert text_of(seen) == "x"  # published, but the edge never wrote it to its client
    assert await w.core.release(OWNER, conv, key.turn)
    await stream.aclose()  # type: ignore[attr-defined]
    await w.settled()
    record = w.store.records[key]
    assert stored(w, conv) == [] and record.state is TurnRecordState.FAILED and record.partial == ""
    retry = await collect(w.core.send_turn(OWNER, conv, key.turn, "Go"))
    await w.settled()
    assert text_of(retry) == "Hello there." and w.engine.generations[1].resumed_tokens == 0


async def test_a_released_turn_another_stream_follows_goes_on_for_it() -> None:
    w, conv = await fresh()
    key = w.key(conv)
    gate, first = held(w, key, ("x", " y"), 2, "Go")
    while not w.core.turns.live or not w.core.turns.live[key].text:
        await asyncio.sleep(0)
    retry = asyncio.create_task(collect(w.core.send_turn(OWNER, conv, key.turn, "Go")))  # the SDK's retry
    while not w.core.turns.live[key].attached:
        await asyncio.sleep(0)
    assert await w.core.release(OWNER, conv, key.turn)
    first.cancel()  # the first client's stream goes away
    await asyncio.wait([first])  # and is gone before the engine goes on
    gate.set()
    events = await retry
    await w.settled()
    assert text_of(events) == "x y" and isinstance(final_of(events), Completed)
    assert stored(w, conv)[-1] == (Role.ASSISTANT, "x y", MessageStatus.COMPLETE) and len(w.engine.generations) == 1


async def test_a_release_reaching_another_process_is_forwarded_to_the_lease_holder() -> None:
    w, conv = await fresh()
    key = w.key(conv)
    await _claimed_elsewhere(w, key, "Hello?", TurnOptions(), "")
    assert await w.core.release(OWNER, conv, key.turn)
    assert w.peers.releases == [("10.0.0.2:1", key)] and w.peers.stops == []


async def test_a_backend_that_cannot_continue_exactly_fails_the_turn_and_the_retry_starts_afresh() -> None:
    w, conv = await fresh()
    key = w.key(conv)
    await _claimed_elsewhere(w, key, "Hello?", TurnOptions(temperature=0.7, seed=3), "Part one")
    w.engine.refuse_resume = True
    events = await _taken_over(w, key, "Hello?")
    final = final_of(events)
    assert isinstance(final, Failed) and final.retryable and text_of(events) == "Part one"  # never + other text
    record = w.store.records[key]
    assert record.state is TurnRecordState.FAILED and record.partial == "" and stored(w, conv) == []
    again = await collect(w.core.send_turn(OWNER, conv, key.turn, "Hello?"))
    await w.settled()
    assert text_of(again) == "Hello there." and isinstance(final_of(again), Completed)
    assert w.engine.generations[-1].resumed_tokens == 0 and w.engine.generations[-1].seed == 3


async def test_a_reply_already_at_its_cap_is_stored_without_generating_more() -> None:
    w, conv = await fresh()
    key = w.key(conv)
    await _claimed_elsewhere(w, key, "Hello?", TurnOptions(max_tokens=2), "Part two")  # 2 tokens: the cap, shown
    events = await _taken_over(w, key, "Hello?")
    final = final_of(events)
    assert isinstance(final, Completed) and final.finish_reason == "length" and text_of(events) == "Part two"
    assert w.engine.generations == [] and final.usage.output_tokens == 2
    assert stored(w, conv)[-1] == (Role.ASSISTANT, "Part two", MessageStatus.COMPLETE) and w.idle()


# ---- summaries before the context runs out ------------------------------------------------------------------


def test_the_summary_threshold_is_derived_from_the_room_and_a_setting_above_it_is_refused() -> None:
    smollm2 = context.PromptLimits(context_tokens=8192, prompt_cap_tokens=131072, reply_tokens=256)
    llama = context.PromptLimits(context_tokens=131072, prompt_cap_tokens=131072, reply_tokens=256)
    assert summary_threshold(smollm2, 0) == 3968  # half of 8192 - 256
    assert summary_threshold(llama, 0) == 12_000  # the reference's figure where the model has the room
    assert summary_threshold(smollm2, 5000) == 5000
    with pytest.raises(ThresholdRefused, match="above the prompt room of 7936 tokens"):
        summary_threshold(smollm2, 12_000)  # the old default: never fired before the prompt stopped fitting


def _long(n: int, word: str = "word") -> str:
    return " ".join(f"{word}{i}" for i in range(n))


async def test_a_conversation_past_the_context_is_summarised_and_every_turn_answers() -> None:
    limits = context.PromptLimits(context_tokens=600, prompt_cap_tokens=600, reply_tokens=64)  # room 536
    w, conv = await fresh(limits=limits, summary_threshold_tokens=summary_threshold(limits, 0), keep_recent_messages=4)
    for n in range(12):  # ~150 words a turn: the history passes the context after four
        events = await w.turn(conv, _long(150, f"t{n}w"))
        assert isinstance(final_of(events), Completed), (n, final_of(events))
    summaries = [g for g in w.engine.generations if g.turn is None]
    assert len(summaries) >= 3 and w.store.conversations[(OWNER, conv)].summary is not None
    assert all(len(g.prompt_token_ids) <= 536 for g in w.engine.generations if g.turn is not None)


async def test_recent_messages_that_outgrow_the_room_are_summarised_before_the_turn() -> None:
    limits = context.PromptLimits(context_tokens=600, prompt_cap_tokens=600, reply_tokens=64)
    w, conv = await fresh(limits=limits, summary_threshold_tokens=summary_threshold(limits, 0), keep_recent_messages=6)
    await w.turn(conv, "short")
    await w.turn(conv, _long(400, "paste"))  # a paste that fits alone, kept verbatim by the threshold rule
    events = await w.turn(conv, _long(200, "next"))  # with the paste it would not fit: folded first
    assert isinstance(final_of(events), Completed)
    summary = w.store.conversations[(OWNER, conv)].summary
    assert summary is not None and summary.covers_through_index == 3  # everything before the new message
    summariser = [g for g in w.engine.generations if g.turn is None][-1]
    assert len(summariser.prompt_token_ids) <= 600 - SUMMARY_MAX_TOKENS  # its transcript cut to fit


async def test_only_a_new_message_that_cannot_fit_alone_is_refused() -> None:
    limits = context.PromptLimits(context_tokens=600, prompt_cap_tokens=600, reply_tokens=64)
    w, conv = await fresh(limits=limits, summary_threshold_tokens=summary_threshold(limits, 0))
    await w.turn(conv, "hello")
    events = await w.turn(conv, _long(560))
    final = final_of(events)
    assert isinstance(final, Failed) and not final.retryable and "shorten the message" in final.message
    assert isinstance(final_of(await w.turn(conv, "and now a short one")), Completed)  # the conversation lives on
