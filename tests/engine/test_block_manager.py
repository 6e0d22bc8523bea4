"""The block manager: owner-salted reuse, host spill and onboarding, eviction, and a stateful property test
that no sequence of operations leaks a block or drives a reference count negative."""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from chatmesh.engine_adapter.block_manager import BlockConfig, BlockManager, PinnedBlock, PrefixHit, chain_hashes
from chatmesh.engine_adapter.executor import BlockCopy, Tier
from chatmesh.engine_adapter.residency import FROM_START

BS = 4


def _run(bm: BlockManager, seq_id: int, tokens: list[int], prefix: int, salt: bytes,
         conversation: str | None = None) -> PrefixHit:
    """Admits a prompt, computes all of it, and ends the sequence (a turn with no output)."""
    hit = bm.admit(seq_id, tokens, prefix, salt, conversation)
    assert hit is not None
    assert bm.grow(seq_id, len(tokens))
    bm.commit(seq_id, tokens, len(tokens))
    bm.release(seq_id)
    bm.check()
    return hit


SYSTEM = [7] * 8  # a platform prefix of two full blocks


def test_owners_share_only_the_platform_prefix() -> None:
    bm = BlockManager(BlockConfig(BS, 64, 0))
    private = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert _run(bm, 1, SYSTEM + private, len(SYSTEM), b"A").cached_tokens == 0
    # Owner B sends the very same tokens: only the platform prefix is reused.
    assert _run(bm, 2, SYSTEM + private, len(SYSTEM), b"B").cached_tokens == len(SYSTEM)
    # Owner A again: everything but the last, partial block.
    assert _run(bm, 3, SYSTEM + private, len(SYSTEM), b"A").cached_tokens == 16
    # A prefix that ends mid-block: the straddling block is private.
    assert _run(bm, 4, SYSTEM[:6] + [9, 9] + private, 6, b"C").cached_tokens == 4
    assert _run(bm, 5, SYSTEM[:6] + [9, 9] + private, 6, b"D").cached_tokens == 4


def test_next_turn_hits_and_conversation_eviction_makes_it_miss() -> None:
    bm = BlockManager(BlockConfig(BS, 64, 0))
    turn1 = SYSTEM + list(range(20, 33))
    _run(bm, 1, turn1, len(SYSTEM), b"A", "c1")
    turn2 = turn1 + list(range(40, 50))
    assert _run(bm, 2, turn2, len(SYSTEM), b"A", "c1").cached_tokens == 20
    assert bm.evict_conversation("c1") > 0
    assert _run(bm, 3, turn2, len(SYSTEM), b"A", "c1").cached_tokens == len(SYSTEM)  # the shared prefix survives
    assert bm.evict_salt(b"A") > 0
    assert bm.evict_salt(b"A") == 0
    assert _run(bm, 4, turn2, len(SYSTEM), b"A", "c1").cached_tokens == len(SYSTEM)


def test_idle_blocks_spill_to_host_and_come_back() -> None:
    bm = BlockManager(BlockConfig(BS, 6, 8))
    conv_a = [1] * 17  # four full blocks
    _run(bm, 1, conv_a, 0, b"A")
    bm.take_copies()
    _run(bm, 2, [2] * 17, 0, b"B")  # needs five blocks: four of A's spill to host
    spills = bm.take_copies()
    assert spills and all(c.src_tier is Tier.DEVICE and c.dst_tier is Tier.HOST for c in spills)
    assert bm.stats().device_evictions == len(spills)
    hit = bm.admit(3, conv_a + [5], 0, b"A", None)
    assert hit is not None and hit.cached_tokens == 16 and hit.host_cached_tokens > 0
    onboard = [c for c in bm.take_copies() if c.src_tier is Tier.HOST]
    assert len(onboard) * BS == hit.host_cached_tokens
    bm.check()


def test_without_host_tier_evicted_blocks_are_gone() -> None:
    bm = BlockManager(BlockConfig(BS, 5, 0))
    _run(bm, 1, [1] * 17, 0, b"A")
    _run(bm, 2, [2] * 17, 0, b"A")
    assert bm.take_copies() == []
    assert _run(bm, 3, [1] * 17, 0, b"A").cached_tokens == 0


def test_grow_is_all_or_nothing() -> None:
    bm = BlockManager(BlockConfig(BS, 3, 0))
    assert bm.admit(1, [1] * 20, 0, b"", None) is not None
    assert not bm.grow(1, 20)
    assert bm.table(1) == []
    assert bm.grow(1, 12)
    bm.check()


# ---- transfer: pins, reservations, adoption ------------------------------------------------------------------


