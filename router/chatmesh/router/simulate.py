"""Routing against the prefix cache: the reference design's Part 2, extended to what our router really does.

What. Conversations arrive at replicas that each keep an LRU prefix cache measured in tokens; the result is
the share of prompt tokens served from cache. The reference compares random routing with "affinity"
(conversation index modulo the replica count) and reports 45/48/52/59% against 68/84/95/96% at 0.5, 1, 2 and
8 M tokens of cache per replica. This module reproduces those and adds the policies chatmesh's router runs,
driven by the router's own code: plain consistent hashing and bounded loads at several eps (`ring.py`), and
routing that follows the KV (`follow.py`), where a turn occupies its replica while it generates, so a hot
replica really does spill turns, and where the engines' reports of what they cache reach the router.

The model. One pass over the turns in arrival order, every policy against the same engines:
1. Arrivals. Each of `conversations` starts at a uniform time in [0, arrival_window_s) and sends `turns`
   turns, the gaps exponential with mean `turn_gap_s` (one turn a minute while active). Arrivals do not depend
   on routing, so every policy sees the same schedule.
2. Routing. A policy maps each turn to a replica. For the router's policies a turn holds a lease from its
   arrival for `turn_seconds` (default: the reply at the capacity plan's decode step, 400 x 12.7 ms = 5.1 s),
   so the load the bound sees is the turns in flight. Recorded: turns sent away from their prefix (spills),
   turns placed with nothing to lose, and the max/average load across replicas after each arrival (its mean
   and p99 over the steady state, when the average is at least half its peak).
3. Engines. Turn k of a conversation sends its history plus a 150-token message; the history starts as the
   1,500-token system prompt and grows by message + 400-token reply per turn. The replica serves from its
   cache the longest prefix it holds for that conversation (a stale entry left by a moved turn still covers
   the older part) and stores the new history; least recently used histories are evicted past the capacity.
   Every `report_interval_s` (the stats stream's interval) the engines report what changed since their last
   report: each stored conversation's private tokens on that replica (history minus the system prompt; 0 when
   evicted), which is what `follow` places turns by (the ring policies ignore it), and, with
   `engine_load_reports`, their in-flight turns, which the router adds to its leases as the live one does.
   `block_size` > 0 switches to the engines' accounting (block_manager.py): whole blocks only, the last prompt
   token always computed, the system prompt's blocks stored once per replica rather than in every history. The shared system prompt is always warm
   (the reference's assumption), unless owners are *salted*: an engine that salts the cache from the first
   block (TensorRT-LLM's `cache_salt`) cannot share the system prompt across owners, so a turn gets it only if
   the same owner has a history on that replica (salting changes hits, not what is stored, so the same pass
   counts both).

What it leaves out, as the reference does: batching and queueing delay, eviction cost, the host tier as a
separate level (the 8 M row stands for HBM plus host memory), and turns' varying lengths.
"""

from __future__ import annotations

import enum
import heapq
import random
import typing
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chatmesh.mesh.ids import ConversationId, LeaseId, ReplicaId
from chatmesh.router import capacity, follow, link
from chatmesh.router.ring import DEFAULT_VNODES, PickOutcome, Replica, Ring

REFERENCE_CACHES = (500_000, 1_000_000, 2_000_000, 8_000_000)
REFERENCE_RANDOM = (0.45, 0.48, 0.52, 0.59)
REFERENCE_AFFINITY = (0.68, 0.84, 0.95, 0.96)
DEFAULT_EPSILONS = (0.05, 0.1, 0.25, 0.5, 1.0)
DEFAULT_FOLLOW_EPSILONS = (follow.DEFAULT_EPS,)
DEFAULT_PULL_EPSILONS = (follow.DEFAULT_PULL_EPS,)


def _default_turn_seconds() -> float:
    p = capacity.plan()
    return p.workload.output_tokens * p.decode_step_s


class Policy(enum.Enum):
    """How a turn picks its replica."""

    RANDOM = "random"
    MODULO = "modulo"            # the reference's affinity: conversation index mod replicas
    CONSISTENT = "consistent"    # the ring's home, no load bound
    BOUNDED = "bounded"          # the ring's bounded-load walk (ring.py)
    FOLLOW = "follow"            # routing that follows the KV (follow.py): chatmesh's router by default


