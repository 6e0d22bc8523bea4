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

follow.py (the router's default policy, CHATMESH_ROUTER_POLICY=follow) builds on this ring: the same membership,
loads, leases and walk order, with a pick that goes where the conversation's prefix is cached.

The core does no I/O and reads no clock: callers pass `now` (any monotonic seconds, never going back),
which keeps it deterministic for tests and lets the simulator drive it with simulated time.

Cost. A pick is one blake2b of the id, one bisect over the ring's points (kept as 8-byte big-endian digests,
whose byte order is their numeric order, so no int conversion), a cached walk for that ring index, and for
the usual case (home serving, not excluded, under the bound) one comparison against the bound; only a spill
walks further. A lease id is a per-ring random UUID prefix plus a counter; leases live in a plain dict in
expiry order (one TTL for all), so expiry looks at the oldest only when its time has come.
"""

from __future__ import annotations

import enum
import hashlib
import math
import os
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

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
    SPILL_HOME_DRAINING = "spill_home_draining"  # follow.py: the home is shutting down, still serving pulls
    PLACED = "placed"                        # follow.py: no prefix known anywhere; placed where load is lowest

    @property
    def spilled(self) -> bool:
        return self is not PickOutcome.HOME and self is not PickOutcome.PLACED


# Enum member lookups cost a few hundred ns each in CPython 3.11; the hot path uses these aliases.
_HOME, _OVER_BOUND = PickOutcome.HOME, PickOutcome.SPILL_OVER_BOUND
_HOME_DOWN, _EXCLUDED = PickOutcome.SPILL_HOME_DOWN, PickOutcome.SPILL_EXCLUDED


@dataclass(frozen=True, slots=True)
class Replica:
    """A configured engine replica."""

    id: ReplicaId
    address: str


# Lease and Pick are immutable named tuples rather than frozen dataclasses: the hot path builds one of each
# per pick, and a frozen dataclass's __init__ (object.__setattr__ per field) costs several times more.
class Lease(NamedTuple):
    """Load handed out for one turn, counted against `replica` until released or `expires_at`."""

    id: LeaseId
    replica: ReplicaId
    expires_at: float


class Pick(NamedTuple):
    """The replica chosen for a turn, its home, and the lease to release (`lease_id`, open until
    released or `expires_at`); follow.py with pulls: the replica to pull the prefix from (`source`, None for
    none) and the tokens the router believes it caches."""

    replica: Replica
    home: ReplicaId
    lease_id: LeaseId
    expires_at: float
    outcome: PickOutcome
    source: Replica | None
    source_tokens: int


_new = tuple.__new__  # builds a Lease/Pick from a tuple without the generated __new__'s Python frame
_NO_EXCLUSIONS: frozenset[ReplicaId] = frozenset()
# Lease counters run over [2**32, 2**33): hex() of one is "0x1" and then exactly 8 hex digits.
_SEQ_FIRST, _SEQ_END = 1 << 32, 1 << 33


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
    return int.from_bytes(_point_bytes(key))


def _point_bytes(key: str) -> bytes:
    """`point(key)` as its 8 big-endian bytes: they sort as the numbers do, so the ring bisects them as is."""
    return _blake2b(key.encode(), digest_size=8).digest()


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
        self._load: dict[ReplicaId, int] = {}   # engine + open leases; a replica's leases = load - engine
        self._total = 0                          # sum of _load over serving replicas
        self._points: list[bytes] = []           # sorted 8-byte points (see _point_bytes)
        self._owners: list[ReplicaId] = []
        # ring index -> distinct replicas clockwise from it, filled on first use; one extra slot past the
        # last point wraps to index 0, so bisect's answer indexes it directly
        self._walks: list[tuple[ReplicaId, ...] | None] = [None]
        # open leases by id; insertion order is expiry order (one TTL for all, `now` never goes back)
        self._leases: dict[LeaseId, Lease] = {}
        self._next_expiry = math.inf             # no open lease expires before this
        # Lease ids are UUID-shaped (version 4 bits set): a random per-ring prefix and a counter, far
        # cheaper than uuid4() on the hot path and unique across router processes.
        rand = os.urandom(11).hex()
        self._lease_prefix = f"{rand[:8]}-{rand[8:12]}-4{rand[12:15]}-8{rand[15:18]}-{rand[18:22]}"
        self._lease_seq = _SEQ_FIRST - 1
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
        self._load[replica.id] = 0
        self._rebuild()
        self.set_serving(replica.id, serving)

    def remove(self, replica_id: ReplicaId) -> None:
        """Takes a replica off the ring; its open leases are dropped with it."""
        self._require(replica_id)
        self.set_serving(replica_id, False)
        del self._replicas[replica_id], self._engine[replica_id], self._load[replica_id]
        for lid in [lid for lid, lease in self._leases.items() if lease.replica == replica_id]:
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
        pairs = sorted((_point_bytes(f"{rid}#{i}"), rid) for rid in self._replicas for i in range(self.vnodes))
        self._points = [p for p, _ in pairs]
        self._owners = [rid for _, rid in pairs]
        self._walks = [None] * (len(pairs) + 1)

    def _require(self, replica_id: ReplicaId) -> None:
        if replica_id not in self._replicas:
            raise NotFound(f"unknown replica {replica_id}")

    def _adjust(self, replica_id: ReplicaId, delta: int, engine: bool) -> None:
        if engine:
            self._engine[replica_id] += delta
        self._load[replica_id] += delta
        if replica_id in self._serving:
            self._total += delta

    # ---- lookups ----------------------------------------------------------------------------------

    def walk(self, conversation: ConversationId) -> tuple[ReplicaId, ...]:
        """Every configured replica in the order the walk visits them for this conversation; home first."""
        i = bisect_right(self._points, _point_bytes(conversation))
        return self._walks[i] or self._walk_from(i)

    def _walk_from(self, i: int) -> tuple[ReplicaId, ...]:
        """Distinct replicas clockwise from ring index i (len(points) wraps to 0), cached per index."""
        n, want = len(self._owners), len(self._replicas)
        if not n:
            return ()
        seen: dict[ReplicaId, None] = {}
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
        return self._leases.get(lease_id)

    # ---- picks and leases -------------------------------------------------------------------------

    def pick(self, conversation: ConversationId, now: float,
             exclude: frozenset[ReplicaId] = _NO_EXCLUSIONS) -> Pick:
        """Chooses the replica for one turn and opens a lease on it."""
        if now >= self._next_expiry:
            self.expire(now)
        i = bisect_right(self._points, _blake2b(conversation.encode(), digest_size=8).digest())  # walk(), inlined
        order = self._walks[i] or self._walk_from(i)
        serving, load = self._serving, self._load
        if not serving:
            reason = "no replica is configured" if not order else f"none of {len(order)} replicas is serving"
            raise Unavailable(f"no healthy replica: {reason}")
        # The bound is max(floor, ceil(limit)) with limit as in load_bound(); for an integer load,
        # load < ceil(limit) exactly when load < limit, so the usual case needs no ceil.
        limit = self._factor * (self._total + 1) / len(serving) - 1e-9
        home = order[0]
        if home in serving and home not in exclude and (
                (h := load[home]) < limit or h < self.min_spill_load):
            chosen, outcome = home, _HOME
        else:
            chosen, outcome = self._spill(order, max(self.min_spill_load, math.ceil(limit)), exclude)
        return self.lease_on(chosen, home, outcome, now)

    def lease_on(self, chosen: ReplicaId, home: ReplicaId, outcome: PickOutcome, now: float,
                 source: ReplicaId | None = None, source_tokens: int = 0) -> Pick:
        """Opens a lease on the serving replica a pick chose (this walk's, or follow.py's) and returns the pick.
        The caller has run `expire(now)` when due and checked that `chosen` is serving."""
        seq = self._lease_seq + 1
        if seq == _SEQ_END:
            seq = _SEQ_FIRST
        self._lease_seq = seq
        lease_id: LeaseId = self._lease_prefix + hex(seq)[3:]  # type: ignore[assignment]  # NewType call, skipped
        expires_at = now + self.lease_ttl_s
        if expires_at < self._next_expiry:
            self._next_expiry = expires_at
        self._leases[lease_id] = _new(Lease, (lease_id, chosen, expires_at))
        self._load[chosen] += 1
        self._total += 1  # chosen is serving
        return _new(Pick, (self._replicas[chosen], home, lease_id, expires_at, outcome,
                           None if source is None else self._replicas[source], source_tokens))

    def _spill(self, order: tuple[ReplicaId, ...], bound: int,
               exclude: frozenset[ReplicaId]) -> tuple[ReplicaId, PickOutcome]:
        """The walk past a home that cannot take the turn: the first serving, not excluded replica under
        `bound`, else the least-loaded serving one that is not excluded."""
        serving, load = self._serving, self._load
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
        home = order[0]
        if chosen == home:
            return chosen, _HOME  # every usable replica is over the bound and home is the least loaded
        if home not in serving:
            return chosen, _HOME_DOWN
        if home in exclude:
            return chosen, _EXCLUDED
        return chosen, _OVER_BOUND

    def release(self, lease_id: LeaseId) -> Lease:
        """Closes a lease; NotFound if it is unknown, already released or expired."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise NotFound(f"unknown lease {lease_id} (released, expired, or never issued)")
        replica_id = lease.replica
        self._load[replica_id] -= 1
        if replica_id in self._serving:
            self._total -= 1
        return lease

    def expire(self, now: float) -> int:
        """Drops leases whose TTL has passed; returns how many. Cheap when none is due."""
        if now < self._next_expiry:
            return 0
        leases = self._leases
        due: list[Lease] = []
        self._next_expiry = math.inf
        for lease in leases.values():
            if lease.expires_at > now:
                self._next_expiry = lease.expires_at
                break
            due.append(lease)
        for lease in due:
            del leases[lease.id]
            self._adjust(lease.replica, -1, engine=False)
        return len(due)

    def loads(self) -> tuple[ReplicaLoad, ...]:
        """Every configured replica's state and load, in id order."""
        return tuple(
            ReplicaLoad(self._replicas[rid], rid in self._serving, self._engine[rid],
                        self._load[rid] - self._engine[rid])
            for rid in sorted(self._replicas)
        )

    def replica(self, replica_id: ReplicaId) -> Replica:
        self._require(replica_id)
        return self._replicas[replica_id]

    def load(self, replica_id: ReplicaId) -> int:
        return self._load[replica_id]

    @property
    def open_leases(self) -> int:
        return len(self._leases)
