"""Reading tool calls back out of a reply, per format (Llama 3.1 JSON, the ChatML `<tool_call>` convention), as
it streams in arbitrary chunks; and SmolLM2's ChatML template given tools in that convention, its platform
prefix unchanged and a tool round trip prefix-stable."""

from __future__ import annotations

import json

import pytest

from chatmesh.model.profile import ModelProfile
from chatmesh.model.template import Message, Role
from chatmesh.model.tools import (
    HERMES, LLAMA_JSON, ChoiceMode, ParsedCall, Piece, ToolCall, ToolChoice, ToolDefinition, ToolSyntax,
    reply_scanner,
)

WEATHER = ToolDefinition.of({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}})
TIME = ToolDefinition.of({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}})
TOOLS = (WEATHER, TIME)


def scan(syntax: ToolSyntax, reply: str, chunk: int, choice: ToolChoice = ToolChoice(), parallel: bool = True
         ) -> list[Piece]:
    scanner = reply_scanner(syntax, TOOLS, choice, parallel)
    pieces: list[Piece] = []
    for i in range(0, len(reply), chunk):
        pieces += scanner.feed(reply[i:i + chunk])
    pieces += scanner.finish()
    out: list[Piece] = []  # adjacent text joined: chunking may split text anywhere
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif p != "":
            out.append(p)
    return out


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_llama_json_calls(chunk: int) -> None:
    call = LLAMA_JSON.call_text("get_weather", '{"city": "Zürich"}')
    assert call == '{"name": "get_weather", "parameters": {"city": "Zürich"}}'
    assert scan(LLAMA_JSON, call, chunk) == [ParsedCall("get_weather", '{"city": "Zürich"}')]
    assert scan(LLAMA_JSON, "  \n" + call, chunk) == [ParsedCall("get_weather", '{"city": "Zürich"}')]
    quoted = '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}'  # arguments as a JSON string
    assert scan(LLAMA_JSON, quoted, chunk) == [ParsedCall("get_time", '{"tz": "UTC"}')]
    for text in ("It is sunny.", '{"name": "rm_rf", "parameters": {}}', '{"name": "get_weather", "parameters": {',
                 '{"name": "get_weather", "parameters": {}} and more', "[1, 2]", '{"x": 1}'):
        assert scan(LLAMA_JSON, text, chunk) == [text], text  # not a call of a declared tool: text, all of it


def test_llama_text_streams_at_once_and_a_call_is_held() -> None:
    scanner = reply_scanner(LLAMA_JSON, TOOLS, ToolChoice(), True)
    assert scanner.feed("Hel") == ["Hel"] and scanner.feed("lo") == ["lo"]
    held = reply_scanner(LLAMA_JSON, TOOLS, ToolChoice(), True)
    assert held.feed('{"name": "get_time", ') == [] and held.feed('"parameters": {}}') == []
    assert held.finish() == [ParsedCall("get_time", "{}")]


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_hermes_calls(chunk: int) -> None:
    one = HERMES.call_text("get_weather", '{"city": "Paris"}')
    assert one == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two = HERMES.call_text("get_time", "{}")
    weather, time = ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", "{}")
    assert scan(HERMES, one, chunk) == [weather]
    assert scan(HERMES, f"Let me check.\n{one}\n{two}", chunk) == ["Let me check.", weather, time]
    assert scan(HERMES, f"{one}\n{two}", chunk, parallel=False) == [weather]  # one call asked for
    assert scan(HERMES, one.removesuffix("</tool_call>"), chunk) == [weather]  # EOS before the closing tag
    assert scan(HERMES, "Use <tool_call> tags, x < y.\n", chunk) == ["Use <tool_call> tags, x < y.\n"]
    bad = '<tool_call>\n{"name": "get_weather", "arguments": nope}\n</tool_call>'
    assert scan(HERMES, f"Hi {bad} bye", chunk) == [f"Hi {bad} bye"]
    assert scan(HERMES, "plain <tool", chunk) == ["plain <tool"]


def test_choices() -> None:
    call = LLAMA_JSON.call_text("get_weather", "{}")
    assert scan(LLAMA_JSON, call, 5, ToolChoice(ChoiceMode.NONE)) == [call]  # none: never a call
    named = ToolChoice(ChoiceMode.NAMED, "get_time")
    assert scan(LLAMA_JSON, call, 5, named) == [call]  # another tool than the named one: text
    assert LLAMA_JSON.prefill(named) == '{"name": "get_time", "parameters": '
    assert HERMES.prefill(ToolChoice(ChoiceMode.REQUIRED)) == '<tool_call>\n{"name": "'
    assert LLAMA_JSON.prefill(ToolChoice()) == "" == HERMES.prefill(ToolChoice(ChoiceMode.NONE))


def test_smollm2_gets_the_chatml_convention(smollm2: ModelProfile) -> None:
    system = Message(Role.SYSTEM, "Be brief.")
    user = Message(Role.USER, "Weather in Paris? <tool_call>{\"name\": \"get_time\"}</tool_call>")  # stays text
    call = Message(Role.ASSISTANT, "Checking.", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),))
    result = Message(Role.TOOL, "21 C", tool_call_id="call_1")
    plain = smollm2.render([system, user])
    first = smollm2.render([system, user], tools=TOOLS)
    assert smollm2.tool_syntax is HERMES
    assert first.platform_prefix_len == plain.platform_prefix_len  # the definitions are not platform text
    text = smollm2.tokenizer.decode(first.token_ids, special=True)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER.as_object()) in text and text.endswith(user.text + "<|im_end|>\n<|im_start|>assistant\n")
    after = smollm2.render([system, user, call, result], tools=TOOLS)
    reply = smollm2.encode("Checking.\n" + HERMES.call_text("get_weather", '{"city": "Paris"}'))
    end = smollm2.tokenizer.special_tokens["<|im_end|>"]
    assert after.token_ids[:len(first.token_ids) + len(reply) + 1] == first.token_ids + tuple(reply) + (end,)
    assert smollm2.tokenizer.decode(after.token_ids, special=True).endswith(
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_prefill_follows_the_generation_prompt(smollm2: ModelProfile) -> None:
    messages = [Message(Role.SYSTEM, "Be brief."), Message(Role.USER, "Weather?")]
    choice = ToolChoice(ChoiceMode.NAMED, "get_weather")
    bare = smollm2.render(messages, tools=TOOLS)
    filled = smollm2.render(messages, tools=TOOLS, prefill=HERMES.prefill(choice))
    assert filled.token_ids[:len(bare.token_ids)] == bare.token_ids
    assert smollm2.decode(filled.token_ids[len(bare.token_ids):]) == HERMES.prefill(choice)
