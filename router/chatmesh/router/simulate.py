"""Routing against the prefix cache: the reference design's Part 2, extended to what our router really does.

What. Conversations arrive at replicas that each keep an LRU prefix cache measured in tokens; the result is
the share of prompt tokens served from cache. The reference compares random routing with "affinity"
(conversation index modulo the replica count) and reports 45/48/52/59% against 68/84/95/96% at 0.5, 1, 2 and
8 M tokens of cache per replica. This module reproduces those and adds the routers chatmesh runs, driven by
`ring.py` itself: plain consistent hashing, and bounded loads at several eps, where a turn occupies its
replica while it generates, so a hot replica really does spill turns to the next one on the ring.

The model, in three separable steps (routing does not depend on the cache, nor arrivals on routing):
1. Arrivals. Each of `conversations` starts at a uniform time in [0, arrival_window_s) and sends `turns`
   turns, the gaps exponential with mean `turn_gap_s` (one turn a minute while active).
2. Routing. A policy maps each turn to a replica. For the ring policies a turn holds a lease from its arrival
   for `turn_seconds` (default: the reply at the capacity plan's decode step, 400 x 12.7 ms = 5.1 s), so the
   load the bound sees is the turns in flight. We record spills and the max/average load across replicas.
3. Caching. Turn k of a conversation sends its history plus a 150-token message; the history starts as the
   1,500-token system prompt and grows by message + 400-token reply per turn. The replica serves from its
   cache the longest prefix it holds for that conversation (a stale entry left by a spilled turn still
   covers the older part) and stores the new history; least recently used histories are evicted past the
   capacity. The shared system prompt is always warm (the reference's assumption), unless owners are
   *salted*: an engine that salts the cache from the first block (TensorRT-LLM's `cache_salt`) cannot share
   the system prompt across owners, so a turn gets it only if the same owner has a history on that replica.

What it leaves out, as the reference does: batching and queueing delay, eviction cost, the host tier as a
separate level (the 8 M row stands for HBM plus host memory).
"""

from __future__ import annotations

import enum
import heapq
import random
import typing
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chatmesh.mesh.ids import ConversationId, LeaseId, ReplicaId
from chatmesh.router import capacity
from chatmesh.router.ring import DEFAULT_EPS, DEFAULT_VNODES, Replica, Ring

REFERENCE_CACHES = (500_000, 1_000_000, 2_000_000, 8_000_000)
REFERENCE_RANDOM = (0.45, 0.48, 0.52, 0.59)
REFERENCE_AFFINITY = (0.68, 0.84, 0.95, 0.96)
DEFAULT_EPSILONS = (0.05, 0.1, 0.25, 0.5, 1.0)


def _default_turn_seconds() -> float:
    p = capacity.plan()
    return p.workload.output_tokens * p.decode_step_s


class Policy(enum.Enum):
    """How a turn picks its replica."""

    RANDOM = "random"
    MODULO = "modulo"            # the reference's affinity: conversation index mod replicas
    CONSISTENT = "consistent"    # the ring's home, no load bound
    BOUNDED = "bounded"          # the ring's bounded-load walk (chatmesh's router)


@dataclass(frozen=True)
class PolicySpec:
    policy: Policy
    eps: float = DEFAULT_EPS

    @property
    def label(self) -> str:
        match self.policy:
            case Policy.RANDOM:
                return "random"
            case Policy.MODULO:
                return "modulo"
            case Policy.CONSISTENT:
                return "consistent"
            case Policy.BOUNDED:
                return f"bounded e={self.eps:g}"
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
    min_spill_load: int = 0
    seed: int = 1


@dataclass(frozen=True)
class Arrival:
    t: float
    conversation: int
    turn: int


@dataclass(frozen=True)
class Routing:
    """Where each turn went (in arrival order), and what the load looked like."""

    spec: PolicySpec
    replica_of_turn: tuple[int, ...]
    spills: int
    mean_max_over_avg: float   # max replica load / average, averaged over arrivals in steady state
    p99_max_over_avg: float
    peak_in_flight: int

    @property
    def spill_rate(self) -> float:
        return self.spills / len(self.replica_of_turn) if self.replica_of_turn else 0.0


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