def test_a_pin_serves_only_the_owners_chain_and_holds_it_against_eviction() -> None:
    bm = BlockManager(BlockConfig(BS, 8, 0))
    tokens = SYSTEM + list(range(20, 29))  # 2 platform blocks + 2 private, and a last token
    _run(bm, 1, tokens, len(SYSTEM), b"A", "c1")
    hashes = chain_hashes(tokens, len(SYSTEM), b"A", BS)
    assert len(hashes) == 4 and bm.cached_run(hashes) == 4
    # another owner naming A's hashes: the platform blocks are anyone's, the private ones read as not held
    shared = bm.pin(hashes, b"B")
    assert [p.hash for p in shared] == hashes[:2]
    assert bm.pin(hashes[2:], b"B") == [] == bm.pin([b"\0" * 16], b"A")
    bm.unpin(shared)
    pinned = bm.pin(hashes[2:], b"A")
    assert len(pinned) == 2
    bm.check()
    # pressure: another owner needs every block; the pinned ones are never taken
    hit = bm.admit(2, [5] * 33, 0, b"C", None)
    assert hit is not None and not bm.grow(2, 33)
    assert bm.grow(2, 24)
    assert all(bm.still_holds(p) for p in pinned)
    bm.release(2)
    # deletion while pinned: the hashes go at once, the blocks when the transfer ends
    assert bm.evict_conversation("c1") == 2
    assert not any(bm.still_holds(p) for p in pinned)
    bm.check()
    bm.unpin(pinned)
    bm.check()
    assert bm.available_blocks == 8


def test_a_pinned_host_block_is_never_dropped_and_admission_prefills_instead_of_onboarding_it() -> None:
    bm = BlockManager(BlockConfig(BS, 5, 4))
    a = [1] * 17
    _run(bm, 1, a, 0, b"A")
    _run(bm, 2, [2] * 17, 0, b"B")  # A's four blocks spill to host
    bm.take_copies()
    hashes = chain_hashes(a, 0, b"A", BS)
    pinned = bm.pin(hashes, b"A")
    assert [p.tier for p in pinned] == [Tier.HOST] * 4
    hit = bm.admit(3, a, 0, b"A", None)
    assert hit is not None and hit.cached_tokens == 0  # no onboarding of a block a transfer reads
    bm.release(3)
    for i in range(3):  # host-tier pressure: every other spill takes other host blocks, never the pinned
        _run(bm, 10 + i, [3 + i] * 17, 0, b"C")
    assert all(bm.still_holds(p) for p in pinned)
    bm.unpin(pinned)
    bm.check()
    hit = bm.admit(4, a, 0, b"A", None)
    assert hit is not None and hit.cached_tokens == 16 and hit.host_cached_tokens == 16


def test_served_private_blocks_are_demoted_to_the_cold_end_and_evicted_first() -> None:
    bm = BlockManager(BlockConfig(BS, 10, 0))
    served = SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8, 9]  # 2 shared + 2 private blocks
    _run(bm, 2, SYSTEM + [5, 5, 5, 5, 9], len(SYSTEM), b"B", "stays")  # 1 private block of B, older
    _run(bm, 1, served, len(SYSTEM), b"A", "moved")  # A's are the most recently used
    pinned = bm.pin(chain_hashes(served, len(SYSTEM), b"A", BS), b"A")
    bm.unpin(pinned)
    bm.demote(pinned)
    bm.check()
    # room for 7 blocks: the 5 free, then A's 2 demoted private ones; B's and the shared prefix stay
    assert bm.admit(3, [4] * 29, 0, b"C", None) is not None and bm.grow(3, 28)
    assert bm.residency.held() == {"stays": 4}
    bm.release(3)
    assert _run(bm, 4, SYSTEM + [5, 5, 5, 5, 9], len(SYSTEM), b"B").cached_tokens == 12


def test_an_adopted_import_is_a_cached_prefix_of_its_owner_and_conversation() -> None:
    bm = BlockManager(BlockConfig(BS, 8, 0))
    tokens = SYSTEM + list(range(20, 29))
    hashes = chain_hashes(tokens, len(SYSTEM), b"A", BS)
    _run(bm, 1, SYSTEM + [99], len(SYSTEM), b"A")  # the shared prefix is here already
    own = bm.cached_run(hashes)
    assert own == 2
    blocks = bm.reserve(2)
    assert len(blocks) == 2
    bm.check()
    assert bm.adopt(blocks, hashes[own:], own, len(SYSTEM), b"A", "c9") == 2
    bm.check()
    assert bm.residency.held() == {"c9": 8}
    hit = bm.admit(2, tokens, len(SYSTEM), b"A", "c9")
    assert hit is not None and hit.cached_tokens == 16
    bm.release(2)
    assert bm.admit(3, tokens, len(SYSTEM), b"B", None) == PrefixHit(8, 0)  # still salted: B gets only the shared
    bm.release(3)
    # a failed import gives its reservation back; reserving never takes what is referenced or pinned
    pinned = bm.pin(hashes, b"A")
    got = bm.reserve(100)
    assert len(got) == 8 - 4 and not set(got) & {p.block for p in pinned}
    bm.unreserve(got)
    bm.unpin(pinned)
    bm.check()
    assert bm.available_blocks == 8


