"""SmolLM2's tokenizer: GPT-2 byte-level BPE read from the GGUF's metadata, shared by chat and engine.

How a text becomes token ids (the same steps as the Hugging Face `tokenizer.json` and llama.cpp's `smollm`
pre-tokenizer type, which this reproduces):
1. Pre-tokenize. First every numeric character (Unicode category N) is split off on its own, so numbers are
   tokenized digit by digit; then each remaining chunk is cut with GPT-2's pattern (contractions, an optional
   space plus letters, an optional space plus numbers, an optional space plus other symbols, whitespace runs
   that keep their last space for the following word). The order matters: splitting digits first changes where
   whitespace runs end, so the two stages are not one combined pattern.
2. Map each piece's UTF-8 bytes to printable characters with GPT-2's byte-to-unicode table (so a space is `Ġ`).
3. BPE: repeatedly merge the adjacent pair with the lowest rank in `tokenizer.ggml.merges` until none applies,
   then look each resulting symbol up in `tokenizer.ggml.tokens`. Results are cached per piece: chat text
   repeats words, so encoding 3,000 tokens costs a few milliseconds after warm-up.

Special tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, the control tokens of `tokenizer.ggml.token_type`)
are never produced by `encode`: user text that spells `<|im_end|>` is encoded as its ordinary characters. Only
the chat template (template.py) inserts their ids, so a user cannot forge a turn boundary.

Decoding concatenates each token's bytes; control tokens decode to nothing unless `special=True`.
`IncrementalDecoder` does the same for a stream and holds back an incomplete UTF-8 sequence until the token
that completes it arrives, so a streamed reply never shows half an emoji.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import regex

from chatmesh.model.assets import gguf_path
from chatmesh.model.vocabulary import vocabulary_digest

# Token types of llama.cpp's vocabulary (tokenizer.ggml.token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3

_GPT2_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
_DIGIT_SPLIT = regex.compile(r"(\p{N})")

# Pre-tokenizer types (tokenizer.ggml.pre) this module implements: whether digits are split off first.
_PRE_SPLITS_DIGITS = {"smollm": True, "gpt2": False}

_CACHE_LIMIT = 200_000  # cached pieces before the cache is cleared (bounds memory on adversarial text)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes map to themselves,
    the others to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_UNICODE = _byte_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in _BYTE_TO_UNICODE.items()}
_BYTES_TRANSLATION = str.maketrans({chr(b): c for b, c in _BYTE_TO_UNICODE.items()})


class Tokenizer:
    """Byte-level BPE over a fixed vocabulary and merge list."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                 eos_id: int, pre: str = "smollm") -> None:
        if pre not in _PRE_SPLITS_DIGITS:
            raise ValueError(f"unsupported pre-tokenizer {pre!r}; known: {sorted(_PRE_SPLITS_DIGITS)}")
        if len(tokens) != len(token_types):
            raise ValueError("tokens and token_types differ in length")
        self._split_digits = _PRE_SPLITS_DIGITS[pre]
        self._tokens = list(tokens)
        self._merges = list(merges)
        self._control = frozenset(i for i, t in enumerate(token_types) if t == TOKEN_TYPE_CONTROL)
        self._specials = {tokens[i]: i for i in sorted(self._control)}
        self._digest = ""
        # Control tokens are left out of the lookup so BPE can never yield them from text.
        self._ids = {t: i for i, t in enumerate(tokens) if i not in self._control}
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            left, _, right = merge.partition(" ")
            self._ranks[(left, right)] = rank
        self._bytes = [bytes(_UNICODE_TO_BYTE[c] for c in t) if i not in self._control else t.encode()
                       for i, t in enumerate(tokens)]
        self._cache: dict[str, tuple[int, ...]] = {}
        self._eos_id = eos_id
        self._im_start_id = self._special("<|im_start|>")
        self._im_end_id = self._special("<|im_end|>")
        self._endoftext_id = self._special("<|endoftext|>")

    def _special(self, text: str) -> int:
        try:
            i = self._tokens.index(text)
        except ValueError:
            raise ValueError(f"vocabulary has no {text} token") from None
        if i not in self._control:
            raise ValueError(f"{text} is not a control token")
        return i

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from chatmesh.model import gguf_fields

        return cls.from_fields(gguf_fields.read(path), str(path))

    @classmethod
    def from_reader(cls, reader: Any) -> Tokenizer:
        """From an open `gguf.GGUFReader` (the engine's weight loader shares its reader)."""
        from chatmesh.model import gguf_fields

        path = reader.data.filename if hasattr(reader.data, "filename") else "GGUF"
        return cls.from_fields(gguf_fields.of_reader(reader), str(path))

    @classmethod
    def from_fields(cls, fields: Mapping[str, object], path: str) -> Tokenizer:
        """From a GGUF's key-value fields (chatmesh.model.gguf_fields) read from `path`."""

        def field(name: str) -> object:
            if name not in fields:
                raise ValueError(f"{path}: GGUF has no {name}")
            return fields[name]

        model = field("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"{path}: tokenizer model {model!r} is not byte-level BPE (gpt2)")
        tokens = field("tokenizer.ggml.tokens")
        merges = field("tokenizer.ggml.merges")
        types = field("tokenizer.ggml.token_type")
        eos = field("tokenizer.ggml.eos_token_id")
        pre = field("tokenizer.ggml.pre")
        assert isinstance(tokens, list) and isinstance(merges, list) and isinstance(types, list)
        assert isinstance(eos, int) and isinstance(pre, str)
        return cls([str(t) for t in tokens], [str(m) for m in merges], [int(t) for t in types], eos, pre)

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """The control tokens by their text."""
        return self._specials

    @property
    def digest(self) -> str:
        """The vocabulary digest (chatmesh.model.vocabulary), computed on first use."""
        if not self._digest:
            self._digest = vocabulary_digest("bpe", self._tokens, self._merges, self._control)
        return self._digest

    @property
    def eos_id(self) -> int:
        """End of generation as the GGUF declares it (for SmolLM2-Instruct, `<|im_end|>`)."""
        return self._eos_id

    @property
    def im_start_id(self) -> int:
        return self._im_start_id

    @property
    def im_end_id(self) -> int:
        return self._im_end_id

    @property
    def endoftext_id(self) -> int:
        return self._endoftext_id

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens that end an assistant turn: end of turn and end of text."""
        return frozenset({self._im_end_id, self._endoftext_id, self._eos_id})

    def decoder(self) -> IncrementalDecoder:
        """A fresh streaming decoder (so a Tokenizer is the engine's `TextCodec`)."""
        return IncrementalDecoder(self)

    def is_control(self, token_id: int) -> bool:
        return token_id in self._control

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored (byte-level characters), for debugging."""
        return self._tokens[token_id]

    def pieces(self, text: str) -> list[str]:
        """The pre-tokenizer's split of `text` (step 1 of the header)."""
        if not self._split_digits:
            return _GPT2_PATTERN.findall(text)
        out: list[str] = []
        for chunk in _DIGIT_SPLIT.split(text):
            if chunk:
                out.extend(_GPT2_PATTERN.findall(chunk))
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text; never produces a control token."""
        out: list[int] = []
        cache = self._cache
        for piece in self.pieces(text):
            ids = cache.get(piece)
            if ids is None:
                ids = self._bpe(piece.encode("utf-8").decode("latin-1").translate(_BYTES_TRANSLATION))
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[piece] = ids
            out.extend(ids)
        return out

    def _bpe(self, word: str) -> tuple[int, ...]:
        symbols = list(word)
        ranks = self._ranks
        while len(symbols) > 1:
            best_rank = -1
            best: tuple[str, str] | None = None
            for pair in zip(symbols, symbols[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best is None or rank < best_rank):
                    best, best_rank = pair, rank
            if best is None:
                break
            merged: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == best[0] and symbols[i + 1] == best[1]:
                    merged.append(best[0] + best[1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        try:
            return tuple(self._ids[s] for s in symbols)
        except KeyError as e:  # every single byte is in a byte-level vocabulary, so this means a corrupt file
            raise ValueError(f"symbol {e.args[0]!r} is not in the vocabulary") from None

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        if token_id in self._control and not special:
            return b""
        return self._bytes[token_id]

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of `ids`; control tokens are dropped unless `special`. Invalid UTF-8 becomes U+FFFD."""
        return b"".join(self.token_bytes(i, special) for i in ids).decode("utf-8", errors="replace")


class IncrementalDecoder:
    """Streams text from token ids, emitting only complete UTF-8 characters; `flush` ends the stream."""

    def __init__(self, tokenizer: Tokenizer, special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        data = b"".join(self._tokenizer.token_bytes(i, self._special) for i in ids)
        return self._utf8.decode(data, final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD); the decoder is reusable after."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


@functools.lru_cache(maxsize=4)
def _load(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(path)


def load(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of the GGUF in `model_dir`, read once per process (raises ModelMissing when absent)."""
    return _load(str(gguf_path(model_dir).resolve()))
