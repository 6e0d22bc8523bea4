"""Tool turns in the chat core over in-memory ports (issue 28): a reply's call is read out of the engine's text
(held back, never shown as text) and published as a ToolCalled event before a completion with finish reason
tool_calls; the call is stored with the reply, a turn answering it stores the results as a tool message of its
own, and the next prompt replays both; a replay and an attach carry the calls with the sequence numbers the live
stream had; tool_choice none reads no call; a model without a tool format refuses tools before anything is stored;
the options (tools included) survive the turn record's JSON."""

from __future__ import annotations

import json

import pytest

from chatmesh.chat.claimed import call_id
from chatmesh.chat.events import Completed, TurnDelta, TurnStarted, ToolCalled
from chatmesh.chat.options import TurnOptions
from chatmesh.mesh import errors
from chatmesh.model.tools import HERMES, ChoiceMode, ToolChoice, ToolDefinition
from chatmesh.store.values import Role, ToolResult
from tests.chat.fakes import reply_script
from tests.chat.test_core import OWNER, collect, fresh

WEATHER = ToolDefinition.of({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}})
TOOLS = TurnOptions(tools=(WEATHER,))
CALL_TEXT = HERMES.call_text("get_weather", '{"city": "Paris"}')


async def test_a_tool_round_trip() -> None:
    w, conv = await fresh()
    w.engine.scripts.append(reply_script("Checking.\n", CALL_TEXT[:9], CALL_TEXT[9:]))
    asks = w.key(conv)
    events = await collect(w.core.send_turn(OWNER, conv, asks.turn, "Weather in Paris?", TOOLS))
    await w.settled()
    kinds = [e.kind for e in events]
    assert isinstance(kinds[0], TurnStarted) and kinds[1] == TurnDelta("Checking.")  # the call's text never shows
    call = kinds[2]
    assert isinstance(call, ToolCalled) and call.index == 0
    assert (call.call.name, json.loads(call.call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.call.id == call_id(asks.turn, 0)
    assert isinstance(kinds[3], Completed) and kinds[3].finish_reason == "tool_calls"
    assert [e.sequence for e in events] == [1, 1 + len("Checking."), 2 + len("Checking."), 3 + len("Checking.")]

    w.engine.scripts.append(reply_script("It is 21 °C."))
    answers = w.key(conv)
    results = (ToolResult(call.call.id, '{"celsius": 21}'),)
    events = await collect(w.core.send_turn(OWNER, conv, answers.turn, "", TOOLS, results=results))
    await w.settled()
    assert isinstance(events[-1].kind, Completed) and events[-1].kind.finish_reason == "stop"
    stored = w.store.conversations[(OWNER, conv)].messages
    assert [(m.role, m.content, m.tool_calls, m.tool_results) for m in stored] == [
        (Role.USER, "Weather in Paris?", (), ()), (Role.ASSISTANT, "Checking.", (call.call,), ()),
        (Role.TOOL, "", (), results), (Role.ASSISTANT, "It is 21 °C.", (), ())]
    # the second prompt replayed the first one, its reply (text and call) and the results, in order (I3)
    first, second = w.engine.generations[-2].prompt_token_ids, w.engine.generations[-1].prompt_token_ids
    assert second[:len(first)] == first

    # a replay of the calling turn carries the call, numbered as the live stream numbered it
    again = await collect(w.core.send_turn(OWNER, conv, asks.turn, "Weather in Paris?", TOOLS))
    assert [(e.sequence, type(e.kind)) for e in again] == [
        (1, TurnStarted), (1 + len("Checking."), TurnDelta), (2 + len("Checking."), ToolCalled),
        (3 + len("Checking."), Completed)]
    assert isinstance(again[2].kind, ToolCalled) and again[2].kind.call == call.call
    attached = await collect(w.core.attach(OWNER, conv, asks.turn, 1 + len("Checking.")))
    assert [type(e.kind) for e in attached] == [ToolCalled, Completed]


async def test_text_that_is_no_call_comes_out_whole_and_choice_none_reads_none() -> None:
    w, conv = await fresh()
    w.engine.scripts.append(reply_script("Use <tool_call> like ", "this </tool_call>", " ok"))
    events = await collect(w.core.send_turn(OWNER, conv, w.key(conv).turn, "Explain", TOOLS))
    text = "".join(e.kind.text for e in events if isinstance(e.kind, TurnDelta))
    assert text == "Use <tool_call> like this </tool_call> ok"
    w.engine.scripts.append(reply_script(CALL_TEXT))
    none = TurnOptions(tools=(WEATHER,), tool_choice=ToolChoice(ChoiceMode.NONE))
    events = await collect(w.core.send_turn(OWNER, conv, w.key(conv).turn, "Weather?", none))
    assert not any(isinstance(e.kind, ToolCalled) for e in events)
    assert "".join(e.kind.text for e in events if isinstance(e.kind, TurnDelta)) == CALL_TEXT
    await w.settled()


async def test_required_prefills_the_call_opening() -> None:
    w, conv = await fresh()
    w.engine.scripts.append(reply_script(CALL_TEXT[len(HERMES.prefill(ToolChoice(ChoiceMode.REQUIRED))):]))
    required = TurnOptions(tools=(WEATHER,), tool_choice=ToolChoice(ChoiceMode.REQUIRED))
    events = await collect(w.core.send_turn(OWNER, conv, w.key(conv).turn, "Weather?", required))
    await w.settled()
    assert [type(e.kind) for e in events] == [TurnStarted, ToolCalled, Completed]
    prompt = w.engine.generations[-1].prompt_token_ids
    opening = w.core.prompts.renderer.continuation(HERMES.prefill(ToolChoice(ChoiceMode.REQUIRED)))
    assert opening and prompt[-len(opening):] == opening


async def test_a_model_without_a_tool_format_refuses_tools_before_storing(monkeypatch: pytest.MonkeyPatch) -> None:
    w, conv = await fresh()

    def none() -> None:
        raise errors.InvalidArgument("model m does not take tools: its chat format (x) has no tool calls")

    monkeypatch.setattr(w.core.prompts.renderer, "tool_syntax", none)
    with pytest.raises(errors.InvalidArgument, match="does not take tools"):
        await collect(w.core.send_turn(OWNER, conv, w.key(conv).turn, "Weather?", TOOLS))
    assert not w.store.records and w.engine.generations == []
    with pytest.raises(errors.InvalidArgument, match="no content"):
        await collect(w.core.send_turn(OWNER, conv, w.key(conv).turn, "hi", TOOLS,
                                       results=(ToolResult("call_1", "x"),)))


def test_tools_survive_the_records_json() -> None:
    options = TurnOptions(tools=(WEATHER,), tool_choice=ToolChoice(ChoiceMode.NAMED, "get_weather"),
                          parallel_tool_calls=False, temperature=0.5)
    assert TurnOptions.from_json(options.to_json()) == options
    for choice in (ChoiceMode.NONE, ChoiceMode.REQUIRED, ChoiceMode.AUTO):
        again = TurnOptions(tools=(WEATHER,), tool_choice=ToolChoice(choice))
        assert TurnOptions.from_json(again.to_json()) == again
