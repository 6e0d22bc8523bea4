"""The image's smoke turn, run by the image's own Python inside the image's files (deploy/image/smoke.sh feeds it on
stdin): `chatmesh store migrate` (the migrations Job's command), the h100-triton init container's render and pip
install, then `chatmesh up` with the `local` engine (the baked SmolLM2 model on the CPU) and mTLS on, and two
turns of one conversation through the gateway's HTTP/SSE edge. Prints one JSON line (what was checked and
measured) and exits 0 when every check holds. The image's packages only (this file is not in the image)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

UP_TIMEOUT_S = 300.0  # the local engine loads the model and warms up; a loaded 2-core box is slow
TURN_TIMEOUT_S = 180.0


def sse_events(resp: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    event, data = "message", list[str]()
    for line in resp.iter_lines():
        if line == "":
            if data:
                events.append((event, json.loads("\n".join(data))))
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    return events


def turn(client: httpx.Client, conv: str, content: str) -> tuple[str, dict[str, Any], float]:
    started = time.monotonic()
    body = {"turn_id": str(uuid.uuid4()), "content": content}
    with client.stream("POST", f"/v1/conversations/{conv}/turns", json=body) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"smoke: turn answered {resp.status_code}: {resp.read()!r}")
        events = sse_events(resp)
    kinds = [kind for kind, _ in events]
    if not kinds or kinds[-1] != "turn.completed":
        raise SystemExit(f"smoke: the turn did not complete: {kinds}")
    text = "".join(data.get("text", "") for kind, data in events if kind == "turn.delta")
    return text, events[-1][1], time.monotonic() - started


def triton_init(folder: Path) -> dict[str, Any]:
    """The h100-triton overlay's init container `render`, as its manifest runs it, with HOME unwritable as there:
    `chatmesh triton render` (the Llama 3 profile from the baked model folder standing in for the checkpoint's
    tokenizer on /checkpoints), then pip installs the image's wheels for Triton's Python."""
    env = {**os.environ, "HOME": "/opt/chatmesh"}
    render = subprocess.run(
        ["chatmesh", "triton", "render", "--out", str(folder / "repository"), "--model",
         "/checkpoints/Llama-3.1-70B-Instruct-FP8", "--profile", "llama3", "--tp", "8", "--kv-fraction", "0.9",
         "--gpu", "h100", "--host-memory-gib", "1536", "--engine", "trtllm", "--replica-id", "engine-0"],
        env=env, capture_output=True, text=True, timeout=120)
    pip = subprocess.run(["sh", "-c", f"python -m pip install -q --no-index --no-deps --target {folder}/python "
                          "/opt/chatmesh/wheels/*.whl"], env=env, capture_output=True, text=True, timeout=120)
    repo = folder / "repository" / "chatmesh_llm"
    return {"render": render.returncode, "pip": pip.returncode,
            "rendered": sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file())
            if repo.is_dir() else [],
            "installed": sorted(p.name for p in (folder / "python").glob("*") if p.is_dir()
                                and p.name != "bin" and not p.name.endswith(".dist-info")),
            "errors": (render.stderr + pip.stderr).strip()[-400:]}


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="chatmesh-smoke-"))
    env = {**os.environ, "CHATMESH_DATA_DIR": str(work / "data"), "CHATMESH_ENGINE": "local",
           "CHATMESH_MESH_PLAINTEXT": "false", "CHATMESH_MAX_REPLY_TOKENS": "24", "CHATMESH_LOG_LEVEL": "info"}
    # the migrations Job's command, against the embedded SQLite store here (the Job's is PostgreSQL)
    (work / "data").mkdir()
    migrate = subprocess.run(["chatmesh", "store", "migrate"], env=env, capture_output=True, text=True, timeout=120)
    triton = triton_init(work / "triton")
    out = (work / "up.out").open("wb")
    started = time.monotonic()
    up = subprocess.Popen(["chatmesh", "up"], env=env, stdout=out, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL)
    result: dict[str, Any] = {"uid": os.getuid(), "gid": os.getgid(), "python": sys.version.split()[0],
                              "compilers": [c for c in ("gcc", "cc", "g++", "c++", "clang") if shutil.which(c)],
                              "migrate": [migrate.returncode, migrate.stdout.strip()[-80:]], "triton_init": triton}
    try:
        while b"chatmesh is up" not in (work / "up.out").read_bytes():
            if up.poll() is not None or time.monotonic() - started > UP_TIMEOUT_S:
                logs = "".join(f"\n--- {f.name}\n" + f.read_text(errors="replace")[-3000:]
                               for f in sorted((work / "data" / "logs").glob("*.log")))
                raise SystemExit("smoke: chatmesh up did not come up:\n"
                                 + (work / "up.out").read_text(errors="replace")[-4000:] + logs)
            time.sleep(0.5)
        result["up_s"] = round(time.monotonic() - started, 1)
        port = env.get("CHATMESH_GATEWAY_PORT", "8080")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TURN_TIMEOUT_S) as client:
            conv = client.post("/v1/conversations", json={}).json()["id"]
            reply, first, first_s = turn(client, conv, "What is the capital of France?")
            _, second, second_s = turn(client, conv, "And of Italy?")
        result.update(reply=reply, first_turn_s=round(first_s, 2), second_turn_s=round(second_s, 2),
                      first_usage=first.get("usage"), second_usage=second.get("usage"),
                      replica=second.get("replica_id", second.get("replica")))
        checks = {"non_root": os.getuid() != 0, "migrate": migrate.returncode == 0,
                  "triton_init": (triton["render"], triton["pip"], triton["installed"]) == (0, 0, ["chatmesh",
                                                                                             "structlog"]),
                  "no_compiler": not result["compilers"],
                  "paris": "Paris" in reply,
                  "second_turn_cached": second["usage"]["cached_prompt_tokens"] > second["usage"]["prompt_tokens"] // 2}
        result["checks"] = checks
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            result["up_exit"] = up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            result["up_exit"] = up.wait()
        logs = work / "data" / "logs"
        result["warnings"] = sorted({line.strip()[:200] for f in logs.glob("*.log") if logs.is_dir()
                                     for line in f.read_text(errors="replace").splitlines()
                                     if '"level": "warning"' in line or '"level": "error"' in line})[:20]
    print(json.dumps(result))
    return 0 if all(result.get("checks", {"ran": False}).values()) and result["up_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
