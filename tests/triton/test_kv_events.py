"""TensorRT-LLM's KV cache events (KVCacheEventSerializer's dicts, as `get_kv_cache_events_async` yields them)
mapped to the conversations whose blocks they are: what the router places turns by."""

from __future__ import annotations

from typing import Any

from chatmesh.engine_adapter.residency import FROM_START
from chatmesh.engine_adapter.triton.kv_events import KvEventMap

BS = 4
SYSTEM = [9, 9, 9, 9, 8, 8, 8, 8]  # two blocks of platform prefix


def stored(parent: int | None, *blocks: tuple[int, list[int]], window: int = 4096) -> dict[str, Any]:
    return {"event_id": 1, "window_size": window, "data": {"type": "stored", "parent_hash": parent, "blocks": [
        {"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
         "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens]}
        for h, tokens in blocks]}}


def removed(*hashes: int, window: int = 4096) -> dict[str, Any]:
    return {"event_id": 2, "window_size": window, "data": {"type": "removed", "block_hashes": list(hashes)}}


def held(m: KvEventMap) -> dict[str, int]:
    return dict(m.journal.changes(FROM_START).conversations)


def test_stored_blocks_count_for_their_conversation_past_the_platform_prefix() -> None:
    m = KvEventMap(BS)
    prompt = SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8, 1]
    m.started("g1", "c1", prompt, platform_prefix=len(SYSTEM))
    m.apply([stored(None, (10, SYSTEM[:4]), (11, SYSTEM[4:])), stored(11, (12, [1, 2, 3, 4]), (13, [5, 6, 7, 8]))])
    assert held(m) == {"c1": 8}  # the two system-prompt blocks are shared, not counted
    m.extended("g1", [3, 3, 3])  # the reply fills the next block
    m.apply([stored(13, (14, [1, 3, 3, 3]))])
    assert held(m) == {"c1": 12}
    m.apply([removed(14, 13), {"data": {"type": "updated", "block_hash": 12}}])
    assert held(m) == {"c1": 4}
    m.apply([removed(12, 10, 11)])
    assert held(m) == {} and m.unattributed == 0


def test_the_newest_generation_with_those_tokens_owns_a_block_and_unknowns_are_counted_as_such() -> None:
    m = KvEventMap(BS)
    m.started("g1", "c1", SYSTEM + [1, 2, 3, 4, 5], 8)
    m.started("g2", "c2", SYSTEM + [1, 2, 3, 4, 6], 8)  # a fork of c1: the same first private block
    m.apply([stored(None, (10, SYSTEM[:4]), (11, SYSTEM[4:]), (12, [1, 2, 3, 4]))])
    assert held(m) == {"c2": 4}
    m.apply([stored(None, (20, [7, 7, 7, 7])), stored(20, (21, [7, 7, 7, 7])), stored(999, (30, [1, 1, 1, 1]))])
    assert held(m) == {"c2": 4} and m.unattributed == 3


def test_only_the_largest_attention_window_counts() -> None:
    m = KvEventMap(BS)
    m.started("g", "c", [1, 2, 3, 4, 5], 0)
    m.apply([stored(None, (1, [1, 2, 3, 4]), window=4096), stored(None, (2, [1, 2, 3, 4]), window=512)])
    assert held(m) == {"c": 4}


def test_generations_leave_the_index_after_the_recent_ones() -> None:
    m = KvEventMap(BS, recent=2)
    for i in range(3):
        m.started(f"g{i}", f"c{i}", [i + 1] * 5, 0)
    m.apply([stored(None, (1, [1, 1, 1, 1])), stored(None, (3, [3, 3, 3, 3]))])
    assert held(m) == {"c2": 4} and m.unattributed == 1  # g0's blocks came too late to be told apart
