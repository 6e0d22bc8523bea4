"""Time the mesh adds to a turn: time to first token through the edge and chat vs calling GenerateService directly.

Both sides run in one go against one mesh (every service its own process, `sim` engine at a speed factor that
makes its step time ~0, so what is measured is the mesh: HTTP + SSE at the gateway, chat's claim / history read /
input check / route / output check / store writes, and the extra gRPC hops). `--conversations` clients each send
`--turns` turns one after another (with `--think-ms`, each pauses a random time of that mean before its next turn,
as a user reading the reply would); TTFT is from sending the request to the first text delta. It also reports each
service process's CPU time per turn of the edge run (from /proc), where the mesh's capacity goes.

In the same run, after the real mesh, it drives a no-op mesh of the same shape (bench/mesh_floor.py: the same
processes, transports and call shapes, every handler answering at once): its added TTFT is what the hops alone
cost on this machine, so "mesh minus floor" is what chatmesh's own work adds.

    .venv/bin/python -m bench.mesh_overhead --conversations 50 --turns 4 [--think-ms 0] [--append BENCHMARKS.md]

`--observability` instead compares, in one run, the mesh with metrics and tracing off (no metrics endpoints, no
OTEL_EXPORTER_OTLP_ENDPOINT) and on (every /metrics scraped each `--scrape-s` seconds, default 1 s as an eager
Prometheus would, and every span exported by OTLP/gRPC to a receiver in this process that decodes them), ABBA over
`--rounds` rounds: TTFT through the edge and server CPU per turn, side by side. `--modes off,metrics,tracing,on`
adds each half alone, to tell their costs apart. In-process counters are updated in both (they cannot be
turned off; they are what the endpoint serves). Both sides run the mesh with mutual TLS between its services.

    .venv/bin/python -m bench.mesh_overhead --observability --conversations 50 --turns 4 --think-ms 300

`--scrape-cost N` measures what one scrape costs each service: its CPU over N back-to-back GETs of its /metrics,
less its CPU over as long idle (a mesh with metrics on, after a few turns), per scrape.

    .venv/bin/python -m bench.mesh_overhead --scrape-cost 300

`--security` compares, in one run, two meshes up side by side: one in plaintext (CHATMESH_MESH_PLAINTEXT: no TLS,
no identities, no owner tokens) and one as `chatmesh up` runs it (mutual TLS on every hop, per-RPC
authorization, owner tokens minted by the gateway and verified by chat, the store and the engine), the same
paced load sent to each in turn, `--rounds` times with the order swapped each round: TTFT through the edge and
server CPU per turn, side by side. `--layers plain,tls,authz,full` adds the layers between, to tell their costs
apart: mutual TLS with neither check, then with per-RPC authorization, then with owner tokens (the first two
turn the checks off in the services' processes from bench/trust_off/, a bench-only switch); `base` with
`--base-mesh REV` runs the full trust layer with REV's `chatmesh.mesh` (the bootstrap before a change), beside.
`--together` loads every mesh at the same time in each round instead of one after another, so a drift in the
shared machine's speed (CPU per turn of one mesh moves by 20% between rounds here) falls on all of them alike.

    .venv/bin/python -m bench.mesh_overhead --security --conversations 50 --turns 6 --think-ms 2000 --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.mesh_floor import FloorMesh
from chatmesh.mesh import identity as ident
from chatmesh.mesh import settings, status
from chatmesh.mesh.up import Mesh
from chatmesh.model import template
from chatmesh.model.settings import MODEL_DIR
from chatmesh.model.tokenizer import load as load_tokenizer
from chatmesh.v1 import generate_pb2, generate_pb2_grpc, store_pb2, store_pb2_grpc
from tests.conftest import free_port
from tests.e2e.conftest import channel, mesh_env


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def through_edge(url: str, conversations: int, turns: int, think_s: float = 0.0, floor: bool = False
                       ) -> list[float]:
    """TTFT of turns sent through an edge: chatmesh's gateway, or (`floor`) the no-op mesh's (bench/mesh_floor.py)."""
    ttfts: list[float] = []
    limits = httpx.Limits(max_connections=conversations + 10, max_keepalive_connections=conversations + 10)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def conversation(i: int) -> None:
            rng = random.Random(i)
            conv = "" if floor else (await client.post("/v1/conversations", json={})).json()["id"]
            path = "/turn" if floor else f"/v1/conversations/{conv}/turns"
            for t in range(turns):
                if think_s > 0:
                    await asyncio.sleep(rng.expovariate(1 / think_s))
                body = {"turn_id": str(uuid.uuid4()), "content": f"Conversation {i}, turn {t}: tell me more."}
                start = time.perf_counter()
                first = None
                async with client.stream("POST", path, json=body) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(f"turn refused: {resp.status_code} {(await resp.aread())[:200]!r}")
                    async for line in resp.aiter_lines():
                        if first is None and line.startswith("event: turn.delta"):
                            first = time.perf_counter() - start
                if first is not None:
                    ttfts.append(first)

        await asyncio.gather(*[conversation(i) for i in range(conversations)])
    return ttfts


async def direct(mesh: Mesh, prompt_ids: list[int], conversations: int, turns: int, think_s: float = 0.0
                 ) -> list[float]:
    """TTFT of GenerateService called as chat calls it (its certificate, an owner token per owner)."""
    ttfts: list[float] = []
    async with channel(mesh, "engine", ident.CHAT, owner_tokens=True) as channel_:
        stub = generate_pb2_grpc.GenerateServiceStub(channel_)

        async def conversation(i: int) -> None:
            rng = random.Random(i)
            conv = str(uuid.uuid4())
            for _ in range(turns):
                if think_s > 0:
                    await asyncio.sleep(rng.expovariate(1 / think_s))
                req = generate_pb2.GenerateRequest(request_id=str(uuid.uuid4()), conversation_id=conv,
                                                   owner_id=f"owner-{i}",
                                                   turn_id=str(uuid.uuid4()), prompt_token_ids=prompt_ids,
                                                   cache_salt=f"owner-{i}".encode(), max_tokens=48)
                start = time.perf_counter()
                first = None
                async for resp in stub.Generate(req):
                    if first is None and resp.WhichOneof("event") == "delta":
                        first = time.perf_counter() - start
                if first is not None:
                    ttfts.append(first)

        await asyncio.gather(*[conversation(i) for i in range(conversations)])
    return ttfts


async def floor_direct(address: str, conversations: int, turns: int, think_s: float = 0.0) -> list[float]:
    """TTFT of the no-op engine called directly (the floor's counterpart of `direct`)."""
    ttfts: list[float] = []
    async with grpc.aio.insecure_channel(address) as channel:
        generate = channel.unary_stream("/floor.Floor/Generate", request_serializer=bytes,
                                        response_deserializer=bytes)

        async def conversation(i: int) -> None:
            rng = random.Random(i)
            for t in range(turns):
                if think_s > 0:
                    await asyncio.sleep(rng.expovariate(1 / think_s))
                start = time.perf_counter()
                first = None
                async for resp in generate(f"conversation {i} turn {t}".encode()):
                    if first is None and resp.startswith(b"delta:"):
                        first = time.perf_counter() - start
                if first is not None:
                    ttfts.append(first)

        await asyncio.gather(*[conversation(i) for i in range(conversations)])
    return ttfts


SETTLE_S = 6.0


class _SpanSink:
    """An OTLP/gRPC trace receiver that decodes and counts what it is sent (the collector's side of the wire), in a
    process of its own so its threads never hold the measuring client's GIL (`_sink_main`)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "from bench.mesh_overhead import _sink_main; _sink_main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=Path(__file__).parents[1])
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.port = int(self.proc.stdout.readline())

    @property
    def spans(self) -> int:
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _sink_main() -> None:
    from concurrent import futures

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    count = [0]

    class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            count[0] += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)  # type: ignore[no-untyped-call]
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    server.start()
    for _ in sys.stdin:
        print(count[0], flush=True)


class _Scraper:
    """Every /metrics of a mesh scraped each `interval_s` by Debian's real `prometheus` (with the config `chatmesh
    status --scrape-config` prints), or, without it, by a loop in a process of its own; never in the measuring
    process."""

    def __init__(self, mesh: Mesh, interval_s: float, tmp: Path) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        if not mesh.metrics_urls:
            return
        binary = shutil.which("prometheus")
        log = (tmp / "scraper.log").open("wb")
        if binary is not None:
            (tmp / "prometheus.yml").write_text(status.scrape_config(mesh.cfg, interval_s=interval_s))
            self.proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}",
                                          f"--storage.tsdb.path={tmp / 'tsdb'}", "--log.level=warn",
                                          f"--web.listen-address=127.0.0.1:{free_port()}"], stdout=log, stderr=log)
        else:
            loop = ("import sys, time, urllib.request\n"
                    "while True:\n"
                    f"    time.sleep({interval_s})\n"
                    "    for u in sys.argv[1:]:\n"
                    "        try: urllib.request.urlopen(u, timeout=2).read()\n"
                    "        except OSError: pass\n")
            self.proc = subprocess.Popen([sys.executable, "-c", loop, *mesh.metrics_urls.values()], stdout=log,
                                         stderr=log)
        self.what = "Debian's prometheus" if binary is not None else "a scrape loop in a process of its own"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def scrape_cost(args: argparse.Namespace) -> int:
    """What one scrape of each service's /metrics costs it: CPU over `--scrape-cost` back-to-back GETs, less the
    same service's CPU over as long idle, per scrape; the mesh as the observability bench runs it (metrics on)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = mesh_env(Path(tmp) / "data", **LIFTED, CHATMESH_MESH_PLAINTEXT="false",
                       CHATMESH_OWNER_TOKEN_ADDRESS=f"127.0.0.1:{free_port()}")
        mesh = Mesh(env=env, log_dir=Path(tmp) / "logs", start_timeout_s=180)
        mesh.start()
        try:
            asyncio.run(through_edge(mesh.gateway_url, 8, 2))  # every series that turns create exists
            rows = []
            with httpx.Client(timeout=10) as client:
                for name, url in mesh.metrics_urls.items():
                    proc = mesh.procs[name]
                    client.get(url)
                    started, before = time.perf_counter(), cpu_seconds(proc.pid)
                    size = sum(len(client.get(url).content) for _ in range(args.scrape_cost))
                    wall, busy = time.perf_counter() - started, cpu_seconds(proc.pid) - before
                    before = cpu_seconds(proc.pid)
                    time.sleep(wall)
                    idle = cpu_seconds(proc.pid) - before
                    rows.append((name, size // args.scrape_cost, (busy - idle) / args.scrape_cost * 1e3))
        finally:
            mesh.stop()
    total = sum(ms for _, _, ms in rows)
    print("\n".join([
        f"### One scrape of every /metrics ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} cores, {args.scrape_cost} GETs per service, load average {os.getloadavg()[0]:.1f})",
        "", "| service | bytes | CPU per scrape (ms) |", "|---|---|---|",
        *[f"| {name} | {size} | {ms:.2f} |" for name, size, ms in rows],
        f"| all | | {total:.2f} |", ""]))
    return 0


MODES = {"off": "nothing (no metrics endpoints, no OTLP)", "metrics": "metrics only (scraped)",
         "tracing": "tracing only (OTLP)", "on": "metrics + tracing",
         "sampled": "metrics + tracing, 1 turn in 10 traced (OTEL_TRACES_SAMPLER)"}


def observability(args: argparse.Namespace) -> int:
    sink = _SpanSink()
    modes = args.modes.split(",")
    if modes[0] != "off" or not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: off first, then any of {', '.join(MODES)}")
    results: dict[str, list[tuple[list[float], float]]] = {m: [] for m in modes}
    spans: dict[str, int] = {m: 0 for m in modes}
    loads: list[float] = []
    rates: list[float] = []  # turns per second of each measured load
    scraped_by = ""
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:  # ABBA: no side always goes first
            loads.append(os.getloadavg()[0])
            with tempfile.TemporaryDirectory() as tmp:
                extra = {"CHATMESH_SIM_SPEED": "100000", "CHATMESH_MAX_REPLY_TOKENS": "48",
                         "CHATMESH_LOG_LEVEL": "warning", "CHATMESH_LIMIT_TURNS_PER_MINUTE": "1000000",
                         "CHATMESH_LIMIT_OPEN_STREAMS": "100000",
                         "CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR": "1000000000",
                         "CHATMESH_MESH_PLAINTEXT": "false",  # mutual TLS between the services, as deployed
                         "CHATMESH_OWNER_TOKEN_ADDRESS": f"127.0.0.1:{free_port()}"}  # (served with mTLS on)
                env = mesh_env(Path(tmp) / "data", **extra)
                if mode in ("off", "tracing"):
                    env.update({s.env: "0" for s in settings.METRIC_PORTS.values()})
                if mode in ("tracing", "on", "sampled"):
                    env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port}"})
                if mode == "sampled":  # the OpenTelemetry SDK's standard sampler settings
                    env.update({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"})
                spans_before = sink.spans
                mesh = Mesh(env=env, log_dir=Path(tmp) / "logs", start_timeout_s=180)
                mesh.start()
                scraper: _Scraper | None = None
                try:
                    asyncio.run(through_edge(mesh.gateway_url, 4, 1))
                    scraper = _Scraper(mesh, args.scrape_s, Path(tmp))
                    scraped_by = scraper.what if scraper.proc is not None else scraped_by
                    before = {name: cpu_seconds(p.pid) for name, p in mesh.procs.items()}
                    started = time.perf_counter()
                    edge = asyncio.run(through_edge(mesh.gateway_url, args.conversations, args.turns,
                                                    args.think_ms / 1000))
                    rates.append(len(edge) / (time.perf_counter() - started))
                    # Spans leave in batches up to 5 s after their turn (BatchSpanProcessor's schedule delay):
                    # wait that out on both sides so the export's CPU is counted, then read the CPU times.
                    time.sleep(SETTLE_S)
                    cpu = sum(cpu_seconds(p.pid) - before[name] for name, p in mesh.procs.items()) / len(edge)
                    results[mode].append((edge, cpu))
                    spans[mode] += sink.spans - spans_before
                finally:
                    if scraper is not None:
                        scraper.stop()
                    mesh.stop()
    sink.stop()
    rows = []
    for mode in modes:
        ttfts = [t for edge, _ in results[mode] for t in edge]
        cpu = statistics.mean(c for _, c in results[mode])
        rows.append((mode, len(ttfts), statistics.median(ttfts) * 1e3, pct(ttfts, 0.95) * 1e3, cpu * 1e3))
    _, _, off_p50, off_p95, off_cpu = rows[0]
    lines = [
        f"### Metrics and tracing on vs off ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} cores, {platform.machine()}, {args.conversations} concurrent conversations x "
        f"{args.turns} turns, think time {args.think_ms:.0f} ms, {args.rounds} rounds ABBA, a fresh mesh per mode "
        f"and round, mesh mTLS on, sim at ~0 step time, load average {min(loads):.1f}-{max(loads):.1f})",
        "",
        "| observability | turns | TTFT p50 (ms) | TTFT p95 (ms) | server CPU per turn (ms) | p50 vs off | "
        "CPU vs off | spans per turn |",
        "|---|---|---|---|---|---|---|---|",
        *[f"| {MODES[mode]} | {n} | {p50:.2f} | {p95:.2f} | {cpu:.2f} | {p50 - off_p50:+.2f} ms | "
          f"{(cpu / off_cpu - 1) * 100:+.1f}% | {spans[mode] / (n + 4 * args.rounds):.1f} |"
          for mode, n, p50, p95, cpu in rows],
        "",
        "Per round, TTFT p50 / CPU per turn (ms): " + "; ".join(
            f"{mode} " + ", ".join(f"{statistics.median(e) * 1e3:.2f} / {c * 1e3:.2f}" for e, c in results[mode])
            for mode in modes) + f". Load: {statistics.mean(rates):.1f} turns/s.",
        "",
        f"Spans were received and decoded by an OTLP/gRPC receiver in a process of its own (per turn: the warm-up "
        f"turns included); every /metrics scraped each {args.scrape_s:g} s by {scraped_by or 'nothing'}. The "
        "receiver and the scraper run beside the mesh, never in the measuring client's process. CPU per turn counts each service's "
        f"CPU from the first measured turn to {SETTLE_S:.0f} s after the last (the span batches' export included).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)
    return 0


LIFTED = {"CHATMESH_SIM_SPEED": "100000", "CHATMESH_MAX_REPLY_TOKENS": "48", "CHATMESH_LOG_LEVEL": "warning",
          "CHATMESH_LIMIT_TURNS_PER_MINUTE": "1000000", "CHATMESH_LIMIT_OPEN_STREAMS": "100000",
          "CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR": "1000000000"}  # one local user drives every conversation


LAYERS = {"plain": "plaintext", "tls": "mTLS only", "authz": "mTLS + authorization",
          "full": "mTLS + owner tokens", "base": "mTLS + owner tokens, --base-mesh's bootstrap"}
TRUST_OFF = {"tls": "authz,tokens", "authz": "tokens"}  # what bench/trust_off/sitecustomize.py turns off


def _layer_env(layer: str, base_src: Path | None) -> dict[str, str]:
    if layer == "plain":
        return {"CHATMESH_MESH_PLAINTEXT": "true"}
    env = {"CHATMESH_MESH_PLAINTEXT": "false"}
    if layer in TRUST_OFF:
        env["CHATMESH_BENCH_TRUST_OFF"] = TRUST_OFF[layer]
    if layer == "base":
        assert base_src is not None
        env["CHATMESH_BENCH_MESH_SRC"] = str(base_src)
    if layer in TRUST_OFF or layer == "base":
        here = str(Path(__file__).parent / "trust_off")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    return env


def _base_mesh(rev: str, tmp: Path) -> Path:
    """`rev`'s chatmesh.mesh package, extracted under `tmp`."""
    root = Path(__file__).parents[1]
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, "mesh/chatmesh/mesh"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return tmp / "mesh" / "chatmesh" / "mesh"


async def _check_layer(mesh: Mesh, layer: str) -> None:
    """The layer is what it says: a wrong identity (moderation) is refused the store iff authorization is on, and
    chat without an owner token iff owner tokens are on."""
    async def outcome(who: ident.Identity) -> str:
        async with channel(mesh, "store", who) as ch:
            try:
                await store_pb2_grpc.StoreServiceStub(ch).ListOwnerConversations(
                    store_pb2.ListOwnerConversationsRequest(owner_id="local"))
                return "OK"
            except grpc.aio.AioRpcError as err:
                return err.code().name

    expected = {"plain": ("OK", "OK"), "tls": ("OK", "OK"), "authz": ("PERMISSION_DENIED", "OK"),
                "full": ("PERMISSION_DENIED", "UNAUTHENTICATED"), "base": ("PERMISSION_DENIED", "UNAUTHENTICATED")}[layer]
    found = (await outcome(ident.MODERATION), await outcome(ident.CHAT))
    if found != expected:
        raise SystemExit(f"layer {layer}: moderation -> store, chat without a token -> store answered {found}, "
                         f"expected {expected}")


def _record(results: dict[str, list[tuple[list[float], dict[str, float]]]], layer: str, r: int, edge: list[float],
            cpu: dict[str, float]) -> None:
    results[layer].append((edge, cpu))
    print(f"round {r + 1} {layer}: TTFT p50 {statistics.median(edge) * 1e3:.2f} ms, server CPU "
          f"{sum(cpu.values()) * 1e3:.2f} ms per turn, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)


async def _together(urls: list[str], args: argparse.Namespace) -> list[list[float]]:
    return list(await asyncio.gather(*(through_edge(url, args.conversations, args.turns, args.think_ms / 1000)
                                       for url in urls)))


def security(args: argparse.Namespace) -> int:
    """Plaintext vs mutual TLS + authorization + owner tokens (`--layers`: and the layers between): the meshes up
    at once, rounds interleaved."""
    layers = args.layers.split(",")
    if len(layers) < 2 or layers[0] != "plain" or not set(layers) <= set(LAYERS):
        raise SystemExit(f"--layers: plain first, then any of {', '.join(list(LAYERS)[1:])}")
    results: dict[str, list[tuple[list[float], dict[str, float]]]] = {layer: [] for layer in layers}
    if "base" in layers and not args.base_mesh:
        raise SystemExit("--layers base needs --base-mesh REV")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        base_src = _base_mesh(args.base_mesh, Path(tmp)) if "base" in layers else None
        meshes = {}
        try:
            for layer in results:
                env = mesh_env(Path(tmp) / layer / "data", **LIFTED, **_layer_env(layer, base_src))
                meshes[layer] = Mesh(env=env, log_dir=Path(tmp) / layer / "logs", start_timeout_s=180)
                meshes[layer].start()
            for layer, mesh in meshes.items():
                asyncio.run(_check_layer(mesh, layer))
                asyncio.run(through_edge(mesh.gateway_url, 4, 1))
            for r in range(args.rounds):
                if args.together:  # every mesh under the same load at the same time: the machine's drift is shared
                    before_all = {layer: {name: cpu_seconds(p.pid) for name, p in meshes[layer].procs.items()}
                                  for layer in layers}
                    edges = asyncio.run(_together([meshes[layer].gateway_url for layer in layers], args))
                    for layer, edge in zip(layers, edges):
                        procs = meshes[layer].procs.items()
                        cpu = {name: (cpu_seconds(p.pid) - before_all[layer][name]) / len(edge) for name, p in procs}
                        _record(results, layer, r, edge, cpu)
                    continue
                order = layers[r % len(layers):] + layers[:r % len(layers)]  # each layer goes first in turn
                for layer in (order if r % 2 == 0 else order[::-1]):
                    mesh = meshes[layer]
                    before = {name: cpu_seconds(p.pid) for name, p in mesh.procs.items()}
                    edge = asyncio.run(through_edge(mesh.gateway_url, args.conversations, args.turns,
                                                    args.think_ms / 1000))
                    cpu = {name: (cpu_seconds(p.pid) - before[name]) / len(edge) for name, p in mesh.procs.items()}
                    _record(results, layer, r, edge, cpu)
        finally:
            for mesh in meshes.values():
                mesh.stop()
    rows = []
    for layer, runs in results.items():
        ttfts = [t for edge, _ in runs for t in edge]
        p50s = [statistics.median(edge) * 1e3 for edge, _ in runs]
        rows.append((layer, len(ttfts), statistics.median(ttfts) * 1e3, pct(ttfts, 0.95) * 1e3,
                     statistics.mean(sum(c.values()) for _, c in runs) * 1e3, p50s))
    by_service = {layer: {name: statistics.mean(c[name] for _, c in runs) * 1e3 for name in runs[0][1]}
                  for layer, runs in results.items()}
    off = rows[0]
    lines = [
        f"### Trust layers vs plaintext ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} cores, {platform.machine()}, {args.conversations} concurrent conversations x "
        f"{args.turns} turns, think time {args.think_ms:.0f} ms, {args.rounds} rounds "
        + ("with every mesh loaded at once" if args.together else "interleaved (order changed each round)")
        + f", sim at ~0 step time, load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        + (f", base: chatmesh.mesh at {args.base_mesh}" if "base" in layers else "") + ")",
        "",
        "| mesh | turns | TTFT p50 (ms) | TTFT p95 (ms) | server CPU per turn (ms) | p50 per round (ms) | "
        "p50 minus plaintext (median of the rounds' differences) | CPU minus plaintext |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layer, n, p50, p95, cpu_ms, rounds in rows:
        vs = "" if layer == "plain" else (
            f"**{p50 - off[2]:+.2f}** ({statistics.median(b - a for a, b in zip(off[5], rounds)):+.2f})")
        cpu_vs = "" if layer == "plain" else f"{cpu_ms - off[4]:+.2f} ({(cpu_ms / off[4] - 1) * 100:+.1f}%)"
        lines.append(f"| {LAYERS[layer]} | {n} | {p50:.2f} | {p95:.2f} | {cpu_ms:.2f} | "
                     f"{', '.join(f'{x:.2f}' for x in rounds)} | {vs} | {cpu_vs} |")
    lines += [
        "",
        "Server CPU per turn by service (ms), " + " / ".join(LAYERS[layer] for layer in layers) + ": "
        + ", ".join(f"{name} " + " / ".join(f"{by_service[layer][name]:.2f}" for layer in layers)
                    for name in sorted(by_service["plain"], key=lambda n: -by_service["plain"][n])),
        "",
    ]
    report(lines, args.append)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--think-ms", type=float, default=0.0,
                        help="mean pause before each turn (exponential; 0: back to back)")
    parser.add_argument("--append", help="append the results to this Markdown file")
    parser.add_argument("--observability", action="store_true",
                        help="compare metrics + tracing on vs off instead (see the module docstring)")
    parser.add_argument("--security", action="store_true",
                        help="compare plaintext vs mutual TLS + owner tokens instead (see the module docstring)")
    parser.add_argument("--layers", default="plain,full",
                        help="with --security: plain first, then any of tls (mTLS only), authz (mTLS + authorization), "
                             "full (+ owner tokens), base (full, with --base-mesh's chatmesh.mesh)")
    parser.add_argument("--together", action="store_true",
                        help="with --security: load every mesh at the same time in each round (instead of in turn)")
    parser.add_argument("--base-mesh", default="",
                        help="with --security --layers ...,base: the commit whose chatmesh.mesh the base mesh runs")
    parser.add_argument("--rounds", type=int, default=2,
                        help="with --observability (modes, ABBA) or --security: alternating rounds")
    parser.add_argument("--modes", default="off,on",
                        help="with --observability: off first, then any of metrics, tracing, on, sampled "
                             "(comma-separated)")
    parser.add_argument("--scrape-cost", type=int, default=0, metavar="N",
                        help="instead: each service's CPU per scrape of its /metrics, over N scrapes")
    parser.add_argument("--scrape-s", type=float, default=1.0,
                        help="with --observability: seconds between scrapes of every /metrics")
    args = parser.parse_args()
    if args.scrape_cost:
        return scrape_cost(args)
    if args.observability:
        return observability(args)
    if args.security:
        return security(args)
    with tempfile.TemporaryDirectory() as tmp:
        # One local user drives every conversation: lift the per-user limits so the edge measures, not refuses.
        env = mesh_env(Path(tmp) / "data", CHATMESH_SIM_SPEED="100000", CHATMESH_MAX_REPLY_TOKENS="48",
                       CHATMESH_LOG_LEVEL="warning", CHATMESH_LIMIT_TURNS_PER_MINUTE="1000000",
                       CHATMESH_LIMIT_OPEN_STREAMS="100000", CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR="1000000000")
        mesh = Mesh(env=env, log_dir=Path(tmp) / "logs", start_timeout_s=180)
        mesh.start()
        try:
            tok = load_tokenizer(mesh.cfg[MODEL_DIR])
            prompt = list(template.render(tok, [(template.Role.USER, "Conversation 1, turn 1: tell me more.")])
                          .token_ids)
            # Warm both paths (connections, caches), then measure.
            asyncio.run(through_edge(mesh.gateway_url, 4, 1))
            asyncio.run(direct(mesh, prompt, 4, 1))
            engine = asyncio.run(direct(mesh, prompt, args.conversations, args.turns, args.think_ms / 1000))
            before = {name: cpu_seconds(p.pid) for name, p in mesh.procs.items()}
            started = time.perf_counter()
            edge = asyncio.run(through_edge(mesh.gateway_url, args.conversations, args.turns, args.think_ms / 1000))
            wall = time.perf_counter() - started
            cpu = {name: (cpu_seconds(p.pid) - before[name]) / max(1, len(edge)) for name, p in mesh.procs.items()}
        finally:
            mesh.stop()
    floor = FloorMesh()
    floor.start()
    try:
        asyncio.run(through_edge(floor.gateway_url, 4, 1, floor=True))
        asyncio.run(floor_direct(floor.engine_address, 4, 1))
        floor_engine = asyncio.run(floor_direct(floor.engine_address, args.conversations, args.turns,
                                                args.think_ms / 1000))
        floor_edge = asyncio.run(through_edge(floor.gateway_url, args.conversations, args.turns,
                                              args.think_ms / 1000, floor=True))
    finally:
        floor.stop()
    rows = []
    for name, values in (("GenerateService directly", engine), ("edge + chat (full mesh)", edge),
                         ("no-op engine directly (floor)", floor_engine),
                         ("no-op edge + chat (floor: hops only)", floor_edge)):
        rows.append((name, len(values), statistics.median(values) * 1e3, pct(values, 0.99) * 1e3))
    added_p50 = rows[1][2] - rows[0][2]
    added_p99 = rows[1][3] - rows[0][3]
    floor_p50 = rows[3][2] - rows[2][2]
    floor_p99 = rows[3][3] - rows[2][3]
    load = os.getloadavg()[0]
    lines = [
        f"### Mesh overhead on TTFT ({datetime.date.today()}, {os.cpu_count()} cores, {platform.machine()}, "
        f"{args.conversations} concurrent conversations x {args.turns} turns, think time {args.think_ms:.0f} ms, "
        f"sim at ~0 step time, load average {load:.1f})",
        "",
        "| path | turns | TTFT p50 (ms) | TTFT p99 (ms) |",
        "|---|---|---|---|",
        *[f"| {n} | {c} | {p50:.1f} | {p99:.1f} |" for n, c, p50, p99 in rows],
        f"| **added by the mesh** | | **{added_p50:.1f}** | **{added_p99:.1f}** |",
        f"| added by the no-op mesh's hops alone (floor) | | {floor_p50:.1f} | {floor_p99:.1f} |",
        f"| added by chatmesh's own work (mesh minus floor) | | {added_p50 - floor_p50:.1f} | "
        f"{added_p99 - floor_p99:.1f} |",
        "",
        f"Edge run: {len(edge) / wall:.1f} turns/s; server CPU per turn (ms): "
        + ", ".join(f"{name} {ms * 1e3:.2f}" for name, ms in sorted(cpu.items(), key=lambda kv: -kv[1]))
        + f"; all services {sum(cpu.values()) * 1e3:.2f}",
        "",
    ]
    report(lines, args.append)
    return 0


def report(lines: list[str], append: str | None) -> None:
    """Prints a result's Markdown lines and, with `append`, adds them to that file (BENCHMARKS.md)."""
    text = "\n".join(lines)
    print(text)
    if append:
        with open(append, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    raise SystemExit(main())
