"""`chatmesh serve` warns of CHATMESH_* variables its service never read (misspelled, stale, another service's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import free_port


def test_serve_names_the_settings_it_was_given_and_never_read(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CHATMESH_")},
           "CHATMESH_MESH_PLAINTEXT": "true", "CHATMESH_ROUTER_HEALTH": "false",
           "CHATMESH_ROUTER_ADDRESS": f"127.0.0.1:{free_port()}", "CHATMESH_ROUTER_METRICS_PORT": "0",
           "CHATMESH_ROUTER_EPSILON": "0.3e-0",         # misspelled (CHATMESH_ROUTER_EPS); a value no timestamp holds
           "CHATMESH_STORE_DATABASE_URL": "sqlite://",  # stale/wrong name (CHATMESH_DATABASE_URL)
           "CHATMESH_KEY_PEPPER": "x" * 32}             # the gateway's, not the router's
    log = tmp_path / "router.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "chatmesh.mesh.cli", "serve", "router"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        found: list[dict[str, object]] = []
        while time.monotonic() < deadline and not found and proc.poll() is None:
            time.sleep(0.1)
            found = [e for e in map(json.loads, filter(None, log.read_text().splitlines()))
                     if e.get("event") == "settings_unread"]
    finally:
        proc.terminate()
        proc.wait(10)
    assert found, log.read_text()
    assert found[0]["names"] == ["CHATMESH_KEY_PEPPER", "CHATMESH_ROUTER_EPSILON", "CHATMESH_STORE_DATABASE_URL"]
    assert found[0]["unknown"] == ["CHATMESH_ROUTER_EPSILON", "CHATMESH_STORE_DATABASE_URL"]
    assert found[0]["level"] == "warning"
    read = [e for e in map(json.loads, filter(None, log.read_text().splitlines())) if e.get("event") == "settings_read"]
    assert "CHATMESH_ROUTER_HEALTH" in read[0]["names"] and "CHATMESH_ROUTER_EPSILON" not in read[0]["names"]
    assert "0.3e-0" not in log.read_text() and "x" * 32 not in log.read_text()  # names only, never values
