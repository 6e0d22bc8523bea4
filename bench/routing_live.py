"""Live routing against the planner: the router and N `sim` engine replicas as real processes over gRPC, driven
by the simulator's own arrival schedule, the hit rate read from the engines' counters next to what
`chatmesh simulate` predicts for the same scaled parameters.

What runs. `chatmesh serve router` (CHATMESH_ROUTER_POLICY=follow or ring, health and stats watching on, stats
every 500 ms) and `--replicas` x `chatmesh serve engine` (CHATMESH_ENGINE=sim), each its own process on free
loopback ports. This process plays chat's engine-facing part of a turn: PickReplica, Generate on the picked
replica with the turn's token ids, ReleaseLease when the stream ends; the router sees conversation ids only,
and learns placement from its picks and the engines' WatchStats residency, as in production. (Chat's own
context builder is left out on purpose: it adds nothing to routing, and token-exact prompts are what make the
planner's prediction apply to the same parameters.)

Scaling, so it fits this machine (2 cores) while keeping the reference's ratios:
- tokens x `--token-scale` (0.2): system prompt 300, message 30, reply 80 tokens;
- conversations per replica `--per-replica` (60, the reference has 500) and KV capacity per replica scaled with
  both: 2 M x 0.2 x 60 / 500 = 48,000 tokens (3,000 blocks of 16), so the working set fits as tightly as the
  reference's 1.9 M in 2 M;
- time x `--time-scale` (0.2): a turn a user sends every 12 s, conversations starting over 120 s, and the
  engine's fixed step time chosen so a reply lasts 400 x 12.7 ms x 0.2 = 1.0 s (80 tokens at 12 ms);
- the load bound's floor lowered to `--floor` (2) for both policies and the prediction, so the bound acts at
  this small load (the default floor 16 would keep every turn home here), and follow's hold_tokens scaled with
  the tokens (1,600 x 0.2 = 320).
Prompts: turn k of a conversation is its previous prompt, the reply the engine generated, then a new message of
fresh token ids (the platform prefix, the system prompt, is the same for everyone; each conversation has its
own owner salt). The engines' block accounting differs from the reference's token model, so the prediction
runs the simulator with the engines' own (`block_size` 16: whole blocks, the last token computed, the system
prompt stored once per replica) and the router's load as live (leases plus the engines' reported in-flight
turns), with the turn time measured live.

Hit rate live = (hit tokens) / (hit + miss tokens) summed over the engines' GetStats counters (before/after);
with pulls (issue 29) the rate that counts is hit-or-pull: (hit + pulled) / (hit + pulled + miss), pulled tokens
from EngineStats.prefix_transfer, predicted by the simulator with pulls on (`PolicySpec.pull`). A policy spelled
`follow+pull:0.05` runs the router with CHATMESH_ROUTER_PULLS on and that pull eps (the prefill eps stays 0.2);
without `+pull` the router plans no pulls. Every turn names an owner (its conversation: one owner each, as the
simulator's salting), so the engines derive its salt and a moved turn can pull its prefix.

`--rolling-restart`: while the schedule runs, every engine in turn gets SIGTERM (it drains: no new turns, pulls
still served through CHATMESH_SHUTDOWN_GRACE_S, then exits), is started again once gone, and the next follows
once the router lists it serving. Figures before (turns started before the first SIGTERM), during (until the
last engine serves again) and after, from the turns' own Started events: cached on the replica, pulled,
prefilled.

    .venv/bin/python -m bench.routing_live [--replicas 4] [--policies follow:0.2,follow+pull:0.05,ring:0.25]
        [--rolling-restart]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from chatmesh.mesh.trust import Trust
from chatmesh.mesh.up import replicas_serving
from chatmesh.router import follow, simulate
from chatmesh.router.simulate import Policy, PolicySpec, SimConfig
from chatmesh.v1 import generate_pb2, generate_pb2_grpc, route_pb2, route_pb2_grpc
from tests.conftest import free_port

REFERENCE_CACHE = 2_000_000
REFERENCE_PER_REPLICA = 500
OUTCOMES = {route_pb2.PICK_OUTCOME_HOME: "home", route_pb2.PICK_OUTCOME_SPILL: "spill",
            route_pb2.PICK_OUTCOME_PLACED: "placed"}


@dataclass(frozen=True)
class Scaled:
    cfg: SimConfig
    cache_tokens: int
    step_ms: float
    hold_tokens: int  # follow's hold_tokens, scaled with the tokens


def scaled(replicas: int, per_replica: int, token_scale: float, time_scale: float, block_size: int,
           floor: int, seed: int) -> Scaled:
    ref = SimConfig()
    reply = round(ref.reply_tokens * token_scale)
    turn_s = ref.turn_seconds * time_scale
    cfg = SimConfig(conversations=replicas * per_replica, replicas=replicas,
                    system_tokens=round(ref.system_tokens * token_scale),
                    message_tokens=round(ref.message_tokens * token_scale), reply_tokens=reply,
                    turn_gap_s=ref.turn_gap_s * time_scale, arrival_window_s=ref.arrival_window_s * time_scale,
                    turn_seconds=turn_s, min_spill_load=floor, block_size=block_size, engine_load_reports=True,
                    seed=seed)
    cache = round(REFERENCE_CACHE * token_scale * per_replica / REFERENCE_PER_REPLICA)
    return Scaled(cfg, cache, 1000 * turn_s / reply, round(follow.DEFAULT_HOLD_TOKENS * token_scale))


@dataclass
class Turn:
    outcome: str
    replica: str
    seconds: float
    prompt_tokens: int
    cached_tokens: int  # the replica's own cache
    late_s: float  # how long it waited for the previous turn of its conversation
    pulled_tokens: int = 0
    started_at: float = 0.0  # monotonic
    source: str = ""  # the replica the pick named to pull from


class Processes:
    """The router and the engines as child processes; stopped by pid."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.by_name: dict[str, tuple[subprocess.Popen[bytes], str, str, dict[str, str]]] = {}

    def start(self, name: str, service: str, address: str, env: dict[str, str]) -> None:
        log = (self.log_dir / f"{name}.log").open("ab")
        full = {**os.environ, "CHATMESH_LOG_LEVEL": "warning", "CHATMESH_ROUTER_METRICS_PORT": "0",
                "CHATMESH_MESH_PLAINTEXT": "true",  # loopback only
                "CHATMESH_ENGINE_METRICS_PORT": "0", **env}
        proc = subprocess.Popen([sys.executable, "-m", "chatmesh.mesh.cli", "serve", service,
                                 "--listen", address], env=full, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        self.by_name[name] = (proc, service, address, env)

    def terminate_and_restart(self, name: str, timeout_s: float = 60.0) -> None:
        """SIGTERM to one process (by its pid), wait for it to exit, start it again with the same settings."""
        proc, service, address, env = self.by_name[name]
        proc.terminate()
        proc.wait(timeout_s)
        self.start(name, service, address, env)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


async def engine_counters(addresses: dict[str, str]) -> dict[str, tuple[int, int, int]]:
    """Each engine's (hit, miss, pulled) prompt tokens since it started."""
    out = {}
    for rid, address in addresses.items():
        async with grpc.aio.insecure_channel(address) as channel:
            stats = (await generate_pb2_grpc.GenerateServiceStub(channel).GetStats(
                generate_pb2.GetStatsRequest(), timeout=10)).stats
            out[rid] = (stats.hit_tokens, stats.miss_tokens, stats.prefix_transfer.pulled_tokens)
    return out


def router_serving(router: str, replica: str) -> bool:
    async def ask() -> bool:
        async with grpc.aio.insecure_channel(router) as channel:
            resp = await route_pb2_grpc.RouteServiceStub(channel).ListReplicas(route_pb2.ListReplicasRequest(),
                                                                               timeout=2)
        return any(r.replica_id == replica and r.state == route_pb2.REPLICA_STATE_SERVING for r in resp.replicas)
    try:
        return asyncio.run(ask())
    except grpc.RpcError:
        return False


def rolling_restart(procs: Processes, names: dict[str, str], router: str, marks: list[tuple[str, float]]) -> None:
    """Every engine in turn (replica id -> process name): SIGTERM, wait for its exit, start it again, wait until
    the router serves it."""
    for rid, name in names.items():
        marks.append((f"term {rid}", time.monotonic()))
        procs.terminate_and_restart(name)
        deadline = time.monotonic() + 120
        while not router_serving(router, rid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router never saw {rid} serving again")
            time.sleep(0.1)
        marks.append((f"back {rid}", time.monotonic()))


def wait_serving(router: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not replicas_serving(Trust.insecure(), router):
        if time.monotonic() > deadline:
            raise RuntimeError("the router never saw every engine serving")
        time.sleep(0.2)


async def drive(s: Scaled, router: str, addresses: dict[str, str],
                during: Callable[[], None] | None = None, at_s: float = 0.0) -> list[Turn]:
    """Every turn of the simulator's schedule at its (scaled) time: pick, generate, release; `during` runs in a
    thread from `at_s` seconds in (a rolling restart)."""
    cfg = s.cfg
    schedule = simulate.arrivals(cfg)
    rng = random.Random(cfg.seed ^ 0xB0B)
    system = [rng.randrange(1, 30_000) for _ in range(cfg.system_tokens)]
    prompts: dict[int, list[int]] = {}
    previous: dict[int, asyncio.Task[None]] = {}
    turns: list[Turn] = []
    channels = {rid: grpc.aio.insecure_channel(a) for rid, a in addresses.items()}
    engines = {rid: generate_pb2_grpc.GenerateServiceStub(ch) for rid, ch in channels.items()}
    router_channel = grpc.aio.insecure_channel(router)
    route = route_pb2_grpc.RouteServiceStub(router_channel)
    conversation_ids = [str(uuid.uuid5(uuid.NAMESPACE_URL, f"chatmesh-bench/{cfg.seed}/{c}"))
                        for c in range(cfg.conversations)]

    async def turn(c: int, k: int, after: asyncio.Task[None] | None) -> None:
        queued = time.monotonic()
        if after is not None:
            await after
        late = time.monotonic() - queued
        prompt = prompts.get(c, system) + [rng.randrange(30_000, 60_000) for _ in range(cfg.message_tokens)]
        start = time.monotonic()
        cached = pulled = 0
        reply: list[int] = []
        for attempt in range(50):  # an engine restarting: ask the router again (it learns within a stats interval)
            pick = await route.PickReplica(route_pb2.PickReplicaRequest(conversation_id=conversation_ids[c]))
            reply = []
            try:
                async for event in engines[pick.replica_id].Generate(generate_pb2.GenerateRequest(
                        request_id=str(uuid.uuid4()), conversation_id=conversation_ids[c], turn_id=str(uuid.uuid4()),
                        prompt_token_ids=prompt, owner_id=conversation_ids[c],
                        platform_prefix_tokens=cfg.system_tokens, max_tokens=cfg.reply_tokens, seed=c * 31 + k,
                        source_replica_id=pick.source_replica_id, source_address=pick.source_address)):
                    kind = event.WhichOneof("event")
                    if kind == "started":
                        cached, pulled = event.started.cached_prompt_tokens, event.started.pulled_prompt_tokens
                    elif kind == "delta":
                        reply.extend(event.delta.token_ids)
                break
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or reply or attempt == 49:
                    raise
                await asyncio.sleep(0.1)
            finally:
                await route.ReleaseLease(route_pb2.ReleaseLeaseRequest(lease_id=pick.lease_id))
        prompts[c] = prompt + reply
        turns.append(Turn(OUTCOMES[pick.outcome], pick.replica_id, time.monotonic() - start, len(prompt), cached,
                          late, pulled, start, pick.source_replica_id))

    t0 = time.monotonic()
    side: asyncio.Task[None] | None = None
    if during is not None:
        async def later() -> None:
            await asyncio.sleep(at_s)
            await asyncio.to_thread(during)
        side = asyncio.create_task(later())
    try:
        for a in schedule:
            wait = t0 + a.t - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            previous[a.conversation] = asyncio.create_task(turn(a.conversation, a.turn, previous.get(a.conversation)))
        await asyncio.gather(*previous.values())
        if side is not None:
            await side
    finally:
        for ch in channels.values():
            await ch.close(None)
        await router_channel.close(None)
    return turns


@dataclass(frozen=True)
class Window:
    """Prompt tokens of the turns started in one stretch of a run, by where they came from."""

    name: str
    turns: int
    cached: float
    pulled: float
    prefilled: float


def windows(turns: list[Turn], marks: list[tuple[str, float]]) -> list[Window]:
    if not marks:
        return []
    first, last = marks[0][1], marks[-1][1]
    out = []
    for name, lo, hi in (("before", -math.inf, first), ("during", first, last), ("after", last, math.inf)):
        chosen = [t for t in turns if lo <= t.started_at < hi]
        total = sum(t.prompt_tokens for t in chosen) or 1
        cached, pulled = sum(t.cached_tokens for t in chosen), sum(t.pulled_tokens for t in chosen)
        out.append(Window(name, len(chosen), cached / total, pulled / total, 1 - (cached + pulled) / total))
    return out


@dataclass(frozen=True)
class Result:
    policy: str
    eps: float
    live_hit: float  # hit-or-pull: (cached + pulled) / prompt tokens, engines' counters
    client_hit: float
    predicted_hit: float
    live_spill: float
    predicted_spill: float
    live_placed: float
    predicted_placed: float
    turn_s: float
    late_p99_s: float
    turns: int
    live_pulled: float = 0.0
    predicted_pulled: float = 0.0
    windows: tuple[Window, ...] = ()
    restarts: tuple[tuple[str, float], ...] = ()


def run_policy(s: Scaled, policy: str, eps: float, log_dir: Path, restart: bool = False) -> Result:
    cfg = s.cfg
    bs = cfg.block_size
    family, pull = policy.removesuffix("+pull"), policy.endswith("+pull")
    tag = policy.replace("+", "-")
    addresses = {f"engine-{i}": f"127.0.0.1:{free_port()}" for i in range(cfg.replicas)}
    router = f"127.0.0.1:{free_port()}"
    procs = Processes(log_dir)
    marks: list[tuple[str, float]] = []
    eps_env = {"CHATMESH_ROUTER_PULL_EPS": f"{eps:g}"} if pull else {"CHATMESH_ROUTER_EPS": f"{eps:g}"}
    try:
        for rid, address in addresses.items():
            procs.start(f"{tag}-{rid}", "engine", address, {
                "CHATMESH_ENGINE": "sim", "CHATMESH_REPLICA_ID": rid, "CHATMESH_SIM_TEXT": "words",
                "CHATMESH_SIM_STEP_MS": f"{s.step_ms:g}", "CHATMESH_BLOCK_SIZE": str(bs),
                "CHATMESH_DEVICE_BLOCKS": str(s.cache_tokens // bs), "CHATMESH_HOST_BLOCKS": "0",
                "CHATMESH_SIM_REPLY_TOKENS": "0", "CHATMESH_SHUTDOWN_GRACE_S": "3"})
        procs.start(f"{tag}-router", "router", router, {
            "CHATMESH_REPLICAS": ",".join(f"{k}={v}" for k, v in addresses.items()),
            "CHATMESH_ROUTER_POLICY": family, "CHATMESH_ROUTER_PULLS": "true" if pull else "false", **eps_env,
            "CHATMESH_ROUTER_MIN_SPILL_LOAD": str(cfg.min_spill_load),
            "CHATMESH_ROUTER_HOLD_TOKENS": str(s.hold_tokens),
            "CHATMESH_ROUTER_STATS_INTERVAL_MS": str(round(1000 * cfg.report_interval_s))})
        wait_serving(router)
        before = asyncio.run(engine_counters(addresses))
        during = (lambda: rolling_restart(procs, {rid: f"{tag}-{rid}" for rid in addresses}, router, marks)) \
            if restart else None
        turns = asyncio.run(drive(s, router, addresses, during, at_s=0.4 * cfg.arrival_window_s))
        after = asyncio.run(engine_counters(addresses))
    finally:
        procs.stop()
    if restart:  # the engines' counters restarted with them: the turns' own Started events are the figures
        cached_live = sum(t.cached_tokens for t in turns)
        pulled_live = sum(t.pulled_tokens for t in turns)
        total_live = sum(t.prompt_tokens for t in turns)
    else:
        cached_live = sum(after[r][0] - before[r][0] for r in addresses)
        pulled_live = sum(after[r][2] - before[r][2] for r in addresses)
        total_live = cached_live + pulled_live + sum(after[r][1] - before[r][1] for r in addresses)
    turn_s = statistics.fmean(t.seconds for t in turns)
    spec = PolicySpec(Policy.FOLLOW if family == "follow" else Policy.BOUNDED, follow.DEFAULT_EPS if pull else eps,
                      hold_tokens=s.hold_tokens, floor=cfg.min_spill_load, pull=pull, pull_eps=eps)
    predicted = simulate.simulate(spec, dataclasses.replace(cfg, turn_seconds=turn_s), simulate.arrivals(cfg),
                                  s.cache_tokens)
    outcomes = Counter(t.outcome for t in turns)
    late = sorted(t.late_s for t in turns)
    return Result(policy, eps, (cached_live + pulled_live) / total_live, sum(
        t.cached_tokens + t.pulled_tokens for t in turns) / sum(t.prompt_tokens for t in turns),
        predicted.served_rate, outcomes["spill"] / len(turns), predicted.spill_rate,
        outcomes["placed"] / len(turns), predicted.placed / predicted.turns, turn_s,
        late[int(0.99 * (len(late) - 1))], len(turns), pulled_live / total_live, predicted.pulled_rate,
        tuple(windows(turns, marks)), tuple((m, round(t - marks[0][1], 1)) for m, t in marks))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--per-replica", type=int, default=60, help="conversations per replica")
    ap.add_argument("--token-scale", type=float, default=0.2)
    ap.add_argument("--time-scale", type=float, default=0.2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--floor", type=int, default=2, help="the load bound's floor, live and predicted")
    ap.add_argument("--policies", default="follow:0.2,follow+pull:0.05,ring:0.25",
                    help="policy:eps pairs, comma-separated (follow+pull: with pulls, eps the pull eps)")
    ap.add_argument("--rolling-restart", action="store_true",
                    help="SIGTERM and restart every engine in turn during the run (figures before/during/after)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    s = scaled(args.replicas, args.per_replica, args.token_scale, args.time_scale, args.block_size, args.floor,
               args.seed)
    cfg = s.cfg
    load_start = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    results = []
    with tempfile.TemporaryDirectory(prefix="chatmesh-routing-live-") as tmp:
        for item in args.policies.split(","):
            policy, _, eps = item.partition(":")
            results.append(run_policy(s, policy.strip(), float(eps or 0.2), Path(tmp), args.rolling_restart))
    load_end = os.getloadavg()
    print(f"Routing live vs planner, {started:%Y-%m-%d %H:%M} UTC. Machine: {platform.machine()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}, grpcio {grpc.__version__}.")
    print(f"Command: python -m bench.routing_live --replicas {args.replicas} --per-replica {args.per_replica} "
          f"--token-scale {args.token_scale:g} --time-scale {args.time_scale:g} --block-size {args.block_size} "
          f"--floor {args.floor} --policies {args.policies} --seed {args.seed}"
          + (" --rolling-restart" if args.rolling_restart else ""))
    print(f"Scaled workload: {cfg.conversations} conversations x {cfg.turns} turns on {cfg.replicas} sim replicas, "
          f"system/message/reply {cfg.system_tokens}/{cfg.message_tokens}/{cfg.reply_tokens} tokens, a turn every "
          f"{cfg.turn_gap_s:g} s, starts over {cfg.arrival_window_s:g} s, KV {s.cache_tokens:,} tokens per replica "
          f"({s.cache_tokens // cfg.block_size:,} blocks of {cfg.block_size}), step {s.step_ms:.1f} ms, "
          f"floor {cfg.min_spill_load}.")
    print(f"Load average (1, 5, 15 min) at start: {', '.join(f'{x:.2f}' for x in load_start)}; "
          f"at end: {', '.join(f'{x:.2f}' for x in load_end)}.")
    print("")
    source = "the turns' Started events" if args.rolling_restart else "engines' counters"
    print(f"| policy | hit-or-pull, {source} | predicted (chatmesh simulate) | live - predicted | pulled live / "
          "predicted | spill live / predicted | placed live / predicted | mean turn (s) | p99 wait for previous "
          "turn (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.policy} e={r.eps:g} | {r.live_hit:.1%} | {r.predicted_hit:.1%} | "
              f"{100 * (r.live_hit - r.predicted_hit):+.1f} pt | {r.live_pulled:.1%} / {r.predicted_pulled:.1%} | "
              f"{r.live_spill:.1%} / {r.predicted_spill:.1%} | "
              f"{r.live_placed:.1%} / {r.predicted_placed:.1%} | {r.turn_s:.2f} | {r.late_p99_s:.2f} |")
    print("")
    print("(Client-side check, cached + pulled tokens the engines announced in Started over prompt tokens: "
          + ", ".join(f"{r.policy} {r.client_hit:.1%}" for r in results) + ".)")
    if args.rolling_restart:
        print("")
        print("Rolling restart (every engine SIGTERM, restarted once gone, the next once the router serves it), "
              "prompt tokens of the turns started in each stretch:")
        print("")
        print("| policy | stretch | turns | cached | pulled | prefilled |")
        print("|---|---|---:|---:|---:|---:|")
        for r in results:
            for w in r.windows:
                print(f"| {r.policy} e={r.eps:g} | {w.name} | {w.turns} | {w.cached:.1%} | {w.pulled:.1%} | "
                      f"{w.prefilled:.1%} |")
        for r in results:
            print(f"({r.policy}: " + ", ".join(f"{m} at +{t:g} s" for m, t in r.restarts) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
