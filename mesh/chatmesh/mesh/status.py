"""`chatmesh status`: the running mesh at a glance, and the Prometheus scrape config for it.

What it prints: each service's health (the standard gRPC health check, as the operator identity; the gateway's
/healthz), each engine replica's state, load and KV occupancy (from the router's metrics, which carry what each
engine last reported), and over the last minute: turns by outcome, the prefix-cache hit rate (prompt tokens
found in cache / looked up, from the engine's vLLM-named counters) and TTFT p50/p95 as clients see it (the
gateway's histogram). "The last minute" needs no Prometheus: each service's /metrics also answers
`?ago=60` with what it said about a minute ago (`chatmesh.mesh.metrics`), and the figures are the difference,
computed the way Prometheus's `increase` and `histogram_quantile` would. `--watch [S]` refreshes every S seconds.

`chatmesh status --scrape-config` prints a Prometheus configuration scraping every service of this mesh (the
same settings as `chatmesh up`); docs/observability/prometheus.yml is its output for the defaults.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from chatmesh.mesh import config, identity, settings
from chatmesh.mesh.config import Config
from chatmesh.mesh.trust import Trust, TrustRefused
from chatmesh.mesh.up import ORDER, Extra, MeshError, grpc_serving, http_answers, metrics_targets, scaled

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_config(cfg: Config, interval_s: float = 15.0, extra: Sequence[Extra] = ()) -> str:
    """A Prometheus configuration with one job per service of the mesh `cfg` describes; with `extra` processes
    (`chatmesh up --engines N --chats N`: up.scaled) the engine and chat jobs list every replica, each target
    labelled with its process (engine-0, engine-1, ...)."""
    lines = ["# Prometheus scrape config for a chatmesh mesh (chatmesh status --scrape-config)", "global:",
             f"  scrape_interval: {_duration(interval_s)}", f"  evaluation_interval: {_duration(interval_s)}",
             "scrape_configs:"]
    targets = metrics_targets(cfg, extra)
    for service in dict.fromkeys(t.service for t in targets):
        lines += [f"  - job_name: chatmesh-{service}", "    metrics_path: /metrics", "    static_configs:"]
        for t in targets:
            if t.service == service:
                process = f", process: {t.process}" if t.process != service else ""
                lines += [f"      - targets: ['{t.url.removeprefix('http://').removesuffix('/metrics')}']",
                          f"        labels: {{service: {service}{process}}}"]
    return "\n".join(lines) + "\n"


def _duration(seconds: float) -> str:
    return f"{int(seconds)}s" if seconds >= 1 and seconds == int(seconds) else f"{int(seconds * 1000)}ms"


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def scrape(url: str, ago_s: float | None = None, timeout_s: float = 2.0) -> tuple[Samples, float] | None:
    """A service's samples now (or about `ago_s` ago, with the snapshot's real age); None when unreachable."""
    try:
        with urllib.request.urlopen(url + (f"?ago={ago_s:g}" if ago_s is not None else ""),
                                    timeout=timeout_s) as resp:
            return parse(resp.read().decode()), float(resp.headers.get("x-chatmesh-age-seconds") or 0.0)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def total(samples: Samples, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in samples.items() if n == name and all((k, want) in labels
                                                                            for k, want in match.items()))


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in samples.items():
        if n == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def quantile(q: float, buckets: Mapping[float, float]) -> float:
    """Prometheus's histogram_quantile over cumulative bucket counts {le: count}: linear inside the bucket."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below) if count > below else bound
        lower, below = bound, count
    return lower


def histogram_delta(now: Samples, then: Samples, name: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for (n, labels), v in now.items():
        if n == name + "_bucket":
            le = float(dict(labels)["le"])
            out[le] = out.get(le, 0.0) + v - then.get((n, labels), 0.0)
    return out


@dataclass
class Report:
    health: dict[str, bool]
    replicas: dict[str, dict[str, float]]
    window_s: float
    turns: dict[str, float]
    hit_rate: float
    ttft_p50_s: float
    ttft_p95_s: float

    def render(self) -> str:
        lines = ["services:"]
        lines += [f"  {name:<10} {'SERVING' if ok else 'DOWN'}" for name, ok in self.health.items()]
        lines.append("replicas:        state    load  KV used")
        for rid, r in sorted(self.replicas.items()):
            kv = f"{r['kv'] * 100:5.1f}%" if "kv" in r else "    ?"
            lines.append(f"  {rid:<14} {'serving' if r.get('serving') else 'down   '} {int(r.get('load', 0)):5d}  {kv}")
        window = f"last {self.window_s:.0f} s" if self.window_s >= 1 else "since start"
        turns = ", ".join(f"{k} {int(v)}" for k, v in sorted(self.turns.items()) if v) or "none"
        lines.append(f"{window}: turns {turns}")
        lines.append(f"  prefix-cache hit rate {_pct(self.hit_rate)}  TTFT p50 {_ms(self.ttft_p50_s)}  "
                     f"p95 {_ms(self.ttft_p95_s)} (at the edge)")
        return "\n".join(lines)


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 100:.1f}%"


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f} ms"


