"""Multi-turn chat on the `local` backend (SmolLM2-135M on the CPU): TTFT of later turns with the prefix cache
against the same workload with it disabled, aggregate output tokens/s, and peak RSS.

The workload (issue 6, scaled by flags): `--conversations` conversations of `--turns` turns, run
`--concurrency` at a time; every prompt is a `--system-tokens` system prompt (shared by all: the platform prefix)
plus the history plus a `--message-tokens` user message; replies are greedy and capped at `--reply-tokens`.
"Cache disabled" gives every request a fresh owner salt and no platform prefix, so no block is ever reused:
exactly a replica without prefix caching. Both modes run in one process on one loaded model, side by side.

    .venv/bin/python -m bench.local_multiturn                      # the scaled-down default
    .venv/bin/python -m bench.local_multiturn --conversations 16 --turns 8 --concurrency 16 --reply-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import time
import uuid
from dataclasses import dataclass, field

from chatmesh.engine_adapter.backend import Delta, Finished, GenerateParams, Started
from chatmesh.engine_adapter.engine import EngineCore
from chatmesh.engine_adapter.local.backend import build_local, load_model
from chatmesh.engine_adapter.local.model import LoadedModel
from chatmesh.mesh.config import Config
from chatmesh.model.settings import MODEL_DIR
from chatmesh.model.template import Message, Role, render
from chatmesh.model.tokenizer import Tokenizer

WORDS = ("the engine keeps each conversation history close at hand so that the next turn starts where the last "
         "one ended while a user pauses to think and the blocks of their history wait in memory for the reply "
         "a long new prompt is cut into chunks that share each step with replies already streaming").split()


def text_of(tok: Tokenizer, n_tokens: int, offset: int) -> str:
    """English-looking text of about n_tokens tokens (one token per common word), varied by offset."""
    words = [WORDS[(offset * 7 + i * 3) % len(WORDS)] for i in range(n_tokens)]
    text = " ".join(words)
    while len(tok.encode(text)) > n_tokens:
        words.pop()
        text = " ".join(words)
    return text


TOPICS = ("the history of Paris", "how bread is baked", "why the sky is blue", "the life of bees",
          "how trains work", "the water cycle", "learning to swim", "the planets of the solar system",
          "how a bicycle works", "the seasons of the year", "volcanoes", "the moon")


@dataclass
class Result:
    ttft_first: list[float] = field(default_factory=list)  # turn 1
    ttft_later: list[float] = field(default_factory=list)  # turns 2..N
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0


async def conversation(engine: EngineCore, tok: Tokenizer, args: argparse.Namespace, system: str, c: int,
                       cache: bool, res: Result) -> None:
    history = [Message(Role.SYSTEM, system)]
    salt = f"owner-{c}".encode()
    for turn in range(args.turns):
        topic = TOPICS[(c * args.turns + turn) % len(TOPICS)]
        ask = f" Now write a detailed paragraph about {topic}."
        history.append(Message(Role.USER, "Notes: " + text_of(tok, args.message_tokens - len(tok.encode(ask)) - 2,
                                                              c + turn) + ask))
        prompt = render(tok, history)
        params = GenerateParams(
            prompt.token_ids, args.reply_tokens,
            cache_salt=salt if cache else uuid.uuid4().bytes,
            platform_prefix_tokens=prompt.platform_prefix_len if cache else 0)
        t0 = time.perf_counter()
        first: float | None = None
        reply: list[str] = []
        async for event in engine.generate(params):
            match event:
                case Started():
                    res.cached_tokens += event.cached_tokens
                case Delta():
                    if first is None and event.token_ids:
                        first = time.perf_counter() - t0
                    reply.append(event.text)
                case Finished():
                    res.output_tokens += event.usage.output_tokens
                    res.prompt_tokens += event.usage.prompt_tokens
        assert first is not None
        (res.ttft_first if turn == 0 else res.ttft_later).append(first)
        history.append(Message(Role.ASSISTANT, "".join(reply)))


async def run(model: LoadedModel, args: argparse.Namespace, cache: bool) -> Result:
    env = {"CHATMESH_LOCAL_THREADS": str(args.threads), "CHATMESH_MAX_BATCH": str(args.concurrency),
           "CHATMESH_STEP_TOKEN_BUDGET": str(args.step_tokens), "CHATMESH_FLUSH_INTERVAL_MS": "5"}
    engine = build_local(Config(env=env), model=model)
    await engine.start()
    tok = model.tokenizer
    system = "You are a helpful assistant. " + text_of(tok, args.system_tokens, 0)
    res = Result()
    sem = asyncio.Semaphore(args.concurrency)

    async def one(c: int) -> None:
        async with sem:
            await conversation(engine, tok, args, system, c, cache, res)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(c) for c in range(args.conversations)))
    res.wall_s = time.perf_counter() - t0
    await engine.close()
    return res


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--message-tokens", type=int, default=150)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--step-tokens", type=int, default=512, help="engine step token budget (prefill chunk)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="cache,nocache")
    args = ap.parse_args()

    t0 = time.perf_counter()
    model = load_model(Config()[MODEL_DIR])
    load_s = time.perf_counter() - t0
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"model loaded in {load_s:.1f} s, peak RSS {rss_loaded:.0f} MiB; workload: {args.conversations} conversations"
          f" x {args.turns} turns, {args.concurrency} at once, system {args.system_tokens} + message "
          f"{args.message_tokens} tokens, replies <= {args.reply_tokens}, {args.threads} torch thread(s)")
    results = {}
    for mode in args.modes.split(","):
        results[mode] = asyncio.run(run(model, args, cache=(mode == "cache")))
        r = results[mode]
        print(f"{mode:8s} TTFT turn 1 p50 {statistics.median(r.ttft_first):6.2f} s | turns 2..{args.turns} "
              f"p50 {statistics.median(r.ttft_later):6.2f} s p95 {pct(r.ttft_later, 0.95):6.2f} s "
              f"mean {statistics.mean(r.ttft_later):6.2f} s | {r.output_tokens} output tok in {r.wall_s:6.1f} s = "
              f"{r.output_tokens / r.wall_s:5.1f} tok/s | prompt {r.prompt_tokens} tok, cached {r.cached_tokens}",
              flush=True)
    if "cache" in results and "nocache" in results:
        a, b = results["cache"], results["nocache"]
        print(f"TTFT turns 2..{args.turns}: mean {statistics.mean(b.ttft_later) / statistics.mean(a.ttft_later):.1f}x"
              f" faster with the prefix cache (p50 {statistics.median(b.ttft_later) / statistics.median(a.ttft_later):.1f}x)")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