def route(spec: PolicySpec, cfg: SimConfig, schedule: Sequence[Arrival]) -> Routing:
    """Sends every turn through the policy, holding each replica for `turn_seconds` per turn."""
    n = cfg.replicas
    ids = [ReplicaId(f"replica-{i}") for i in range(n)]
    index = {rid: i for i, rid in enumerate(ids)}
    ring = Ring([Replica(rid, "") for rid in ids], vnodes=cfg.vnodes, eps=spec.eps, lease_ttl_s=1e18,
                min_spill_load=cfg.min_spill_load)
    rng = random.Random(cfg.seed ^ 0x5EED)
    in_flight = [0] * n
    done: list[tuple[float, int, int, LeaseId | None]] = []  # (end time, seq, replica, lease)
    chosen: list[int] = []
    samples: list[tuple[float, int]] = []  # (average, max) load after each arrival
    spills = peak = 0
    for seq, a in enumerate(schedule):
        while done and done[0][0] <= a.t:
            _, _, r, lease = heapq.heappop(done)
            in_flight[r] -= 1
            if lease is not None:
                ring.release(lease)
        lease_id: LeaseId | None = None
        match spec.policy:
            case Policy.RANDOM:
                r = rng.randrange(n)
            case Policy.MODULO:
                r = a.conversation % n
            case Policy.CONSISTENT:
                r = index[ring.home(conversation_key(a.conversation))]
            case Policy.BOUNDED:
                pick = ring.pick(conversation_key(a.conversation), a.t)
                r, lease_id = index[pick.replica.id], pick.lease_id
                spills += pick.outcome.spilled
            case _:
                typing.assert_never(spec.policy)
        chosen.append(r)
        in_flight[r] += 1
        heapq.heappush(done, (a.t + cfg.turn_seconds, seq, r, lease_id))
        total = sum(in_flight)
        peak = max(peak, total)
        samples.append((total / n, max(in_flight)))
    top = max((avg for avg, _ in samples), default=0.0)
    steady = sorted(m / avg for avg, m in samples if avg >= 0.5 * top)
    return Routing(
        spec, tuple(chosen), spills,
        mean_max_over_avg=sum(steady) / len(steady) if steady else 0.0,
        p99_max_over_avg=steady[min(len(steady) - 1, int(0.99 * len(steady)))] if steady else 0.0,
        peak_in_flight=peak,
    )


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

    def store(self, conversation: int, owner_of: list[int], length: int) -> None:
        old = self.entries.pop(conversation, None)
        if old is None:
            self.owners[owner_of[conversation]] += 1
        self.used += length - (old or 0)
        self.entries[conversation] = length
        while self.used > self.capacity and self.entries:
            gone, tokens = self.entries.popitem(last=False)
            self.used -= tokens
            self.owners[owner_of[gone]] -= 1


