"""The `local` backend: SmolLM2-135M-Instruct on the CPU under the engine core (see `backend.py`).

This package's `__init__` stays light: the settings module is imported by every process for the flag table,
and importing torch there would add seconds to every service's start. `build_backend` imports it on use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatmesh.engine_adapter.backend import Backend
    from chatmesh.mesh.config import Config


def build_backend(cfg: Config) -> Backend:
    from chatmesh.engine_adapter.local.backend import build_local

    return build_local(cfg)
