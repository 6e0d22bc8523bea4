"""Consistent hashing with bounded loads: which engine replica serves a conversation's next turn.

Why. A replica that still holds a conversation's KV prefix skips most of the prompt (the reference's
simulation: about 95% of prompt tokens cached with conversation affinity, about 50% without). So every turn
of a conversation should go to the same replica, its *home*. But pure affinity lets a replica holding busy
conversations run hot. Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent
Hashing with Bounded Loads", SODA 2018) keeps affinity and caps the imbalance.

How.
- The ring: each configured replica puts `vnodes` points on a 64-bit circle, point i of replica r at
  blake2b("r#i") (unkeyed and the same in every process, unlike Python's salted `hash()`), so every
  router process with the same membership builds the same ring and picks the same home.
- Home: a conversation id hashes (blake2b) to a point; its home is the owner of the first replica point
  clockwise from it. Adding a replica to N moves only the ids that now land on the newcomer's points (about
  1/(N+1) of them); removing one moves only its own ids.
- Bounded-load walk: with m = total load of the serving replicas counting the incoming turn and n serving
  replicas, the bound is ceil((1 + eps) * m / n). The turn goes to the first replica clockwise (home first)
  whose load is under the bound, so its load after the pick is at most the bound. A replica at the bound is
  skipped and the turn *spills* to the next distinct replica on the ring: one cache miss, latency protected.
  Because the least-loaded serving replica always has load <= (m - 1) / n < bound, the walk always finds
  room unless the caller excluded every replica that has it; then the least-loaded candidate is taken.
- Load of a replica = the in-flight sequences its engine last reported (running + queued) plus the leases
  this router has handed out for it and not yet seen released. A lease counts from the pick until the caller
  releases it or, if the caller crashed, until its TTL expires, so a lost caller cannot pin load forever.
  (A running leased turn is counted twice, once by the engine and once by the lease, the same on every
  replica; the engine report is what covers other router processes' turns.)
- Health: a replica that is not serving stays on the ring (so homes do not move) but the walk skips it and
  it is left out of n and m; its conversations spill to the next replica and return when it serves again.
- Exclusions: a caller may exclude replicas for one pick (one that just failed this turn); they are skipped.

Parameters and defaults:
- `vnodes` = 160 points per replica (ketama's figure): the share of the ring per replica varies by about
  1/sqrt(vnodes), ~8%, which eps has to absorb.
- `eps` = 0.5: a replica may carry up to 50% above the average before turns spill (the paper's c = 1 + eps;
  smaller eps balances better and spills more). Chosen from `chatmesh simulate` in the reference's setup
  (8 replicas, ~37 turns in flight each): eps 0.25 spills 6% of turns and costs ~4 points of hit rate,
  eps 0.5 spills ~1% and costs under 1 point while still cutting the p99 max/average load from 1.7 to 1.5.
- `min_spill_load` = 0: a floor under the bound (bound = max(floor, ceil((1+eps) m / n))). 0 is the paper's
  rule. An engine batches up to hundreds of sequences, so at low traffic the paper's bound (3 when 4 turns
  are in flight on 2 replicas) spills turns away from a replica that is nowhere near busy; a floor of a few
  tens of sequences keeps those turns home and lets the bound act only when load is real.
- `lease_ttl_s` = 120 s: longer than a normal turn (400 tokens at ~79 tokens/s is ~5 s); a longer turn's
  load is still covered by the engine's own report after its lease lapses.

The core does no I/O and reads no clock: callers pass `now` (any monotonic seconds), which keeps it
deterministic for tests and lets the simulator drive it with simulated time.
"""

from __future__ import annotations

import enum
import hashlib
import math
import os
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from chatmesh.mesh.errors import InvalidArgument, NotFound, Unavailable
from chatmesh.mesh.ids import ConversationId, LeaseId, ReplicaId

DEFAULT_VNODES = 160
DEFAULT_EPS = 0.5
DEFAULT_LEASE_TTL_S = 120.0
MAX_CONVERSATION_ID_BYTES = 128


