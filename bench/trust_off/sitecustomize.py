"""Bench only (`bench.mesh_overhead --security --layers ...`): turns parts of the mesh's trust off in a service
process, so one hop's TLS can be told apart from the checks made over it. Never on a service's path otherwise:
it runs only in processes started with this folder on PYTHONPATH and CHATMESH_BENCH_TRUST_OFF set.

CHATMESH_BENCH_TRUST_OFF, a comma-separated list:
- `tokens`: the process's trust has no owner-token verifier (the gateway mints none, chat, the store and the
  engine believe a request's owner field, as in plaintext);
- `authz`: no per-RPC authorization check (every peer with a mesh certificate may call every RPC).
Mutual TLS itself stays on.

CHATMESH_BENCH_MESH_SRC, a folder: this process imports `chatmesh.mesh` from there instead (the shared bootstrap
at another commit, `git archive`d by the bench), so one run compares the trust layer before and after a change.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

_OFF = {part for part in os.environ.get("CHATMESH_BENCH_TRUST_OFF", "").split(",") if part}


def _patch() -> None:
    from chatmesh.mesh import authz, trust

    if "tokens" in _OFF:
        original = trust.Trust.from_config.__func__  # type: ignore[attr-defined]

        def from_config(cls: Any, *args: Any, **kwargs: Any) -> Any:
            return dataclasses.replace(original(cls, *args, **kwargs), verifier=None)

        trust.Trust.from_config = classmethod(from_config)  # type: ignore[assignment]
    if "authz" in _OFF:  # the servicers' handlers are registered on the server itself, unwrapped
        def unguarded(server: Any, guard: Any) -> Any:
            return server

        authz.guarded = unguarded


def _mesh_from(folder: str) -> None:
    import importlib

    finder = importlib.import_module("__editable___chatmesh_0_1_0_finder")  # the editable install's mapping
    finder.MAPPING["chatmesh.mesh"] = folder


if os.environ.get("CHATMESH_BENCH_MESH_SRC"):
    _mesh_from(os.environ["CHATMESH_BENCH_MESH_SRC"])
if _OFF:
    _patch()