def hit_rate(routing: Routing, cfg: SimConfig, schedule: Sequence[Arrival], cache_tokens: int,
             salted: bool = False) -> float:
    """Share of prompt tokens served from cache for one routing and one cache size per replica."""
    caches = [_ReplicaCache(cache_tokens) for _ in range(cfg.replicas)]
    owner_of = [c // cfg.conversations_per_owner for c in range(cfg.conversations)]
    history = [cfg.system_tokens] * cfg.conversations
    cached = total = 0
    for a, r in zip(schedule, routing.replica_of_turn, strict=True):
        cache, c = caches[r], a.conversation
        prompt = history[c] + cfg.message_tokens
        own = cache.lookup(c)
        if not salted or cache.owners[owner_of[c]] > 0:
            own = max(own, cfg.system_tokens)  # the system prompt's blocks are warm here
        cached += min(own, prompt)
        total += prompt
        history[c] = prompt + cfg.reply_tokens
        cache.store(c, owner_of, history[c])
    return cached / total if total else 0.0


@dataclass(frozen=True)
class Report:
    cfg: SimConfig
    caches: tuple[int, ...]
    routings: tuple[Routing, ...]
    hits: dict[tuple[str, int], float]          # (policy label, cache) -> hit rate, shared system prompt
    salted_hits: dict[tuple[str, int], float]   # the same with per-owner salting

    def hit(self, label: str, cache: int, salted: bool = False) -> float:
        return (self.salted_hits if salted else self.hits)[(label, cache)]


def run(cfg: SimConfig = SimConfig(), caches: Sequence[int] = REFERENCE_CACHES,
        epsilons: Sequence[float] = DEFAULT_EPSILONS) -> Report:
    schedule = arrivals(cfg)
    specs = [PolicySpec(Policy.RANDOM), PolicySpec(Policy.MODULO), PolicySpec(Policy.CONSISTENT),
             *(PolicySpec(Policy.BOUNDED, e) for e in epsilons)]
    routings = tuple(route(s, cfg, schedule) for s in specs)
    hits, salted = {}, {}
    for routing in routings:
        for cap in caches:
            hits[(routing.spec.label, cap)] = hit_rate(routing, cfg, schedule, cap)
            salted[(routing.spec.label, cap)] = hit_rate(routing, cfg, schedule, cap, salted=True)
    return Report(cfg, tuple(caches), routings, hits, salted)


def _mtok(tokens: int) -> str:
    return f"{tokens / 1e6:g} M"


def render(report: Report) -> str:
    cfg, caches = report.cfg, report.caches
    labels = [r.spec.label for r in report.routings]
    lines = [f"prefix-cache hit rate: {cfg.conversations:,} conversations x {cfg.turns} turns on "
             f"{cfg.replicas} replicas (seed {cfg.seed}); share of prompt tokens served from cache", ""]
    if caches == REFERENCE_CACHES and cfg == SimConfig(seed=cfg.seed, turn_seconds=cfg.turn_seconds,
                                                     vnodes=cfg.vnodes, min_spill_load=cfg.min_spill_load):
        lines.append("the reference's table (its figures in brackets)")
        lines.append(f"  {'cache per replica':<20}{'random':>14}{'affinity (modulo)':>22}")
        for cap, ref_r, ref_a in zip(caches, REFERENCE_RANDOM, REFERENCE_AFFINITY, strict=True):
            lines.append(f"  {_mtok(cap) + ' tokens':<20}{report.hit('random', cap):>8.0%} [{ref_r:.0%}]"
                         f"{report.hit('modulo', cap):>15.0%} [{ref_a:.0%}]")
        lines.append("")
    width = max(12, *(len(x) + 2 for x in labels))
    lines.append("every policy, shared system prompt")
    lines.append(f"  {'cache':<8}" + "".join(f"{x:>{width}}" for x in labels))
    for cap in caches:
        lines.append(f"  {_mtok(cap):<8}" + "".join(f"{report.hit(x, cap):>{width}.1%}" for x in labels))
    lines.append("")
    base = "consistent"
    floor = f", spill floor {cfg.min_spill_load}" if cfg.min_spill_load else ""
    lines.append(f"load and spill (a turn holds its replica {cfg.turn_seconds:.1f} s{floor}; hit cost against "
                 f"'{base}' in percentage points per cache size)")
    lines.append(f"  {'policy':<16}{'spill':>8}{'max/avg mean':>14}{'p99':>7}{'peak in flight':>16}   hit cost "
                 + " / ".join(_mtok(c) for c in caches))
    for r in report.routings:
        cost = " / ".join(f"{100 * (report.hit(base, c) - report.hit(r.spec.label, c)):+.1f}" for c in caches)
        lines.append(f"  {r.spec.label:<16}{r.spill_rate:>8.2%}{r.mean_max_over_avg:>14.2f}"
                     f"{r.p99_max_over_avg:>7.2f}{r.peak_in_flight:>16,}   {cost}")
    lines.append("")
    per_owner = cfg.conversations_per_owner
    lines.append(f"owner salting from the first block (no shared system prompt; {per_owner} conversation"
                 f"{'s' if per_owner > 1 else ''} per owner): hit rate shared -> salted")
    lines.append(f"  {'cache':<8}" + "".join(f"{x:>{width + 8}}" for x in labels))
    for cap in caches:
        cells = [f"{report.hit(x, cap):.0%} -> {report.hit(x, cap, True):.0%}" for x in labels]
        lines.append(f"  {_mtok(cap):<8}" + "".join(f"{c:>{width + 8}}" for c in cells))
    return "\n".join(lines)


def plot(report: Report, folder: Path) -> list[Path]:
    """PNG charts: hit rate by policy and cache size; the spill/balance trade-off of eps; salting cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    caches = report.caches
    xs = [c / 1e6 for c in caches]
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in report.routings:
        style = {Policy.RANDOM: "--", Policy.MODULO: ":"}.get(r.spec.policy, "-")
        marker = {Policy.MODULO: "D", Policy.CONSISTENT: "s"}.get(r.spec.policy, "o")
        ax.plot(xs, [100 * report.hit(r.spec.label, c) for c in caches], style, marker=marker,
                label=r.spec.label, markerfacecolor="none" if r.spec.policy is Policy.MODULO else None)
    if caches == REFERENCE_CACHES:
        ax.scatter(xs, [100 * v for v in REFERENCE_AFFINITY], marker="x", s=80, color="black",
                   label="reference affinity", zorder=5)
        ax.scatter(xs, [100 * v for v in REFERENCE_RANDOM], marker="+", s=80, color="black",
                   label="reference random", zorder=5)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(xs, [f"{x:g} M" for x in xs])
    ax.set_xlabel("prefix cache per replica (tokens)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Routing and cache size: {report.cfg.conversations:,} conversations on "
                 f"{report.cfg.replicas} replicas")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    written.append(_save(fig, folder / "hit_rate_by_policy.png"))

    bounded = [r for r in report.routings if r.spec.policy is Policy.BOUNDED]
    if bounded:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
        eps = [r.spec.eps for r in bounded]
        left.plot(eps, [100 * r.spill_rate for r in bounded], marker="o", label="turns spilled (%)")
        mid = caches[len(caches) // 2]
        left.plot(eps, [100 * (report.hit("consistent", mid) - report.hit(r.spec.label, mid)) for r in bounded],
                  marker="s", label=f"hit rate lost at {_mtok(mid)} (pp)")
        left.set_xscale("log")
        left.minorticks_off()
        left.set_xticks(eps, [f"{e:g}" for e in eps])
        left.set_xlabel("eps (bound = ceil((1+eps) x average load))")
        left.set_title("What the bound costs")
        left.grid(alpha=0.3)
        left.legend(fontsize=8)
        others = [r for r in report.routings if r.spec.policy is not Policy.BOUNDED]
        names = [r.spec.label for r in others] + [r.spec.label for r in bounded]
        vals = [r.p99_max_over_avg for r in others] + [r.p99_max_over_avg for r in bounded]
        right.bar(range(len(names)), vals, color=["#b0420c"] * len(others) + ["#2b6a24"] * len(bounded))
        right.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        right.axhline(1.0, color="grey", linewidth=0.8)
        right.set_ylabel("max / average replica load (p99 over arrivals)")
        right.set_title("What the bound buys")
        fig.tight_layout()
        written.append(_save(fig, folder / "bounded_load_tradeoff.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [r.spec.label for r in report.routings]
    cap = caches[len(caches) // 2]
    pos = range(len(labels))
    ax.bar([p - 0.2 for p in pos], [100 * report.hit(x, cap) for x in labels], 0.4, label="shared system prompt")
    ax.bar([p + 0.2 for p in pos], [100 * report.hit(x, cap, True) for x in labels], 0.4,
           label="salted per owner from block 0")
    ax.set_xticks(list(pos), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"The cost of salting the system prompt per owner ({_mtok(cap)} tokens per replica)")
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
