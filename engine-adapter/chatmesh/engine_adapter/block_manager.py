"""Paged KV memory with owner-salted prefix reuse and a host spill tier (pure Python, no model, no clock).

What. A sequence's KV cache lives in fixed-size blocks (`block_size` tokens, default 32) of the DEVICE tier;
its block table lists them in order (PagedAttention, SOSP 2023). A block that is full and computed is *cached*:
it gets a content hash and stays findable after its sequence ends, so the next turn of a conversation, which
replays the same prefix (I3), reuses it instead of prefilling again (automatic prefix caching).

Hash chain. block i's hash = blake2b(hash of block i-1, [salt], the block's token ids). A block therefore
names its whole prefix, not just its own tokens. The owner's `salt` enters the chain once, at the first block
that reaches past the platform prefix (the versioned system prompt): blocks wholly inside the platform prefix
are unsalted and shared by every owner; every later block is reachable only under the same salt (I1). A block
straddling the boundary holds private tokens, so it is salted.

Tiers and eviction. Every device block is exactly one of: free (no data), referenced (ref count > 0: in some
running sequence's table; shared prefix blocks have several), or cached-idle (ref 0, hashed, kept in LRU
order). Allocating takes a free block, else evicts the least recently used idle block: its contents are copied
to the HOST tier (a `BlockCopy` the executor performs before the step) and it stays findable there; when the
host tier is full its own LRU block is dropped for good. A prefix match that finds a block on the host
*onboards* it: a device block is allocated and a host->device copy queued (time modelled by `sim`, a real copy
in `local`); the host block is freed, so a hash lives in exactly one tier. Sequences release their blocks
tail-first, so within one sequence the tail is evicted before the prefix that more turns share.

Eviction by conversation or salt (deletion, I4): each salted cached block is tagged with its salt and the last
conversation that computed or reused it. Evicting drops those hashes from both tiers; a block still in use
loses its hash and is freed when its sequence releases it.

Residency (what the router places turns by, residency.py): a conversation's cached tokens here are its tagged
blocks, device and host tiers together, times the block size (the shared platform prefix is untagged and not
counted). Each change of a conversation's count (a block committed, reused under another conversation, dropped)
is recorded in `residency`, a journal watchers read by cursor: O(1) per block touched in a step.

Transfer between replicas (issue 29, transfer.py). A SOURCE pins the leading run of a puller's named chain
hashes that it holds (`pin`): a salted block counts only when its tag carries the puller's verified owner salt,
so another owner's hash reads exactly like an unknown one; unsalted platform-prefix blocks are anyone's. A
pinned device block is referenced (never evicted or reallocated), a pinned host block leaves the host LRU (never
dropped or overwritten; an admission that meets it prefills instead of onboarding it, so a hash still lives in
one tier); `unpin` returns them when the transfer ends, and after a transfer that delivered them all `demote`
moves the private ones to the cold end of their tier's LRU (the conversation now lives on the puller; a retried
pull still finds them, but they are the next evicted instead of a duplicate history crowding out live
conversations: `chatmesh simulate`'s demote_pulled, 94.1% -> 95.4% of prompt tokens without prefill). A PULLER `reserve`s device blocks for the blocks it
receives (free ones, then LRU idle ones dropped without a spill: a spill's queued copy would race the import's
write), and once every block arrived and verified, `adopt` caches them under their hashes as if computed here
(tags, residency); a failed transfer `unreserve`s them.

Parameters: `BlockConfig(block_size, device_blocks, host_blocks)`; host_blocks 0 disables the spill tier.
Counters (`BlockStats`): tier occupancy, device evictions (spills or drops), host evictions (drops).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from chatmesh.engine_adapter.executor import BlockCopy, Tier
from chatmesh.engine_adapter.residency import ResidencyJournal

BlockHash = bytes
K = TypeVar("K")


@dataclass(frozen=True)
class BlockConfig:
    """Block geometry and tier sizes, in blocks."""

    block_size: int = 32
    device_blocks: int = 1024
    host_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.device_blocks < 1 or self.host_blocks < 0:
            raise ValueError(f"bad block config {self}")


@dataclass(frozen=True)
class PrefixHit:
    """What an admission found in the cache."""

    cached_tokens: int  # prompt tokens whose KV came from cached blocks (device or host)
    host_cached_tokens: int  # of those, onboarded from the host tier


@dataclass(frozen=True)
class PinnedBlock:
    """A cached block held for a transfer: its hash and where its data is."""

    hash: BlockHash
    tier: Tier
    block: int


@dataclass(frozen=True)
class BlockStats:
    """Tier occupancy (used + free = total) and since-start eviction counters."""

    device_total: int
    device_free: int
    device_cached: int  # used, but held by no sequence (idle, evictable)
    host_total: int
    host_free: int
    device_evictions: int
    host_evictions: int

    @property
    def device_used(self) -> int:
        return self.device_total - self.device_free

    @property
    def host_used(self) -> int:
        return self.host_total - self.host_free


@dataclass
class _SeqBlocks:
    """One sequence's block table and the hash chain of its full, computed blocks."""

    salt: bytes
    first_private: int  # index of the first block salted (reaching past the platform prefix)
    conversation: str | None
    table: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)


