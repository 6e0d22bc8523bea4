"""What every tokenizer of a model profile offers, whatever file it was read from (a GGUF's metadata through the
hand-written BPE in tokenizer.py, or a Hugging Face `tokenizer.json` through the `tokenizers` library in
tokenizer_json.py), and the digest that says whether two of them give token ids the same meaning.

Plain text never yields a special token: `encode` treats `<|im_end|>` or `<|eot_id|>` spelled in user text as
ordinary characters, so only a chat template (which inserts special ids itself) can mark a turn boundary.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol


class IncrementalDecoder(Protocol):
    """Turns a stream of token ids into text, holding back the bytes of an incomplete UTF-8 character."""

    def feed(self, ids: Sequence[int]) -> str: ...

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD); the decoder is reusable after."""
        ...


class TextTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """Special (control) tokens by their text: a template may spell them, plain text never yields them."""
        ...

    @property
    def digest(self) -> str:
        """`vocabulary_digest` of this tokenizer."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text; never a special token."""
        ...

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of `ids`; special tokens are dropped unless `special`."""
        ...

    def decoder(self) -> IncrementalDecoder:
        """A fresh streaming decoder (special tokens dropped)."""
        ...


# Texts of special tokens that end a generation wherever a vocabulary has them (end of turn, end of message,
# end of text), as llama.cpp's end-of-generation list does; a profile adds the ids its files declare.
END_TOKEN_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                   "<end_of_turn>", "</s>")


def vocabulary_digest(kind: str, tokens: Sequence[str], merges: Sequence[str], special_ids: Iterable[int]) -> str:
    """sha256 over the tokenizer's model kind, its tokens in id order, its merges and its special ids: two
    tokenizers with the same digest map every id to the same token, so prompt ids mean the same text to both.
    Independent of the file format's layout (a re-saved tokenizer.json keeps its digest)."""
    canonical = json.dumps([kind, list(tokens), list(merges), sorted(set(special_ids))], ensure_ascii=False,
                           separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
