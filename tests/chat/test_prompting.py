"""Chat renders and counts with the served model's profile: on SmolLM2 the same tokens as before (the built-in
ChatML through the first renderer's functions), on Llama 3 Llama 3.1's format in Llama token ids; the per-piece
token cache changes the work, never the tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatmesh.chat.context import Speaker
from chatmesh.chat.prompting import ProfileRenderer
from chatmesh.chat.service import context_tokens
from chatmesh.mesh.config import Config
from chatmesh.model import assets, profile, template
from chatmesh.model.tokenizer import Tokenizer, load
from tests.conftest import need_models


def _model_dir(asset: assets.WheelAsset) -> Path:
    return need_models(asset)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load(_model_dir(assets.SMOLLM2))


@pytest.fixture(scope="module")
def smollm2() -> profile.ModelProfile:
    return profile.load_spec("smollm2", _model_dir(assets.SMOLLM2))


@pytest.fixture(scope="module")
def llama3() -> profile.ModelProfile:
    return profile.load_spec("llama3", _model_dir(assets.LLAMA3_TOKENIZER))


def conversation(turns: int) -> list[tuple[Speaker, str]]:
    out = [(Speaker.SYSTEM, "You are a helpful assistant.")]
    for i in range(turns):
        out.append((Speaker.USER, f"Question {i}: what is {i} squared, and why? Café, naïve, 東京 {i * 7}"))
        out.append((Speaker.ASSISTANT, f"{i} squared is {i * i}.\n\nBecause {i} x {i} = {i * i}."))
    return out


def reference(tok: Tokenizer, messages: list[tuple[Speaker, str]]) -> tuple[tuple[int, ...], int]:
    """SmolLM2's ChatML as chat rendered it before the profile (template.render, the built-in format)."""
    out = template.render(tok, [template.Message(role, text) for role, text in messages])
    return out.token_ids, out.platform_prefix_len


def test_smollm2_renders_the_tokens_it_did_before_turn_after_turn(smollm2: profile.ModelProfile,
                                                                  tok: Tokenizer) -> None:
    renderer = ProfileRenderer(smollm2)
    for turns in range(1, 12):
        messages = conversation(turns)
        for _ in range(2):  # first build fills the piece cache, the second is served from it
            got = renderer.render(messages)
            assert (got.token_ids, got.platform_prefix_tokens) == reference(tok, messages)
    assert renderer.count("Hello world 42") == len(tok.encode("Hello world 42"))


def test_llama3_renders_llama_31s_format_in_llama_ids(llama3: profile.ModelProfile) -> None:
    renderer = ProfileRenderer(llama3)
    messages = conversation(3)
    got = renderer.render(messages)
    text = llama3.tokenizer.decode(got.token_ids, special=True)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    head = llama3.tokenizer.decode(got.token_ids[:got.platform_prefix_tokens], special=True)
    assert head.endswith("You are a helpful assistant.<|eot_id|>")
    assert renderer.count("Café naïve 東京") == len(llama3.encode("Café naïve 東京"))


def test_long_pastes_are_not_pinned_in_the_cache(smollm2: profile.ModelProfile, tok: Tokenizer) -> None:
    renderer = ProfileRenderer(smollm2)
    paste = "word " * 20000  # 100,000 characters
    messages = [(Speaker.SYSTEM, "sys"), (Speaker.USER, paste)]
    assert renderer.render(messages).token_ids == reference(tok, messages)[0]
    assert paste not in smollm2._encoder._texts


def test_the_context_is_the_served_models_within_the_setting(smollm2: profile.ModelProfile,
                                                              llama3: profile.ModelProfile) -> None:
    assert context_tokens(Config(env={}), smollm2) == 8192  # SmolLM2's, the setting's default
    assert context_tokens(Config(env={}), llama3) == 8192  # the setting caps Llama 3.1's 131,072
    assert context_tokens(Config(env={"CHATMESH_CONTEXT_TOKENS": "200000"}), llama3) == 131072
    assert context_tokens(Config(env={"CHATMESH_CONTEXT_TOKENS": "200000"}), smollm2) == 8192
