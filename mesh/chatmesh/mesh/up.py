"""`chatmesh up`: the whole mesh on loopback, each service its own process, as in production.

Start order follows the data flow backwards (store, moderation, engine, router, chat, gateway), each waiting for
the standard health check to answer SERVING (the gateway: an HTTP answer) before the next starts. Ctrl-C or
SIGTERM stops them in reverse order with SIGTERM, so open streams end cleanly; a service that exits on its own
takes the mesh down with a message naming it. The same `Mesh` class starts the mesh for the end-to-end tests.

Trust: before starting, `Mesh` makes (or renews) the development CA, a certificate per identity and the
owner-token keys (pki.py: the CA's key in `<CHATMESH_DATA_DIR>/ca/`, which no service is given, each identity's
pair in `certs/`, the signing keys in `gateway/`, the gateway's alone), refuses to start when a private key or
private folder is open to other users (`pki.check_layout`), and checks health as the operator identity.
"""

from __future__ import annotations

import argparse
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chatmesh.mesh import config, pki, settings
from chatmesh.mesh import identity as ident
from chatmesh.mesh.channels import open_blocking_channel
from chatmesh.mesh.config import Config
from chatmesh.mesh.trust import Trust, certs_folder
from chatmesh.v1 import route_pb2, route_pb2_grpc

# (service, setting holding its address) in start order; the gateway comes last.
ORDER: tuple[tuple[str, config.Setting[str]], ...] = (
    ("store", settings.STORE_ADDRESS),
    ("moderation", settings.MODERATION_ADDRESS),
    ("engine", settings.ENGINE_ADDRESS),
    ("router", settings.ROUTER_ADDRESS),
    ("chat", settings.CHAT_ADDRESS),
)


@dataclass(frozen=True)
class Extra:
    """One more gRPC process beside the standard ones, such as a second engine replica or chat process, with the
    port of its own Prometheus /metrics (0: none)."""

    name: str
    service: str
    address: str
    env: Mapping[str, str]
    metrics_port: int = 0


class MeshError(RuntimeError):
    """A service did not start or died."""


