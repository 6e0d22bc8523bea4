"""SIGTERM during a streaming turn: every process exits promptly and cleanly."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import httpx

from tests.e2e.conftest import read_sse, start_mesh


def test_sigterm_mid_stream_exits_within_10s_without_tracebacks(tmp_path: Path) -> None:
    mesh = start_mesh(tmp_path, CHATMESH_SIM_STEP_MS="100", CHATMESH_MAX_REPLY_TOKENS="200")
    got_delta = threading.Event()
    events: list[str] = []

    def stream() -> None:
        with httpx.Client(base_url=mesh.gateway_url, timeout=60) as client:
            conv = client.post("/v1/conversations", json={}).json()["id"]
            body = {"turn_id": str(uuid.uuid4()), "content": "Write a long story."}
            try:
                with client.stream("POST", f"/v1/conversations/{conv}/turns", json=body) as resp:
                    for event in read_sse(resp):
                        events.append(event.event)
                        if event.event == "turn.delta":
                            got_delta.set()
            except httpx.HTTPError:
                pass

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    try:
        assert got_delta.wait(30), "no delta arrived before SIGTERM"
    finally:
        started = time.monotonic()
        codes = mesh.stop(timeout_s=15)
        elapsed = time.monotonic() - started
    reader.join(10)
    assert elapsed < 10, f"mesh took {elapsed:.1f} s to stop"
    assert all(code == 0 for code in codes.values()), codes
    for log in (tmp_path / "logs").glob("*.log"):
        text = log.read_text()
        assert "Traceback" not in text, f"{log.name}:\n{text[-3000:]}"
        assert '"exception"' not in text, f"{log.name}:\n{text[-3000:]}"
