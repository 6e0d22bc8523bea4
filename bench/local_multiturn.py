"""Multi-turn chat on the `local` backend (SmolLM2-135M on the CPU): TTFT of later turns with the prefix cache
against the same workload with it disabled, aggregate output tokens/s, and peak RSS.

The workload (issue 6, scaled by flags): `--conversations` conversations of `--turns` turns, run
`--concurrency` at a time; every prompt is a `--system-tokens` system prompt (shared by all: the platform prefix)
plus the history plus a `--message-tokens` user message; replies are greedy and capped at `--reply-tokens`.
"Cache disabled" gives every request a fresh owner salt and no platform prefix, so no block is ever reused:
exactly a replica without prefix caching. Both modes run in one process on one loaded model, side by side.
`--nocache-turns` runs the disabled half on fewer turns (it prefills every prompt whole, so at full scale it
alone takes most of an hour here); its TTFT comparison then covers the turns both halves ran.

Memory: each mode's engine gets the configured KV budget (default: the backend's, 64 k tokens); `--touch-kv`
writes every page of the pools before the run, so the peak RSS printed is that of a FULL budget, not only of
the blocks the workload reaches (the pools are otherwise mapped lazily).

The workload's texts (`system_prompt`, `user_message`) are functions so that bench/llamacpp_baseline.py builds
the identical prompts.

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
from chatmesh.engine_adapter.engine import EngineCore, StepReport
from chatmesh.engine_adapter.local.backend import build_local, load_model
from chatmesh.engine_adapter.local import model as local_model
from chatmesh.engine_adapter.local.executor import LocalExecutor
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


def system_prompt(tok: Tokenizer, system_tokens: int) -> str:
    """The shared system prompt (the platform prefix of every conversation)."""
    return "You are a helpful assistant. " + text_of(tok, system_tokens, 0)


def user_message(tok: Tokenizer, message_tokens: int, c: int, turn: int, turns: int) -> str:
    """Conversation c's user message at turn `turn` (0-based) of `turns`: ~message_tokens tokens."""
    topic = TOPICS[(c * turns + turn) % len(TOPICS)]
    ask = f" Now write a detailed paragraph about {topic}."
    return "Notes: " + text_of(tok, message_tokens - len(tok.encode(ask)) - 2, c + turn) + ask


@dataclass
class Result:
    ttft_first: list[float] = field(default_factory=list)  # turn 1
    ttft_later: list[float] = field(default_factory=list)  # turns 2..N
    ttft_by_turn: dict[int, list[float]] = field(default_factory=dict)
    # turns 2..N from the step that starts the turn's prefill (the engine's Started event: it comes at admission,
    # which is the step that runs the prompt's first chunk) to the first token: like a one-at-a-time server's
    # TTFT "from service start", without the wait behind other conversations' prefills
    ttft_service_later: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0
    decode_steps: int = 0  # steps that ran only decode rows, and their seconds
    decode_s: float = 0.0
    decode_rows: int = 0
    mixed_steps: int = 0  # steps with prefill tokens (and any decode rows riding along)
    mixed_s: float = 0.0
    prefill_tokens: int = 0

    def on_step(self, r: StepReport) -> None:
        if r.prefill_tokens:
            self.mixed_steps += 1
            self.mixed_s += r.duration_s
            self.prefill_tokens += r.prefill_tokens
        else:
            self.decode_steps += 1
            self.decode_s += r.duration_s
            self.decode_rows += r.decode_seqs

    def steps_line(self) -> str:
        return (f"steps: {self.decode_steps} decode-only in {self.decode_s:.1f} s ({self.decode_rows} rows, "
                f"{self.decode_rows / max(self.decode_s, 1e-9):.1f} tok/s), {self.mixed_steps} with prefill in "
                f"{self.mixed_s:.1f} s ({self.prefill_tokens} prefill tokens, "
                f"{self.prefill_tokens / max(self.mixed_s, 1e-9):.0f} tok/s incl. riding decodes)")