def grpc_serving(trust: Trust, address: str, service: str, timeout_s: float = 1.0) -> bool:
    """One standard health check (a blocking call: usable with or without a running event loop)."""
    with open_blocking_channel(trust, address, service) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                             timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def replicas_serving(trust: Trust, router: str, timeout_s: float = 1.0) -> bool:
    """True once the router sees every configured engine replica as serving (it watches their health)."""
    with open_blocking_channel(trust, router, "router") as channel:
        try:
            resp = route_pb2_grpc.RouteServiceStub(channel).ListReplicas(route_pb2.ListReplicasRequest(),
                                                                         timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(resp.replicas) and all(r.state == route_pb2.REPLICA_STATE_SERVING for r in resp.replicas)


def _probe_tls() -> ssl.SSLContext:
    """TLS for the local readiness probe: it sends nothing secret and only asks whether the gateway answers, so
    it does not verify the certificate (which may name a public host, or chain to a CA this machine lacks)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def http_answers(url: str, timeout_s: float = 1.0) -> bool:
    """Whether `url` (http or https) answers below 500."""
    try:
        context = _probe_tls() if url.startswith("https:") else None
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
            return int(resp.status) < 500
    except urllib.error.HTTPError as err:
        return err.code < 500
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Mesh:
    """The services of one mesh as child processes."""

    env: Mapping[str, str]
    log_dir: Path
    start_timeout_s: float = 120.0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    extra: tuple[Extra, ...] = ()  # the extra processes `start` was given
    layout_notes: list[str] = field(default_factory=list)  # what `pki.check_layout` said of the files

    @property
    def cfg(self) -> Config:
        return Config(env=self.env)

    @property
    def certs(self) -> Path:
        return certs_folder(self.cfg)

    def trust(self, who: ident.Identity = ident.OPERATOR) -> Trust:
        """Acting as `who` (default: the operator) toward this mesh, with its development certificates."""
        return Trust.from_config(self.cfg, who)

    @property
    def gateway_url(self) -> str:
        """The edge's URL: https when CHATMESH_TLS_CERT is set (the gateway then speaks only TLS)."""
        cfg = self.cfg
        scheme = "https" if self.env.get("CHATMESH_TLS_CERT") else "http"
        return f"{scheme}://{cfg[settings.HOST]}:{cfg[settings.GATEWAY_PORT]}"

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Where each process serves its Prometheus metrics (processes whose port is 0 are left out): the
        standard services by name, and with extra replicas every engine and chat process by its own name
        (engine-0, engine-1, ...)."""
        return {t.process: t.url for t in metrics_targets(self.cfg, self.extra)}

    def _spawn(self, service: str, name: str | None = None, env: Mapping[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
        name = name or service
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "chatmesh.mesh.cli", "serve", service],
            env={**os.environ, **self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
        self.procs[name] = proc
        return proc

    def _wait(self, name: str, ready: Any) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        proc = self.procs[name]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise MeshError(f"{name} exited with code {proc.returncode}; see {self.log_dir / name}.log")
            if ready():
                return
            time.sleep(0.1)
        raise MeshError(f"{name} did not become healthy in {self.start_timeout_s:.0f} s; "
                        f"see {self.log_dir / name}.log")


    def start(self, on_ready: Any = None, extra: Sequence[Extra] = ()) -> None:
        """Starts every service (plus `extra` replicas) at once and waits until each is healthy. Services reach
        each other lazily (channels connect on first use, the router keeps re-watching engines), so the start
        order does not matter and the mesh is up in the time of its slowest service, not the sum."""
        cfg = self.cfg
        self.extra = tuple(extra)
        if not cfg[settings.MESH_PLAINTEXT]:
            pki.ensure(self.certs)
            refusals, self.layout_notes = pki.check_layout(self.certs)
            if refusals:
                raise MeshError("keys are not kept apart: " + "; ".join(refusals))
        trust = self.trust()
        try:
            waits: list[tuple[str, Any, str]] = []
            for service, address in ORDER:
                self._spawn(service)
                waits.append((service, lambda a=cfg[address], s=service: grpc_serving(trust, a, s), cfg[address]))
            for x in extra:  # each extra process serves its metrics on a port of its own (or none)
                metrics_port = settings.METRIC_PORTS[x.service].env
                self._spawn(x.service, x.name, {**x.env, metrics_port: str(x.metrics_port),
                                                "CHATMESH_LISTEN": x.address})
                waits.append((x.name, lambda a=x.address, s=x.service: grpc_serving(trust, a, s), x.address))
            self._spawn("gateway")
            waits.append(("gateway", lambda: http_answers(self.gateway_url + "/healthz"), self.gateway_url))
            for name, ready, where in waits:
                self._wait(name, ready)
                if on_ready:
                    on_ready(name, where)
            self._wait("router", lambda: replicas_serving(trust, cfg[settings.ROUTER_ADDRESS]))
        except BaseException:
            self.stop()
            raise

    def dead(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def stop(self, timeout_s: float = 10.0) -> dict[str, int]:
        """SIGTERM in reverse start order; SIGKILL whatever is left after `timeout_s`. Returns exit codes."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int] = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes


@dataclass(frozen=True)
class MetricsTarget:
    """One process's Prometheus endpoint: `process` is the service's name, or with extra replicas of that service
    the process's own (engine-0 for the standard engine, engine-1, ... for the extras)."""

    process: str
    service: str
    url: str


def metrics_urls(cfg: Config) -> dict[str, str]:
    """service -> its /metrics URL, on the interface the service listens on (loopback for `chatmesh up`)."""
    return {t.service: t.url for t in metrics_targets(cfg)}


def metrics_targets(cfg: Config, extra: Sequence[Extra] = ()) -> list[MetricsTarget]:
    """Every process's /metrics of the mesh `cfg` describes plus `extra` (what `scaled` returns), in start order
    per service; processes whose metrics port is 0 are left out."""
    hosts = {service: _host(cfg[address]) for service, address in ORDER}
    hosts["gateway"] = cfg[settings.HOST]
    scaled_services = {x.service for x in extra}
    out: list[MetricsTarget] = []
    for service, port in settings.METRIC_PORTS.items():
        if cfg[port]:
            process = f"{service}-0" if service in scaled_services else service
            out.append(MetricsTarget(process, service, f"http://{_url_host(hosts[service])}:{cfg[port]}/metrics"))
        out += [MetricsTarget(x.name, x.service, f"http://{_url_host(_host(x.address))}:{x.metrics_port}/metrics")
                for x in extra if x.service == service and x.metrics_port]
    return out


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]") if ":" in address else address


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _step(address: str, i: int) -> str:
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + 10 * i}"


