"""Residency from TensorRT-LLM's KV cache events: which conversations' blocks the LLM's pool holds.

Why. The router places turns where their prefix is cached (router/chatmesh/router/follow.py); `sim` and `local`
know it from their own block manager, but inside TensorRT-LLM only the KV event stream says what is cached
(`KvCacheConfig(event_buffer_max_size=...)`, `LLM.get_kv_cache_events_async`, the dicts of TensorRT-LLM's
KVCacheEventSerializer):

    {"event_id": 7, "window_size": 4096, "data": {"type": "stored", "parent_hash": 11 | None,
        "blocks": [{"type": "stored_block", "block_hash": 12, "tokens": [{"token_id": 5, ...}, ...],
                    "cache_level": 0, "priority": 35}, ...]}}
    {"data": {"type": "removed", "block_hashes": [12, ...]}}
    {"data": {"type": "updated", ...}}   (a block changed tier or priority: still cached, nothing to do)
    {"data": {"type": "created", ...}}   (the pool's sizes at start)

Events carry block hashes and tokens, not requests, so this map attributes a stored block to a conversation by
its content: while a generation runs, its tokens (prompt, then output as it streams) are indexed by (block
position, hash of the block's tokens); a stored block is found by its position (its parent's position + 1, 0
without a parent) and its tokens. The newest generation with those tokens at that position owns it, as chatmesh's
own block manager retags a reused block to the conversation that used it last. A removed block leaves its
conversation's count. Blocks wholly inside the platform prefix are shared across owners and not counted.

Where it cannot tell (said here and in docs/triton.md): a block stored after its generation left the index (kept
for the `recent` most recent generations) or whose parent was never attributed is not counted; with several
attention windows (VSWA) only the largest window's events are counted, so each block counts once; attention-DP
ranks must be gathered into one stream (TensorRT-LLM's attention_dp_events_gather_period_ms). Cost: O(prompt
blocks) per generation to index, O(blocks) per event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from chatmesh.engine_adapter.residency import ResidencyJournal

DEFAULT_RECENT = 256


class KvEventMap:
    """Attributes TensorRT-LLM's stored/removed block events to conversations; counts land in `journal`."""

    def __init__(self, block_size: int, recent: int = DEFAULT_RECENT) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self.recent = recent
        self.journal = ResidencyJournal()
        self.unattributed = 0  # stored blocks no indexed generation matched
        self._window: int | None = None
        # generation key -> (conversation, platform prefix tokens, tokens so far); oldest first
        self._generations: OrderedDict[object, tuple[str, int, list[int]]] = OrderedDict()
        self._index: dict[tuple[int, int], object] = {}  # (block position, hash of its tokens) -> generation
        # block hash -> (conversation or "" when unattributed, position, counted tokens)
        self._blocks: dict[int, tuple[str, int, int]] = {}
        self._tokens: dict[str, int] = {}  # conversation -> private tokens counted

    def started(self, key: object, conversation: str, prompt: Sequence[int], platform_prefix: int) -> None:
        """A generation began: index its prompt's full blocks."""
        self._generations[key] = (conversation, platform_prefix, list(prompt))
        self._generations.move_to_end(key)
        self._index_from(key, 0)
        while len(self._generations) > self.recent:
            self._drop(next(iter(self._generations)))

    def extended(self, key: object, tokens: Iterable[int]) -> None:
        """Output tokens of a running generation (their blocks are stored as they fill)."""
        entry = self._generations.get(key)
        if entry is None:
            return
        have = len(entry[2]) // self.block_size
        entry[2].extend(tokens)
        self._index_from(key, have)

    def apply(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Folds KV cache events (KVCacheEventSerializer's dicts) into the counts."""
        for event in events:
            data = event.get("data", event)
            kind = data.get("type")
            window = event.get("window_size")
            if kind in ("stored", "removed") and window is not None:
                if self._window is None or window > self._window:
                    self._window = int(window)
                elif window < self._window:
                    continue
            if kind == "stored":
                self._stored(data.get("parent_hash"), data.get("blocks", ()))
            elif kind == "removed":
                for h in data.get("block_hashes", ()):
                    self._removed(int(h))

    def _stored(self, parent: int | None, blocks: Iterable[Mapping[str, Any]]) -> None:
        if parent is None:
            position = 0
        else:
            known = self._blocks.get(int(parent))
            if known is None:
                self.unattributed += sum(1 for _ in blocks)
                return
            position = known[1] + 1
        for block in blocks:
            tokens = tuple(int(t["token_id"]) if isinstance(t, Mapping) else int(t) for t in block.get("tokens", ()))
            key = self._index.get((position, hash(tokens)))
            entry = self._generations.get(key) if key is not None else None
            h = int(block["block_hash"])
            if entry is None:  # keep its position, so its children can still be placed
                self.unattributed += 1
                self._removed(h)
                self._blocks[h] = ("", position, 0)
                position += 1
                continue
            conversation, prefix, _ = entry
            private = len(tokens) if (position + 1) * self.block_size > prefix else 0
            self._removed(h)  # a hash stored again replaces its old owner
            self._blocks[h] = (conversation, position, private)
            if private:
                self._count(conversation, private)
            position += 1

    def _removed(self, h: int) -> None:
        gone = self._blocks.pop(h, None)
        if gone is not None and gone[2]:
            self._count(gone[0], -gone[2])

    def _count(self, conversation: str, delta: int) -> None:
        tokens = self._tokens.get(conversation, 0) + delta
        if tokens > 0:
            self._tokens[conversation] = tokens
        else:
            self._tokens.pop(conversation, None)
        self.journal.set(conversation, max(0, tokens))

    def _index_from(self, key: object, first_block: int) -> None:
        _, _, tokens = self._generations[key]
        bs = self.block_size
        for i in range(first_block, len(tokens) // bs):
            self._index[(i, hash(tuple(tokens[i * bs:(i + 1) * bs])))] = key

    def _drop(self, key: object) -> None:
        _, _, tokens = self._generations.pop(key)
        bs = self.block_size
        for i in range(len(tokens) // bs):
            slot = (i, hash(tuple(tokens[i * bs:(i + 1) * bs])))
            if self._index.get(slot) == key:
                del self._index[slot]
