"""The chat renderer's per-message token cache changes the work, never the tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatmesh.chat.context import Speaker
from chatmesh.chat.prompting import ChatMLRenderer
from chatmesh.mesh.config import Config
from chatmesh.model import template
from chatmesh.model.assets import GGUF_NAME
from chatmesh.model.settings import MODEL_DIR
from chatmesh.model.tokenizer import Tokenizer, load


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    path = Path(Config()[MODEL_DIR])
    if not (path / GGUF_NAME).is_file():
        pytest.skip(f"model file {path / GGUF_NAME} absent; run `chatmesh model fetch`")
    return load(path)


def conversation(turns: int) -> list[tuple[Speaker, str]]:
    out = [(Speaker.SYSTEM, "You are a helpful assistant.")]
    for i in range(turns):
        out.append((Speaker.USER, f"Question {i}: what is {i} squared, and why? Café, naïve, 東京 {i * 7}"))
        out.append((Speaker.ASSISTANT, f"{i} squared is {i * i}.\n\nBecause {i} x {i} = {i * i}."))
    return out


def reference(tok: Tokenizer, messages: list[tuple[Speaker, str]]) -> tuple[tuple[int, ...], int]:
    out = template.render(tok, [template.Message(role, text) for role, text in messages])
    return out.token_ids, out.platform_prefix_len


def test_cached_render_equals_the_template_turn_after_turn(tok: Tokenizer) -> None:
    renderer = ChatMLRenderer(tok, cached_messages=8)  # small, so eviction happens along the way
    for turns in range(1, 12):
        messages = conversation(turns)
        for _ in range(2):  # first build fills the cache, the second is served from it
            got = renderer.render(messages)
            assert (got.token_ids, got.platform_prefix_tokens) == reference(tok, messages)
    assert len(renderer._messages) == 8


def test_without_a_system_message_the_templates_default_is_used(tok: Tokenizer) -> None:
    renderer = ChatMLRenderer(tok)
    messages = [(Speaker.USER, "Hello there")]
    got = renderer.render(messages)
    assert (got.token_ids, got.platform_prefix_tokens) == reference(tok, messages)
    assert got.platform_prefix_tokens > 0


def test_long_pastes_are_not_pinned_in_the_cache(tok: Tokenizer) -> None:
    renderer = ChatMLRenderer(tok)
    paste = "word " * 20000  # 100,000 characters
    messages = [(Speaker.SYSTEM, "sys"), (Speaker.USER, paste)]
    assert renderer.render(messages).token_ids == reference(tok, messages)[0]
    assert (Speaker.USER, paste) not in renderer._messages