def _metrics_step(cfg: Config, service: str, i: int) -> int:
    base = cfg[settings.METRIC_PORTS[service]]
    return base + 10 * i if base else 0


def scaled(cfg: Config, engines: int, chats: int) -> tuple[dict[str, str], list[Extra]]:
    """More engine replicas and chat processes on one host: replica i (engine-i) and chat process i listen ten
    ports above the previous one (engines 50054, 50064, ...; chats 50051, 50061, ...), and serve their metrics
    ten ports apart too (engines 9154, 9164, ...; chats 9151, 9161, ...; none when the service's metrics port is
    0). Returns the settings every process gets (the router's CHATMESH_REPLICAS, the gateway's
    CHATMESH_CHAT_ADDRESSES) and the extra processes. Raises MeshError when a stepped port is one the mesh
    already uses."""
    if engines < 1 or chats < 1:
        raise MeshError("--engines and --chats must be at least 1")
    env: dict[str, str] = {}
    extra: list[Extra] = []
    if engines > 1:
        replicas = next(s for s in config.all_settings() if s.env == "CHATMESH_REPLICAS")  # the router's setting
        if cfg[replicas]:
            raise MeshError("--engines replaces CHATMESH_REPLICAS; set one or the other")
        addresses = [_step(cfg[settings.ENGINE_ADDRESS], i) for i in range(engines)]
        env[replicas.env] = ",".join(f"engine-{i}={a}" for i, a in enumerate(addresses))
        extra += [Extra(f"engine-{i}", "engine", a, {"CHATMESH_REPLICA_ID": f"engine-{i}"},
                        _metrics_step(cfg, "engine", i))
                  for i, a in enumerate(addresses) if i]
    if chats > 1:
        addresses = [_step(cfg[settings.CHAT_ADDRESS], i) for i in range(chats)]
        env["CHATMESH_CHAT_ADDRESSES"] = ",".join(addresses)
        extra += [Extra(f"chat-{i}", "chat", a, {"CHATMESH_CHAT_INSTANCE_ID": f"chat-{i}"},
                        _metrics_step(cfg, "chat", i))
                  for i, a in enumerate(addresses) if i]
    if extra:
        _check_ports(cfg, extra)
    return env, extra


def _check_ports(cfg: Config, extra: Sequence[Extra]) -> None:
    """No two processes of the mesh on one port (they all run on this host)."""
    taken: dict[int, str] = {}

    def take(port: int, who: str) -> None:
        if port in taken:
            raise MeshError(f"{who} would listen on port {port}, which is {taken[port]}'s: move the base ports "
                            "apart (replicas and chat processes step by ten)")
        taken[port] = who

    for service, address in ORDER:
        take(int(cfg[address].rpartition(":")[2]), f"{service} (gRPC)")
    take(cfg[settings.GATEWAY_PORT], "gateway (HTTP)")
    for service, port in settings.METRIC_PORTS.items():
        if cfg[port]:
            take(cfg[port], f"{service} (metrics)")
    for x in extra:
        take(int(x.address.rpartition(":")[2]), f"{x.name} (gRPC)")
        if x.metrics_port:
            take(x.metrics_port, f"{x.name} (metrics)")


