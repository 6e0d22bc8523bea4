"""The sliding window an output check keeps across chunk boundaries.

A reply streams in chunks of a few words (25 ms of tokens), so a phrase, a card number or even one word can be
split between two chunks. Each chunk is judged over `tail + chunk`, where `tail` is the last `window_chars`
characters already judged. What counts as new, so that nothing already judged is reported twice:
- a regex match is new when it ends inside the new chunk (a match that straddles the boundary is new, and is
  seen whole; a match wholly inside the tail was judged with an earlier chunk);
- a word is new when it ends inside the new chunk (so "idi" + "ot" is judged as "idiot" with the second chunk).
The classifier scores the new words plus up to `context_tokens` earlier words as context, leaving out earlier
words that lean profane: context dilutes a score the way a sentence does, but never re-accuses old text.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatmesh.moderation.classifier import TOKEN


@dataclass(frozen=True)
class View:
    """One chunk seen through the window: `text` is tail + chunk, the chunk starting at `new_from`."""

    text: str
    new_from: int

    def is_new(self, end: int) -> bool:
        """Whether a span ending at `end` (exclusive) reaches into the new chunk."""
        return end > self.new_from

    def words(self) -> tuple[list[str], list[str]]:
        """(old words, new words), lower-cased, in order."""
        old: list[str] = []
        new: list[str] = []
        for m in TOKEN.finditer(self.text):
            (new if m.end() > self.new_from else old).append(m.group().lower())
        return old, new


class Window:
    """The judged tail of one reply. Mutable, owned by one output stream."""

    def __init__(self, window_chars: int) -> None:
        self._keep = window_chars
        self._tail = ""
        self.checked_chars = 0

    def push(self, chunk: str) -> View:
        view = View(self._tail + chunk, len(self._tail))
        self._tail = view.text[-self._keep:]
        self.checked_chars += len(chunk)
        return view
