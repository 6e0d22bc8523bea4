"""Fixtures of the mesh's trust tests: the log lines a process writes (chatmesh.mesh.logs, as JSON)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from chatmesh.mesh import logs


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    out = io.StringIO()
    logs.configure("test", stream=out)
    yield out
    structlog.reset_defaults()
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)


def events(out: io.StringIO, name: str) -> list[dict[str, object]]:
    """The captured lines whose event is `name`."""
    found = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    return [line for line in found if line.get("event") == name]
