"""Token text for the engine: how token ids become stream text, and what `sim` says.

`TextCodec` is the small interface the engine needs from the served model: an incremental decoder per stream
(never splitting a UTF-8 character), the ids that end a turn, and the model's identity (reported in stats,
checked against what chat rendered for). A model profile (chatmesh.model.profile, from CHATMESH_MODEL) is one;
`WordCodec` is the self-contained fallback of `sim`: one token per word of `PASSAGE`, so `sim` streams read as
English without any model file (its identity matches no real tokenizer, so chat refuses to send it prompts).

`PASSAGE` is the deterministic text `sim` generates from: its tokens are cycled, starting at a place chosen by
the request's seed, so the same seed and prompt length give the same reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from chatmesh.model.profile import ModelIdentity
from chatmesh.model.vocabulary import IncrementalDecoder

PASSAGE = (
    "The engine keeps each conversation's history close at hand, so the next turn starts where the last one "
    "ended. When a user pauses to think, the blocks of their history move from the accelerator to host memory, "
    "and when they reply the blocks come back over the bus instead of being computed again. A long new prompt "
    "is cut into chunks that share each step with the replies already streaming, so nobody waits while a "
    "stranger's document is read. Every owner has a salt of their own: the system prompt is shared by all, "
    "while everything after it stays private to the person who wrote it. When a conversation is deleted its "
    "blocks are dropped from every tier, and when a stream is cancelled its memory returns to the pool at the "
    "next step. The router sends each turn back to the replica that remembers it, unless that replica is "
    "already too busy, in which case the turn spills to the next one on the ring and pays for one miss. "
    "Measured this way the fleet is sized by time rather than by slots, and the cache decides how much time "
    "the prompts will cost."
)


class TextCodec(Protocol):
    """What the engine needs from the served model's tokenizer."""

    @property
    def identity(self) -> ModelIdentity:
        """The model and tokenizer digest this engine reports and checks prompts against."""
        ...

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that always end a generation (end of turn, end of sequence)."""
        ...

    def decoder(self) -> IncrementalDecoder:
        """A fresh decoder for one stream."""
        ...

    def encode(self, text: str) -> list[int]: ...


class _WordDecoder:
    def __init__(self, words: Sequence[str]):
        self._words = words
        self._first = True

    def feed(self, ids: Sequence[int]) -> str:
        parts = []
        for i in ids:
            word = self._words[i] if 0 <= i < len(self._words) else "<unk>"
            parts.append(word if self._first else " " + word)
            self._first = False
        return "".join(parts)

    def flush(self) -> str:
        return ""


class WordCodec:
    """A whitespace word vocabulary: id 0 is the end-of-turn token, then every distinct word of `text`."""

    EOT = 0
    identity = ModelIdentity("sim-words", "words:passage")

    def __init__(self, text: str = PASSAGE):
        self.words: list[str] = ["<|im_end|>"]
        self._ids: dict[str, int] = {}
        for w in text.split():
            if w not in self._ids:
                self._ids[w] = len(self.words)
                self.words.append(w)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset({self.EOT})

    def decoder(self) -> IncrementalDecoder:
        return _WordDecoder(self.words)

    def encode(self, text: str) -> list[int]:
        """Known words map to their ids; unknown words are added (the vocabulary grows, ids stay stable)."""
        out = []
        for w in text.split():
            if w not in self._ids:
                self._ids[w] = len(self.words)
                self.words.append(w)
            out.append(self._ids[w])
        return out
