"""ChatML rendering: the GGUF template's text, the platform prefix, and prefix stability across turns (I3)."""

from __future__ import annotations

from pathlib import Path

from chatmesh.model.template import DEFAULT_SYSTEM, Message, Role, generation_prompt_ids, render
from chatmesh.model.tokenizer import Tokenizer


def test_renders_the_chatml_text(tok: Tokenizer) -> None:
    p = render(tok, [(Role.SYSTEM, "Be brief."), (Role.USER, "Hi there")])
    assert tok.decode(p.token_ids, special=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(p.token_ids[:p.platform_prefix_len], special=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n")


def test_default_system_message(tok: Tokenizer) -> None:
    p = render(tok, [("user", "Hi")])
    assert tok.decode(p.token_ids[:p.platform_prefix_len]) == f"system\n{DEFAULT_SYSTEM}\n"
    assert p.token_ids[0] == tok.im_start_id


def test_prefix_stability_across_turns(tok: Tokenizer) -> None:
    convo = [Message(Role.SYSTEM, "You answer questions."), Message(Role.USER, "What is 2+2?")]
    turn1 = render(tok, convo)
    # The reply continues right after the generation prompt; whitespace at its start must not merge backwards.
    convo += [Message(Role.ASSISTANT, "\n 4, of course."), Message(Role.USER, "  and 3+3?")]
    turn2 = render(tok, convo)
    assert turn2.token_ids[:len(turn1.token_ids)] == turn1.token_ids
    assert turn2.platform_prefix_len == turn1.platform_prefix_len
    assert turn2.token_ids[-len(generation_prompt_ids(tok)):] == tuple(generation_prompt_ids(tok))


def test_without_generation_prompt(tok: Tokenizer) -> None:
    p = render(tok, [(Role.USER, "x")], add_generation_prompt=False)
    assert p.token_ids[-2:] == (tok.im_end_id, *tok.encode("\n"))


def test_chatml_boundary_splits_are_the_stated_ones(tok: Tokenizer, model_dir: Path) -> None:
    # template.py: per-piece encoding equals tokenizing SmolLM2's rendered text whole (the `tokenizers` oracle,
    # special tokens parsed) except where content starts with whitespace, which then is not merged into the
    # newline before it: other ids, the same characters.
    from tokenizers import AddedToken

    from tests.model.test_tokenizer import _hf

    hf = _hf(model_dir)
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tok.special_tokens])

    def whole(messages: list[Message]) -> list[int]:
        text = tok.decode(render(tok, messages).token_ids, special=True)
        return list(hf.encode(text, add_special_tokens=False).ids)

    plain = [Message(Role.SYSTEM, "Be brief."), Message(Role.USER, "What is 2+2? Café 東京 🎉"),
             Message(Role.ASSISTANT, "4, of course.\n\nAnd 5 + 5 = 10. "), Message(Role.USER, "Thanks!\n")]
    for n in range(1, len(plain) + 1):
        assert list(render(tok, plain[:n]).token_ids) == whole(plain[:n])
    spaced = [*plain[:2], Message(Role.ASSISTANT, "\n 4, of course."), Message(Role.USER, "  and 3+3?")]
    ours = render(tok, spaced).token_ids
    assert list(ours) != whole(spaced)
    assert tok.decode(ours, special=True) == hf.decode(whole(spaced), skip_special_tokens=False)
