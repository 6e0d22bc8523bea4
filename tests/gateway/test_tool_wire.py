"""The OpenAI surface's tool wire without a mesh: tools, tool_choice and parallel_tool_calls parsed from both APIs'
shapes into what chat takes; calls and results in messages and items; bad shapes refused naming the parameter;
the history digest over calls and results (and unchanged for messages without them); the Responses events of a
reply that calls a tool, checked against the Open Responses schemas and order."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import uuid
from typing import Any

import pytest

from chatmesh.gateway import events
from chatmesh.gateway.openai import history, wire
from chatmesh.gateway.openai.errors import OpenAIError
from chatmesh.gateway.openai.history import Point
from chatmesh.gateway.openai.response_events import EventFraming, Immediate, Outcome
from chatmesh.gateway.openai.response_object import Shape, request_fields
from chatmesh.gateway.openai.stored import options_pb
from chatmesh.gateway.openai.tool_wire import response_tools
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.model.tools import ChoiceMode, ToolCall
from chatmesh.v1 import chat_pb2
from tests.gateway.openresponses_spec import check_stream

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                            "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def chat(**body: Any) -> wire.ChatRequest:
    return wire.chat_request({"model": "m", **body}, max_chars=10_000, context_tokens=8192)


def test_chat_tools_and_a_tool_turn() -> None:
    req = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
               parallel_tool_calls=False, messages=[
                   {"role": "user", "content": "Weather?"},
                   {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None, "annotations": []},
                   {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}])
    tools = req.options.tools
    assert [t.name for t in tools.definitions] == ["get_weather"]
    assert json.loads(tools.definitions[0].definition_json) == WEATHER  # as the client sent it
    assert tools.choice.mode is ChoiceMode.NAMED and tools.choice.name == "get_weather" and tools.parallel is False
    assert req.input.content == "" and req.input.results == (("call_1", '{"celsius": 21}'),)
    assert [m.role for m in req.input.history] == [wire.Role.USER, wire.Role.ASSISTANT]
    assert req.input.history[1].tool_calls == (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)
    options = options_pb(req.options)
    assert options.tools[0].name == "get_weather" and options.tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_NAMED
    assert options.HasField("parallel_tool_calls") and not options.parallel_tool_calls


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]}, "tools[0].function.bogus"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": "[1]"}}]}, {"role": "tool", "tool_call_id": "call_1",
                                                                   "content": "x"}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_2", "content": "x"}]}, "messages[2].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [CALL]},
                   {"role": "tool", "content": "x"}]}, "messages[2].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": "x", "refusal": "no"}, {"role": "user", "content": "hi"}]},
     "messages[0].refusal"),
])
def test_bad_tool_shapes_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as err:
        chat(**{"messages": [{"role": "user", "content": "hi"}], **body})
    assert err.value.status == 400 and err.value.param == param


def test_responses_tools_and_items() -> None:
    flat = {"type": "function", "name": "get_weather", "description": "Weather.",
            "parameters": {"type": "object", "properties": {}}, "strict": True}
    req = wire.response_request({"model": "m", "tools": [flat], "tool_choice": {"type": "function",
                                                                                "name": "get_weather"},
                                 "input": [{"role": "user", "content": "Weather?"},
                                           {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                            "arguments": "{}", "id": "fc_1", "status": "completed"},
                                           {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                                            "arguments": "{}"},
                                           {"type": "function_call_output", "call_id": "call_1", "output": "a"},
                                           {"type": "function_call_output", "call_id": "call_2", "output": "b"}]},
                                max_chars=10_000, context_tokens=8192)
    assert req.input.results == (("call_1", "a"), ("call_2", "b"))
    (user, calls) = req.input.history
    assert [c.id for c in calls.tool_calls] == ["call_1", "call_2"]  # one reply's calls: one assistant message
    definition = json.loads(req.tools.definitions[0].definition_json)
    assert definition == {"type": "function", "function": {k: v for k, v in flat.items() if k != "type"}}
    fields = req.tools.response_fields()
    assert fields["tools"] == [flat] and fields["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert fields["parallel_tool_calls"] is True
    with pytest.raises(OpenAIError, match="function tools only"):
        response_tools({"tools": [{"type": "web_search"}]})
    with pytest.raises(OpenAIError) as err:
        wire.response_request({"model": "m", "input": [{"type": "reasoning", "summary": []}]}, max_chars=100,
                              context_tokens=8192)
    assert err.value.param == "input[0].type"


def _old_digest(secret: bytes, owner: str, chat_id: str, messages: list[wire.Message]) -> str:
    """The digest before tools (history.py at 19bc6d2): the recorded histories of existing conversations."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (owner, chat_id):
        raw = part.encode()
        mac.update(len(raw).to_bytes(4, "big") + raw)
    for m in messages:
        raw = m.text.strip().encode()
        mac.update(m.role.value[0].encode() + len(raw).to_bytes(4, "big") + raw)
    return mac.hexdigest()


