"""The sliding window an output check keeps across chunk boundaries.

A reply streams in chunks of a few words (25 ms of tokens), so a phrase, a card number or even one word can be
split between two chunks. Each chunk is judged over `tail + chunk`, where `tail` is the last `window_chars`
characters already judged. What counts as new, so that nothing already judged is reported twice:
- a regex match is new when it ends inside the new chunk (a match that straddles the boundary is new, and is
  seen whole; a match wholly inside the tail was judged with an earlier chunk);
- a word is new when it ends inside the new chunk (so "idi" + "ot" is judged as "idiot" with the second chunk).
The classifier scores the new words plus up to `context_tokens` earlier complete words as context, leaving out
earlier words that lean profane: context dilutes a score the way a sentence does, but never re-accuses old
text. Words are found incrementally (from the start of the word straddling the boundary), so a chunk costs in
proportion to its own length, not the window's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from chatmesh.moderation.classifier import TOKEN


@dataclass(frozen=True)
class View:
    """One chunk seen through the window: `text` is tail + chunk, the chunk starting at `new_from`;
    `words` are the new words after up to `context_tokens` earlier ones (lower-cased)."""

    text: str
    new_from: int
    words: tuple[str, ...] = ()
    new_words: int = 0

    def is_new(self, end: int) -> bool:
        """Whether a span ending at `end` (exclusive) reaches into the new chunk."""
        return end > self.new_from


def _is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


class Window:
    """The judged tail of one reply and its recent context words. Mutable, owned by one output stream."""

    def __init__(self, window_chars: int, context_tokens: int, keep_as_context: Callable[[str], bool]) -> None:
        self._keep = window_chars
        self._tail = ""
        self._context: deque[str] = deque(maxlen=context_tokens)
        self._keep_as_context = keep_as_context
        self.checked_chars = 0

    def push(self, chunk: str) -> View:
        text = self._tail + chunk
        new_from = len(self._tail)
        start = new_from
        while start > 0 and _is_word_char(text[start - 1]):
            start -= 1
        new = [m.group().lower() for m in TOKEN.finditer(text, start) if m.end() > new_from]
        view = View(text, new_from, (*self._context, *new) if new else (), len(new))
        complete = new[:-1] if text and _is_word_char(text[-1]) else new
        self._context.extend(w for w in complete if self._keep_as_context(w))
        self._tail = text[-self._keep:]
        self.checked_chars += len(chunk)
        return view
