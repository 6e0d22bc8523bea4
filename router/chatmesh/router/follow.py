"""Routing that follows the KV: send a turn where its conversation's prefix is cached, a turn with nothing to
lose where load is lowest, and keep every replica under a load bound.

Why. Consistent hashing (ring.py) keeps a conversation on one replica, which is what makes its prefix hit
(the reference's Part 2: ~95% of prompt tokens cached with affinity, ~52% without), but a hash knows nothing of
load: in the reference's setup the busiest replica carries 1.7x the average at p99. The ring's bounded-load walk
caps that, yet every turn it spills misses its whole history on the replica it lands on, and returns home a turn
out of date: at eps 0.25 it loses 4 points of hit rate. Two facts let a router do better. An eighth of all
turns are first turns, which have nothing cached but the shared system prompt and can go anywhere for free; and
a turn that must move can move its conversation with it, paying one miss instead of two.

How (`Follow.pick`).
- Placement (`Placement`): for each conversation, the replicas caching its private (owner-salted) prefix and how
  many tokens each, learned from two sources: the engines' residency reports (WatchStats include_residency,
  engine_adapter/residency.py: counts per conversation, 0 once evicted or deleted), and this router's own picks
  (a turn sent to r leaves r holding the conversation's newest prefix, so r becomes its home at once, before r
  reports). The conversation's *home* is the replica caching the most of it. The router never sees text.
- The bound: with m = the serving replicas' load counting the incoming turn and n of them, a replica takes a turn
  while its load is under B = max(floor, ceil((1 + eps) m / n)) (ring.py's rule) ...
- ... and a turn whose home caches T tokens of it may stay home up to `T // hold_tokens` sequences above B (a
  turn that would lose more prefill is worth more imbalance), never past the cap
  C = max(floor, ceil((1 + eps + overshoot) m / n)).
- A turn with a home that is serving, not excluded and under its allowance goes home (outcome HOME). Otherwise
  it goes to the serving, not excluded replica under B that caches the most of its prefix (a stale copy left by
  an earlier move saves all but the turns since), then the least loaded, ties in the conversation's ring walk
  order (so equal replicas are not chosen in one fixed order). A conversation known nowhere (a first turn,
  or its blocks were evicted everywhere) is PLACED so; one with a home is a spill (over the bound, home down,
  home excluded). Either way the chosen replica becomes the home: a moved conversation stays where it moved.
  If no replica is under B, the least-loaded usable one takes it (the ring's rule).
- Load, leases, health and the walk order are the ring's (ring.py): engine-reported in-flight sequences plus
  this router's open leases.

Interchangeable routers: the choice is a function of the membership, the loads, the placement table and the
conversation id, with ties broken by the ring's deterministic walk, so two router processes that have seen the
same picks and reports choose the same replica. Routers that share traffic learn each other's placements from
the engines' reports within one stats interval (500 ms against the ~60 s between a user's turns).

Parameters and defaults (chosen with `chatmesh simulate`, docs/simulate/README.md, where the whole trade-off
between hit rate and max/avg load is plotted):
- `eps` = 0.2 (CHATMESH_ROUTER_EPS): the bound's slack over the average.
- `hold_tokens` = 1,600: cached prefix tokens that buy one sequence over the bound (about half the reference's
  3,000-token prompt: a conversation past its third turn may stay home one over, past its fifth two over).
  0 disables the overshoot.
- `overshoot` = 0.15: the cap C is (1 + eps + overshoot) x the average.
- `floor` = 16 (CHATMESH_ROUTER_MIN_SPILL_LOAD): a replica running fewer than 16 sequences never sends a turn
  away from its prefix (an engine batches hundreds): at low traffic turns stay home, the bound acts when load is
  real (the bound is at least the floor).
- `max_conversations` = 262,144 placement entries (least recently picked dropped first: a dropped conversation
  is treated as new). 13 reference fleets' worth of open conversations; ~100 MB.
What it achieves (`chatmesh simulate`, the reference's setup: 4,000 conversations x 8 turns, 8 replicas, 2 M
tokens each): 94.5% of prompt tokens cached at a p99 max/avg load of 1.30, where unbounded consistent hashing
gets 95.3% at 1.69 and the ring's bound at eps 0.25 91.1% at 1.31; 94.3% at 1.32 and 1.35 on 16 and 64 replicas
at the same density. What it does not: 95% at a p99 of 1.25. A replica's turns in flight are a Poisson count,
so holding the busiest to 1.25x the average moves every turn that arrives while it is full (Erlang's loss
formula: 2-5% of turns at 20-37 in flight), and a moved turn loses its history; BENCHMARKS.md has the curve.

Cost. The usual pick (home known and under the bound) hashes nothing: a dict lookup of the home, one
comparison, a move to the end of the placement's LRU, the lease. Placing or moving a turn walks the ring as
ring.py does (one blake2b, a bisect, a cached walk) and scans the serving replicas once. A report costs
O(conversations in it). The table keeps, per conversation, a small dict of replicas and, per replica, the set of
its conversations (for full listings and removal).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable

from chatmesh.mesh.errors import Unavailable
from chatmesh.mesh.ids import ConversationId, ReplicaId
from chatmesh.router.ring import DEFAULT_LEASE_TTL_S, DEFAULT_VNODES, Pick, PickOutcome, Replica, Ring

DEFAULT_EPS = 0.2
DEFAULT_HOLD_TOKENS = 1600
DEFAULT_OVERSHOOT = 0.15
DEFAULT_FLOOR = 16
DEFAULT_MAX_CONVERSATIONS = 1 << 18

_HOME, _PLACED, _OVER = PickOutcome.HOME, PickOutcome.PLACED, PickOutcome.SPILL_OVER_BOUND
_DOWN, _EXCLUDED = PickOutcome.SPILL_HOME_DOWN, PickOutcome.SPILL_EXCLUDED
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
            if home is None or (home != replica and tokens > held[home]):
                homes[conversation] = replica
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
        self._home[conversation] = max(held, key=held.__getitem__)

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
            assert held[self._home[conversation]] == max(held.values())
            assert all(conversation in self._by_replica[r] for r in held)
        for replica, conversations in self._by_replica.items():
            assert all(replica in self._held[c] for c in conversations)


class Follow(Ring):
    """A ring (its membership, loads, leases and walk order, ring.py) whose picks follow the KV."""

    def __init__(self, replicas: Iterable[Replica] = (), *, placement: Placement | None = None,
                 vnodes: int = DEFAULT_VNODES, eps: float = DEFAULT_EPS, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 min_spill_load: int = DEFAULT_FLOOR, hold_tokens: int = DEFAULT_HOLD_TOKENS,
                 overshoot: float = DEFAULT_OVERSHOOT) -> None:
        if overshoot < 0:
            raise ValueError("overshoot must be >= 0")
        if hold_tokens < 0:
            raise ValueError("hold_tokens must be >= 0")
        self.placement = placement or Placement()
        self.hold_tokens, self.overshoot = hold_tokens, overshoot
        # read on every pick; Placement keeps them current
        self._held, self._homes = self.placement._held, self.placement._home
        super().__init__(replicas, vnodes=vnodes, eps=eps, lease_ttl_s=lease_ttl_s, min_spill_load=min_spill_load)

    def remove(self, replica_id: ReplicaId) -> None:
        super().remove(replica_id)
        self.placement.drop_replica(replica_id)

    def bounds(self) -> tuple[int, int]:
        """(B, C) for the next pick: the bound every replica is held to, and the cap a held prefix may reach."""
        avg = (self._total + 1) / max(1, len(self._serving))
        return (max(self.min_spill_load, math.ceil(self._factor * avg - 1e-9)),
                max(self.min_spill_load, math.ceil((self._factor + self.overshoot) * avg - 1e-9)))

    def pick(self, conversation: ConversationId, now: float,
             exclude: frozenset[ReplicaId] = _NO_EXCLUSIONS) -> Pick:
        """Chooses the replica for one turn and opens a lease on it."""
        if now >= self._next_expiry:
            self.expire(now)
        serving = self._serving
        if not serving:
            reason = "no replica is configured" if not self._replicas else (
                f"none of {len(self._replicas)} replicas is serving")
            raise Unavailable(f"no healthy replica: {reason}")
        limit = self._factor * (self._total + 1) / len(serving) - 1e-9
        home = self._homes.get(conversation)
        if home is not None and home in serving and home not in exclude:
            h = self._load[home]
            if h < limit or h < self.min_spill_load or (self.hold_tokens and h < self._allowance(conversation, home)):
                self._held.move_to_end(conversation)  # placement.picked(), for a turn that stays home
                return self.lease_on(home, home, _HOME, now)
        chosen = self._elsewhere(conversation, home, max(self.min_spill_load, math.ceil(limit)), exclude)
        if home is None:
            outcome, home = _PLACED, chosen
        elif chosen == home:
            outcome = _HOME  # every usable replica is over the bound and the home is the least loaded
        elif home not in serving:
            outcome = _DOWN
        elif home in exclude:
            outcome = _EXCLUDED
        else:
            outcome = _OVER
        self.placement.picked(conversation, chosen)
        return self.lease_on(chosen, home, outcome, now)

    def _allowance(self, conversation: ConversationId, home: ReplicaId) -> int:
        """The load under which a turn may stay home: B plus one per `hold_tokens` cached there, at most C."""
        bound, cap = self.bounds()
        return min(cap, bound + self._held[conversation][home] // self.hold_tokens)

    def _elsewhere(self, conversation: ConversationId, home: ReplicaId | None, bound: int,
                   exclude: frozenset[ReplicaId]) -> ReplicaId:
        """The serving, not excluded replica under `bound` caching most of the prefix, then least loaded, ties in
        walk order (the home skipped: it was over its allowance, down or excluded); none under the bound: the
        least-loaded usable replica, the home included."""
        serving, load = self._serving, self._load
        held = self._held.get(conversation)
        best = fallback = None
        best_tokens = best_load = fallback_load = 0
        for rid in self.walk(conversation):
            if rid not in serving or rid in exclude:
                continue
            lr = load[rid]
            if fallback is None or lr < fallback_load:
                fallback, fallback_load = rid, lr
            if rid == home or lr >= bound:
                continue
            tokens = held.get(rid, 0) if held else 0
            if best is None or tokens > best_tokens or (tokens == best_tokens and lr < best_load):
                best, best_tokens, best_load = rid, tokens, lr
        if best is not None:
            return best
        if fallback is None:
            raise Unavailable(f"no healthy replica: all {len(serving)} serving replicas are excluded")
        return fallback