class PickOutcome(enum.Enum):
    """Whether a turn landed on its home replica, and if not, why it spilled."""

    HOME = "home"
    SPILL_OVER_BOUND = "spill_over_bound"    # the home was at the load bound
    SPILL_HOME_DOWN = "spill_home_down"      # the home is not serving
    SPILL_EXCLUDED = "spill_excluded"        # the caller excluded the home

    @property
    def spilled(self) -> bool:
        return self is not PickOutcome.HOME


# Enum member lookups cost a few hundred ns each in CPython 3.11; the hot path uses these aliases.
_HOME, _OVER_BOUND = PickOutcome.HOME, PickOutcome.SPILL_OVER_BOUND
_HOME_DOWN, _EXCLUDED = PickOutcome.SPILL_HOME_DOWN, PickOutcome.SPILL_EXCLUDED


@dataclass(frozen=True, slots=True)
class Replica:
    """A configured engine replica."""

    id: ReplicaId
    address: str


@dataclass(frozen=True, slots=True)
class Lease:
    """Load handed out for one turn, counted against `replica` until released or `expires_at`."""

    id: LeaseId
    replica: ReplicaId
    expires_at: float


@dataclass(frozen=True, slots=True)
class Pick:
    """The replica chosen for a turn, its home, and the lease to release (`lease_id`, open until
    released or `expires_at`)."""

    replica: Replica
    home: ReplicaId
    lease_id: LeaseId
    expires_at: float
    outcome: PickOutcome


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's state and load as the ring sees it."""

    replica: Replica
    serving: bool
    engine_load: int
    open_leases: int

    @property
    def load(self) -> int:
        return self.engine_load + self.open_leases


def parse_conversation_key(text: str, field: str = "conversation_id") -> ConversationId:
    """The routing key: any 1-128 byte conversation id (the router never needs more than its bytes)."""
    if not text:
        raise InvalidArgument(f"{field} is required")
    if len(text.encode()) > MAX_CONVERSATION_ID_BYTES:
        raise InvalidArgument(f"{field} must be at most {MAX_CONVERSATION_ID_BYTES} bytes")
    return ConversationId(text)


_blake2b = hashlib.blake2b


def point(key: str) -> int:
    """A key's position on the 64-bit ring (blake2b, identical in every process)."""
    return int.from_bytes(_blake2b(key.encode(), digest_size=8).digest())


def load_bound(total_with_incoming: int, serving: int, eps: float, floor: int = 0) -> int:
    """max(floor, ceil((1 + eps) * average load)), the average counting the incoming turn.

    The tiny subtraction keeps float rounding from pushing an exact integer (e.g. 1.25 * 4) up by one."""
    return max(floor, math.ceil((1.0 + eps) * total_with_incoming / serving - 1e-9))


