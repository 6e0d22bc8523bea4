"""Runs the backend conformance tests (conformance.py) against every backend in the registry."""

from __future__ import annotations

from tests.engine.conformance import *  # noqa: F403
