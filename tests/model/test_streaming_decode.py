"""Streaming detokenisation of tokenizer.json tokenizers (tokenizer_json.JsonDecoder): never half a character,
and the stream's text is what `tokenizers` decodes from all the ids at once, for byte-level BPE (Llama 3) and
for SentencePiece-style BPE with byte-fallback tokens (`<0xF0>`), whose decoder strips the first space."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers

from chatmesh.model.profile import ModelProfile
from chatmesh.model.tokenizer_json import JsonTokenizer

TEXTS = ["Hello wörld 🎉 and 👩‍👩‍👧 done", "日本語のテキスト", "plain ascii words", "  spaced   out  ", "½ ² Ⅻ ٣ ü"]


def byte_fallback_tokenizer() -> JsonTokenizer:
    """A small Llama-2/Mistral-style tokenizer: `▁` for spaces, whole words in the vocabulary, every other
    character as UTF-8 byte tokens <0x00>..<0xFF>, and their decoder chain."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ("▁", "▁Hello", "▁and", "▁done", "▁plain", "▁words", "▁spaced", "▁out", "H", "e", "l", "o", "w",
                  "r", "d", "a", "n"):
        vocab[piece] = len(vocab)
    rust = RustTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    return JsonTokenizer(rust, [], "bpe")


def stream(tok: JsonTokenizer, ids: list[int], rng: random.Random) -> list[str]:
    dec = tok.decoder()
    parts = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 3)  # the engine sends the tokens of a flush interval together
        parts.append(dec.feed(ids[i:i + n]))
        i += n
    parts.append(dec.flush())
    return parts


@pytest.mark.parametrize("text", TEXTS)
def test_byte_fallback_stream_is_the_whole_decode(text: str) -> None:
    tok = byte_fallback_tokenizer()
    ids = tok.encode(text)
    assert any(tok.decode([i], special=True) == "\ufffd" for i in ids) == (not text.isascii())
    for seed in range(5):
        parts = stream(tok, ids, random.Random(seed))
        assert all("\ufffd" not in p for p in parts)
        assert "".join(parts) == tok.decode(ids)


def test_byte_level_stream_on_random_ids(llama3: ModelProfile) -> None:
    # Arbitrary id sequences (a model may emit any): the stream still equals the whole decode, and only a
    # trailing incomplete character may come out as U+FFFD, at the flush.
    tok = llama3.tokenizer
    assert isinstance(tok, JsonTokenizer)
    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.randrange(128000) for _ in range(rng.randint(1, 20))]
        parts = stream(tok, ids, rng)
        whole = tok.decode(ids)
        assert "".join(parts) == whole
        if "\ufffd" not in whole:
            assert all("\ufffd" not in p for p in parts)


def test_special_tokens_are_dropped_from_the_stream(llama3: ModelProfile) -> None:
    eot = llama3.tokenizer.special_tokens["<|eot_id|>"]
    dec = llama3.decoder()
    assert dec.feed([*llama3.encode("Hi"), eot]) == "Hi"
    assert dec.flush() == ""