@dataclass(frozen=True)
class _Tag:
    salt: bytes
    conversation: str | None


def block_hash(parent: BlockHash, tokens: Sequence[int], salt: bytes | None) -> BlockHash:
    """The chained hash of one full block; `salt` is given only for the first private block."""
    h = hashlib.blake2b(parent, digest_size=16)
    if salt is not None:
        h.update(b"salt:%d:" % len(salt))
        h.update(salt)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(tokens: Sequence[int], platform_prefix: int, salt: bytes, block_size: int,
                 blocks: int | None = None) -> list[BlockHash]:
    """The chain hashes of the first `blocks` full blocks of `tokens` (default: every full block but a last token
    left to compute, what admission looks up), the salt entering at the first block past the platform prefix."""
    first_private = platform_prefix // block_size
    n = (len(tokens) - 1) // block_size if blocks is None else blocks
    out: list[BlockHash] = []
    parent = b""
    for i in range(n):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size], salt if i == first_private else None)
        out.append(parent)
    return out


class BlockManager:
    """Device and host KV tiers, the prefix-cache index, and every sequence's block table."""

    def __init__(self, cfg: BlockConfig):
        self.cfg = cfg
        self.block_size = cfg.block_size
        n, m = cfg.device_blocks, cfg.host_blocks
        self._ref = [0] * n
        self._dev_hash: list[BlockHash | None] = [None] * n
        self._dev_free = list(range(n - 1, -1, -1))  # a stack: low ids first
        self._dev_idle: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; oldest first
        self._host_hash: list[BlockHash | None] = [None] * m
        self._host_free = list(range(m - 1, -1, -1))
        self._host_idle: OrderedDict[int, None] = OrderedDict()  # every used host block; oldest first
        self._where: dict[BlockHash, tuple[Tier, int]] = {}
        self._tags: dict[BlockHash, _Tag] = {}
        self._by_salt: dict[bytes, set[BlockHash]] = {}
        self._by_conversation: dict[str, set[BlockHash]] = {}
        self._seqs: dict[int, _SeqBlocks] = {}
        self._dev_pins: dict[int, int] = {}  # device block -> transfers pinning it (each also holds a reference)
        self._host_pins: dict[int, int] = {}  # host block -> transfers pinning it (out of the host LRU meanwhile)
        self._reserved: set[int] = set()  # device blocks an import is writing (one reference each)
        self._copies: list[BlockCopy] = []
        self.device_evictions = 0
        self.host_evictions = 0
        self.residency = ResidencyJournal()  # conversation -> cached private tokens, with a change journal

    # ---- sequences -------------------------------------------------------------------------------------

    def admit(self, seq_id: int, tokens: Sequence[int], platform_prefix: int, salt: bytes,
              conversation: str | None) -> PrefixHit | None:
        """Starts a sequence, taking every cached full block of its prompt prefix (at least the last token is
        left to compute, so the step can sample). None, holding nothing, when onboarding finds no device room."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already admitted")
        bs = self.block_size
        seq = _SeqBlocks(salt=salt, first_private=platform_prefix // bs, conversation=conversation)
        self._seqs[seq_id] = seq
        host_blocks = 0
        parent = b""
        for i in range((len(tokens) - 1) // bs):
            h = block_hash(parent, tokens[i * bs:(i + 1) * bs], salt if i == seq.first_private else None)
            where = self._where.get(h)
            if where is None:
                break
            tier, block = where
            if tier is Tier.DEVICE:
                self._hold(block)
            elif block in self._host_pins:
                break  # a transfer is reading it: prefill instead (onboarding would move the hash)
            else:
                del self._host_idle[block]  # so the spill that makes device room cannot pick it
                dev = self._allocate()
                if dev is None:
                    self._host_idle[block] = None
                    self.release(seq_id)
                    return None
                self._copies.append(BlockCopy(Tier.HOST, block, Tier.DEVICE, dev))
                self._host_hash[block] = None
                self._host_free.append(block)
                self._dev_hash[dev] = h
                self._where[h] = (Tier.DEVICE, dev)
                block = dev
                host_blocks += 1
            seq.table.append(block)
            seq.hashes.append(h)
            self._retag(h, conversation)
            parent = h
        return PrefixHit(cached_tokens=len(seq.table) * bs, host_cached_tokens=host_blocks * bs)

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Makes the sequence's table cover `num_tokens` positions; all or nothing."""
        table = self._seqs[seq_id].table
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return True
        if need > len(self._dev_free) + len(self._dev_idle):
            return False
        for _ in range(need):
            block = self._allocate()
            assert block is not None
            table.append(block)
        return True

    def commit(self, seq_id: int, tokens: Sequence[int], num_computed: int) -> None:
        """Caches the blocks that `num_computed` computed tokens have filled (tokens[:num_computed] is their KV)."""
        seq = self._seqs[seq_id]
        bs = self.block_size
        i = len(seq.hashes)
        while (i + 1) * bs <= num_computed:
            parent = seq.hashes[-1] if seq.hashes else b""
            h = block_hash(parent, tokens[i * bs:(i + 1) * bs], seq.salt if i == seq.first_private else None)
            seq.hashes.append(h)
            if h not in self._where:  # else an identical block is cached already: ours stays anonymous
                block = seq.table[i]
                self._where[h] = (Tier.DEVICE, block)
                self._dev_hash[block] = h
                if i >= seq.first_private:
                    self._tags[h] = _Tag(seq.salt, None)
                    self._by_salt.setdefault(seq.salt, set()).add(h)
                self._retag(h, seq.conversation)
            i += 1

    def release(self, seq_id: int) -> None:
        """Ends a sequence (finished, cancelled, or preempted): its blocks return tail-first."""
        seq = self._seqs.pop(seq_id)
        for block in reversed(seq.table):
            self._unref(block)

    def table(self, seq_id: int) -> list[int]:
        """The sequence's block table (live: the executor reads it during the step)."""
        return self._seqs[seq_id].table

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def take_copies(self) -> list[BlockCopy]:
        """Tier copies queued since the last call, in the order they must run (before the next step)."""
        copies, self._copies = self._copies, []
        return copies

    @property
    def available_blocks(self) -> int:
        """Device blocks an allocation can take now: free ones plus idle cached ones (evictable)."""
        return len(self._dev_free) + len(self._dev_idle)

    # ---- transfer between replicas ---------------------------------------------------------------------------

    def cached_run(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` this replica caches (either tier): what a prefix pull need not ask for."""
        n = 0
        for h in hashes:
            if h not in self._where:
                break
            n += 1
        return n

    def pin(self, hashes: Sequence[BlockHash], salt: bytes) -> list[PinnedBlock]:
        """Pins the leading run of `hashes` cached here under `salt` (unsalted platform blocks under any), for a
        transfer; the same few dictionary lookups whether a hash is unknown or another owner's."""
        pinned: list[PinnedBlock] = []
        for h in hashes:
            where = self._where.get(h)
            tag = self._tags.get(h)
            if where is None or (tag is not None and tag.salt != salt):
                break
            tier, block = where
            if tier is Tier.DEVICE:
                self._hold(block)
                self._dev_pins[block] = self._dev_pins.get(block, 0) + 1
            else:
                if block not in self._host_pins:
                    del self._host_idle[block]
                self._host_pins[block] = self._host_pins.get(block, 0) + 1
            pinned.append(PinnedBlock(h, tier, block))
        return pinned

    def still_holds(self, p: PinnedBlock) -> bool:
        """The pinned block still caches its hash (False once evicted for deletion meanwhile)."""
        return self._where.get(p.hash) == (p.tier, p.block)

    def unpin(self, pinned: Sequence[PinnedBlock]) -> None:
        """Ends a transfer's hold on its blocks."""
        for p in pinned:
            if p.tier is Tier.DEVICE:
                _release_count(self._dev_pins, p.block)
                self._unref(p.block)
            else:
                if _release_count(self._host_pins, p.block):
                    continue
                if self._host_hash[p.block] is not None:
                    self._host_idle[p.block] = None
                else:  # dropped for deletion while pinned
                    self._host_free.append(p.block)

    def demote(self, served: Sequence[PinnedBlock]) -> None:
        """Moves served private blocks (unpinned, still cached) to the cold end of their LRU, tail first."""
        for p in served:
            if p.hash not in self._tags or not self.still_holds(p):
                continue
            if p.tier is Tier.DEVICE:
                if p.block in self._dev_idle:
                    self._dev_idle.move_to_end(p.block, last=False)
            elif p.block in self._host_idle:
                self._host_idle.move_to_end(p.block, last=False)

    def reserve(self, n: int) -> list[int]:
        """Up to `n` device blocks for an import (free ones first, then LRU idle ones, dropped without a spill)."""
        out: list[int] = []
        while len(out) < n and (block := self._allocate(spill=False)) is not None:
            self._reserved.add(block)
            out.append(block)
        return out

    def unreserve(self, blocks: Sequence[int]) -> None:
        """Frees reserved blocks whose import failed."""
        for block in blocks:
            self._reserved.remove(block)
            self._unref(block)

    def adopt(self, blocks: Sequence[int], hashes: Sequence[BlockHash], first_index: int, platform_prefix: int,
              salt: bytes, conversation: str | None) -> int:
        """Caches imported blocks: `blocks[j]` holds chain block `first_index + j`, hash `hashes[j]`, computed
        under `salt` (salted past the platform prefix). A hash cached meanwhile keeps its own block (the import's
        is freed). Returns how many were cached."""
        first_private = platform_prefix // self.block_size
        adopted = 0
        for j, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            self._reserved.remove(block)
            if h not in self._where:
                self._where[h] = (Tier.DEVICE, block)
                self._dev_hash[block] = h
                if first_index + j >= first_private:
                    self._tags[h] = _Tag(salt, None)
                    self._by_salt.setdefault(salt, set()).add(h)
                self._retag(h, conversation)
                adopted += 1
            self._unref(block)
        return adopted

    # ---- eviction for deletion ---------------------------------------------------------------------------

    def evict_conversation(self, conversation: str, salt: bytes | None = None) -> int:
        """Drops every cached block tagged with the conversation (with `salt`: only those under that owner's salt,
        so one owner's deletion cannot evict another's blocks by naming their conversation), from both tiers;
        returns how many."""
        hashes = self._by_conversation.get(conversation, set())
        if salt is not None:
            hashes = {h for h in hashes if self._tags[h].salt == salt}
        return self._drop_all(hashes)

    def evict_salt(self, salt: bytes) -> int:
        """Drops every cached block under the owner's salt, from both tiers; returns how many."""
        return self._drop_all(self._by_salt.get(salt, set()))

    def stats(self) -> BlockStats:
        return BlockStats(
            device_total=self.cfg.device_blocks, device_free=len(self._dev_free), device_cached=len(self._dev_idle),
            host_total=self.cfg.host_blocks, host_free=len(self._host_free),
            device_evictions=self.device_evictions, host_evictions=self.host_evictions)

    # ---- internals -----------------------------------------------------------------------------------------

    def _unref(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self._dev_hash[block] is not None:
                self._dev_idle[block] = None
            else:
                self._dev_free.append(block)

    def _hold(self, block: int) -> None:
        """One more reference to a cached device block (out of the idle LRU while referenced)."""
        if self._ref[block] == 0:
            del self._dev_idle[block]
        self._ref[block] += 1

    def _allocate(self, spill: bool = True) -> int | None:
        """A device block with no data: a free one, else the LRU idle one, spilled to host (or dropped)."""
        if self._dev_free:
            block = self._dev_free.pop()
            self._ref[block] = 1
            return block
        if not self._dev_idle:
            return None
        block, _ = self._dev_idle.popitem(last=False)
        h = self._dev_hash[block]
        assert h is not None
        self._dev_hash[block] = None
        self.device_evictions += 1
        host = self._host_block() if spill else None
        if host is None:
            self._forget(h)
        else:
            self._copies.append(BlockCopy(Tier.DEVICE, block, Tier.HOST, host))
            self._host_hash[host] = h
            self._host_idle[host] = None
            self._where[h] = (Tier.HOST, host)
        self._ref[block] = 1
        return block

    def _host_block(self) -> int | None:
        if self._host_free:
            return self._host_free.pop()
        if not self._host_idle:
            return None  # no host tier
        host, _ = self._host_idle.popitem(last=False)
        h = self._host_hash[host]
        assert h is not None
        self._host_hash[host] = None
        self.host_evictions += 1
        self._forget(h)
        return host

    def _retag(self, h: BlockHash, conversation: str | None) -> None:
        tag = self._tags.get(h)
        if tag is None or conversation is None or tag.conversation == conversation:
            return
        if tag.conversation is not None:
            _discard(self._by_conversation, tag.conversation, h)
            self._changed(tag.conversation)
        self._tags[h] = _Tag(tag.salt, conversation)
        self._by_conversation.setdefault(conversation, set()).add(h)
        self._changed(conversation)

    def _changed(self, conversation: str) -> None:
        self.residency.set(conversation, len(self._by_conversation.get(conversation, ())) * self.block_size)

    def _forget(self, h: BlockHash) -> None:
        """Removes a hash from the index (its block is being reused or dropped)."""
        del self._where[h]
        tag = self._tags.pop(h, None)
        if tag is None:
            return
        _discard(self._by_salt, tag.salt, h)
        if tag.conversation is not None:
            _discard(self._by_conversation, tag.conversation, h)
            self._changed(tag.conversation)

    def _drop_all(self, hashes: set[BlockHash]) -> int:
        dropped = 0
        for h in list(hashes):
            tier, block = self._where[h]
            self._forget(h)
            if tier is Tier.HOST:
                self._host_hash[block] = None
                if block not in self._host_pins:  # a pinned one is freed when its transfer ends
                    del self._host_idle[block]
                    self._host_free.append(block)
            else:
                self._dev_hash[block] = None
                if self._ref[block] == 0:
                    del self._dev_idle[block]
                    self._dev_free.append(block)
            dropped += 1
        return dropped

    # ---- invariants (tests) -------------------------------------------------------------------------------

    def check(self) -> None:
        """Asserts the structural invariants; tests call it after every operation."""
        n = self.cfg.device_blocks
        refs = [0] * n
        for seq in self._seqs.values():
            for b in seq.table:
                refs[b] += 1
        for b, pins in self._dev_pins.items():
            assert pins > 0
            refs[b] += pins
        for b in self._reserved:
            refs[b] += 1
            assert self._dev_hash[b] is None, "a reserved block has a hash before its import is adopted"
        assert refs == self._ref, "reference counts disagree with the block tables, pins and reservations"
        free, idle = set(self._dev_free), set(self._dev_idle)
        assert len(free) == len(self._dev_free) and not free & idle
        for b in range(n):
            assert self._ref[b] >= 0
            state = (b in free) + (b in idle) + (self._ref[b] > 0)
            assert state == 1, f"device block {b} is in {state} states"
            assert b not in free or self._dev_hash[b] is None
            assert b not in idle or self._dev_hash[b] is not None
        hfree, hpinned = set(self._host_free), set(self._host_pins)
        assert len(hfree) == len(self._host_free) and not hfree & set(self._host_idle)
        assert not hpinned & (hfree | set(self._host_idle)) and all(n > 0 for n in self._host_pins.values())
        assert len(hfree) + len(self._host_idle) + len(hpinned) == self.cfg.host_blocks
        for h, (tier, b) in self._where.items():
            owner = self._dev_hash[b] if tier is Tier.DEVICE else self._host_hash[b]
            assert owner == h, "index points at a block holding other data"
        hashed = sum(x is not None for x in self._dev_hash) + sum(x is not None for x in self._host_hash)
        assert hashed == len(self._where)
        for salt, hs in self._by_salt.items():
            assert all(self._tags[h].salt == salt for h in hs)
        self.residency.check()
        assert self.residency.held() == {c: len(hs) * self.block_size for c, hs in self._by_conversation.items()}


def _release_count(counts: dict[int, int], key: int) -> int:
    """Decrements a pin count, removing it at 0; returns what is left."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
    return left


def _discard(index: dict[K, set[BlockHash]], key: K, h: BlockHash) -> None:
    bucket = index.get(key)
    if bucket is not None:
        bucket.discard(h)
        if not bucket:
            del index[key]
