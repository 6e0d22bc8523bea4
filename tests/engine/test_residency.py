"""Residency: the engine's per-conversation cached-token counts and the journal watchers read by cursor."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from chatmesh.engine_adapter.block_manager import BlockConfig, BlockManager
from chatmesh.engine_adapter.residency import FROM_START, ResidencyJournal

BS = 4
SYSTEM = [7] * 8  # two full blocks of platform prefix: shared, never counted


def _turn(bm: BlockManager, seq_id: int, tokens: list[int], conversation: str) -> None:
    assert bm.admit(seq_id, tokens, len(SYSTEM), b"owner", conversation) is not None
    assert bm.grow(seq_id, len(tokens))
    bm.commit(seq_id, tokens, len(tokens))
    bm.release(seq_id)


def test_counts_private_blocks_and_reports_eviction_as_zero() -> None:
    bm = BlockManager(BlockConfig(BS, 8, 0))
    _turn(bm, 1, SYSTEM + list(range(100, 113)), "c1")  # 13 private tokens: 3 full blocks
    first = bm.residency.changes(FROM_START)
    assert first.full and first.conversations == (("c1", 12),)
    _turn(bm, 2, SYSTEM + list(range(200, 217)), "c2")  # 4 private blocks + a partial one: c1 must give up 2
    changes = bm.residency.changes(first.version)
    assert not changes.full
    held = dict(changes.conversations)
    assert held == {"c2": 16, "c1": 4}  # 8 device blocks, no host tier: LRU took c1's tail (released first)
    assert bm.evict_conversation("c2") == 4
    assert bm.residency.changes(changes.version).conversations == (("c2", 0),)
    assert bm.residency.changes(bm.residency.version).conversations == ()  # nothing since


def test_reuse_under_another_conversation_moves_the_count() -> None:
    bm = BlockManager(BlockConfig(BS, 32, 0))
    prompt = SYSTEM + list(range(100, 109))
    _turn(bm, 1, prompt, "c1")
    cursor = bm.residency.version
    _turn(bm, 2, prompt + [1, 2, 3, 4], "c2")  # a fork of c1 (same owner, same history): c2 now holds it
    assert dict(bm.residency.changes(cursor).conversations) == {"c1": 0, "c2": 12}


def test_compaction_sends_old_cursors_a_full_listing() -> None:
    journal = ResidencyJournal(slack=3)
    journal.set("keep", 32)
    stale = journal.version
    for i in range(6):
        journal.set(f"gone-{i}", 32)
        journal.set(f"gone-{i}", 0)
    assert journal.resync_below > stale
    old = journal.changes(stale)
    assert old.full and old.conversations == (("keep", 32),)
    fresh = journal.changes(journal.version)
    assert not fresh.full and fresh.conversations == ()
    journal.check()


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.sampled_from([0, 0, 32, 64])), max_size=60),
       reads=st.sets(st.integers(0, 60)))
def test_a_watcher_reading_at_any_points_ends_with_what_is_held(ops: list[tuple[str, int]], reads: set[int]) -> None:
    journal = ResidencyJournal(slack=1)
    seen: dict[str, int] = {}
    cursor = FROM_START

    def read() -> None:
        nonlocal cursor
        changes = journal.changes(cursor)
        if changes.full:
            seen.clear()
        for conversation, tokens in changes.conversations:
            if tokens:
                seen[conversation] = tokens
            else:
                seen.pop(conversation, None)
        cursor = changes.version

    for i, (conversation, tokens) in enumerate(ops):
        journal.set(conversation, tokens)
        journal.check()
        if i in reads:
            read()
    read()
    assert seen == journal.held()
