"""The no-op mesh that bench/mesh_overhead.py measures beside the real one: it must carry a turn end to end
(HTTP -> gateway -> chat -> claim/pick/check -> engine stream -> output check -> SSE), or its floor means nothing."""

from __future__ import annotations

import asyncio

from bench.mesh_floor import ROLES, FloorMesh
from bench.mesh_overhead import floor_direct, through_edge


def test_floor_mesh_streams_a_delta_through_every_hop() -> None:
    mesh = FloorMesh()
    mesh.start()
    try:
        edge = asyncio.run(through_edge(mesh.gateway_url, 2, 2, floor=True))
        direct = asyncio.run(floor_direct(mesh.engine_address, 2, 2))
        # every process is still up: a hop that failed would have taken its turn (and its TTFT) with it
        assert [role for role in ROLES if mesh.procs[role].poll() is not None] == []
    finally:
        mesh.stop()
    assert len(edge) == 4 and len(direct) == 4
    assert all(0 < t < 10 for t in edge + direct)
    assert all(proc.poll() is not None for proc in mesh.procs.values())
