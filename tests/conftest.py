"""Shared fixtures. Tests that need PostgreSQL, Redis, Triton or a browser call `need(...)`: without the
service they skip with the reason, and with CHATMESH_REQUIRE_SERVICES=1 (CI) they fail instead."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# CI runs property tests derandomized, so a submission's result does not depend on the run's luck; local runs
# keep exploring new examples (and the .hypothesis database replays what they found).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

REQUIRE_SERVICES = os.environ.get("CHATMESH_REQUIRE_SERVICES", "") == "1"
POSTGRES_URL = os.environ.get("CHATMESH_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("CHATMESH_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def need(available: bool, what: str) -> None:
    """Skip (or fail, in CI) when a service the test needs is absent."""
    if available:
        return
    if REQUIRE_SERVICES:
        pytest.fail(f"{what} is required (CHATMESH_REQUIRE_SERVICES=1) but not available")
    pytest.skip(f"{what} not available")


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
_PICKS = range(10000, _EPHEMERAL[0]) if _EPHEMERAL[0] - 10000 >= 4096 else range(0)
_HANDED: set[int] = set()
_RNG = random.SystemRandom()  # not the global generator, which a seeded test would make repeat across processes


def free_port() -> int:
    """A loopback port nothing is bound to, for a service a test starts. Drawn at random below the kernel's
    ephemeral range (ip_local_port_range), so that between this pick and the service's bind no outgoing
    connection of any process can take it as its source port (bind(0) hands out a port from that very range,
    where a mesh starting up makes dozens of connections: a service once failed to start with 'cannot serve
    metrics ... address in use'); never the same port twice in one process. Falls back to bind(0) when the
    range leaves no room below it."""
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