# ---- stateful property test ----------------------------------------------------------------------------


@dataclass
class _Seq:
    seq_id: int
    tokens: list[int]
    computed: int = 0
    prefix: int = 0
    salt: bytes = b""
    extra: list[int] = field(default_factory=list)


class BlockMachine(RuleBasedStateMachine):
    """Random admissions, chunked computation, extension by sampled tokens, finish/cancel, eviction."""

    seqs = Bundle("seqs")
    pins = Bundle("pins")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(BlockConfig(BS, 12, 6))
        self.open_pins: dict[int, list[PinnedBlock]] = {}
        self.bm.residency.slack = 2  # compact often, so watchers also meet resyncs
        self.next_id = 0
        self.watched: dict[str, int] = {}  # what a watcher rebuilt from the journal (residency.py)
        self.cursor = FROM_START

    @rule(target=seqs, tokens=st.lists(st.integers(1, 3), min_size=1, max_size=40),
          prefix=st.integers(0, 12), salt=st.sampled_from([b"a", b"b"]), conv=st.sampled_from(["c1", "c2", None]))
    def admit(self, tokens: list[int], prefix: int, salt: bytes, conv: str | None) -> _Seq | None:
        self.next_id += 1
        prefix = min(prefix, len(tokens))
        hit = self.bm.admit(self.next_id, tokens, prefix, salt, conv)
        if hit is None:
            return None
        assert hit.cached_tokens % BS == 0 and hit.cached_tokens < len(tokens)
        assert hit.host_cached_tokens <= hit.cached_tokens
        return _Seq(self.next_id, list(tokens), hit.cached_tokens, prefix, salt)

    @rule(seq=seqs, chunk=st.integers(1, 16))
    def compute(self, seq: _Seq | None, chunk: int) -> None:
        if seq is None or not self.bm.holds(seq.seq_id):
            return
        n = min(len(seq.tokens), seq.computed + chunk)
        if self.bm.grow(seq.seq_id, n):
            seq.computed = n
            self.bm.commit(seq.seq_id, seq.tokens, n)

    @rule(seq=seqs, token=st.integers(1, 3))
    def extend(self, seq: _Seq | None, token: int) -> None:
        if seq is None or not self.bm.holds(seq.seq_id) or seq.computed < len(seq.tokens):
            return
        seq.tokens.append(token)  # a sampled token; computing it is the next decode step

    @rule(seq=consumes(seqs))
    def finish(self, seq: _Seq | None) -> None:
        if seq is not None and self.bm.holds(seq.seq_id):
            self.bm.release(seq.seq_id)

    @rule(conv=st.sampled_from(["c1", "c2"]))
    def evict_conversation(self, conv: str) -> None:
        assert self.bm.evict_conversation(conv) >= 0
        assert self.bm.evict_conversation(conv) == 0

    @rule(salt=st.sampled_from([b"a", b"b"]))
    def evict_salt(self, salt: bytes) -> None:
        self.bm.evict_salt(salt)
        assert self.bm.evict_salt(salt) == 0

    @rule(target=pins, tokens=st.lists(st.integers(1, 3), min_size=1, max_size=40), prefix=st.integers(0, 12),
          salt=st.sampled_from([b"a", b"b"]), asker=st.sampled_from([b"a", b"b"]))
    def pin(self, tokens: list[int], prefix: int, salt: bytes, asker: bytes) -> int:
        """A source pins what a puller under `asker`'s salt names (hashes computed under `salt`)."""
        pinned = self.bm.pin(chain_hashes(tokens, min(prefix, len(tokens)), salt, BS), asker)
        for p in pinned:
            tag = self.bm._tags.get(p.hash)
            assert tag is None or tag.salt == asker, "a pin served another owner's block"
        self.next_id += 1
        key = self.next_id
        self.open_pins[key] = pinned
        return key

    @rule(key=consumes(pins))
    def unpin(self, key: int) -> None:
        self.bm.unpin(self.open_pins.pop(key))

    @rule(tokens=st.lists(st.integers(1, 3), min_size=1, max_size=40), prefix=st.integers(0, 12),
          salt=st.sampled_from([b"a", b"b"]), conv=st.sampled_from(["c1", "c2", None]), ok=st.booleans())
    def pull(self, tokens: list[int], prefix: int, salt: bytes, conv: str | None, ok: bool) -> None:
        """A puller reserves blocks for what its cache lacks, then adopts them (or the transfer failed)."""
        prefix = min(prefix, len(tokens))
        hashes = chain_hashes(tokens, prefix, salt, BS)
        own = self.bm.cached_run(hashes)
        got = self.bm.reserve(len(hashes) - own)
        self.bm.check()
        if ok:
            self.bm.adopt(got, hashes[own:own + len(got)], own, prefix, salt, conv)
        else:
            self.bm.unreserve(got)

    @rule()
    def run_copies(self) -> None:
        for copy in self.bm.take_copies():
            assert isinstance(copy, BlockCopy) and copy.src_tier is not copy.dst_tier

    @rule()
    def watch(self) -> None:
        """A watcher (the router) applying the journal's changes knows exactly what is cached per conversation."""
        changes = self.bm.residency.changes(self.cursor)
        if changes.full:
            self.watched.clear()
        for conversation, tokens in changes.conversations:
            if tokens:
                self.watched[conversation] = tokens
            else:
                self.watched.pop(conversation, None)
        self.cursor = changes.version
        assert self.watched == self.bm.residency.held()

    @invariant()
    def consistent(self) -> None:
        self.bm.check()
        s = self.bm.stats()
        assert s.device_used + s.device_free == s.device_total
        assert s.host_used + s.host_free == s.host_total
        assert 0 <= s.device_free <= s.device_total and 0 <= s.host_free <= s.host_total

    def teardown(self) -> None:
        for seq_id in list(self.bm._seqs):
            self.bm.release(seq_id)
        for pinned in self.open_pins.values():
            self.bm.unpin(pinned)
        self.bm.check()
        assert self.bm.available_blocks == self.bm.cfg.device_blocks  # nothing leaked


BlockMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_block_machine = BlockMachine.TestCase


@settings(max_examples=150, deadline=None)
@given(turns=st.lists(st.tuples(st.sampled_from([b"A", b"B", b"C"]), st.sampled_from([0, 4, 6, 8]),
                                st.lists(st.integers(1, 2), min_size=1, max_size=24)), min_size=1, max_size=12),
       device=st.integers(4, 16), host=st.integers(0, 8))
def test_a_hit_only_ever_reuses_what_the_same_owner_or_the_shared_prefix_computed(
        turns: list[tuple[bytes, int, list[int]]], device: int, host: int) -> None:
    """Safety of owner salting (I1): every block a prompt is served from was computed earlier either wholly inside
    the platform prefix (shared) or under the same salt with the same platform prefix."""
    bm = BlockManager(BlockConfig(BS, device, host))
    computed: set[tuple[object, ...]] = set()

    def key(salt: bytes, prefix: int, tokens: list[int], i: int) -> tuple[object, ...]:
        end = (i + 1) * BS
        return ("shared", tuple(tokens[:end])) if end <= prefix else (salt, prefix // BS, tuple(tokens[:end]))

    for seq_id, (salt, prefix, user) in enumerate(turns):
        tokens = [7] * prefix + user
        hit = bm.admit(seq_id, tokens, prefix, salt, None)
        if hit is None:
            continue
        for i in range(hit.cached_tokens // BS):
            assert key(salt, prefix, tokens, i) in computed
        if bm.grow(seq_id, len(tokens)):
            bm.commit(seq_id, tokens, len(tokens))
            computed.update(key(salt, prefix, tokens, i) for i in range(len(tokens) // BS))
        bm.release(seq_id)
        bm.check()


def test_evicting_a_conversation_under_a_salt_drops_that_owners_blocks_only() -> None:
    """Issue 30: an owner's deletion of a conversation id evicts its own blocks of it, never another owner's (the
    engine passes the verified owner's salt)."""
    bm = BlockManager(BlockConfig(BS, 64, 0))
    for seq, salt in ((1, b"alice"), (2, b"bob")):
        _run(bm, seq, SYSTEM + list(range(20, 40)), len(SYSTEM), salt, "shared-id")
    assert bm.evict_conversation("shared-id", b"mallory") == 0
    alices = bm.evict_conversation("shared-id", b"alice")
    assert alices > 0 and bm.evict_conversation("shared-id", b"alice") == 0
    assert bm.evict_conversation("shared-id") > 0  # unscoped (plaintext, no owner): what is left, bob's
