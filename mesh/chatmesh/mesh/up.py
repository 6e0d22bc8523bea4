"""`chatmesh up`: the whole mesh on loopback, each service its own process, as in production.

Start order follows the data flow backwards (store, moderation, engine, router, chat, gateway), each waiting for
the standard health check to answer SERVING (the gateway: an HTTP answer) before the next starts. Ctrl-C or
SIGTERM stops them in reverse order with SIGTERM, so open streams end cleanly; a service that exits on its own
takes the mesh down with a message naming it. The same `Mesh` class starts the mesh for the end-to-end tests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chatmesh.mesh import config, settings
from chatmesh.mesh.config import Config

# (service, setting holding its address) in start order; the gateway comes last.
ORDER: tuple[tuple[str, config.Setting[str]], ...] = (
    ("store", settings.STORE_ADDRESS),
    ("moderation", settings.MODERATION_ADDRESS),
    ("engine", settings.ENGINE_ADDRESS),
    ("router", settings.ROUTER_ADDRESS),
    ("chat", settings.CHAT_ADDRESS),
)


class MeshError(RuntimeError):
    """A service did not start or died."""


def grpc_serving(address: str, timeout_s: float = 1.0) -> bool:
    async def check() -> bool:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    try:
        return asyncio.run(check())
    except grpc.aio.AioRpcError:
        return False


def http_answers(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
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

    @property
    def cfg(self) -> Config:
        return Config(env=self.env)

    @property
    def gateway_url(self) -> str:
        cfg = self.cfg
        return f"http://{cfg[settings.HOST]}:{cfg[settings.GATEWAY_PORT]}"

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

    def add(self, name: str, service: str, address: str, env: Mapping[str, str]) -> None:
        """Starts one more gRPC process (a second engine replica or chat process) and waits for its health."""
        self._spawn(service, name, {**env, "CHATMESH_LISTEN": address})
        self._wait(name, lambda: grpc_serving(address))

    def start(self, on_ready: Any = None, before: Mapping[str, Any] | None = None) -> None:
        """Starts the mesh; `before[service]()` runs just before that service starts (to add extra replicas)."""
        cfg = self.cfg
        try:
            for service, address in ORDER:
                if before and service in before:
                    before[service]()
                self._spawn(service)
                self._wait(service, lambda a=cfg[address]: grpc_serving(a))
                if on_ready:
                    on_ready(service, cfg[address])
            self._spawn("gateway")
            self._wait("gateway", lambda: http_answers(self.gateway_url + "/healthz"))
            if on_ready:
                on_ready("gateway", self.gateway_url)
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


def register(sub: Any) -> None:
    p = sub.add_parser("up", help="run every service on loopback with the embedded defaults")
    config.add_flags(p)
    p.set_defaults(handler=_up)


def _up(args: argparse.Namespace) -> int:
    cfg = Config(flags=config.flags_of(args))
    env = cfg.as_env(config.all_settings())
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
        mesh.start(on_ready=lambda name, where: print(f"  {name:<10} ready at {where}", file=sys.stderr))
    except MeshError as err:
        print(f"chatmesh: {err}", file=sys.stderr)
        return 1
    url = mesh.gateway_url
    print(f"""
chatmesh is up. Open {url}/ in a browser, or stream a reply with curl:

  conv=$(curl -s -X POST {url}/v1/conversations | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
  curl -N {url}/v1/conversations/$conv/turns -H 'content-type: application/json' \\
    -d '{{"turn_id": "'$(python3 -c 'import uuid; print(uuid.uuid4())')'", "content": "What is the capital of France?"}}'

Press Ctrl-C to stop.""", flush=True)
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
