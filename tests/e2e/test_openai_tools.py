"""Tool calling end to end (issue 28's Done-when): the official `openai` SDK against the real edge and mesh (every
service its own process; the `sim` engine serving Llama 3.1's format, CHATMESH_MODEL=llama3, scripted to call a
tool when asked about the weather and to answer once it has the result). In Chat Completions and in Responses,
streamed and not: the call comes back parsed into the SDK's own types, the result goes back, the final answer is
stored (read back from the store through the edge), and turn 3 of the conversation is served from the prefix
cache (the tool round trip kept the prompt prefix-stable)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from openai.types.responses import FunctionToolParam, ResponseFunctionToolCall

from chatmesh.mesh import settings
from chatmesh.mesh.up import Mesh
from tests.e2e.conftest import start_mesh
from tests.gateway.openai_client import make_key, sdk
from tests.gateway.openresponses_spec import check_response, check_stream

MODEL = "Llama-3-tokenizer"  # the llama3 profile's id (its fetched tokenizer folder)
BLOCK = 32
PARIS = {"city": "Paris", "unit": "celsius"}
RESULT = '{"celsius": 21, "sky": "clear"}'
ANSWER = "It is 21 degrees and clear in Paris."
RULES = [{"when": "weather in Paris", "tool_calls": [{"name": "get_weather", "arguments": PARIS}]},
         {"when": "celsius", "reply": ANSWER}, {"when": "Thanks!", "reply": "You are welcome."}]
PARAMETERS: dict[str, object] = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
              "required": ["city"]}
CHAT_TOOLS: list[ChatCompletionToolParam] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.", "parameters": PARAMETERS}}]
RESPONSE_TOOLS: list[FunctionToolParam] = [{"type": "function", "name": "get_weather", "strict": False,
                                            "description": "Current weather in a city.", "parameters": PARAMETERS}]


@pytest.fixture(scope="module")
def tools_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("openai-tools"), CHATMESH_MODEL="llama3", CHATMESH_MAX_REPLY_TOKENS="24",
                   CHATMESH_SIM_REPLIES=json.dumps(RULES), CHATMESH_SIM_STEP_MS="5")
    try:
        yield m
    finally:
        m.stop()


async def _client(mesh: Mesh) -> tuple[openai.AsyncOpenAI, str]:
    key = await make_key(Path(mesh.cfg[settings.DATA_DIR]), f"u-{uuid.uuid4().hex[:8]}")
    return sdk(mesh.gateway_url, key), key


async def _stored(mesh: Mesh, key: str) -> list[dict[str, Any]]:
    """The messages of the user's one conversation, as the store keeps them (chatmesh's own REST route)."""
    async with httpx.AsyncClient(base_url=mesh.gateway_url, headers={"Authorization": f"Bearer {key}"}) as http:
        (conv,) = (await http.get("/v1/conversations")).json()["conversations"]
        messages: list[dict[str, Any]] = (await http.get(f"/v1/conversations/{conv['id']}")).json()[
            "messages"]
        return messages


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_completions_tool_round_trip(tools_mesh: Mesh, stream: bool) -> None:
    client, key = await _client(tools_mesh)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What's the weather in Paris?"}]

    async def turn() -> tuple[Any, Any]:
        if not stream:
            done = await client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS)
            return done.choices[0], done.usage
        async with client.chat.completions.stream(model=MODEL, messages=messages, tools=CHAT_TOOLS,
                                                  stream_options={"include_usage": True}) as s:
            final = await s.get_final_completion()
        return final.choices[0], final.usage

    choice, first = await turn()
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == PARIS
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    choice, second = await turn()
    assert choice.message.content == ANSWER and choice.finish_reason == "stop" and not choice.message.tool_calls
    messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Thanks!"}]
    choice, third = await turn()
    assert choice.message.content
    # one conversation, each turn the next of it: the calls and results were recognised as its history, and
    # turn 3's prompt came from the cache up to the last full block of turn 2's
    assert second.prompt_tokens > first.prompt_tokens and third.prompt_tokens > second.prompt_tokens
    assert third.prompt_tokens_details.cached_tokens >= second.prompt_tokens - BLOCK
    stored = await _stored(tools_mesh, key)
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert stored[1]["tool_calls"] == [{"id": call.id, "name": "get_weather", "arguments": call.function.arguments}]
    assert stored[2]["tool_results"] == [{"tool_call_id": call.id, "content": RESULT}]
    assert stored[3]["content"] == ANSWER


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_tool_round_trip(tools_mesh: Mesh, stream: bool) -> None:
    client, key = await _client(tools_mesh)

    async def respond(**kw: Any) -> Any:
        if not stream:
            return await client.responses.create(model=MODEL, tools=RESPONSE_TOOLS, **kw)
        async with client.responses.stream(model=MODEL, tools=RESPONSE_TOOLS, **kw) as s:
            kinds = [event.type async for event in s]
            final = await s.get_final_response()
        if isinstance(final.output[0], ResponseFunctionToolCall):
            assert "response.function_call_arguments.done" in kinds
        return final

    asked = await respond(input="What's the weather in Paris?")
    check_response(asked.model_dump(mode="json"))
    (call,) = asked.output  # a reply that is only a call: its function_call is the whole output
    assert isinstance(call, ResponseFunctionToolCall) and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == PARIS
    assert asked.tools[0].name == "get_weather" and asked.parallel_tool_calls is True
    answered = await respond(previous_response_id=asked.id,
                             input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    assert answered.output_text == ANSWER and answered.status == "completed"
    thanked = await respond(previous_response_id=answered.id, input="Thanks!")
    assert thanked.usage is not None and answered.usage is not None
    assert thanked.usage.input_tokens_details.cached_tokens >= answered.usage.input_tokens - BLOCK
    again = await client.responses.retrieve(answered.id)
    assert again.output_text == ANSWER  # stored
    retrieved_call = (await client.responses.retrieve(asked.id)).output[0]
    assert isinstance(retrieved_call, ResponseFunctionToolCall) and retrieved_call.call_id == call.call_id
    assert asked.conversation is not None
    items = (await client.conversations.items.list(asked.conversation.id, order="asc")).data
    assert [i.type for i in items][:4] == ["message", "function_call", "function_call_output", "message"]
    assert [m["role"] for m in await _stored(tools_mesh, key)][:4] == ["user", "assistant", "tool", "assistant"]


async def test_the_streamed_call_events_follow_the_specification(tools_mesh: Mesh) -> None:
    _, key = await _client(tools_mesh)
    async with httpx.AsyncClient(base_url=tools_mesh.gateway_url + "/openai/v1", timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        raw = (await http.post("/responses", json={
            "model": MODEL, "stream": True, "tools": RESPONSE_TOOLS, "input": "What is the weather in Paris, please?",
            "tool_choice": "required"})).text
    events = check_stream(raw)  # every event against the Open Responses schemas, in the specification's order
    kinds = [e["type"] for e in events]
    assert kinds[2:-1] == ["response.output_item.added", "response.function_call_arguments.delta",
                           "response.function_call_arguments.done", "response.output_item.done"]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"]) == PARIS and events[-1]["response"]["output"][0]["call_id"]