@dataclass(frozen=True)
class PolicySpec:
    policy: Policy
    eps: float = 0.5  # BOUNDED and FOLLOW: the bound's slack
    hold_tokens: int = follow.DEFAULT_HOLD_TOKENS  # FOLLOW
    overshoot: float = follow.DEFAULT_OVERSHOOT  # FOLLOW
    floor: int = follow.DEFAULT_FLOOR  # FOLLOW's spill floor (BOUNDED takes SimConfig.min_spill_load)
    pull: bool = False  # a turn that lands off its prefix pulls it from the replica caching most of it
    pull_eps: float = follow.DEFAULT_PULL_EPS  # FOLLOW with pulls: the bound's slack for a pullable prefix

    @property
    def label(self) -> str:
        return self._name + (" +pull" if self.pull else "")

    @property
    def _name(self) -> str:
        match self.policy:
            case Policy.RANDOM:
                return "random"
            case Policy.MODULO:
                return "modulo"
            case Policy.CONSISTENT:
                return "consistent"
            case Policy.BOUNDED:
                return f"bounded e={self.eps:g}"
            case Policy.FOLLOW:
                defaults = (follow.DEFAULT_HOLD_TOKENS, follow.DEFAULT_OVERSHOOT, follow.DEFAULT_FLOOR)
                extra = "" if (self.hold_tokens, self.overshoot, self.floor) == defaults else (
                    f" h={self.hold_tokens} o={self.overshoot:g} f={self.floor}")
                if self.pull:  # the bound that acts is pull_eps; eps only for prefixes no move can pull
                    other = "" if self.eps == follow.DEFAULT_EPS else f" (prefill e={self.eps:g})"
                    return f"follow e={self.pull_eps:g}{other}{extra}"
                return f"follow e={self.eps:g}{extra}"
            case _:
                typing.assert_never(self.policy)


@dataclass(frozen=True)
class SimConfig:
    """The reference's setup by default."""

    conversations: int = 4_000
    turns: int = 8
    replicas: int = 8
    system_tokens: int = 1_500
    message_tokens: int = 150
    reply_tokens: int = 400
    turn_gap_s: float = 60.0
    arrival_window_s: float = 600.0
    turn_seconds: float = field(default_factory=_default_turn_seconds)
    conversations_per_owner: int = 1
    vnodes: int = DEFAULT_VNODES
    min_spill_load: int = 0  # the ring's floor for BOUNDED (its default 0 is the paper's rule)
    report_interval_s: float = 0.5  # engines report residency (and load) every this often: the stats interval
    engine_load_reports: bool = False  # the router also counts each engine's reported in-flight turns (as live)
    block_size: int = 0  # 0: the reference's token model; else the engines' whole-block accounting
    link_gbps: float = link.DEFAULT_NIC_GBPS  # pulls: each NIC's speed, Gb/s
    link_nics: int = link.DEFAULT_NICS  # pulls: NICs a replica sends over at once
    link_latency_s: float = link.DEFAULT_LATENCY_S  # pulls: fixed cost per transfer
    demote_pulled: bool = True  # a source's copy of a prefix it served a pull of is the next it evicts
    seed: int = 1

    @property
    def cost(self) -> link.PrefixCost:
        """The link and prefill prices pulls are planned and counted by (the reference's replica)."""
        return link.PrefixCost.from_plan(capacity.plan(), link.Link.from_gbps(self.link_gbps, self.link_nics,
                                                                              self.link_latency_s))


@dataclass(frozen=True)
class Arrival:
    t: float
    conversation: int
    turn: int


@dataclass(frozen=True)
class Outcome:
    """One policy against one cache size: what hit, what moved, how balanced the load was."""

    spec: PolicySpec
    cache_tokens: int
    hit_rate: float            # share of prompt tokens served from cache, shared system prompt
    salted_hit_rate: float     # the same with the cache salted per owner from the first block
    pulled_rate: float         # share of prompt tokens pulled from another replica (the rest is prefilled)
    salted_pulled_rate: float
    turns: int
    spills: int                # turns sent away from the replica their prefix was on
    placed: int                # turns with no prefix anywhere, placed by load (follow only)
    mean_max_over_avg: float   # max replica load / average, averaged over arrivals in steady state
    p99_max_over_avg: float
    peak_in_flight: int
    replica_of_turn: tuple[int, ...]
    pulls: int = 0                 # turns that pulled their prefix (tokens > 0)
    pulls_short: int = 0           # turns whose named source held less than the router believed (evicted)
    pulled_bytes: int = 0
    link_mean_share: float = 0.0   # a replica's pulled bytes per second (sent or received) over its link, mean
    link_peak_share: float = 0.0   # the busiest replica-second, sent or received, over its link
    link_bytes_s: float = 0.0      # mean bytes per second per replica, one direction

    @property
    def spill_rate(self) -> float:
        return self.spills / self.turns if self.turns else 0.0

    @property
    def served_rate(self) -> float:
        """Share of prompt tokens served without prefill: cached or pulled."""
        return self.hit_rate + self.pulled_rate

    @property
    def prefilled_rate(self) -> float:
        return 1.0 - self.served_rate