def _summed(parts: Sequence[Samples]) -> Samples:
    """One service's samples over its processes (counters and histogram buckets add up across replicas)."""
    out: Samples = {}
    for samples in parts:
        for key, value in samples.items():
            out[key] = out.get(key, 0.0) + value
    return out


def report(cfg: Config, window_s: float = 60.0, extra: Sequence[Extra] = ()) -> Report:
    """The mesh `cfg` describes, plus `extra` processes (up.scaled: `chatmesh status --engines N --chats N`),
    whose engines' and chats' figures add up with the standard ones'."""
    trust = Trust.from_config(cfg, identity.OPERATOR)
    health = {service: grpc_serving(trust, cfg[address], service) for service, address in ORDER}
    health.update({x.name: grpc_serving(trust, x.address, x.service) for x in extra})
    health["gateway"] = http_answers(f"http://{cfg[settings.HOST]}:{cfg[settings.GATEWAY_PORT]}/healthz")
    targets = metrics_targets(cfg, extra)
    now = {t.process: scrape(t.url) for t in targets}
    then = {t.process: scrape(t.url, window_s) for t in targets}

    def pair(service: str) -> tuple[Samples, Samples, float]:
        current = [(c, then.get(t.process)) for t in targets if t.service == service
                   and (c := now.get(t.process)) is not None]
        if not current:
            return {}, {}, 0.0
        past = [p for _, p in current if p is not None]
        return (_summed([c[0] for c, _ in current]), _summed([p[0] for p in past]),
                max((p[1] for p in past), default=0.0))

    router, _, _ = pair("router")
    replicas: dict[str, dict[str, float]] = {}
    for key, metric in (("load", "chatmesh_router_replica_load"), ("serving", "chatmesh_router_replica_serving"),
                        ("kv", "chatmesh_router_replica_kv_usage_ratio")):
        for rid, value in by_label(router, metric, "replica").items():
            replicas.setdefault(rid, {})[key] = value
    engine_now, engine_then, _ = pair("engine")
    hits = total(engine_now, "vllm:prefix_cache_hits_total") - total(engine_then, "vllm:prefix_cache_hits_total")
    queries = (total(engine_now, "vllm:prefix_cache_queries_total")
               - total(engine_then, "vllm:prefix_cache_queries_total"))
    edge_now, edge_then, age = pair("gateway")
    turns_now = by_label(edge_now, "chatmesh_gateway_turns_total", "outcome")
    turns_then = by_label(edge_then, "chatmesh_gateway_turns_total", "outcome")
    turns = {k: v - turns_then.get(k, 0.0) for k, v in turns_now.items()}
    ttft = histogram_delta(edge_now, edge_then, "chatmesh_gateway_time_to_first_token_seconds")
    return Report(health, replicas, age, turns, hits / queries if queries else math.nan,
                  quantile(0.5, ttft), quantile(0.95, ttft))


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="the running mesh at a glance (health, replicas, last minute's figures)")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--scrape-config", action="store_true",
                   help="print a Prometheus scrape config for this mesh instead")
    p.add_argument("--engines", type=int, default=1, metavar="N",
                   help="the mesh runs N engine replicas (as started by `chatmesh up --engines N`)")
    p.add_argument("--chats", type=int, default=1, metavar="N",
                   help="the mesh runs N chat processes (as started by `chatmesh up --chats N`)")
    config.add_flags(p, "chatmesh.mesh.settings")
    p.set_defaults(handler=_status)


def _status(args: argparse.Namespace) -> int:
    cfg = Config(flags=config.flags_of(args))
    try:
        _, extra = scaled(cfg, args.engines, args.chats)
    except MeshError as err:
        print(f"chatmesh: {err}", file=sys.stderr)
        return 2
    if args.scrape_config:
        sys.stdout.write(scrape_config(cfg, extra=extra))
        return 0
    while True:
        try:
            text = report(cfg, extra=extra).render()
        except TrustRefused as err:  # no certificates to ask the mesh with: say so, not a traceback
            print(f"chatmesh: {err}", file=sys.stderr)
            return 2
        if args.watch is None:
            print(text)
            return 0 if "DOWN" not in text.split("replicas:")[0] else 1
        print("\033[H\033[J" + time.strftime("%H:%M:%S ") + "chatmesh status\n" + text, flush=True)
        time.sleep(max(args.watch, 0.2))