class Ring:
    """The replicas' ring, their loads and the open leases. Not thread-safe; one event loop owns it."""

    def __init__(self, replicas: Iterable[Replica] = (), *, vnodes: int = DEFAULT_VNODES,
                 eps: float = DEFAULT_EPS, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 min_spill_load: int = 0) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be at least 1")
        if eps < 0:
            raise ValueError("eps must be >= 0")
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be > 0")
        if min_spill_load < 0:
            raise ValueError("min_spill_load must be >= 0")
        self.vnodes, self.eps, self.lease_ttl_s, self.min_spill_load = vnodes, eps, lease_ttl_s, min_spill_load
        self._factor = 1.0 + eps
        self._replicas: dict[ReplicaId, Replica] = {}
        self._serving: set[ReplicaId] = set()
        self._engine: dict[ReplicaId, int] = {}
        self._leased: dict[ReplicaId, int] = {}
        self._load: dict[ReplicaId, int] = {}   # engine + leased, kept in step for the hot path
        self._total = 0                          # sum of _load over serving replicas
        self._points: list[int] = []
        self._owners: list[ReplicaId] = []
        self._walks: dict[int, tuple[ReplicaId, ...]] = {}  # ring index -> distinct replicas clockwise
        # lease id -> (replica, expires_at); insertion order is expiry order (one TTL for all)
        self._leases: OrderedDict[LeaseId, tuple[ReplicaId, float]] = OrderedDict()
        self._next_expiry = math.inf
        # Lease ids are UUID-shaped (version 4 bits set): a random per-ring prefix and a counter, far
        # cheaper than uuid4() on the hot path and unique across router processes.
        rand = os.urandom(11).hex()
        self._lease_prefix = f"{rand[:8]}-{rand[8:12]}-4{rand[12:15]}-8{rand[15:18]}-{rand[18:22]}"
        self._lease_seq = 0
        for r in replicas:
            self.add(r)

    # ---- membership -------------------------------------------------------------------------------

    def add(self, replica: Replica, serving: bool = True) -> None:
        """Puts a replica on the ring (or updates its address)."""
        new = replica.id not in self._replicas
        self._replicas[replica.id] = replica
        if not new:
            return
        self._engine[replica.id] = 0
        self._leased[replica.id] = 0
        self._load[replica.id] = 0
        self._rebuild()
        self.set_serving(replica.id, serving)

    def remove(self, replica_id: ReplicaId) -> None:
        """Takes a replica off the ring; its open leases are dropped with it."""
        self._require(replica_id)
        self.set_serving(replica_id, False)
        del self._replicas[replica_id], self._engine[replica_id], self._leased[replica_id]
        del self._load[replica_id]
        for lid in [lid for lid, (rid, _) in self._leases.items() if rid == replica_id]:
            del self._leases[lid]
        self._rebuild()

    def set_serving(self, replica_id: ReplicaId, serving: bool) -> None:
        """Health: a replica that is not serving is skipped by the walk and left out of the average."""
        self._require(replica_id)
        if serving and replica_id not in self._serving:
            self._serving.add(replica_id)
            self._total += self._load[replica_id]
        elif not serving and replica_id in self._serving:
            self._serving.discard(replica_id)
            self._total -= self._load[replica_id]

    def set_engine_load(self, replica_id: ReplicaId, in_flight: int) -> None:
        """The engine's last reported in-flight sequences (running + queued)."""
        self._require(replica_id)
        self._adjust(replica_id, max(0, in_flight) - self._engine[replica_id], engine=True)

    def _rebuild(self) -> None:
        pairs = sorted((point(f"{rid}#{i}"), rid) for rid in self._replicas for i in range(self.vnodes))
        self._points = [p for p, _ in pairs]
        self._owners = [rid for _, rid in pairs]
        self._walks.clear()

    def _require(self, replica_id: ReplicaId) -> None:
        if replica_id not in self._replicas:
            raise NotFound(f"unknown replica {replica_id}")

    def _adjust(self, replica_id: ReplicaId, delta: int, engine: bool) -> None:
        if engine:
            self._engine[replica_id] += delta
        else:
            self._leased[replica_id] += delta
        self._load[replica_id] += delta
        if replica_id in self._serving:
            self._total += delta

    # ---- lookups ----------------------------------------------------------------------------------

    def walk(self, conversation: ConversationId) -> tuple[ReplicaId, ...]:
        """Every configured replica in the order the walk visits them for this conversation; home first."""
        if not self._points:
            return ()
        i = bisect_right(self._points, point(conversation))
        if i == len(self._points):
            i = 0
        return self._walks.get(i) or self._walk_from(i)

    def _walk_from(self, i: int) -> tuple[ReplicaId, ...]:
        """Distinct replicas clockwise from ring index i, cached per index."""
        seen: dict[ReplicaId, None] = {}
        n, want = len(self._owners), len(self._replicas)
        for k in range(n):
            seen.setdefault(self._owners[(i + k) % n])
            if len(seen) == want:
                break
        order = self._walks[i] = tuple(seen)
        return order

    def home(self, conversation: ConversationId) -> ReplicaId:
        """The conversation's home replica (first on the ring), serving or not."""
        order = self.walk(conversation)
        if not order:
            raise Unavailable("no healthy replica: no replica is configured")
        return order[0]

    def bound(self) -> int:
        """The load bound for the next pick (counting it)."""
        return load_bound(self._total + 1, max(1, len(self._serving)), self.eps, self.min_spill_load)

    def lease(self, lease_id: LeaseId) -> Lease | None:
        """An open lease, or None."""
        entry = self._leases.get(lease_id)
        return None if entry is None else Lease(lease_id, *entry)

    # ---- picks and leases -------------------------------------------------------------------------

    def pick(self, conversation: ConversationId, now: float,
             exclude: frozenset[ReplicaId] = frozenset()) -> Pick:
        """Chooses the replica for one turn and opens a lease on it."""
        if now >= self._next_expiry:
            self.expire(now)
        points = self._points
        if points:  # walk(), inlined: this is the hot path
            i = bisect_right(points, int.from_bytes(_blake2b(conversation.encode(), digest_size=8).digest()))
            if i == len(points):
                i = 0
            order = self._walks.get(i) or self._walk_from(i)
        else:
            order = ()
        if not self._serving:
            reason = "no replica is configured" if not order else f"none of {len(order)} replicas is serving"
            raise Unavailable(f"no healthy replica: {reason}")
        serving, load = self._serving, self._load
        bound = math.ceil(self._factor * (self._total + 1) / len(serving) - 1e-9)  # load_bound, inlined
        if bound < self.min_spill_load:
            bound = self.min_spill_load
        chosen: ReplicaId | None = None
        fallback: ReplicaId | None = None
        for rid in order:
            if rid not in serving or rid in exclude:
                continue
            if load[rid] < bound:
                chosen = rid
                break
            if fallback is None or load[rid] < load[fallback]:
                fallback = rid
        if chosen is None:
            if fallback is None:
                raise Unavailable(f"no healthy replica: all {len(serving)} serving replicas are excluded")
            chosen = fallback
        self._lease_seq += 1
        lease_id = cast(LeaseId, f"{self._lease_prefix}{self._lease_seq & 0xFFFFFFFF:08x}")  # cheaper than a NewType call
        expires_at = now + self.lease_ttl_s
        if not self._leases:
            self._next_expiry = expires_at
        self._leases[lease_id] = (chosen, expires_at)
        self._leased[chosen] += 1
        load[chosen] += 1
        self._total += 1  # chosen is serving
        home = order[0]
        if chosen == home:
            outcome = _HOME
        elif home not in serving:
            outcome = _HOME_DOWN
        elif home in exclude:
            outcome = _EXCLUDED
        else:
            outcome = _OVER_BOUND
        return Pick(self._replicas[chosen], home, lease_id, expires_at, outcome)

    def release(self, lease_id: LeaseId) -> Lease:
        """Closes a lease; NotFound if it is unknown, already released or expired."""
        entry = self._leases.pop(lease_id, None)
        if entry is None:
            raise NotFound(f"unknown lease {lease_id} (released, expired, or never issued)")
        replica_id = entry[0]
        self._leased[replica_id] -= 1
        self._load[replica_id] -= 1
        if replica_id in self._serving:
            self._total -= 1
        return Lease(lease_id, replica_id, entry[1])

    def expire(self, now: float) -> int:
        """Drops leases whose TTL has passed; returns how many."""
        dropped = 0
        leases = self._leases
        while leases:
            replica_id, expires_at = next(iter(leases.values()))
            if expires_at > now:
                self._next_expiry = expires_at
                return dropped
            leases.popitem(last=False)
            self._adjust(replica_id, -1, engine=False)
            dropped += 1
        self._next_expiry = math.inf
        return dropped

    def loads(self) -> tuple[ReplicaLoad, ...]:
        """Every configured replica's state and load, in id order."""
        return tuple(
            ReplicaLoad(self._replicas[rid], rid in self._serving, self._engine[rid], self._leased[rid])
            for rid in sorted(self._replicas)
        )

    def replica(self, replica_id: ReplicaId) -> Replica:
        self._require(replica_id)
        return self._replicas[replica_id]

    def load(self, replica_id: ReplicaId) -> int:
        return self._load[replica_id]

    @property
    def serving_count(self) -> int:
        return len(self._serving)

    @property
    def open_leases(self) -> int:
        return len(self._leases)