async def conversation(engine: EngineCore, tok: Tokenizer, args: argparse.Namespace, system: str, c: int,
                       cache: bool, res: Result, turns: int) -> None:
    history = [Message(Role.SYSTEM, system)]
    salt = f"owner-{c}".encode()
    for turn in range(turns):
        history.append(Message(Role.USER, user_message(tok, args.message_tokens, c, turn, args.turns)))
        prompt = render(tok, history)
        params = GenerateParams(
            prompt.token_ids, args.reply_tokens,
            cache_salt=salt if cache else uuid.uuid4().bytes,
            platform_prefix_tokens=prompt.platform_prefix_len if cache else 0)
        t0 = time.perf_counter()
        first: float | None = None
        served: float | None = None
        reply: list[str] = []
        async for event in engine.generate(params):
            match event:
                case Started():
                    served = time.perf_counter() - t0
                    res.cached_tokens += event.cached_tokens
                case Delta():
                    if first is None and event.token_ids:
                        first = time.perf_counter() - t0
                    reply.append(event.text)
                case Finished():
                    res.output_tokens += event.usage.output_tokens
                    res.prompt_tokens += event.usage.prompt_tokens
        assert first is not None and served is not None
        (res.ttft_first if turn == 0 else res.ttft_later).append(first)
        if turn > 0:
            res.ttft_service_later.append(first - served)
        res.ttft_by_turn.setdefault(turn, []).append(first)
        history.append(Message(Role.ASSISTANT, "".join(reply)))


async def run(model: LoadedModel, args: argparse.Namespace, cache: bool, turns: int) -> Result:
    env = {"CHATMESH_LOCAL_THREADS": str(args.threads), "CHATMESH_MAX_BATCH": str(args.concurrency),
           "CHATMESH_STEP_TOKEN_BUDGET": str(args.step_tokens), "CHATMESH_FLUSH_INTERVAL_MS": "5",
           "CHATMESH_LOCAL_KV_DTYPE": args.kv_dtype, "CHATMESH_DEVICE_BLOCKS": str(args.device_blocks),
           "CHATMESH_LOCAL_NATIVE_ATTENTION": str(args.attention == "native")}
    engine = build_local(Config(env=env), model=model)
    executor = engine.executor
    assert isinstance(executor, LocalExecutor)
    print(f"  decode attention: {'native kernel' if executor.net.decode_kernel is not None else 'PyTorch'}",
          flush=True)
    if args.touch_kv:
        for pool in executor.pools.values():
            pool.touch()
        print(f"  KV pools of {engine.blocks.cfg.device_blocks * engine.blocks.block_size} device tokens "
              f"({sum(p.nbytes for p in executor.pools.values()) / 2**20:.0f} MiB) touched: RSS now {rss_now():.0f} "
              f"MiB, peak {peak_rss():.0f} MiB", flush=True)
    res = Result()
    engine.on_step = res.on_step
    await engine.start()
    tok = model.tokenizer
    system = system_prompt(tok, args.system_tokens)
    sem = asyncio.Semaphore(args.concurrency)

    async def one(c: int) -> None:
        async with sem:
            await conversation(engine, tok, args, system, c, cache, res, turns)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(c) for c in range(args.conversations)))
    res.wall_s = time.perf_counter() - t0
    await engine.close()
    return res


