"""The `sim` engine ends replies by itself (EOS after a length drawn per generation) and answers scripted
prompts with scripted replies, so `completed`, `incomplete` and scripted text are reachable without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatmesh.engine_adapter.backend import Delta, Finished, FinishReason, GenerateEvent, GenerateParams
from chatmesh.engine_adapter.engine import EngineCore, VirtualClock
from chatmesh.engine_adapter.executor import SamplingParams
from chatmesh.engine_adapter.sim import build_sim, encode_script, parse_replies
from chatmesh.engine_adapter.text import WordCodec
from chatmesh.mesh.config import Config
from chatmesh.model import assets
from chatmesh.model.profile import ModelProfile, load_spec
from chatmesh.model.template import Message, Role
from chatmesh.model.tools import HERMES, LLAMA_JSON, ChoiceMode, ToolChoice, ToolDefinition
from tests.conftest import need_models


def _sim(codec: WordCodec | ModelProfile, **env: str) -> EngineCore:
    return build_sim(Config(env={"CHATMESH_DEVICE_BLOCKS": "2048", "CHATMESH_HOST_BLOCKS": "0", **env}),
                     codec=codec, clock=VirtualClock())


async def _reply(core: EngineCore, prompt: tuple[int, ...], max_tokens: int = 2000, seed: int = 0
                 ) -> tuple[list[int], str, Finished]:
    events: list[GenerateEvent] = [e async for e in core.generate(GenerateParams(
        prompt, max_tokens, cache_salt=b"o", sampling=SamplingParams(seed=seed)))]
    last = events[-1]
    assert isinstance(last, Finished)
    deltas = [e for e in events if isinstance(e, Delta)]
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), last


def _profile(name: str, asset: assets.WheelAsset) -> ModelProfile:
    return load_spec(name, need_models(asset))


@pytest.fixture(scope="module")
def llama3() -> ModelProfile:
    return _profile("llama3", assets.LLAMA3_TOKENIZER)


@pytest.fixture(scope="module")
def smollm2() -> ModelProfile:
    return _profile("smollm2", assets.SMOLLM2)


async def test_replies_end_at_a_drawn_length_the_same_for_the_same_seed() -> None:
    codec = WordCodec()
    core = _sim(codec, CHATMESH_SIM_REPLY_TOKENS="40")
    await core.start()
    try:
        prompt = tuple(codec.encode("hello there how are you"))
        lengths = set()
        for seed in range(8):
            tokens, _, fin = await _reply(core, prompt, seed=seed)
            assert fin.reason is FinishReason.STOP and 20 <= len(tokens) <= 60  # [mean / 2, 1.5 x mean]
            assert fin.usage.output_tokens == len(tokens) + 1  # the end token is sampled, not streamed
            again, _, _ = await _reply(core, prompt, seed=seed)
            assert again == tokens
            lengths.add(len(tokens))
        assert len(lengths) > 1  # drawn, not fixed
        capped, _, fin = await _reply(core, prompt, max_tokens=5)
        assert fin.reason is FinishReason.LENGTH and len(capped) == 5  # a cap below the draw: incomplete
    finally:
        await core.close()


async def test_a_continued_reply_goes_on_with_the_tokens_and_the_end_of_the_reply_it_continues() -> None:
    """A turn continued elsewhere (the prompt plus the reply shown so far, resumed_tokens): the same tokens after
    the shown part, and the end where the whole reply ended (the length is drawn from the prompt without them)."""
    codec = WordCodec()
    core = _sim(codec, CHATMESH_SIM_REPLY_TOKENS="40")
    await core.start()
    try:
        prompt = tuple(codec.encode("tell me about the river and the lantern"))
        whole, _, _ = await _reply(core, prompt, seed=9)
        for shown in (1, 7, len(whole) - 1):
            events = [e async for e in core.generate(GenerateParams(
                prompt + tuple(whole[:shown]), 2000, cache_salt=b"o", sampling=SamplingParams(seed=9),
                resumed_tokens=shown))]
            rest = [t for e in events if isinstance(e, Delta) for t in e.token_ids]
            last = events[-1]
            assert rest == whole[shown:] and isinstance(last, Finished) and last.reason is FinishReason.STOP
    finally:
        await core.close()


async def test_reply_tokens_zero_runs_to_max_tokens() -> None:
    codec = WordCodec()
    core = _sim(codec, CHATMESH_SIM_REPLY_TOKENS="0")
    await core.start()
    try:
        tokens, _, fin = await _reply(core, tuple(codec.encode("hello")), max_tokens=700)
        assert fin.reason is FinishReason.LENGTH and len(tokens) == 700
    finally:
        await core.close()


async def test_a_scripted_rule_answers_the_prompt_whose_last_message_matches(llama3: ModelProfile,
                                                                             tmp_path: Path) -> None:
    rules = [{"when": "weather in Paris", "reply": "It is 22 °C and sunny in Paris."},
             {"when": "22 °C", "reply": "<|python_tag|>never"}]  # matches only a last message holding "22 °C"
    path = tmp_path / "replies.json"
    path.write_text(json.dumps(rules))
    core = _sim(llama3, CHATMESH_SIM_REPLIES=str(path))
    await core.start()
    try:
        turn1 = [(Role.SYSTEM, "Be brief."), (Role.USER, "What is the weather in Paris?")]
        tokens, text, fin = await _reply(core, llama3.render(turn1).token_ids)
        assert text == "It is 22 °C and sunny in Paris." and fin.reason is FinishReason.STOP
        assert tokens == llama3.encode(text)
        # turn 2: the matching text is now in an earlier message only; the last one matches no rule
        turn2 = [*turn1, (Role.ASSISTANT, text), (Role.USER, "Thanks!")]
        _, other, fin = await _reply(core, llama3.render(turn2).token_ids)
        assert "Paris" not in other and fin.reason is FinishReason.STOP and other
        _, cut, fin = await _reply(core, llama3.render(turn1).token_ids, max_tokens=3)
        assert fin.reason is FinishReason.LENGTH and text.startswith(cut)
    finally:
        await core.close()


def test_scripts_spell_special_tokens_and_bad_scripts_are_refused(llama3: ModelProfile) -> None:
    ids = encode_script(llama3, '<|python_tag|>{"name": "f"}')
    assert ids[0] == llama3.tokenizer.special_tokens["<|python_tag|>"]
    assert list(ids[1:]) == llama3.encode('{"name": "f"}')
    script = parse_replies('[{"when": "a", "reply": "b"}]', llama3)
    assert script is not None and script.rules[0].when == "a"
    assert parse_replies("", llama3) is None
    for bad in ('{"when": "a"}', "/nonexistent/replies.json",
                '[{"when": "", "reply": "b"}]', '[{"reply": "b"}]', "[nope", '[{"when": "a"}]',
                '[{"when": "a", "tool_calls": [{"name": "f"}, {"name": "g"}]}]',  # Llama: one call a reply
                '[{"when": "a", "tool_calls": [{"arguments": {}}]}]'):
        with pytest.raises(ValueError, match="CHATMESH_SIM_REPLIES"):
            parse_replies(bad, llama3)


async def test_a_scripted_tool_call_is_written_in_the_models_format(llama3: ModelProfile, smollm2: ModelProfile
                                                                    ) -> None:
    rule = [{"when": "weather", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}]
    for served, want in ((llama3, LLAMA_JSON.call_text("get_weather", '{"city": "Paris"}')),
                         (smollm2, HERMES.call_text("get_weather", '{"city": "Paris"}'))):
        core = _sim(served, CHATMESH_SIM_REPLIES=json.dumps(rule))
        await core.start()
        try:
            messages = [Message(Role.SYSTEM, "Be brief."), Message(Role.USER, "The weather in Paris?")]
            tools = (ToolDefinition.of({"type": "function", "function": {"name": "get_weather"}}),)
            _, text, fin = await _reply(core, served.render(messages, tools=tools).token_ids)
            assert text == want and fin.reason is FinishReason.STOP
            # a prompt ending with the call's opening (tool_choice required): the reply continues it
            prefill = served.tool_syntax.prefill(ToolChoice(ChoiceMode.NAMED, "get_weather"))
            _, rest, _ = await _reply(core, served.render(messages, tools=tools, prefill=prefill).token_ids)
            assert prefill + rest == want
        finally:
            await core.close()
