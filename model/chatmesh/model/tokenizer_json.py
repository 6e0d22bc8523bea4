"""A Hugging Face `tokenizer.json` through the `tokenizers` library (the Rust implementation serving stacks use),
as a profile's tokenizer: Llama 3's byte-level BPE, SentencePiece-style BPE with byte fallback, or anything else
the library reads.

Plain text is encoded with `encode_special_tokens` on and `add_special_tokens` off: a special token spelled in
user text is split like any other text, and no BOS is added (the chat template inserts it).

Streaming detokenisation (`JsonDecoder`) is the offsets method of Hugging Face's text-generation-inference and
vLLM, which holds for every decoder the library has (byte-level, byte fallback `<0xE2>` tokens, SentencePiece's
`▁` with its first-token space strip): keep the ids since the last emitted boundary (`prefix`), decode
ids[prefix:read] and ids[prefix:] and emit the difference, unless the new text ends in U+FFFD, which means the
last token ended inside a UTF-8 character (its remaining bytes arrive with the next token). Decoding from a
window rather than from each token alone keeps context-dependent decoders right (a space strip applies at the
stream's start, not at every token). Each feed costs two decodes of a few tokens, once per delta the engine
sends, not per token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

from chatmesh.model.vocabulary import vocabulary_digest

_REPLACEMENT = "\ufffd"


class JsonTokenizer:
    """A `TextTokenizer` over `tokenizers`."""

    def __init__(self, rust: RustTokenizer, merges: Sequence[str], kind: str):
        self._rust = rust
        self._rust.encode_special_tokens = True
        vocab = rust.get_vocab(with_added_tokens=True)
        self._size = max(vocab.values()) + 1 if vocab else 0
        tokens = [""] * self._size
        for text, i in vocab.items():
            tokens[i] = text
        added = rust.get_added_tokens_decoder()
        self._specials = {t.content: i for i, t in sorted(added.items()) if t.special}
        self._digest = vocabulary_digest(kind, tokens, merges, self._specials.values())

    @classmethod
    def from_file(cls, path: str | Path) -> JsonTokenizer:
        raw: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
        model = raw.get("model", {})
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        return cls(RustTokenizer.from_str(json.dumps(raw)), merges, str(model.get("type", "")).lower())

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def special_tokens(self) -> Mapping[str, int]:
        return self._specials

    @property
    def digest(self) -> str:
        return self._digest

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._rust.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        text: str = self._rust.decode(list(ids), skip_special_tokens=not special)
        return text

    def decoder(self) -> JsonDecoder:
        return JsonDecoder(self)


class JsonDecoder:
    """Streams text from token ids (the offsets method in the module's header); special tokens are dropped."""

    def __init__(self, tokenizer: JsonTokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []  # ids from the last emitted boundary on
        self._read = 0  # ids[:read] have been emitted

    def feed(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        self._ids.extend(ids)
        before = self._tokenizer.decode(self._ids[:self._read])
        text = self._tokenizer.decode(self._ids)
        if text.endswith(_REPLACEMENT) or len(text) < len(before):
            return ""  # inside a UTF-8 character: wait for its last bytes
        new = text[len(before):]
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        return new

    def flush(self) -> str:
        before = self._tokenizer.decode(self._ids[:self._read])
        text = self._tokenizer.decode(self._ids)
        self._ids, self._read = [], 0
        return text[len(before):]