def arrivals(cfg: SimConfig) -> list[Arrival]:
    rng = random.Random(cfg.seed)
    out: list[Arrival] = []
    for c in range(cfg.conversations):
        t = rng.uniform(0, cfg.arrival_window_s)
        for k in range(cfg.turns):
            out.append(Arrival(t, c, k))
            t += rng.expovariate(1 / cfg.turn_gap_s)
    out.sort(key=lambda a: (a.t, a.conversation))
    return out


def conversation_key(c: int) -> ConversationId:
    return ConversationId(f"conversation-{c:08d}")


class _ReplicaCache:
    """An LRU of conversation histories, by tokens; tracks which owners have a history here."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.used = 0
        self.entries: OrderedDict[int, int] = OrderedDict()  # conversation -> cached prefix tokens
        self.owners: Counter[int] = Counter()

    def lookup(self, conversation: int) -> int:
        length = self.entries.get(conversation)
        if length is None:
            return 0
        self.entries.move_to_end(conversation)
        return length

    def store(self, conversation: int, owner_of: list[int], length: int) -> list[int]:
        """Stores a history; returns the conversations evicted to make room."""
        old = self.entries.pop(conversation, None)
        if old is None:
            self.owners[owner_of[conversation]] += 1
        self.used += length - (old or 0)
        self.entries[conversation] = length
        gone: list[int] = []
        while self.used > self.capacity and self.entries:
            evicted, tokens = self.entries.popitem(last=False)
            self.used -= tokens
            self.owners[owner_of[evicted]] -= 1
            gone.append(evicted)
        return gone


class _Router:
    """The policy under test behind one `place(conversation, now) -> replica` call, plus report delivery."""

    def __init__(self, spec: PolicySpec, cfg: SimConfig) -> None:
        self.spec, self.n = spec, cfg.replicas
        self.ids = [ReplicaId(f"replica-{i}") for i in range(cfg.replicas)]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        replicas = [Replica(rid, "") for rid in self.ids]
        # FOLLOW routes with it; with pulls, every other policy keeps its placement (fed the same reports and
        # told its picks) to name sources, as a router with that policy and the follow table would
        self.follow = follow.Follow(replicas, vnodes=cfg.vnodes, eps=spec.eps, lease_ttl_s=1e18,
                                    min_spill_load=spec.floor, hold_tokens=spec.hold_tokens, overshoot=spec.overshoot,
                                    pulls=cfg.cost if spec.pull else None, pull_eps=spec.pull_eps)
        self.ring = self.follow if spec.policy is Policy.FOLLOW else Ring(
            replicas, vnodes=cfg.vnodes, eps=spec.eps, lease_ttl_s=1e18, min_spill_load=cfg.min_spill_load)
        self.rng = random.Random(cfg.seed ^ 0x5EED)
        self.spills = self.placed = 0

    def place(self, c: int, now: float) -> tuple[int, LeaseId | None, int | None, int]:
        """(replica, lease, the replica to pull from or None, the tokens the router believes it holds)."""
        key = conversation_key(c)
        match self.spec.policy:
            case Policy.RANDOM:
                return self._pulled(key, self.rng.randrange(self.n))
            case Policy.MODULO:
                return self._pulled(key, c % self.n)
            case Policy.CONSISTENT:
                return self._pulled(key, self.index[self.ring.home(key)])
            case Policy.BOUNDED:
                pick = self.ring.pick(key, now)
                chosen, lease, source, tokens = self._pulled(key, self.index[pick.replica.id])
            case Policy.FOLLOW:
                pick = self.follow.pick(key, now)
                chosen, lease = self.index[pick.replica.id], None
                source = None if pick.source is None else self.index[pick.source.id]
                tokens = pick.source_tokens
            case _:
                typing.assert_never(self.spec.policy)
        self.spills += pick.outcome.spilled
        self.placed += pick.outcome is PickOutcome.PLACED
        return chosen, pick.lease_id, source, tokens

    def _pulled(self, key: ConversationId, r: int) -> tuple[int, None, int | None, int]:
        if not self.spec.pull:
            return r, None, None, 0
        source, tokens = self.follow.source_for(key, self.ids[r])
        self.follow.placement.picked(key, self.ids[r])
        return r, None, None if source is None else self.index[source], tokens

    def report(self, replica: int, c: int, tokens: int) -> None:
        if self.spec.policy is Policy.FOLLOW or self.spec.pull:
            self.follow.placement.report(self.ids[replica], [(conversation_key(c), tokens)])

    def engine_load(self, in_flight: Sequence[int]) -> None:
        for rid, load in zip(self.ids, in_flight, strict=True):
            self.ring.set_engine_load(rid, load)


class _Engines:
    """The replicas' caches and what a turn finds in them: the reference's token model (`block_size` 0), or the
    engines' own (block_manager.py): whole blocks only, the last token always computed, the platform prefix's
    blocks shared once per replica instead of counted in every history."""

    def __init__(self, cfg: SimConfig, cache_tokens: int) -> None:
        self.cfg, bs = cfg, cfg.block_size
        self.shared = (cfg.system_tokens // bs) * bs if bs else cfg.system_tokens
        room = cache_tokens - self.shared if bs else cache_tokens
        self.caches = [_ReplicaCache(room) for _ in range(cfg.replicas)]
        self.owner_of = [c // cfg.conversations_per_owner for c in range(cfg.conversations)]

    def turn(self, r: int, c: int, prompt: int, history_after: int, source: int | None = None
             ) -> tuple[int, int, int, int, int, list[int]]:
        """One turn of conversation c on replica r, pulling first from `source` what it holds beyond r's own
        prefix: (cached tokens, pulled, the same two if salted from block 0, the private tokens it leaves cached
        there, the conversations evicted to make room). A pull reads the source's copy without refreshing it in
        the source's LRU (the conversation has moved; the copy ages out)."""
        bs, cache, shared = self.cfg.block_size, self.caches[r], self.shared
        own = cache.lookup(c)
        owner_here = own > 0 or cache.owners[self.owner_of[c]] > 0
        far = self.caches[source].entries.get(c, 0) if source is not None else 0
        if bs:
            usable = ((prompt - 1) // bs) * bs  # the last prompt token is always computed
            own = own + shared if own else 0
            far = far + shared if far else 0
            stored = ((history_after - 1) // bs) * bs - shared  # KV of all but the last sampled token, full blocks
        else:
            usable, stored = prompt, history_after
        hit = min(max(own, shared), usable)  # the shared system prompt's blocks are warm everywhere
        salted = min(max(own, shared if owner_here else 0), usable)
        pulled = max(0, min(far, usable) - hit)
        salted_pulled = max(0, min(far, usable) - salted)  # salted, the source's copy includes the system prompt
        if pulled and self.cfg.demote_pulled:
            self.caches[source].entries.move_to_end(c, last=False)  # type: ignore[index]
        gone = cache.store(c, self.owner_of, stored)
        return hit, pulled, salted, salted_pulled, stored if bs else stored - shared, gone


def simulate(spec: PolicySpec, cfg: SimConfig, schedule: Sequence[Arrival], cache_tokens: int) -> Outcome:
    """Every turn through the policy and the replicas' caches, in arrival order (see the module header)."""
    n = cfg.replicas
    router = _Router(spec, cfg)
    engines = _Engines(cfg, cache_tokens)
    history = [cfg.system_tokens] * cfg.conversations
    in_flight = [0] * n
    done: list[tuple[float, int, int, LeaseId | None]] = []  # (end time, seq, replica, lease)
    pending: deque[tuple[int, int, int]] = deque()  # residency changes since the last report: (replica, conv, tokens)
    next_report = cfg.report_interval_s
    chosen: list[int] = []
    samples: list[tuple[float, int]] = []  # (average, max) load after each arrival
    cached = salted = total = peak = pulled = salted_pulled = pulls = short = 0
    kv_bytes = cfg.cost.kv_bytes_per_token
    moved: Counter[tuple[int, int, bool]] = Counter()  # (replica, second, sent) -> pulled bytes

    def finish_until(t: float) -> None:
        while done and done[0][0] <= t:
            _, _, r, lease = heapq.heappop(done)
            in_flight[r] -= 1
            if lease is not None:
                router.ring.release(lease)

    for seq, a in enumerate(schedule):
        while next_report <= a.t:  # the engines report every interval: what changed, and their load
            finish_until(next_report)
            while pending:
                router.report(*pending.popleft())
            if cfg.engine_load_reports:
                router.engine_load(in_flight)
            next_report += cfg.report_interval_s
        finish_until(a.t)
        c = a.conversation
        r, lease_id, source, believed = router.place(c, a.t)
        chosen.append(r)
        in_flight[r] += 1
        heapq.heappush(done, (a.t + cfg.turn_seconds, seq, r, lease_id))
        load = sum(in_flight)
        peak = max(peak, load)
        samples.append((load / n, max(in_flight)))
        prompt = history[c] + cfg.message_tokens
        history[c] = prompt + cfg.reply_tokens
        hit, pull, hit_salted, pull_salted, private, gone = engines.turn(r, c, prompt, history[c], source)
        total += prompt
        cached += hit
        salted += hit_salted
        pulled += pull
        salted_pulled += pull_salted
        if source is not None:
            held = engines.caches[source].entries.get(c, 0)
            short += held - (0 if cfg.block_size else cfg.system_tokens) < believed
        if pull:
            assert source is not None
            pulls += 1
            second = int(a.t)
            moved[r, second, False] += pull * kv_bytes
            moved[source, second, True] += pull * kv_bytes
        pending.append((r, c, private))
        pending.extend((r, g, 0) for g in gone)
    top = max((avg for avg, _ in samples), default=0.0)
    steady = sorted(m / avg for avg, m in samples if avg >= 0.5 * top)
    seconds = max(1.0, (schedule[-1].t - schedule[0].t) if schedule else 1.0)
    bandwidth = cfg.cost.link.bandwidth_bytes_s
    per_replica_s = pulled * kv_bytes / n / seconds
    return Outcome(
        spec, cache_tokens, cached / total if total else 0.0, salted / total if total else 0.0,
        pulled / total if total else 0.0, salted_pulled / total if total else 0.0, len(schedule),
        router.spills, router.placed,
        mean_max_over_avg=sum(steady) / len(steady) if steady else 0.0,
        p99_max_over_avg=steady[min(len(steady) - 1, int(0.99 * len(steady)))] if steady else 0.0,
        peak_in_flight=peak, replica_of_turn=tuple(chosen), pulls=pulls, pulls_short=short,
        pulled_bytes=pulled * kv_bytes, link_mean_share=per_replica_s / bandwidth,
        link_peak_share=max(moved.values(), default=0) / bandwidth, link_bytes_s=per_replica_s)


def default_specs(epsilons: Sequence[float] = DEFAULT_EPSILONS,
                  follow_epsilons: Sequence[float] = DEFAULT_FOLLOW_EPSILONS,
                  pull_epsilons: Sequence[float] = DEFAULT_PULL_EPSILONS,
                  pulls: Sequence[bool] = (False, True)) -> list[PolicySpec]:
    """Every policy with pulls off and on; follow at `follow_epsilons` without pulls, `pull_epsilons` with."""
    out: list[PolicySpec] = []
    for pull in pulls:
        out += [PolicySpec(Policy.RANDOM, pull=pull), PolicySpec(Policy.MODULO, pull=pull),
                PolicySpec(Policy.CONSISTENT, pull=pull), *(PolicySpec(Policy.BOUNDED, e, pull=pull) for e in epsilons)]
        out += [PolicySpec(Policy.FOLLOW, follow.DEFAULT_EPS, pull=True, pull_eps=e) for e in pull_epsilons] if pull \
            else [PolicySpec(Policy.FOLLOW, e) for e in follow_epsilons]
    return out


@dataclass(frozen=True)
class Report:
    cfg: SimConfig
    caches: tuple[int, ...]
    specs: tuple[PolicySpec, ...]
    outcomes: dict[tuple[str, int], Outcome]   # (policy label, cache) -> outcome

    def outcome(self, label: str, cache: int) -> Outcome:
        return self.outcomes[(label, cache)]

    def hit(self, label: str, cache: int, salted: bool = False) -> float:
        """Share of prompt tokens served without prefill: cached, or (a +pull policy) pulled."""
        o = self.outcomes[(label, cache)]
        return o.salted_hit_rate + o.salted_pulled_rate if salted else o.served_rate

    @property
    def labels(self) -> list[str]:
        return [s.label for s in self.specs]


def run(cfg: SimConfig = SimConfig(), caches: Sequence[int] = REFERENCE_CACHES,
        specs: Sequence[PolicySpec] | None = None) -> Report:
    schedule = arrivals(cfg)
    specs = list(specs if specs is not None else default_specs())
    outcomes = {(s.label, cap): simulate(s, cfg, schedule, cap) for s in specs for cap in caches}
    return Report(cfg, tuple(caches), tuple(specs), outcomes)


def _mtok(tokens: int) -> str:
    return f"{tokens / 1e6:g} M"


def balance_cache(caches: Sequence[int]) -> int:
    """The cache size the load table and the hit-vs-load chart are drawn at: 2 M tokens (the reference's working
    set fits) when simulated, else the middle one."""
    return 2_000_000 if 2_000_000 in caches else caches[len(caches) // 2]


def render(report: Report) -> str:
    cfg, caches = report.cfg, report.caches
    labels = report.labels
    lines = [f"prefix-cache hit rate: {cfg.conversations:,} conversations x {cfg.turns} turns on "
             f"{cfg.replicas} replicas (seed {cfg.seed}); share of prompt tokens served from cache", ""]
    reference = SimConfig(seed=cfg.seed, turn_seconds=cfg.turn_seconds, vnodes=cfg.vnodes,
                          min_spill_load=cfg.min_spill_load, report_interval_s=cfg.report_interval_s)
    if caches == REFERENCE_CACHES and cfg == reference and {"random", "modulo"} <= set(labels):
        lines.append("the reference's table (its figures in brackets)")
        lines.append(f"  {'cache per replica':<20}{'random':>14}{'affinity (modulo)':>22}")
        for cap, ref_r, ref_a in zip(caches, REFERENCE_RANDOM, REFERENCE_AFFINITY, strict=True):
            lines.append(f"  {_mtok(cap) + ' tokens':<20}{report.hit('random', cap):>8.0%} [{ref_r:.0%}]"
                         f"{report.hit('modulo', cap):>15.0%} [{ref_a:.0%}]")
        lines.append("")
    width = max(12, *(len(x) + 2 for x in labels))
    lines.append("every policy, shared system prompt (+pull: a turn off its prefix pulls it from the replica "
                 "caching most of it; served = cached or pulled)")
    lines.append(f"  {'cache':<8}" + "".join(f"{x:>{width}}" for x in labels))
    for cap in caches:
        lines.append(f"  {_mtok(cap):<8}" + "".join(f"{report.hit(x, cap):>{width}.1%}" for x in labels))
    lines.append("")
    at = balance_cache(caches)
    base = "consistent" if "consistent" in labels else labels[0]
    floor = f", ring spill floor {cfg.min_spill_load}" if cfg.min_spill_load else ""
    lines.append(f"load and spill at {_mtok(at)} tokens per replica (a turn holds its replica {cfg.turn_seconds:.1f} s"
                 f"{floor}; engines report every {cfg.report_interval_s:g} s; hit cost against '{base}' in points)")
    name = max(16, *(len(x) + 2 for x in labels))
    lines.append(f"  {'policy':<{name}}{'served':>8}{'cost':>7}{'spill':>8}{'placed':>8}{'max/avg mean':>14}"
                 f"{'p99':>7}{'peak in flight':>16}")
    for label in labels:
        o = report.outcome(label, at)
        placed = o.placed / o.turns if o.turns else 0.0
        lines.append(f"  {label:<{name}}{o.served_rate:>8.1%}{100 * (report.hit(base, at) - o.served_rate):>+7.1f}"
                     f"{o.spill_rate:>8.2%}{placed:>8.2%}{o.mean_max_over_avg:>14.2f}{o.p99_max_over_avg:>7.2f}"
                     f"{o.peak_in_flight:>16,}")
    lines.append("")
    pulled = [x for x in labels if report.outcome(x, at).spec.pull]
    if pulled:
        c = cfg.cost
        lines.append(f"prompt tokens by source at {_mtok(at)} tokens per replica, and the link (a replica's link "
                     f"{c.link.bandwidth_bytes_s * 8 / 1e9:,.0f} Gb/s, {c.link.latency_s * 1e3:g} ms a transfer; "
                     f"{c.kv_bytes_per_token / 1024:,.0f} KiB per token; "
                     f"{'a served pull demotes the source copy' if cfg.demote_pulled else 'sources keep their copy'})")
        lines.append(f"  {'policy':<{name}}{'cached':>8}{'pulled':>8}{'prefilled':>10}{'pulls':>8}{'short':>7}"
                     f"{'MB/s per replica':>18}{'link mean':>11}{'busiest s':>11}")
        for label in pulled:
            o = report.outcome(label, at)
            lines.append(f"  {label:<{name}}{o.hit_rate:>8.1%}{o.pulled_rate:>8.1%}{o.prefilled_rate:>10.1%}"
                         f"{o.pulls / o.turns if o.turns else 0:>8.1%}{o.pulls_short:>7,}{o.link_bytes_s / 1e6:>18,.1f}"
                         f"{o.link_mean_share:>11.3%}{o.link_peak_share:>11.2%}")
        lines.append("  (pulls: share of turns that pulled; short: pulls whose source held less than the router "
                     "believed; busiest s: the most one replica sent or received in one second, over its link)")
        lines.append("")
    per_owner = cfg.conversations_per_owner
    lines.append(f"owner salting from the first block (no shared system prompt; {per_owner} conversation"
                 f"{'s' if per_owner > 1 else ''} per owner): hit rate shared -> salted")
    lines.append(f"  {'cache':<8}" + "".join(f"{x:>{width + 8}}" for x in labels))
    for cap in caches:
        cells = [f"{report.hit(x, cap):.0%} -> {report.hit(x, cap, True):.0%}" for x in labels]
        lines.append(f"  {_mtok(cap):<8}" + "".join(f"{c:>{width + 8}}" for c in cells))
    return "\n".join(lines)


_COLORS = {Policy.RANDOM: "#5f5e55", Policy.MODULO: "#141413", Policy.CONSISTENT: "#b0420c",
           Policy.BOUNDED: "#2b6a24", Policy.FOLLOW: "#1f5fa8"}


def plot(report: Report, folder: Path) -> list[Path]:
    """PNG charts: hit rate by policy and cache size; served rate (cached or pulled) against max/avg load for
    every policy with pulls off (hollow) and on (filled); where prompt tokens come from; the spill/balance
    trade-off of the ring's eps; salting cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    caches, specs, cfg = report.caches, report.specs, report.cfg
    xs = [c / 1e6 for c in caches]
    at = balance_cache(caches)
    scale = f"{cfg.conversations:,} conversations on {cfg.replicas} replicas"
    written: list[Path] = []

    if len(caches) > 1:
        fig, ax = plt.subplots(figsize=(8, 5))
        for spec in specs:
            if spec.pull and spec.policy is not Policy.FOLLOW:
                continue  # one +pull line (follow's) keeps the chart readable; the others are in the tables
            style = {Policy.RANDOM: "--", Policy.MODULO: ":"}.get(spec.policy, "-.") if not spec.pull else "-"
            marker = {Policy.MODULO: "D", Policy.CONSISTENT: "s", Policy.FOLLOW: "^"}.get(spec.policy, "o")
            ax.plot(xs, [100 * report.hit(spec.label, c) for c in caches], style, marker=marker, label=spec.label,
                    markerfacecolor="none" if spec.policy is Policy.MODULO else None)
        if caches == REFERENCE_CACHES:
            ax.scatter(xs, [100 * v for v in REFERENCE_AFFINITY], marker="x", s=80, color="black",
                       label="reference affinity", zorder=5)
            ax.scatter(xs, [100 * v for v in REFERENCE_RANDOM], marker="+", s=80, color="black",
                       label="reference random", zorder=5)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(xs, [f"{x:g} M" for x in xs])
        ax.set_xlabel("prefix cache per replica (tokens)")
        ax.set_ylabel("prompt tokens served from cache (+pull: or pulled) (%)")
        ax.set_ylim(0, 100)
        ax.set_title(f"Routing and cache size: {scale}")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        written.append(_save(fig, folder / "hit_rate_by_policy.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    routed = [s for s in specs if s.policy is not Policy.RANDOM or s.pull]  # random without pulls: ~52%, off scale
    for ax, attr, title in ((left, "p99_max_over_avg", "p99"), (right, "mean_max_over_avg", "mean")):
        for policy in (Policy.BOUNDED, Policy.FOLLOW):
            for pull in (False, True):
                line = sorted((getattr(report.outcome(s.label, at), attr), 100 * report.hit(s.label, at))
                              for s in routed if s.policy is policy and s.pull is pull)
                if len(line) > 1:
                    ax.plot(*zip(*line), "-" if pull else ":", color=_COLORS[policy], alpha=0.4)
        for spec in routed:
            o = report.outcome(spec.label, at)
            x, y = getattr(o, attr), 100 * o.served_rate
            ax.scatter([x], [y], marker="^" if spec.policy is Policy.FOLLOW else "o", s=45, zorder=3,
                       color=_COLORS[spec.policy] if spec.pull else "none", edgecolors=_COLORS[spec.policy])
            if spec.pull:  # the +pull points crowd one line near the top: short labels under them
                short = {Policy.BOUNDED: f"{spec.eps:g}", Policy.FOLLOW: f"{spec.pull_eps:g}"}.get(
                    spec.policy, spec.policy.value)
                ax.annotate(short, (x, y), textcoords="offset points", xytext=(0, -11), fontsize=6, ha="center",
                            color=_COLORS[spec.policy])
            else:
                ax.annotate(spec.label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=6)
        ax.set_xlabel(f"max / average replica load ({title} over arrivals in steady state)")
        ax.set_title(f"{title} max/avg load")
        ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D

    families = sorted({s.policy for s in routed}, key=lambda p: list(Policy).index(p))
    handles = [Line2D([], [], linestyle="", marker="^" if p is Policy.FOLLOW else "o", color=_COLORS[p],
                      label=f"{p.value} +pull (e under the point)" if p in (Policy.BOUNDED, Policy.FOLLOW)
                      else f"{p.value} +pull") for p in families]
    handles.append(Line2D([], [], linestyle="", marker="o", color="grey", markerfacecolor="none", label="pulls off"))
    right.legend(handles=handles, fontsize=7, loc="lower right")
    left.set_ylabel(f"prompt tokens served without prefill (%) at {_mtok(at)} tokens per replica")
    fig.suptitle(f"Cached or pulled against balance, every policy, pulls off (hollow) and on (filled): {scale} "
                 "(up and left is better)", fontsize=10)
    fig.tight_layout()
    written.append(_save(fig, folder / "hit_rate_vs_load.png"))

    if any(s.pull for s in specs):
        fig, ax = plt.subplots(figsize=(9, 4.8))
        labels = report.labels
        pos = list(range(len(labels)))
        outs = [report.outcome(x, at) for x in labels]
        cached = [100 * o.hit_rate for o in outs]
        pulled = [100 * o.pulled_rate for o in outs]
        ax.bar(pos, cached, 0.7, label="cached on the replica", color="#1f5fa8")
        ax.bar(pos, pulled, 0.7, bottom=cached, label="pulled from another replica", color="#e3a21a")
        ax.bar(pos, [100 * o.prefilled_rate for o in outs], 0.7, bottom=[c + p for c, p in zip(cached, pulled)],
               label="prefilled", color="#b0420c")
        for p, o in zip(pos, outs):
            if o.spec.pull:
                ax.annotate(f"{o.link_mean_share:.2%}", (p, 101), ha="center", fontsize=6)
        ax.set_xticks(pos, labels, rotation=40, ha="right", fontsize=7)
        ax.set_ylabel("prompt tokens (%)")
        ax.set_ylim(0, 108)
        ax.set_title(f"Where prompt tokens come from at {_mtok(at)} tokens per replica "
                     f"(above a +pull bar: its mean share of a replica's link)", fontsize=9)
        ax.legend(fontsize=8, loc="lower left")
        fig.tight_layout()
        written.append(_save(fig, folder / "prompt_tokens_by_source.png"))

    bounded = [s for s in specs if s.policy is Policy.BOUNDED and not s.pull]
    if bounded and "consistent" in report.labels:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
        eps = [s.eps for s in bounded]
        left.plot(eps, [100 * report.outcome(s.label, at).spill_rate for s in bounded], marker="o",
                  label="turns spilled (%)")
        left.plot(eps, [100 * (report.hit("consistent", at) - report.hit(s.label, at)) for s in bounded],
                  marker="s", label=f"hit rate lost at {_mtok(at)} (pp)")
        left.set_xscale("log")
        left.minorticks_off()
        left.set_xticks(eps, [f"{e:g}" for e in eps])
        left.set_xlabel("eps (bound = ceil((1+eps) x average load))")
        left.set_title("What the ring's bound costs")
        left.grid(alpha=0.3)
        left.legend(fontsize=8)
        offs = [s for s in specs if not s.pull]
        names = [s.label for s in offs]
        right.bar(range(len(names)), [report.outcome(x, at).p99_max_over_avg for x in names],
                  color=[_COLORS[s.policy] for s in offs])
        right.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        right.axhline(1.0, color="grey", linewidth=0.8)
        right.set_ylabel("max / average replica load (p99 over arrivals)")
        right.set_title("What a bound buys")
        fig.tight_layout()
        written.append(_save(fig, folder / "bounded_load_tradeoff.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = report.labels
    pos = list(range(len(labels)))
    ax.bar([p - 0.2 for p in pos], [100 * report.hit(x, at) for x in labels], 0.4, label="shared system prompt")
    ax.bar([p + 0.2 for p in pos], [100 * report.hit(x, at, True) for x in labels], 0.4,
           label="salted per owner from block 0")
    ax.set_xticks(list(pos), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("prompt tokens served without prefill (%)")
    ax.set_title(f"The cost of salting the system prompt per owner ({_mtok(at)} tokens per replica)")
    ax.set_ylim(0, 115)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    written.append(_save(fig, folder / "owner_salting_cost.png"))
    return written


def _save(fig: typing.Any, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