def peak_rss() -> float:
    """Peak resident set of this process, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_now() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


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
    ap.add_argument("--step-tokens", type=int, default=-1,
                    help="engine step token budget (prefill chunk); -1: the local backend's default")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="cache,nocache")
    ap.add_argument("--nocache-turns", type=int, default=0, help="turns of the cache-disabled half (0: --turns)")
    ap.add_argument("--weights", default="float32", choices=("float16", "float32"), help="weight storage")
    ap.add_argument("--kv-dtype", default="int8", choices=("int8", "bfloat16", "float16", "float32"))
    ap.add_argument("--device-blocks", type=int, default=-1, help="KV blocks (-1: the backend's 64 k tokens)")
    ap.add_argument("--touch-kv", action="store_true", help="write every page of the KV pools first")
    ap.add_argument("--attention", default="native", choices=("native", "torch"),
                    help="decode attention: the native kernel (the backend's default) or PyTorch")
    ap.add_argument("--decode-chunk", type=int, default=0,
                    help="decoding sequences attended per gather (tuning; 0: the model's default)")
    args = ap.parse_args()
    if args.decode_chunk > 0:
        local_model._DECODE_CHUNK = args.decode_chunk

    t0 = time.perf_counter()
    model = load_model(Config()[MODEL_DIR], args.weights)
    load_s = time.perf_counter() - t0
    print(f"model loaded in {load_s:.1f} s ({args.weights} weights, {model.weights.nbytes / 2**20:.0f} MiB), RSS "
          f"{rss_now():.0f} MiB, peak {peak_rss():.0f} MiB; workload: {args.conversations} conversations x "
          f"{args.turns} turns, {args.concurrency} at once, system {args.system_tokens} + message "
          f"{args.message_tokens} tokens, replies <= {args.reply_tokens}, {args.threads} torch thread(s), step "
          f"budget {args.step_tokens if args.step_tokens > 0 else 'backend default'}, {args.kv_dtype} KV, "
          f"{args.attention} decode attention, decode chunk {local_model._DECODE_CHUNK}", flush=True)
    results = {}
    for mode in args.modes.split(","):
        cache = mode == "cache"
        turns = args.turns if cache or not args.nocache_turns else args.nocache_turns
        results[mode] = r = asyncio.run(run(model, args, cache, turns))
        by_turn = " ".join(f"t{t + 1} {statistics.median(x):.2f}" for t, x in sorted(r.ttft_by_turn.items()))
        every = r.ttft_first + r.ttft_later
        print(f"{mode:8s} ({turns} turns) TTFT turn 1 p50 {statistics.median(r.ttft_first):6.2f} s | turns 2..{turns}"
              f" p50 {statistics.median(r.ttft_later):6.2f} s p95 {pct(r.ttft_later, 0.95):6.2f} s mean "
              f"{statistics.mean(r.ttft_later):6.2f} s | all turns p95 {pct(every, 0.95):6.2f} s | {r.output_tokens} "
              f"output tok in {r.wall_s:6.1f} s = {r.output_tokens / r.wall_s:5.1f} tok/s | prompt {r.prompt_tokens}"
              f" tok, cached {r.cached_tokens} | TTFT p50 by turn: {by_turn} | peak RSS {peak_rss():.0f} MiB",
              flush=True)
        if r.ttft_service_later:
            print(f"         TTFT turns 2..{turns} from the step that starts the turn's prefill (service start): p50 "
                  f"{statistics.median(r.ttft_service_later):.2f} s p95 {pct(r.ttft_service_later, 0.95):.2f} s",
                  flush=True)
        print(f"         {r.steps_line()}", flush=True)
    if "cache" in results and "nocache" in results:
        a, b = results["cache"], results["nocache"]
        common = sorted(set(a.ttft_by_turn) & set(b.ttft_by_turn) - {0})
        if common:
            xa = [x for t in common for x in a.ttft_by_turn[t]]
            xb = [x for t in common for x in b.ttft_by_turn[t]]
            print(f"TTFT turns {common[0] + 1}..{common[-1] + 1} (both halves): mean "
                  f"{statistics.mean(xb) / statistics.mean(xa):.1f}x faster with the prefix cache (p50 "
                  f"{statistics.median(xb) / statistics.median(xa):.1f}x)")
    print(f"peak RSS {peak_rss():.0f} MiB")


if __name__ == "__main__":
    main()
