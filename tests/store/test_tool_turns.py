"""Tool turns on both backends (issue 28): a reply's tool calls are stored with it, a turn whose input is tool
results stores them as a tool message in the user message's place, seeds carry both, the regenerate guard counts
a tool message as later input, the export holds them; and the same over the servicer's protobuf."""

from __future__ import annotations

import json
import uuid

import pytest

from chatmesh.mesh.errors import FailedPrecondition, InvalidArgument
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.store import wire
from chatmesh.store.core import ConversationStore
from chatmesh.store.values import (
    Claimed, Done, MessageStatus, Reply, Role, Seed, ToolCall, ToolResult, Usage,
)

OWNER = OwnerId("alice")
CALL = ToolCall("call_1", "get_weather", '{"city": "Zürich"}')
RESULT = ToolResult("call_1", '{"celsius": 21}')


def _turn() -> TurnId:
    return TurnId(str(uuid.uuid4()))


def _reply(text: str, calls: tuple[ToolCall, ...] = ()) -> Reply:
    return Reply(user_token_count=3, text=text, token_count=5, status=MessageStatus.COMPLETE,
                 usage=Usage(10, 0, 5), tool_calls=calls)


async def _claim(store: ConversationStore, conv: ConversationId, turn: TurnId, content: str = "",
                 results: tuple[ToolResult, ...] = ()) -> Claimed:
    claim = await store.turns.begin_turn(OWNER, conv, turn, content=content, lease_holder="chat-1",
                                         tool_results=results)
    assert isinstance(claim, Claimed)
    return claim


async def test_a_tool_round_trip_is_stored_turn_by_turn(store: ConversationStore) -> None:
    conv = (await store.conversations.insert_conversation(OWNER, "t", "v1")).conversation_id
    asks, answers = _turn(), _turn()
    claim = await _claim(store, conv, asks, content="Weather in Zürich?")
    finished = await store.turns.finish_turn(OWNER, conv, asks, claim.lease_id, _reply("", (CALL,)))
    assert finished.reply.tool_calls == (CALL,)
    claim = await _claim(store, conv, answers, results=(RESULT,))
    await store.turns.finish_turn(OWNER, conv, answers, claim.lease_id, _reply("21 °C."))
    history = await store.conversations.read_conversation(OWNER, conv)
    assert [(m.role, m.content, m.tool_calls, m.tool_results) for m in history.messages] == [
        (Role.USER, "Weather in Zürich?", (), ()), (Role.ASSISTANT, "", (CALL,), ()),
        (Role.TOOL, "", (), (RESULT,)), (Role.ASSISTANT, "21 °C.", (), ())]
    again = await store.turns.begin_turn(OWNER, conv, asks, content="Weather in Zürich?", lease_holder="chat-2")
    assert isinstance(again, Done) and again.reply.tool_calls == (CALL,)  # a replay carries the calls
    # the reply to the first question can no longer be regenerated: a tool message came after it
    with pytest.raises(FailedPrecondition):
        await store.turns.begin_turn(OWNER, conv, _turn(), content="", lease_holder="chat-1", regenerates=asks)
    exported = await store.lifecycle.export_user_data(OWNER)
    messages = exported["conversations"][0]["messages"]
    assert messages[1]["tool_calls"] == [{"id": "call_1", "name": "get_weather", "arguments": CALL.arguments}]
    assert messages[2]["tool_results"] == [{"tool_call_id": "call_1", "content": RESULT.content}]
    assert json.dumps(exported)  # JSON-ready


async def test_seeds_carry_calls_and_results_and_bad_shapes_are_refused(store: ConversationStore) -> None:
    seed = (Seed(Role.USER, "Weather?"), Seed(Role.ASSISTANT, "", tool_calls=(CALL,)),
            Seed(Role.TOOL, "", tool_results=(RESULT,)), Seed(Role.ASSISTANT, "21."))
    conv, _ = await store.conversations.create_conversation(OWNER, "t", "v1", seed=seed)
    history = await store.conversations.read_conversation(OWNER, conv.conversation_id)
    assert [(m.role, m.tool_calls, m.tool_results) for m in history.messages] == [
        (s.role, s.tool_calls, s.tool_results) for s in seed]
    for bad in ((Seed(Role.USER, "x", tool_calls=(CALL,)),), (Seed(Role.TOOL, ""),),
                (Seed(Role.ASSISTANT, "", tool_calls=(ToolCall("", "f", "{}"),)),)):
        with pytest.raises(InvalidArgument):
            await store.conversations.create_conversation(OWNER, "t", "v1", seed=bad)
    with pytest.raises(InvalidArgument, match="no content"):
        await store.turns.begin_turn(OWNER, conv.conversation_id, _turn(), content="hi", lease_holder="c",
                                     tool_results=(RESULT,))


def test_the_wire_keeps_calls_and_results() -> None:
    seed = Seed(Role.ASSISTANT, "", 3, (CALL,), ())
    assert wire.seed_of(wire.seed_pb(seed)) == seed
    tool = Seed(Role.TOOL, "", 0, (), (RESULT,))
    assert wire.seed_of(wire.seed_pb(tool)) == tool