def test_the_history_digest_covers_calls_and_results() -> None:
    owner = OwnerId("alice")
    plain = [wire.Message(wire.Role.USER, "hi"), wire.Message(wire.Role.ASSISTANT, " hello ")]
    assert history.digest(b"k", owner, "", plain) == _old_digest(b"k", owner, "", plain)
    call = wire.Message(wire.Role.ASSISTANT, "", tool_calls=(ToolCall("call_1", "f", '{"b": 1, "a": 2}'),))
    respaced = wire.Message(wire.Role.ASSISTANT, "", tool_calls=(ToolCall("call_1", "f", '{"a":2,"b":1}'),))
    other = wire.Message(wire.Role.ASSISTANT, "", tool_calls=(ToolCall("call_1", "f", '{"a": 3, "b": 1}'),))
    digest = history.digest(b"k", owner, "", [plain[0], call])
    assert digest == history.digest(b"k", owner, "", [plain[0], respaced])  # a client may re-serialise arguments
    assert digest != history.digest(b"k", owner, "", [plain[0], other])
    assert digest != history.digest(b"k", owner, "", [plain[0], wire.Message(wire.Role.ASSISTANT, "")])
    result = wire.Message(wire.Role.TOOL, "21", tool_call_id="call_1")
    assert history.digest(b"k", owner, "", [result]) != history.digest(
        b"k", owner, "", [wire.Message(wire.Role.TOOL, "21", tool_call_id="call_2")])


def _stream(text: str, calls: list[ToolCall]) -> str:
    point = Point(ConversationId(str(uuid.uuid4())), TurnId(str(uuid.uuid4())))
    fields = request_fields(model="m", created_at=1, instructions=None, previous_response_id=None,
                            max_output_tokens=None, temperature=0.0, top_p=1.0, store=True, background=False,
                            truncation="disabled", metadata={}, user=None, safety_identifier=None,
                            prompt_cache_key=None)

    async def ending(end: events.ReplyEnd) -> Outcome:
        return Outcome("completed", None, 2)

    framing = EventFraming(Shape(point, fields), ending, Immediate())

    async def run() -> bytes:
        out = await framing.event(events.ReplyStarted(1, point.turn, False, None))
        if text:
            out += framing.delta(2, text)
        for i, c in enumerate(calls):
            out += await framing.event(events.ReplyToolCall(3 + i, i, c))
        out += await framing.event(events.ReplyCompleted(9, events.Usage(),
                                                         finish_reason="tool_calls" if calls else "stop"))
        return out + await framing.end(events.Outcome(events.SseEvent.COMPLETED, 0))

    return asyncio.run(run()).decode()


def test_the_responses_events_of_a_call() -> None:
    call = ToolCall("call_ab", "get_weather", '{"city": "Paris"}')
    only = check_stream(_stream("", [call]))
    assert [e["type"] for e in only][2:-1] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert all(e.get("output_index", 0) == 0 for e in only)  # the call is the whole output
    assert only[-1]["response"]["output"] == [{"type": "function_call", "id": "fc_ab", "call_id": "call_ab",
                                               "name": "get_weather", "arguments": call.arguments,
                                               "status": "completed"}]
    both = check_stream(_stream("Let me check.", [call, ToolCall("call_cd", "get_weather", "{}")]))
    final = both[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["message", "function_call", "function_call"]
    assert final[0]["content"][0]["text"] == "Let me check."
    assert [e["output_index"] for e in both if e["type"] == "response.output_item.added"] == [0, 1, 2]
    plain = check_stream(_stream("Hi.", []))
    assert [i["type"] for i in plain[-1]["response"]["output"]] == ["message"]
    empty = check_stream(_stream("", []))  # no text, no call: still the one (empty) message item
    assert [e["type"] for e in empty][2:4] == ["response.output_item.added", "response.content_part.added"]


def test_a_continuing_response_answers_with_results_alone() -> None:
    req = wire.response_request({"model": "m", "previous_response_id": "resp_x", "input": [
        {"type": "function_call_output", "call_id": "call_1", "output": "21"}]}, max_chars=100, context_tokens=8192)
    assert req.input.history == () and req.input.content == "" and req.input.results == (("call_1", "21"),)
    with pytest.raises(OpenAIError) as err:  # Chat Completions carries the whole history: the call must be in it
        chat(messages=[{"role": "tool", "tool_call_id": "call_1", "content": "21"}])
    assert err.value.param == "messages[0].tool_call_id"


def test_one_key_names_each_turn_of_a_tool_round_trip() -> None:
    from chatmesh.gateway.openai.turns import Ask, Continuity

    turns = Continuity.__new__(Continuity)
    asked = Ask(owner=OwnerId("o"), chat="", history=(), content="Weather?", options=wire.Options(),
                request_digest="a", key="message-1")
    answered = Ask(owner=OwnerId("o"), chat="", history=(), content="", options=wire.Options(),
                   request_digest="b", key="message-1", results=(("call_1", "21"),))
    assert turns.turn_id(asked) != turns.turn_id(answered)  # Open WebUI sends the message id with both
    assert turns.turn_id(answered) == turns.turn_id(Ask(**{**answered.__dict__, "request_digest": "c"}))


def test_max_tool_calls_is_echoed() -> None:
    assert response_tools({"max_tool_calls": 3}).response_fields()["max_tool_calls"] == 3
    assert response_tools({}).response_fields()["max_tool_calls"] is None
    with pytest.raises(OpenAIError):
        response_tools({"max_tool_calls": 0})
