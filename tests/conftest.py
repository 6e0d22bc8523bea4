"""Shared fixtures. Tests that need PostgreSQL, Redis, Triton or a browser call `need(...)`: without the
service they skip with the reason, and with CHATMESH_REQUIRE_SERVICES=1 (CI) they fail instead."""

from __future__ import annotations

import os
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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
