"""A pytest plugin that breaks the engine backend builder (`-p tests.hooks.broken_backend`): every
`service.build_backend` call raises, as a bug in a backend's construction would. tests/test_require_services.py
runs the conformance cases with it to show that such a builder fails them instead of skipping them."""

from __future__ import annotations

from typing import NoReturn

import pytest

from chatmesh.engine_adapter import service
from chatmesh.mesh.config import Config


def _broken(cfg: Config) -> NoReturn:
    raise RuntimeError("the backend builder is broken (tests.hooks.broken_backend)")


def pytest_configure(config: pytest.Config) -> None:
    service.build_backend = _broken
