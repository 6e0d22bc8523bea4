"""Residency: which conversations' KV prefixes a replica caches, and a journal of changes watchers read by cursor.

Why. The router places a turn where its conversation's prefix is (router/chatmesh/router/follow.py). It learns
that from its own picks and from what every engine reports here: per conversation, the tokens of its private
(owner-salted) prefix the replica still caches, 0 once they are evicted or deleted. Conversation ids and counts
only: no token, no salt leaves the engine.

How. `set(conversation, tokens)` records a conversation's count; a change bumps a version and moves the
conversation to the end of a journal kept in version order, so `changes(since)` lists what changed after a
watcher's cursor by walking back from the journal's end: O(changes), O(1) per update. Conversations whose count
fell to 0 stay as "gone" entries until they outnumber the held ones by `slack`; compacting drops them and raises
`resync_below`, and a cursor older than that is answered with a full listing instead; a new watcher starts from
`FROM_START` (-1), which always gets one.

Parameters: `slack` = 4,096 gone entries beyond the held count before compaction (so compaction, O(journal),
runs at most once per `slack` changes).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

JOURNAL_SLACK = 4096
FROM_START = -1  # the cursor of a watcher that has seen nothing yet


@dataclass(frozen=True)
class ResidencyChanges:
    """Conversations' cached tokens: every held one (`full`) or those changed after the cursor passed in (0: none
    left). `version` is the cursor for the next call."""

    version: int
    full: bool
    conversations: tuple[tuple[str, int], ...]


class ResidencyJournal:
    """Cached tokens per conversation and the journal of their changes. Not thread-safe (one loop owns it)."""

    def __init__(self, slack: int = JOURNAL_SLACK) -> None:
        self.slack = slack
        self._tokens: dict[str, int] = {}              # held conversations only (tokens > 0)
        self._journal: OrderedDict[str, int] = OrderedDict()  # conversation -> version of its last change
        self.version = 0
        self.resync_below = 0  # a cursor below this gets a full listing

    def set(self, conversation: str, tokens: int) -> None:
        """Records the conversation's cached tokens here (0: none)."""
        if tokens > 0:
            if self._tokens.get(conversation) == tokens:
                return
            self._tokens[conversation] = tokens
        elif self._tokens.pop(conversation, None) is None:
            return
        self.version += 1
        journal = self._journal
        journal[conversation] = self.version
        journal.move_to_end(conversation)
        if len(journal) > 2 * len(self._tokens) + self.slack:
            self._compact()

    def tokens(self, conversation: str) -> int:
        return self._tokens.get(conversation, 0)

    def held(self) -> dict[str, int]:
        """Every held conversation's tokens (a copy)."""
        return dict(self._tokens)

    def changes(self, since: int) -> ResidencyChanges:
        """What changed after cursor `since` (an earlier call's `version`), or everything held when the journal
        no longer reaches back that far (or `since` is not one of this journal's cursors)."""
        if since < self.resync_below or since > self.version:
            return ResidencyChanges(self.version, True, tuple(self._tokens.items()))
        changed: list[tuple[str, int]] = []
        tokens = self._tokens
        for conversation, version in reversed(self._journal.items()):
            if version <= since:
                break
            changed.append((conversation, tokens.get(conversation, 0)))
        return ResidencyChanges(self.version, False, tuple(changed))

    def _compact(self) -> None:
        gone = [(c, v) for c, v in self._journal.items() if c not in self._tokens]
        for c, _ in gone:
            del self._journal[c]
        self.resync_below = max(v for _, v in gone)

    def check(self) -> None:
        """Asserts the journal's invariants (tests)."""
        versions = list(self._journal.values())
        assert versions == sorted(versions) and all(0 < v <= self.version for v in versions)
        assert set(self._tokens) <= set(self._journal), "a held conversation is missing from the journal"
        assert all(t > 0 for t in self._tokens.values())
