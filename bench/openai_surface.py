"""Time to first token of the OpenAI-compatible surface vs chatmesh's own SSE route, side by side on one mesh.

One mesh (every service its own process, `sim` at ~0 step time, as bench/mesh_overhead.py runs it). The native
path is bench/mesh_overhead.py's `through_edge` (POST /v1/conversations/{id}/turns after creating the
conversation); the OpenAI path is what the `openai` SDK sends, over the same HTTP client: POST
/openai/v1/chat/completions with `stream: true` and the whole history each turn, so the edge has to recognise
the conversation (history digest) before it sends the turn; a conversation's first turn creates it. TTFT is from
sending the request to the first text (turn.delta, or a chunk with content). `--conversations` clients each send
`--turns` turns, paced by `--think-ms`; the two paths alternate for `--rounds` rounds so a noisy machine affects
both alike.

    .venv/bin/python -m bench.openai_surface --conversations 50 --turns 4 --think-ms 200 [--append BENCHMARKS.md]
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
import tempfile
import time
from pathlib import Path

import httpx

from bench.mesh_overhead import pct, report, through_edge
from chatmesh.mesh import settings
from chatmesh.mesh.up import Mesh
from tests.e2e.conftest import mesh_env
from tests.gateway.openai_client import make_key

MODEL = "smollm2-135m-instruct"


async def through_openai(url: str, key: str, conversations: int, turns: int, think_s: float) -> list[float]:
    ttfts: list[float] = []
    limits = httpx.Limits(max_connections=conversations + 10, max_keepalive_connections=conversations + 10)
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, headers=headers) as client:
        async def conversation(i: int) -> None:
            rng = random.Random(i)
            messages: list[dict[str, str]] = []
            tag = os.urandom(4).hex()
            for t in range(turns):
                if think_s > 0:
                    await asyncio.sleep(rng.expovariate(1 / think_s))
                messages.append({"role": "user", "content": f"Conversation {i} {tag}, turn {t}: tell me more."})
                body = {"model": MODEL, "messages": messages, "stream": True}
                start = time.perf_counter()
                first: float | None = None
                parts: list[str] = []
                async with client.stream("POST", "/openai/v1/chat/completions", json=body) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(f"refused: {resp.status_code} {(await resp.aread())[:200]!r}")
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        delta = json.loads(line[6:])["choices"]
                        text = delta[0]["delta"].get("content") if delta else None
                        if text:
                            if first is None:
                                first = time.perf_counter() - start
                            parts.append(text)
                messages.append({"role": "assistant", "content": "".join(parts)})
                if first is not None:
                    ttfts.append(first)

        await asyncio.gather(*[conversation(i) for i in range(conversations)])
    return ttfts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--think-ms", type=float, default=200.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--append", help="append the results to this Markdown file")
    args = parser.parse_args()
    think = args.think_ms / 1000
    native: list[float] = []
    surface: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        env = mesh_env(Path(tmp) / "data", CHATMESH_SIM_SPEED="100000", CHATMESH_MAX_REPLY_TOKENS="48",
                       CHATMESH_LOG_LEVEL="warning", CHATMESH_LIMIT_TURNS_PER_MINUTE="1000000",
                       CHATMESH_LIMIT_OPEN_STREAMS="100000", CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR="1000000000")
        mesh = Mesh(env=env, log_dir=Path(tmp) / "logs", start_timeout_s=180)
        mesh.start()
        loads = []
        try:
            key = asyncio.run(make_key(Path(mesh.cfg[settings.DATA_DIR]), "bench"))
            asyncio.run(through_edge(mesh.gateway_url, 4, 1))  # warm both paths
            asyncio.run(through_openai(mesh.gateway_url, key, 4, 1, 0))
            for _ in range(args.rounds):
                loads.append(os.getloadavg()[0])
                native += asyncio.run(through_edge(mesh.gateway_url, args.conversations, args.turns, think))
                surface += asyncio.run(through_openai(mesh.gateway_url, key, args.conversations, args.turns, think))
        finally:
            mesh.stop()
    rows = [(name, len(v), statistics.median(v) * 1e3, pct(v, 0.99) * 1e3)
            for name, v in (("chatmesh SSE (/v1/conversations/{id}/turns)", native),
                            ("OpenAI surface (/openai/v1/chat/completions, stream)", surface))]
    lines = [
        f"### OpenAI surface vs chatmesh's own SSE route, TTFT ({datetime.date.today()}, {os.cpu_count()} cores, "
        f"{platform.machine()}, {args.conversations} conversations x {args.turns} turns x {args.rounds} rounds "
        f"alternating, think time {args.think_ms:.0f} ms, sim at ~0 step time, load average "
        f"{min(loads):.1f}-{max(loads):.1f})",
        "",
        "| path | turns | TTFT p50 (ms) | TTFT p99 (ms) |",
        "|---|---|---|---|",
        *[f"| {n} | {c} | {p50:.2f} | {p99:.2f} |" for n, c, p50, p99 in rows],
        f"| **added by the OpenAI surface** | | **{rows[1][2] - rows[0][2]:.2f}** | {rows[1][3] - rows[0][3]:.2f} |",
        "",
    ]
    report(lines, args.append)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