def register(sub: Any) -> None:
    p = sub.add_parser("up", help="run every service on loopback with the embedded defaults")
    p.add_argument("--engines", type=int, default=1, metavar="N",
                   help="engine replicas (engine-0 .. engine-N-1, ports ten apart from CHATMESH_ENGINE_ADDRESS): "
                        "watch conversation affinity and spill with `chatmesh status --watch`")
    p.add_argument("--chats", type=int, default=1, metavar="N",
                   help="chat processes (ports ten apart from CHATMESH_CHAT_ADDRESS); the gateway spreads turns "
                        "over them (CHATMESH_CHAT_ADDRESSES)")
    config.add_flags(p)
    p.set_defaults(handler=_up)


def _up(args: argparse.Namespace) -> int:
    cfg = Config(flags=config.flags_of(args))
    try:
        more_env, extra = scaled(cfg, args.engines, args.chats)
    except MeshError as err:
        print(f"chatmesh: {err}", file=sys.stderr)
        return 2
    env = {**cfg.as_env(config.all_settings()), **more_env}
    mesh = Mesh(env=env, log_dir=Path(cfg[settings.DATA_DIR]) / "logs")
    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print("chatmesh: starting store, moderation, engine, router, chat, gateway "
          f"(logs in {mesh.log_dir})", file=sys.stderr)
    try:
        mesh.start(on_ready=lambda name, where: print(f"  {name:<10} ready at {where}", file=sys.stderr),
                   extra=extra)
    except MeshError as err:
        print(f"chatmesh: {err}", file=sys.stderr)
        return 1
    url = mesh.gateway_url
    trust_line = ("gRPC in plaintext (CHATMESH_MESH_PLAINTEXT, loopback only): no identities, no owner tokens."
                  if mesh.cfg[settings.MESH_PLAINTEXT] else
                  f"Every gRPC hop speaks mutual TLS with the certificates in {mesh.certs}; `chatmesh certs` prints\n"
                  "the flags that make grpcurl the operator (README, \"Debugging with grpcurl\").\n"
                  f"Keys: {' '.join(mesh.layout_notes)}.")
    metrics_lines = "".join(f"\n  {name:<10} {where}" for name, where in mesh.metrics_urls.items()) or "off"
    flags = (f" --engines {args.engines}" if args.engines > 1 else "") + (f" --chats {args.chats}" if args.chats > 1
                                                                        else "")
    print(f"""
chatmesh is up. Open {url}/ in a browser, or stream a reply with curl:

  conv=$(curl -s -X POST {url}/v1/conversations | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
  curl -N {url}/v1/conversations/$conv/turns -H 'content-type: application/json' \\
    -d '{{"turn_id": "'$(python3 -c 'import uuid; print(uuid.uuid4())')'", "content": "What is the capital of France?"}}'

{trust_line}
Prometheus metrics (GET /metrics): {metrics_lines}
At a glance: chatmesh status{flags} [--watch]
A Prometheus config scraping these: chatmesh status{flags} --scrape-config
(Grafana dashboard: docs/observability/grafana-dashboard.json). Each reply on the web page shows its TTFT and
how many of its prompt tokens came from the engine's cache: the second turn of a conversation hits it.

Press Ctrl-C to stop.""", flush=True)
    if extra:
        print(f"{args.engines} engine replicas, {args.chats} chat processes: `chatmesh status --watch` shows each "
              "replica's load and picks; a conversation's turns stay on one replica (its prefix is cached there) "
              "until that replica is over the load bound, then they spill.", flush=True)
    while not stopping:
        dead = mesh.dead()
        if dead:
            print(f"chatmesh: {', '.join(dead)} exited; stopping the mesh", file=sys.stderr)
            mesh.stop()
            return 1
        time.sleep(0.5)
    print("chatmesh: stopping", file=sys.stderr)
    mesh.stop()
    return 0
