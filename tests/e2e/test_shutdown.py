"""SIGTERM during a streaming turn: every process exits by itself, within its grace, and cleanly.

No wall-clock bound: each process must exit on SIGTERM before `stop` would kill it (exit code 0, not -9), and
the 20 s reply must be cut short (the grace, 2 s, ended the stream, not the reply running out)."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import httpx

from tests.e2e.conftest import read_sse, start_mesh


def test_sigterm_mid_stream_exits_within_the_grace_without_tracebacks(tmp_path: Path) -> None:
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
        codes = mesh.stop(timeout_s=30)
    reader.join(10)
    assert all(code == 0 for code in codes.values()), codes  # each exited by itself: none was killed
    assert events.count("turn.delta") < 150, events.count("turn.delta")  # of ~200: the grace cut the stream
    for log in (tmp_path / "logs").glob("*.log"):
        text = log.read_text()
        assert "Traceback" not in text, f"{log.name}:\n{text[-3000:]}"
        assert '"exception"' not in text, f"{log.name}:\n{text[-3000:]}"
