"""Routing that follows the KV: send a turn where its conversation's prefix is cached, a turn with nothing to
lose where load is lowest, keep every replica under a load bound, and (with pulls) let a turn that must move take
its prefix along from the cheapest source instead of recomputing it.

Why. Consistent hashing (ring.py) keeps a conversation on one replica, which is what makes its prefix hit
(the reference's Part 2: ~95% of prompt tokens cached with affinity, ~52% without), but a hash knows nothing of
load: in the reference's setup the busiest replica carries 1.7x the average at p99. The ring's bounded-load walk
caps that, yet every turn it spills misses its whole history on the replica it lands on, and returns home a turn
out of date: at eps 0.25 it loses 4 points of hit rate. Two facts let a router do better. An eighth of all
turns are first turns, which have nothing cached but the shared system prompt and can go anywhere for free; and
a turn that must move can move its conversation with it, paying one miss instead of two. Pulls remove the miss
itself: an engine can take a prefix's KV blocks from a peer (GenerateService.PullPrefix, issue 29) in ~1.7 ms for
the reference's 3,000-token prompt against ~67 ms to prefill it (link.py), so a move costs almost nothing and the
bound can be as tight as the ring's tightest.

How (`Follow.pick`).
- Placement (`Placement`): for each conversation, the replicas caching its private (owner-salted) prefix and how
  many tokens each, learned from two sources: the engines' residency reports (WatchStats include_residency,
  engine_adapter/residency.py: counts per conversation, 0 once evicted or deleted), and this router's own picks
  (a turn sent to r leaves r holding the conversation's newest prefix, so r becomes its home at once, before r
  reports). The conversation's *home* is the replica caching the most of it (ties: the lowest replica id, so
  the table is the same whatever order reports arrive in). The router never sees text.
- The bound: with m = the serving replicas' load counting the incoming turn and n of them, a replica takes a turn
  while its load is under B = max(floor, ceil((1 + eps) m / n)) (ring.py's rule). With pulls, a conversation
  whose prefix some replica can serve a pull of (*pullable*) is held to the tighter B' with `pull_eps` for eps.
- ... and a turn whose home caches T tokens of it may stay home past B up to one sequence per `hold_tokens` a
  move would cost, never past the cap C = max(floor, ceil((1 + eps + overshoot) m / n)). Without a possible pull
  a move costs T (it prefills the history); with one it costs what the move is priced at (below), so a pullable
  prefix of the reference's size buys no overshoot: 3,000 tokens pull for the price of 77 prefilled.
- A turn with a home that is serving, not excluded and under its allowance goes home (outcome HOME). Otherwise
  it goes to the serving, not excluded replica under the bound whose move costs least: without pulls the one
  caching the most of its prefix (a stale copy left by an earlier move saves all but the turns since), with
  pulls the cheapest by the price below; then the least loaded, ties in the conversation's ring walk order (so
  equal replicas are not chosen in one fixed order). A conversation known nowhere (a first turn, or its blocks
  were evicted everywhere) is PLACED so; one with a home is a spill (over the bound, home down, home draining,
  home excluded). Either way the chosen replica becomes the home: a moved conversation stays where it moved.
  If no replica is under the bound, the least-loaded usable one takes it (the ring's rule).
- Pricing (pulls on, `pulls` = link.PrefixCost): for a candidate r caching `own` tokens of a conversation whose
  best copy holds `top`, its own tokens are free, a pullable prefix costs its bytes over the link, the rest costs
  prefill: price(r) = pull(s) + prefill(top - tokens(s)) with s the source below, else prefill(top - own); in
  prefill-token equivalents a pull of t tokens is latency x rate + t x KV bytes x rate / bandwidth.
- The source (`source_for`): the replica serving pulls (`set_pulls`: the engine says it serves them, it is
  serving or draining, it is not excluded) caching the most of the prefix, with the same KV layout as the
  target (blocks move only between equal layouts), when that is at least `break_even` tokens more than the target
  holds (below ~23 tokens the transfer's latency outweighs the prefill saved): so a pull is planned only when it
  costs less than prefilling what it brings, and the whole move never costs more than recompute. A target that
  cannot receive pulls (triton) gets no source and is priced at full prefill. The pick names the source
  (Pick.source, PickReplicaResponse.source_replica_id); the engine pulls what its own cache lacks and prefills
  the rest, and any failure of the pull falls back to prefill.
- Draining: an engine that got SIGTERM stops serving turns but keeps answering pulls through its grace period
  (it reports `draining`): it is not serving and still a source, so each of its conversations' next turns moves
  (SPILL_HOME_DRAINING) naming it as the source. Once it is gone it is no source: the next best copy, if any.
- Load, leases, health and the walk order are the ring's (ring.py): engine-reported in-flight sequences plus
  this router's open leases.

Interchangeable routers: the choice is a function of the membership, the loads, the pull roles, the placement
table and the conversation id, with ties broken by the ring's deterministic walk and the table's lowest-id rule,
so two router processes that have seen the same picks and reports choose the same replica and source, and a
router that restarts rebuilds the table from each engine's full listing (a new stats stream starts with one).
Routers that share traffic learn each other's placements from the engines' reports within one stats interval
(500 ms against the ~60 s between a user's turns).

Parameters and defaults (chosen with `chatmesh simulate`, docs/simulate/README.md, where the whole trade-off
between hit rate and max/avg load is plotted, pulls off and on):
- `eps` = 0.2 (CHATMESH_ROUTER_EPS): the bound's slack over the average for a prefix no move can pull.
- `pull_eps` = 0.05 (CHATMESH_ROUTER_PULL_EPS): the slack for a pullable prefix. The simulator's curve with pulls
  (8 replicas, the reference's setup): prompt tokens served without prefill stay at 95.4% from eps 0.2 (p99
  max/avg 1.25) down to 0.05 (p99 1.12) and 0.02 (1.09): a move loses nothing, so the bound costs only pulls,
  12% of turns at 0.05 (1.2 ms each) and 0.02% of a replica's link. 0.05 matches the ring's tightest setting's
  balance (p99 1.12) and moves a third as many turns as it.
- `hold_tokens` = 1,600: move-cost tokens that buy one sequence over the bound (about half the reference's
  3,000-token prompt: without pulls a conversation past its third turn may stay home one over, past its fifth
  two over). 0 disables the overshoot.
- `overshoot` = 0.15: the cap C is (1 + eps + overshoot) x the average.
- `floor` = 16 (CHATMESH_ROUTER_MIN_SPILL_LOAD): a replica running fewer than 16 sequences never sends a turn
  away from its prefix (an engine batches hundreds): at low traffic turns stay home, the bound acts when load is
  real (the bound is at least the floor).
- `pulls` (CHATMESH_ROUTER_PULLS, on): the cost model (link.py: 8 x 400 Gb/s per replica, 0.5 ms a transfer,
  160 KiB a token, 44,850 prefill tokens/s); None plans no pulls and picks exactly as before pulls.
- `max_conversations` = 262,144 placement entries (least recently picked dropped first: a dropped conversation
  is treated as new). 13 reference fleets' worth of open conversations; ~100 MB.
What it achieves (`chatmesh simulate`, the reference's setup: 4,000 conversations x 8 turns, 8 replicas, 2 M
tokens each): without pulls 94.5% of prompt tokens cached at a p99 max/avg load of 1.30, where unbounded
consistent hashing gets 95.3% at 1.69 and the ring's bound at eps 0.25 91.1% at 1.31. With pulls, 95.4% served
without prefill (88.4% cached, 7.0% pulled) at 1.12: every policy's ceiling at this cache size (the working set
overflows 2 M tokens, and pure affinity gets 95.4% too), at the balance of the ring's eps 0.05, which without
pulls gets 77.5%. BENCHMARKS.md has 16 and 64 replicas.

Cost. The usual pick (home known and under the bound) hashes nothing: a dict lookup of the home, one
comparison, a move to the end of the placement's LRU, the lease. Placing or moving a turn walks the ring as
ring.py does (one blake2b, a bisect, a cached walk) and scans the serving replicas once; with pulls each
candidate's price looks at the conversation's few copies. A report costs O(conversations in it). The table
keeps, per conversation, a small dict of replicas and, per replica, the set of its conversations (for full
listings and removal).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable

from chatmesh.mesh.errors import Unavailable
from chatmesh.mesh.ids import ConversationId, ReplicaId
from chatmesh.router.link import PrefixCost
from chatmesh.router.ring import DEFAULT_LEASE_TTL_S, DEFAULT_VNODES, Pick, PickOutcome, Replica, Ring

DEFAULT_EPS = 0.2
DEFAULT_PULL_EPS = 0.05
DEFAULT_HOLD_TOKENS = 1600
DEFAULT_OVERSHOOT = 0.15
DEFAULT_FLOOR = 16
DEFAULT_MAX_CONVERSATIONS = 1 << 18

_HOME, _PLACED, _OVER = PickOutcome.HOME, PickOutcome.PLACED, PickOutcome.SPILL_OVER_BOUND
_DOWN, _EXCLUDED = PickOutcome.SPILL_HOME_DOWN, PickOutcome.SPILL_EXCLUDED
_DRAINING = PickOutcome.SPILL_HOME_DRAINING
_NO_EXCLUSIONS: frozenset[ReplicaId] = frozenset()


class Placement:
    """Which replicas cache which conversations' prefixes, in tokens, and each conversation's home."""

    def __init__(self, max_conversations: int = DEFAULT_MAX_CONVERSATIONS) -> None:
        if max_conversations < 1:
            raise ValueError("max_conversations must be at least 1")
        self.max_conversations = max_conversations
        # conversation -> {replica: cached tokens}; order = least recently picked first
        self._held: OrderedDict[ConversationId, dict[ReplicaId, int]] = OrderedDict()
        self._home: dict[ConversationId, ReplicaId] = {}
        self._by_replica: dict[ReplicaId, set[ConversationId]] = {}

    def home(self, conversation: ConversationId) -> ReplicaId | None:
        """The replica caching the most of the conversation's prefix (None: known nowhere)."""
        return self._home.get(conversation)

    def held(self, conversation: ConversationId) -> dict[ReplicaId, int]:
        """Replica -> cached tokens for the conversation (a copy; empty when known nowhere)."""
        return dict(self._held.get(conversation, ()))

    def conversations(self, replica: ReplicaId) -> int:
        return len(self._by_replica.get(replica, ()))

    def tokens(self, replica: ReplicaId) -> int:
        """Tokens the table says `replica` caches, over its conversations (O(its conversations): for listings)."""
        held = self._held
        return sum(held[c][replica] for c in self._by_replica.get(replica, ()))

    def __len__(self) -> int:
        return len(self._held)

    def picked(self, conversation: ConversationId, replica: ReplicaId) -> None:
        """A turn went to `replica`: it will hold the conversation's newest prefix, so it is the home now."""
        held = self._held.get(conversation)
        if held is None:
            held = self._held[conversation] = {}
            if len(self._held) > self.max_conversations:
                self._forget(next(iter(self._held)))
        else:
            self._held.move_to_end(conversation)
            if self._home[conversation] == replica:
                return  # already the home, so already the most tokens
        held[replica] = max(held.values(), default=0) + 1
        self._by_replica.setdefault(replica, set()).add(conversation)
        self._home[conversation] = replica

    def report(self, replica: ReplicaId, conversations: Iterable[tuple[ConversationId, int]],
               full: bool = False) -> None:
        """An engine's residency update: (conversation, cached tokens; 0: none left). `full` replaces everything
        known of `replica` (what is not listed is not there)."""
        if full:
            self.drop_replica(replica)
        known = self._by_replica.setdefault(replica, set())
        homes = self._home
        for conversation, tokens in conversations:
            held = self._held.get(conversation)
            if tokens <= 0:
                if held is not None and held.pop(replica, None) is not None:
                    known.discard(conversation)
                    self._rehome(conversation)
                continue
            if held is None:
                held = self._held[conversation] = {}
                self._held.move_to_end(conversation, last=False)  # learned, not picked: first to go
                if len(self._held) > self.max_conversations:
                    self._forget(next(iter(self._held)))
                    continue
            old = held.get(replica)
            held[replica] = tokens
            if old is None:
                known.add(conversation)
            home = homes.get(conversation)
            if home is None or (home != replica and (tokens > held[home] or (tokens == held[home] and replica < home))):
                homes[conversation] = replica  # ties go to the lowest id: the table does not depend on report order
            elif home == replica and old is not None and tokens < old:
                self._rehome(conversation)  # it shrank: another copy may hold more now

    def drop_replica(self, replica: ReplicaId) -> None:
        """Forgets everything cached on `replica` (it left, or restarts its listing)."""
        for conversation in self._by_replica.pop(replica, ()):
            held = self._held.get(conversation)
            if held is not None:
                held.pop(replica, None)
                self._rehome(conversation)

    def _rehome(self, conversation: ConversationId) -> None:
        held = self._held[conversation]
        if not held:
            del self._held[conversation]
            self._home.pop(conversation, None)
            return
        self._home[conversation] = min(held, key=lambda r: (-held[r], r))

    def _forget(self, conversation: ConversationId) -> None:
        for replica in self._held.pop(conversation, {}):
            self._by_replica[replica].discard(conversation)
        self._home.pop(conversation, None)

    def check(self) -> None:
        """Asserts the table's invariants (tests)."""
        assert len(self._held) <= self.max_conversations
        assert set(self._home) == set(self._held)
        for conversation, held in self._held.items():
            assert held and all(t > 0 for t in held.values())
            assert self._home[conversation] == min(held, key=lambda r: (-held[r], r))
            assert all(conversation in self._by_replica[r] for r in held)
        for replica, conversations in self._by_replica.items():
            assert all(replica in self._held[c] for c in conversations)


