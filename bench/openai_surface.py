"""Time to first token of the OpenAI-compatible surface vs chatmesh's own SSE route, side by side on one mesh.

One mesh (every service its own process, mutual TLS between them, `sim` at ~0 step time, as bench/mesh_overhead.py
runs it). Both paths authenticate alike, with one API key as the bearer token (one owner, the same key lookup), and
time the same thing: from sending the request to the first SSE event carrying text (`turn.delta`, or a
`chat.completion.chunk` with content). The native path is POST /v1/conversations/{id}/turns after creating the
conversation (outside the timing); the OpenAI path is what the `openai` SDK sends, POST /openai/v1/chat/completions
with `stream: true` and the whole history each turn, so the edge recognises the conversation (history digest)
before it sends the turn, and a conversation's first turn creates it inside the timed request: first turns and
later turns are reported apart.

Two phases, each alternating the paths ABBA round by round so a noisy machine affects both alike:
- paced: `--conversations` clients each send `--turns` turns, pausing an exponential think time of mean
  `--think-ms` before each; with the default 2 s the mesh runs well under its capacity, so TTFT is the path's
  own latency, not a queue. (A think time that offers more turns per second than the mesh serves, such as 200 ms
  for 50 conversations on 2 cores, measures the queue: TTFT then depends on how long each path's clients spend
  between first token and next request, not on the path; the turns/s and CPU columns show when that happens.)
- serial: one conversation, `--serial-turns` turns back to back: no concurrency at all.
It also reports the services' CPU per turn of each path (from /proc). A third path is the OpenAI one with three
tool definitions in every request (as Open WebUI sends its built-in tools): the tools are parsed at the edge,
carried in the turn's options, rendered into the prompt in the model's format, and the reply goes through the
model's call reader (the scripted sim answers text, so no call is made: what is measured is the tools' cost on
a turn that uses none, the common case).

    .venv/bin/python -m bench.openai_surface --conversations 50 --turns 4 --think-ms 2000 --rounds 4 \
        [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

from bench.mesh_overhead import cpu_seconds, pct, report
from chatmesh.mesh import settings
from chatmesh.mesh.up import Mesh
from tests.conftest import free_port
from tests.e2e.conftest import mesh_env
from tests.gateway.openai_client import make_key

MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the default model profile's id (CHATMESH_MODEL=smollm2)

# (turn index within its conversation, TTFT in seconds)
Samples = list[tuple[int, float]]
PathFn = Callable[[str, str, int, int, float], Coroutine[Any, Any, Samples]]


def _client(url: str, key: str, conversations: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=conversations + 10, max_keepalive_connections=conversations + 10)
    return httpx.AsyncClient(base_url=url, timeout=120, limits=limits, headers={"authorization": f"Bearer {key}"})


async def _first_text(resp: httpx.Response, start: float, text_of: Callable[[str], str | None],
                      parts: list[str]) -> float | None:
    """Reads an SSE response to its end; returns the time of the first data line carrying text."""
    if resp.status_code != 200:
        raise RuntimeError(f"refused: {resp.status_code} {(await resp.aread())[:200]!r}")
    first = None
    async for line in resp.aiter_lines():
        if not line.startswith("data: {"):
            continue
        text = text_of(line[6:])
        if text:
            if first is None:
                first = time.perf_counter() - start
            parts.append(text)
    return first


def _native_text(data: str) -> str | None:
    value = json.loads(data).get("text")
    return value if isinstance(value, str) else None


def _chunk_text(data: str) -> str | None:
    choices = json.loads(data).get("choices")
    value = choices[0]["delta"].get("content") if choices else None
    return value if isinstance(value, str) else None


async def through_native(url: str, key: str, conversations: int, turns: int, think_s: float) -> Samples:
    samples: Samples = []
    async with _client(url, key, conversations) as client:
        async def conversation(i: int) -> None:
            rng = random.Random(i)
            conv = (await client.post("/v1/conversations", json={})).json()["id"]
            for t in range(turns):
                if think_s > 0:
                    await asyncio.sleep(rng.expovariate(1 / think_s))
                body = {"turn_id": str(uuid.uuid4()), "content": f"Conversation {i}, turn {t}: tell me more."}
                start = time.perf_counter()
                async with client.stream("POST", f"/v1/conversations/{conv}/turns", json=body) as resp:
                    first = await _first_text(resp, start, _native_text, [])
                if first is not None:
                    samples.append((t, first))

        await asyncio.gather(*[conversation(i) for i in range(conversations)])
    return samples


TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name.replace('_', ' ').capitalize()} for the user.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to look up"}},
                   "required": ["query"]}}} for name in ("web_search", "fetch_url", "get_current_time")]


async def through_openai_tools(url: str, key: str, conversations: int, turns: int, think_s: float) -> Samples:
    return await through_openai(url, key, conversations, turns, think_s, TOOLS)


async def through_openai(url: str, key: str, conversations: int, turns: int, think_s: float,
                         tools: list[dict[str, Any]] | None = None) -> Samples:
    samples: Samples = []
    async with _client(url, key, conversations) as client:
        async def conversation(i: int) -> None:
            rng = random.Random(i)
            messages: list[dict[str, str]] = []
            tag = os.urandom(4).hex()  # each run's conversations are new ones
            for t in range(turns):
                if think_s > 0:
                    await asyncio.sleep(rng.expovariate(1 / think_s))
                messages.append({"role": "user", "content": f"Conversation {i} {tag}, turn {t}: tell me more."})
                body: dict[str, Any] = {"model": MODEL, "messages": messages, "stream": True}
                if tools:
                    body["tools"] = tools
                parts: list[str] = []
                start = time.perf_counter()
                async with client.stream("POST", "/openai/v1/chat/completions", json=body) as resp:
                    first = await _first_text(resp, start, _chunk_text, parts)
                messages.append({"role": "assistant", "content": "".join(parts)})
                if first is not None:
                    samples.append((t, first))

        await asyncio.gather(*[conversation(i) for i in range(conversations)])
    return samples


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


PATHS: dict[str, PathFn] = {"native": through_native, "openai": through_openai, "tools": through_openai_tools}
NAMES = {"native": "chatmesh SSE (/v1/conversations/{id}/turns)",
         "openai": "OpenAI surface (/openai/v1/chat/completions, stream)",
         "tools": "OpenAI surface with 3 tools in the request"}


class Phase:
    """One phase's samples, CPU and wall time per path, over its rounds."""

    def __init__(self) -> None:
        self.samples: dict[str, Samples] = {p: [] for p in PATHS}
        self.cpu_s: dict[str, float] = {p: 0.0 for p in PATHS}
        self.wall_s: dict[str, float] = {p: 0.0 for p in PATHS}

    def run(self, mesh: Mesh, key: str, path: str, conversations: int, turns: int, think_s: float) -> None:
        before = sum(cpu_seconds(p.pid) for p in mesh.procs.values())
        started = time.perf_counter()
        self.samples[path] += asyncio.run(PATHS[path](mesh.gateway_url, key, conversations, turns, think_s))
        self.wall_s[path] += time.perf_counter() - started
        self.cpu_s[path] += sum(cpu_seconds(p.pid) for p in mesh.procs.values()) - before

    def rows(self, title: str) -> list[str]:
        out = []
        p50: dict[str, tuple[float, float, float]] = {}
        for path in PATHS:
            s = self.samples[path]
            every, firsts, later = [t for _, t in s], [t for i, t in s if i == 0], [t for i, t in s if i > 0]
            p50[path] = (_median(every), _median(firsts), _median(later))
            out.append(f"| {title}: {NAMES[path]} | {len(s)} | {p50[path][0] * 1e3:.2f} | "
                       f"{p50[path][1] * 1e3:.2f} | {p50[path][2] * 1e3:.2f} | "
                       f"{pct(every, 0.99) * 1e3:.2f} | {len(s) / self.wall_s[path]:.1f} | "
                       f"{self.cpu_s[path] / len(s) * 1e3:.2f} |")
        cpu = {p: self.cpu_s[p] / len(self.samples[p]) for p in PATHS}
        for path, label in (("openai", "the OpenAI surface"), ("tools", "the OpenAI surface with tools")):
            added = [(o - n) * 1e3 for o, n in zip(p50[path], p50["native"])]
            out.append(f"| **{title}: added by {label}** | | **{added[0]:+.2f}** | {added[1]:+.2f} | "
                       f"**{added[2]:+.2f}** | | | {(cpu[path] - cpu['native']) * 1e3:+.2f} |")
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--think-ms", type=float, default=2000.0)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each path per phase, ABBA")
    parser.add_argument("--serial-turns", type=int, default=20, help="turns of the one back-to-back conversation")
    parser.add_argument("--append", help="append the results to this Markdown file")
    args = parser.parse_args()
    think = args.think_ms / 1000
    paced, serial = Phase(), Phase()
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        env = mesh_env(Path(tmp) / "data", CHATMESH_SIM_SPEED="100000", CHATMESH_MAX_REPLY_TOKENS="48",
                       CHATMESH_LOG_LEVEL="warning", CHATMESH_LIMIT_TURNS_PER_MINUTE="1000000",
                       CHATMESH_LIMIT_OPEN_STREAMS="100000", CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR="1000000000",
                       CHATMESH_MESH_PLAINTEXT="false", CHATMESH_OWNER_TOKEN_ADDRESS=f"127.0.0.1:{free_port()}")
        mesh = Mesh(env=env, log_dir=Path(tmp) / "logs", start_timeout_s=180)
        mesh.start()
        try:
            key = asyncio.run(make_key(Path(mesh.cfg[settings.DATA_DIR]), "bench"))
            for path in PATHS:  # warm both paths (connections, caches, the key lookup)
                asyncio.run(PATHS[path](mesh.gateway_url, key, 4, 2, 0))
            for r in range(args.rounds):
                order = list(PATHS) if r % 2 == 0 else list(reversed(PATHS))
                loads.append(os.getloadavg()[0])
                for path in order:
                    paced.run(mesh, key, path, args.conversations, args.turns, think)
                for path in order:
                    serial.run(mesh, key, path, 1, args.serial_turns, 0.0)
            loads.append(os.getloadavg()[0])
        finally:
            mesh.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"### OpenAI surface vs chatmesh's own SSE route, TTFT ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} "
        f"UTC, commit {commit}, {os.cpu_count()} cores {platform.machine()}, mesh mTLS on, sim at ~0 step time, "
        f"{args.rounds} rounds ABBA, load average {min(loads):.1f}-{max(loads):.1f})",
        "",
        f"Paced: {args.conversations} conversations x {args.turns} turns, think time {args.think_ms:.0f} ms; "
        f"serial: 1 conversation x {args.serial_turns} turns back to back. Same API key on both paths.",
        "",
        "| phase: path | turns | TTFT p50 (ms) | p50 first turns | p50 later turns | p99 | turns/s | "
        "server CPU per turn (ms) |",
        "|---|---|---|---|---|---|---|---|",
        *paced.rows("paced"),
        *serial.rows("serial"),
        "",
    ]
    report(lines, args.append)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
