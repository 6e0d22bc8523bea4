"""`chatmesh capacity` (the fleet arithmetic) and `chatmesh simulate` (routing vs prefix-cache hit rate)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from chatmesh.mesh.errors import InvalidArgument
from chatmesh.router import capacity, capacity_plot, disaggregate, follow, link, simulate


def register(sub: Any) -> None:
    p = sub.add_parser("capacity", help="size a chat fleet (KV memory, decode/prefill roofline, nodes)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m, h, w = capacity.ModelShape(), capacity.Hardware(), capacity.Workload()
    g = p.add_argument_group("model")
    g.add_argument("--params", type=float, default=m.params, help="parameters")
    g.add_argument("--layers", type=int, default=m.layers)
    g.add_argument("--kv-heads", type=int, default=m.kv_heads)
    g.add_argument("--head-dim", type=int, default=m.head_dim)
    g = p.add_argument_group("hardware")
    g.add_argument("--precision", choices=[x.value for x in capacity.Precision], default=h.precision.value)
    g.add_argument("--gpu", choices=sorted(capacity.GPUS), default="h100", help="GPU preset")
    g.add_argument("--hbm-gb", type=float, help="override the preset's memory per GPU, GB")
    g.add_argument("--bandwidth-tbs", type=float, help="override the preset's memory bandwidth, TB/s")
    g.add_argument("--tflops", type=float, help="override the preset's dense TFLOP/s at the chosen precision")
    g.add_argument("--tp", type=int, default=h.tp, help="tensor parallelism (GPUs per replica)")
    g.add_argument("--gpus-per-node", type=int, default=h.gpus_per_node)
    g.add_argument("--reserved-gb", type=float, default=h.reserved_bytes / 1e9,
                   help="per GPU for activations and runtime")
    g.add_argument("--decode-eff", type=float, default=h.decode_eff, help="achieved share of peak bandwidth")
    g.add_argument("--prefill-mfu", type=float, default=h.prefill_mfu, help="achieved share of peak FLOP/s")
    g.add_argument("--max-batch", type=int, default=h.max_batch,
                   help="most sequences per decode step (the ITL target's); the KV room may hold fewer")
    g.add_argument("--host-memory-gib", type=float, default=h.host_memory_bytes / capacity.GIB,
                   help="host memory per node for the KV tier (a DGX H100 has 2 TB)")
    g.add_argument("--host-link-gbs", type=float, default=h.host_link_bytes_s / 1e9,
                   help="host-to-GPU bandwidth per GPU, GB/s (PCIe Gen5 x16, achieved)")
    g.add_argument("--link-gbps", type=float, default=link.DEFAULT_NIC_GBPS,
                   help="with --disaggregate: each NIC's Gb/s (link.py's model, as simulate's)")
    g.add_argument("--link-nics", type=int, default=link.DEFAULT_NICS, help="with --disaggregate: NICs per node")
    g.add_argument("--link-latency-ms", type=float, default=link.DEFAULT_LATENCY_S * 1e3,
                   help="with --disaggregate: set-up time of one KV transfer")
    g.add_argument("--chunk-tokens", type=int, default=h.chunk_tokens,
                   help="prefill chunk an aggregated step carries (for the ITL comparison)")
    g = p.add_argument_group("workload")
    g.add_argument("--conversations", type=int, default=w.conversations, help="open at peak")
    g.add_argument("--turn-gap-s", type=float, default=w.turn_gap_s, help="seconds between a user's turns")
    g.add_argument("--prompt-tokens", type=int, default=w.prompt_tokens)
    g.add_argument("--output-tokens", type=int, default=w.output_tokens)
    g.add_argument("--cached-share", type=float, default=w.cached_share, help="share of prompt tokens cached")
    g.add_argument("--target-util", type=float, default=w.target_util)
    g.add_argument("--spare-nodes", type=int, default=w.spare_nodes)
    g = p.add_argument_group("what else to print")
    g.add_argument("--disaggregate", action="store_true",
                   help="also size separate prefill and decode pools and the KV transfer between them")
    g.add_argument("--contexts", metavar="LIST",
                   help="sweep prompt lengths, comma-separated (4k,8k,32k,128k; k = 1,000 tokens)")
    g.add_argument("--plots", metavar="DIR", help="with --contexts: write nodes_by_context.png to this folder")
    p.set_defaults(handler=_capacity)

    p = sub.add_parser("simulate", help="prefix-cache hit rate and load balance under random, modulo, consistent, "
                       "bounded and follow-the-KV routing",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s = simulate.SimConfig()
    p.add_argument("--conversations", type=int, default=s.conversations)
    p.add_argument("--turns", type=int, default=s.turns, help="turns per conversation")
    p.add_argument("--replicas", type=int, default=s.replicas)
    p.add_argument("--caches", default=",".join(f"{c / 1e6:g}" for c in simulate.REFERENCE_CACHES),
                   help="cache sizes per replica, millions of tokens, comma-separated")
    p.add_argument("--eps", default=",".join(f"{e:g}" for e in simulate.DEFAULT_EPSILONS),
                   help="bounded-load (ring) eps values to compare, comma-separated (empty: none)")
    p.add_argument("--follow-eps", default=",".join(f"{e:g}" for e in simulate.DEFAULT_FOLLOW_EPSILONS),
                   help="follow-the-KV eps values to compare, comma-separated (empty: none)")
    p.add_argument("--pulls", choices=("off", "on", "both"), default="both",
                   help="run every policy without pulls, with them (a turn off its prefix pulls it from the replica "
                   "caching most of it), or both")
    p.add_argument("--pull-eps", default=",".join(f"{e:g}" for e in simulate.DEFAULT_PULL_EPSILONS),
                   help="follow with pulls: the eps of the bound for a prefix a move can pull, comma-separated")
    p.add_argument("--link-gbps", type=float, default=link.DEFAULT_NIC_GBPS, help="pulls: each NIC's Gb/s")
    p.add_argument("--link-nics", type=int, default=link.DEFAULT_NICS,
                   help="pulls: NICs a replica sends over at once (one per GPU of a TP group)")
    p.add_argument("--link-latency-ms", type=float, default=link.DEFAULT_LATENCY_S * 1e3,
                   help="pulls: fixed cost of one transfer")
    p.add_argument("--keep-pulled", action="store_true",
                   help="pulls: a source keeps its copy where it was in its LRU (default: a served pull makes the "
                   "copy the next one the source evicts, as the engines do)")
    p.add_argument("--hold-tokens", type=int, default=follow.DEFAULT_HOLD_TOKENS,
                   help="follow: cached prefix tokens that buy one sequence over the bound (0: no overshoot)")
    p.add_argument("--overshoot", type=float, default=follow.DEFAULT_OVERSHOOT,
                   help="follow: the cap over the average is 1 + eps + this")
    p.add_argument("--follow-floor", type=int, default=follow.DEFAULT_FLOOR,
                   help="follow: turns in flight below which a replica never sends a turn away from its prefix")
    p.add_argument("--policies", default="random,modulo,consistent,bounded,follow",
                   help="which policy families to run, comma-separated")
    p.add_argument("--report-interval-s", type=float, default=s.report_interval_s,
                   help="how often engines report residency (and load) to the router")
    p.add_argument("--engine-load-reports", action="store_true",
                   help="the router also counts the engines' reported in-flight turns (as the live router does)")
    p.add_argument("--block-size", type=int, default=s.block_size,
                   help="0: the reference's token model; N: the engines' accounting in blocks of N tokens")
    p.add_argument("--system-tokens", type=int, default=s.system_tokens)
    p.add_argument("--message-tokens", type=int, default=s.message_tokens)
    p.add_argument("--reply-tokens", type=int, default=s.reply_tokens)
    p.add_argument("--arrival-window-s", type=float, default=s.arrival_window_s)
    p.add_argument("--turn-gap-s", type=float, default=s.turn_gap_s, help="mean seconds between a user's turns")
    p.add_argument("--turn-seconds", type=float, default=s.turn_seconds,
                   help="seconds a turn holds its replica (default: reply tokens x the capacity plan's step)")
    p.add_argument("--conversations-per-owner", type=int, default=s.conversations_per_owner,
                   help="for the salting table: conversations sharing one owner's salt")
    p.add_argument("--vnodes", type=int, default=s.vnodes, help="ring points per replica")
    p.add_argument("--min-spill-load", type=int, default=s.min_spill_load,
                   help="the ring's floor under the load bound (turns in flight below which a home never spills)")
    p.add_argument("--seed", type=int, default=s.seed)
    p.add_argument("--plots", metavar="DIR", help="write PNG charts to this folder")
    p.set_defaults(handler=_simulate)


def capacity_plan(args: argparse.Namespace) -> capacity.CapacityPlan:
    precision = capacity.Precision(args.precision)
    gpu = capacity.GPUS[args.gpu]
    if args.hbm_gb is not None:
        gpu = dataclasses.replace(gpu, name=f"{gpu.name} ({args.hbm_gb:g} GB)", hbm_bytes=args.hbm_gb * 1e9)
    if args.bandwidth_tbs is not None:
        gpu = dataclasses.replace(gpu, name=f"{gpu.name} ({args.bandwidth_tbs:g} TB/s)",
                                  bandwidth_bytes_s=args.bandwidth_tbs * 1e12)
    if args.tflops is not None:
        flops = {"fp8_flops" if precision is capacity.Precision.FP8 else "bf16_flops": args.tflops * 1e12}
        gpu = dataclasses.replace(gpu, name=f"{gpu.name} ({args.tflops:g} TFLOP/s)", **flops)
    return capacity.plan(
        capacity.ModelShape(args.params, args.layers, args.kv_heads, args.head_dim),
        capacity.Hardware(gpu, precision, args.tp, args.gpus_per_node, args.reserved_gb * 1e9, args.decode_eff,
                          args.prefill_mfu, args.max_batch, args.host_memory_gib * capacity.GIB,
                          args.host_link_gbs * 1e9, args.chunk_tokens),
        capacity.Workload(args.conversations, args.turn_gap_s, args.prompt_tokens, args.output_tokens,
                          args.cached_share, args.target_util, args.spare_nodes),
    )


def _capacity(args: argparse.Namespace) -> int:
    try:
        if args.plots and not args.contexts:
            raise InvalidArgument("--plots draws the context sweep: give --contexts too")
        p = capacity_plan(args)
        contexts = [capacity.parse_tokens(c) for c in args.contexts.split(",") if c.strip()] if args.contexts else []
        plans = capacity.sweep(contexts, p.model, p.hardware, p.workload) if args.contexts else []
        if not (args.link_gbps > 0 and args.link_nics > 0 and args.link_latency_ms >= 0):
            raise InvalidArgument("--link-gbps and --link-nics must be positive, --link-latency-ms at least 0")
        replica_link = link.Link(args.link_gbps * 1e9 / 8 * args.link_nics / p.replicas_per_node,
                                 args.link_latency_ms / 1e3)  # a node's NICs shared among its replicas
    except InvalidArgument as err:
        print(f"chatmesh capacity: {err}", file=sys.stderr)
        return 2
    print(capacity.render(p))
    if args.disaggregate:
        print(disaggregate.render(disaggregate.disaggregate(p, replica_link)))
    if plans:
        print(capacity.render_sweep(plans))
        if args.plots:
            print(f"wrote {capacity_plot.plot_sweep(plans, Path(args.plots))}")
    return 0


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _simulate(args: argparse.Namespace) -> int:
    cfg = simulate.SimConfig(
        conversations=args.conversations, turns=args.turns, replicas=args.replicas, turn_gap_s=args.turn_gap_s,
        turn_seconds=args.turn_seconds, conversations_per_owner=max(1, args.conversations_per_owner),
        vnodes=args.vnodes, min_spill_load=args.min_spill_load, report_interval_s=args.report_interval_s,
        engine_load_reports=args.engine_load_reports, block_size=args.block_size, system_tokens=args.system_tokens,
        message_tokens=args.message_tokens, reply_tokens=args.reply_tokens, arrival_window_s=args.arrival_window_s,
        link_gbps=args.link_gbps, link_nics=args.link_nics, link_latency_s=args.link_latency_ms / 1e3,
        demote_pulled=not args.keep_pulled, seed=args.seed)
    caches = [round(c * 1e6) for c in _floats(args.caches)]
    families = {x.strip() for x in args.policies.split(",") if x.strip()}
    unknown = families - {p.value for p in simulate.Policy}
    if unknown:
        print(f"chatmesh simulate: unknown policies {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    pulls = {"off": (False,), "on": (True,), "both": (False, True)}[args.pulls]
    specs = [spec for spec in simulate.default_specs(_floats(args.eps), _floats(args.follow_eps),
                                                     _floats(args.pull_eps), pulls)
             if spec.policy.value in families]
    specs = [dataclasses.replace(spec, hold_tokens=args.hold_tokens, overshoot=args.overshoot,
                                 floor=args.follow_floor) if spec.policy is simulate.Policy.FOLLOW else spec
             for spec in specs]
    if not specs or not caches:
        print("chatmesh simulate: nothing to simulate (no policy or no cache size)", file=sys.stderr)
        return 2
    report = simulate.run(cfg, caches, specs)
    print(simulate.render(report))
    if args.plots:
        for path in simulate.plot(report, Path(args.plots)):
            print(f"wrote {path}")
    return 0