class Follow(Ring):
    """A ring (its membership, loads, leases and walk order, ring.py) whose picks follow the KV; with a cost
    model (`pulls`), a turn that moves takes its prefix along from the cheapest source."""

    def __init__(self, replicas: Iterable[Replica] = (), *, placement: Placement | None = None,
                 vnodes: int = DEFAULT_VNODES, eps: float = DEFAULT_EPS, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 min_spill_load: int = DEFAULT_FLOOR, hold_tokens: int = DEFAULT_HOLD_TOKENS,
                 overshoot: float = DEFAULT_OVERSHOOT, pulls: PrefixCost | None = None,
                 pull_eps: float = DEFAULT_PULL_EPS) -> None:
        if overshoot < 0:
            raise ValueError("overshoot must be >= 0")
        if pull_eps < 0:
            raise ValueError("pull_eps must be >= 0")
        if hold_tokens < 0:
            raise ValueError("hold_tokens must be >= 0")
        self.placement = placement or Placement()
        self.hold_tokens, self.overshoot = hold_tokens, overshoot
        self.pulls = pulls
        self.pull_eps = pull_eps if pulls is not None else eps
        self._pull_factor = 1.0 + self.pull_eps
        # read on every pick; Placement keeps them current
        self._held, self._homes = self.placement._held, self.placement._home
        # pulls: replicas that serve pulls now (capable, and serving or draining) and that can receive them
        self._sources: set[ReplicaId] = set()
        self._pullers: set[ReplicaId] = set()
        self._layouts: dict[ReplicaId, Hashable] = {}  # blocks move only between equal layouts (None: any)
        if pulls is not None:  # a pull of t tokens costs a + b t prefill-token equivalents
            rate = pulls.prefill_tokens_per_s
            self._pull_a = pulls.link.latency_s * rate
            self._pull_b = pulls.kv_bytes_per_token * rate / pulls.link.bandwidth_bytes_s
            try:
                self._min_pull = pulls.break_even_tokens()
            except ValueError:  # the link is slower per token than prefill: no pull is ever planned
                self._min_pull = 1 << 62
        super().__init__(replicas, vnodes=vnodes, eps=eps, lease_ttl_s=lease_ttl_s, min_spill_load=min_spill_load)

    def add(self, replica: Replica, serving: bool = True) -> None:
        new = replica.id not in self._replicas
        super().add(replica, serving)
        if new and self.pulls is not None:  # capable until the caller says otherwise (set_pulls)
            self._sources.add(replica.id)
            self._pullers.add(replica.id)

    def remove(self, replica_id: ReplicaId) -> None:
        super().remove(replica_id)
        self.placement.drop_replica(replica_id)
        self._sources.discard(replica_id)
        self._pullers.discard(replica_id)
        self._layouts.pop(replica_id, None)

    def set_pulls(self, replica_id: ReplicaId, serves: bool, receives: bool, layout: Hashable = None) -> None:
        """Whether the replica serves pulls of what it caches now (capable, and serving or draining: a replica
        that is not serving but serves pulls is draining), whether it can pull before prefill, and its KV
        layout (a pull is planned only between replicas whose layouts are equal)."""
        self._require(replica_id)
        if self.pulls is None:
            return
        (self._sources.add if serves else self._sources.discard)(replica_id)
        (self._pullers.add if receives else self._pullers.discard)(replica_id)
        self._layouts[replica_id] = layout

    def pull_roles(self, replica_id: ReplicaId) -> tuple[bool, bool]:
        """(serves pulls, receives pulls) as the policy plans them."""
        return replica_id in self._sources, replica_id in self._pullers

    def layout(self, replica_id: ReplicaId) -> Hashable:
        """The KV layout the replica last reported (None: unknown, or pulls off)."""
        return self._layouts.get(replica_id)

    def draining(self, replica_id: ReplicaId) -> bool:
        return replica_id not in self._serving and replica_id in self._sources

    def bounds(self, pullable: bool = False) -> tuple[int, int]:
        """(B, C) for the next pick: the bound every replica is held to, and the cap a held prefix may reach;
        `pullable`: for a conversation whose prefix a move can pull (eps is then pull_eps)."""
        avg = (self._total + 1) / max(1, len(self._serving))
        factor = self._pull_factor if pullable else self._factor
        return (max(self.min_spill_load, math.ceil(factor * avg - 1e-9)),
                max(self.min_spill_load, math.ceil((factor + self.overshoot) * avg - 1e-9)))

    def pullable(self, conversation: ConversationId, exclude: frozenset[ReplicaId] = _NO_EXCLUSIONS) -> bool:
        """Pulls are on and a replica serving pulls (not excluded) caches some of the conversation's prefix."""
        held = self._held.get(conversation)
        if self.pulls is None or held is None:
            return False
        sources = self._sources
        return any(rid in sources and rid not in exclude for rid in held)

    def pick(self, conversation: ConversationId, now: float,
             exclude: frozenset[ReplicaId] = _NO_EXCLUSIONS) -> Pick:
        """Chooses the replica for one turn (and, with pulls, the source of its prefix) and opens a lease."""
        if now >= self._next_expiry:
            self.expire(now)
        serving = self._serving
        if not serving:
            reason = "no replica is configured" if not self._replicas else (
                f"none of {len(self._replicas)} replicas is serving")
            raise Unavailable(f"no healthy replica: {reason}")
        avg = (self._total + 1) / len(serving)
        limit, tight = self._factor * avg - 1e-9, self._pull_factor * avg - 1e-9  # equal without pulls
        home = self._homes.get(conversation)
        if home is not None and home in serving and home not in exclude:
            h = self._load[home]
            if h < tight or h < self.min_spill_load:
                self._held.move_to_end(conversation)  # placement.picked(), for a turn that stays home
                return self.lease_on(home, home, _HOME, now)
            pullable = self.pullable(conversation, exclude)
            if not pullable and h < limit:
                self._held.move_to_end(conversation)
                return self.lease_on(home, home, _HOME, now)
            bound = max(self.min_spill_load, math.ceil(tight if pullable else limit))
            chosen = self._elsewhere(conversation, home, bound, exclude)
            if chosen == home or (self.hold_tokens and
                                  h < self._allowance(conversation, home, chosen, exclude, pullable)):
                self._held.move_to_end(conversation)
                return self.lease_on(home, home, _HOME, now)
        else:
            pullable = home is not None and self.pullable(conversation, exclude)
            bound = max(self.min_spill_load, math.ceil(tight if pullable else limit))
            chosen = self._elsewhere(conversation, home, bound, exclude)
        if home is None:
            outcome, home = _PLACED, chosen
        elif chosen == home:
            outcome = _HOME  # every usable replica is over the bound and the home is the least loaded
        elif home not in serving:
            outcome = _DRAINING if home in self._sources else _DOWN
        elif home in exclude:
            outcome = _EXCLUDED
        else:
            outcome = _OVER
        source, source_tokens = self.source_for(conversation, chosen, exclude)
        self.placement.picked(conversation, chosen)
        return self.lease_on(chosen, home, outcome, now, source, source_tokens)

    def source_for(self, conversation: ConversationId, target: ReplicaId,
                   exclude: frozenset[ReplicaId] = _NO_EXCLUSIONS) -> tuple[ReplicaId | None, int]:
        """The replica `target` should pull the conversation's prefix from, and the tokens it caches: the source
        (serving pulls, not excluded, the target's layout) caching the most (ties: lowest id), when that is more than `target` caches and pulling the
        difference costs less than prefilling it. (None, 0) without pulls or when prefill is as cheap."""
        held = self._held.get(conversation)
        if self.pulls is None or held is None or target not in self._pullers:
            return None, 0
        own = held.get(target, 0)
        best, best_tokens = None, own + self._min_pull - 1
        layouts = self._layouts
        layout = layouts.get(target)
        for rid, tokens in held.items():  # ties: the lowest id, whatever order the table learned them in
            if ((tokens > best_tokens or (tokens == best_tokens and best is not None and rid < best))
                    and rid != target and rid in self._sources and rid not in exclude and layouts.get(rid) == layout):
                best, best_tokens = rid, tokens
        return (best, best_tokens) if best is not None else (None, 0)

    def move_cost(self, conversation: ConversationId, target: ReplicaId,
                  exclude: frozenset[ReplicaId] = _NO_EXCLUSIONS) -> float:
        """What moving the conversation's next turn to `target` costs against its home, in prefill-token
        equivalents: the tokens `target` must prefill that the home caches, plus any pull priced by the link."""
        held = self._held.get(conversation)
        if not held:
            return 0.0
        top = max(held.values())
        own = held.get(target, 0)
        source, tokens = self.source_for(conversation, target, exclude)
        if source is None:
            return float(max(0, top - own))
        return self._pull_a + self._pull_b * (tokens - own) + max(0, top - tokens)

    def _allowance(self, conversation: ConversationId, home: ReplicaId, chosen: ReplicaId,
                   exclude: frozenset[ReplicaId], pullable: bool) -> int:
        """The load under which a turn may stay home: B plus one per `hold_tokens` a move to `chosen` would cost
        (a prefix no move can pull: every token cached at home), at most C."""
        bound, cap = self.bounds(pullable)
        if pullable:
            cost = math.ceil(self.move_cost(conversation, chosen, exclude))
        else:
            cost = self._held[conversation][home]
        return min(cap, bound + cost // self.hold_tokens)

    def _elsewhere(self, conversation: ConversationId, home: ReplicaId | None, bound: int,
                   exclude: frozenset[ReplicaId]) -> ReplicaId:
        """The serving, not excluded replica under `bound` that a move costs least (without pulls: the one
        caching most of the prefix), then least loaded, ties in walk order (the home skipped: it was over its
        allowance, down or excluded); none under the bound: the least-loaded usable replica, the home included."""
        serving, load = self._serving, self._load
        held = self._held.get(conversation)
        priced = held is not None and self.pulls is not None
        prices: dict[tuple[bool, Hashable], float] = {}
        best = fallback = None
        best_cost = 0.0
        best_load = fallback_load = 0
        for rid in self.walk(conversation):
            if rid not in serving or rid in exclude:
                continue
            lr = load[rid]
            if fallback is None or lr < fallback_load:
                fallback, fallback_load = rid, lr
            if rid == home or lr >= bound:
                continue
            if priced:
                assert held is not None
                if rid in held:
                    cost = self.move_cost(conversation, rid, exclude)
                else:  # a replica holding none of it: its price depends only on whether it can pull, and from whom
                    key = (rid in self._pullers, self._layouts.get(rid))
                    known = prices.get(key)
                    cost = known if known is not None else prices.setdefault(
                        key, self.move_cost(conversation, rid, exclude))
            else:
                cost = -float(held.get(rid, 0)) if held else 0.0
            if best is None or cost < best_cost or (cost == best_cost and lr < best_load):
                best, best_cost, best_load = rid, cost, lr
        if best is not None:
            return best
        if fallback is None:
            raise Unavailable(f"no healthy replica: all {len(serving)} serving replicas are excluded")
        return fallback
