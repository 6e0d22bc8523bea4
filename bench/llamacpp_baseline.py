"""The baseline issue 6 asks chatmesh's `local` engine to beat: llama-cpp-python on the same GGUF
(SmolLM2-135M-Instruct Q4_1) and the same multi-turn workload, served one request at a time with its RAM prompt
cache (LlamaRAMCache) enabled, greedy decoding.

The workload is bench/local_multiturn.py's at the issue's full size: 16 conversations of 8 turns, each prompt the
shared 1,500-token system prompt + the history + a 150-token user message, replies capped at 64 tokens. The
prompts are built here with chatmesh's own tokenizer and ChatML renderer (chatmesh.model.template) and handed to
llama.cpp as token ids, so both engines see the same tokens; the texts come from bench/local_multiturn.py's
`system_prompt` and `user_message` (imported, not copied). Each assistant reply is llama.cpp's own greedy reply,
appended to the history as text, exactly as the chatmesh bench appends its engine's reply.

Modes (each in a fresh worker process, so the cache starts empty and peak RSS is per mode):
  rr       RAM cache on; round-robin over the conversations (turn 1 of all, then turn 2 of all, ...): how 16
           concurrently active conversations arrive at a server that takes one request at a time.
  conv     RAM cache on; all turns of conversation 1, then conversation 2, ...: the order that suits its cache.
  nocache  no RAM cache, and the context is reset before each request (no prefix reused at all, like chatmesh's
           "cache disabled"); round-robin order.
  raw      llama.cpp's raw prefill and decode speed: a 512-token prompt on an empty context (and on top of 1,536
           tokens), then 64 greedy decoded tokens.
TTFT is reported from the moment a request starts being served (cache lookup + state restore + prefill + first
sample) and, with arrivals modelled as closed-loop conversations all active at once (turn 1 of every conversation
arrives at the start, turn k+1 the moment turn k's reply is complete; a one-at-a-time server), from its arrival,
which includes the wait behind other conversations' requests. bench/local_multiturn.py measures chatmesh's TTFT
from arrival (the generate() call with 16 conversations in flight).

llama-cpp-python lives in a virtualenv of its own, outside the repository (never a dependency of chatmesh). This
script runs under the project's interpreter (it needs chatmesh's tokenizer) and starts a worker under the
interpreter given by --llama-python (or $CHATMESH_LLAMA_PYTHON). To make one (CPU build from the PyPI source
distribution, about 15-20 minutes on 2 cores):

    python3.11 -m venv ~/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \\
      -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
      nice -n 19 ~/llama-venv/bin/pip install llama-cpp-python==0.3.36

Then (each mode its own run, under the shared lock):

    flock /tmp/chatmesh-heavy.lock .venv/bin/python -m bench.llamacpp_baseline \\
      --llama-python ~/llama-venv/bin/python --modes rr --threads 2
    ... --modes conv --threads 1,2 ; --modes nocache --conversations 2 ; --modes raw
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

DEFAULT_CACHE_BYTES = 2 << 30  # LlamaRAMCache's own default capacity
INSTALL_HINT = ("python3.11 -m venv ~/llama-venv && CMAKE_ARGS=\"-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF "
                "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF\" "
                "CMAKE_BUILD_PARALLEL_LEVEL=2 nice -n 19 ~/llama-venv/bin/pip install llama-cpp-python==0.3.36; "
                "then pass --llama-python ~/llama-venv/bin/python")
MISSING_EXIT = 3


# ---------------------------------------------------------------------------------------------------------------
# Worker: runs under the llama-cpp-python interpreter; imports nothing from chatmesh.


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Worker:
    def __init__(self, lc: Any, req: dict[str, Any]) -> None:
        self.lc = lc
        threads = int(req["n_threads"])
        t0 = time.perf_counter()
        self.llm: Any = lc.Llama(model_path=req["model"], n_ctx=int(req["n_ctx"]), n_batch=int(req["n_batch"]),
                                 n_threads=threads, n_threads_batch=threads, flash_attn=bool(req["flash_attn"]),
                                 verbose=False)
        self.load_s = time.perf_counter() - t0
        cache_bytes = int(req["cache_bytes"])
        if cache_bytes > 0:
            self.llm.set_cache(lc.LlamaRAMCache(capacity_bytes=cache_bytes))
        self.cache = self.llm.cache

    def _perf(self) -> tuple[int, float, int, float]:
        p = self.lc.llama_perf_context(self.llm.ctx)
        return int(p.n_p_eval), float(p.t_p_eval_ms), int(p.n_eval), float(p.t_eval_ms)

    def complete(self, req: dict[str, Any]) -> dict[str, Any]:
        tokens = [int(t) for t in req["tokens"]]
        if req["reset"]:
            self.llm.reset()
        self.lc.llama_perf_context_reset(self.llm.ctx)
        first: list[float] = []

        def on_token(_ids: Any, _logits: Any) -> bool:  # called right after each token is sampled
            if not first:
                first.append(time.perf_counter())
            return False

        t_start = time.perf_counter()
        out = self.llm.create_completion(tokens, max_tokens=int(req["max_tokens"]), temperature=0.0, top_p=1.0,
                                         top_k=0, min_p=0.0, repeat_penalty=1.0, stream=False,
                                         stopping_criteria=self.lc.StoppingCriteriaList([on_token]))
        t_end = time.perf_counter()
        n_p, t_p, n_e, t_e = self._perf()
        cache = self.cache
        return {"text": out["choices"][0]["text"], "finish": out["choices"][0]["finish_reason"],
                "prompt_tokens": out["usage"]["prompt_tokens"], "output_tokens": out["usage"]["completion_tokens"],
                "t_start": t_start, "t_first": first[0] if first else t_end, "t_end": t_end,
                "n_p_eval": n_p, "t_p_eval_ms": t_p, "n_eval": n_e, "t_eval_ms": t_e,
                "cache_entries": len(cache.cache_state) if cache is not None else 0,
                "cache_bytes": int(cache.cache_size) if cache is not None else 0, "rss_mib": _peak_rss_mib()}

    def raw(self, req: dict[str, Any]) -> dict[str, Any]:
        """Prefill `prompt` on top of `context` tokens, then decode `n_decode` greedy tokens; llama.cpp's own
        timers (pure eval time) and the wall clock around each phase."""
        llm = self.llm
        context, prompt, n_decode = list(req["context"]), list(req["prompt"]), int(req["n_decode"])
        llm.reset()
        if context:
            llm.eval(context)
        self.lc.llama_perf_context_reset(llm.ctx)
        greedy = {"temp": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        token = llm.sample(**greedy)  # llama.cpp books its timers when the logits are read
        n_p, t_p, _, _ = self._perf()
        t_decode = time.perf_counter()
        for _ in range(n_decode):
            llm.eval([token])
            token = llm.sample(**greedy)
        t2 = time.perf_counter()
        _, _, n_e, t_e = self._perf()
        return {"prefill_wall_s": t1 - t0, "decode_wall_s": t2 - t_decode, "n_p_eval": n_p, "t_p_eval_ms": t_p,
                "n_eval": n_e, "t_eval_ms": t_e}


def worker_main() -> None:
    """JSON lines on stdin, answers on the original stdout; llama.cpp's own prints go to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        lc = importlib.import_module("llama_cpp")
    except ImportError as exc:
        print(f"llama_cpp is not importable by {sys.executable} ({exc}). Install it in a virtualenv of its own: "
              f"{INSTALL_HINT}", file=sys.stderr)
        sys.exit(MISSING_EXIT)
    worker: _Worker | None = None
    for line in sys.stdin:
        req: dict[str, Any] = json.loads(line)
        op = req["op"]
        if op == "load":
            worker = _Worker(lc, req)
            reply: dict[str, Any] = {"version": lc.__version__, "load_s": worker.load_s, "rss_mib": _peak_rss_mib(),
                                     "system_info": lc.llama_print_system_info().decode(errors="replace")}
        elif op == "complete":
            assert worker is not None
            reply = worker.complete(req)
        elif op == "raw":
            assert worker is not None
            reply = worker.raw(req)
        elif op == "exit":
            out.write(json.dumps({"peak_rss_mib": _peak_rss_mib()}) + "\n")
            return
        else:
            raise ValueError(f"unknown op {op!r}")
        out.write(json.dumps(reply) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Driver: runs under the project's interpreter.


class LlamaProcess:
    """One worker process under the llama-cpp-python interpreter."""

    def __init__(self, python: str, load: dict[str, Any]) -> None:
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.info = self.call({"op": "load", **load})

    def call(self, req: dict[str, Any]) -> dict[str, Any]:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(req) + "\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            rc = self.proc.wait()
            if rc == MISSING_EXIT:
                raise SystemExit(f"the worker interpreter has no llama_cpp. Make one: {INSTALL_HINT}")
            raise SystemExit(f"llama.cpp worker died (exit status {rc})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> float:
        peak = float(self.call({"op": "exit"})["peak_rss_mib"])
        self.proc.wait()
        return peak


@dataclass(frozen=True)
class Served:
    conversation: int
    turn: int  # 0-based
    prompt_tokens: int
    output_tokens: int
    t_start: float
    t_first: float
    t_end: float
    n_p_eval: int
    t_p_eval_ms: float
    n_eval: int
    t_eval_ms: float


@dataclass
class ModeResult:
    served: list[Served] = field(default_factory=list)
    peak_rss_mib: float = 0.0
    loaded_rss_mib: float = 0.0
    cache_entries: int = 0
    cache_bytes: int = 0


def serve_order(mode: str, conversations: int, turns: int) -> list[tuple[int, int]]:
    """(conversation, turn) in the order a one-at-a-time server takes them."""
    if mode == "conv":
        return [(c, t) for c in range(conversations) for t in range(turns)]
    return [(c, t) for t in range(turns) for c in range(conversations)]


def arrival_ttfts(served: list[Served]) -> dict[tuple[int, int], float]:
    """TTFT from arrival: conversations are all active from the start and each sends its next turn the moment its
    previous reply is complete (closed loop, no think time)."""
    t0 = min(s.t_start for s in served)
    done = {(s.conversation, s.turn): s.t_end for s in served}
    return {(s.conversation, s.turn): s.t_first - (t0 if s.turn == 0 else done[(s.conversation, s.turn - 1)])
            for s in served}


def run_mode(mode: str, threads: int, args: argparse.Namespace, model_path: str) -> ModeResult:
    from bench.local_multiturn import system_prompt, user_message
    from chatmesh.model.template import Message, Role, render
    from chatmesh.model.tokenizer import load as load_tokenizer

    tok = load_tokenizer(os.path.dirname(model_path))
    system = system_prompt(tok, args.system_tokens)
    cache_bytes = args.cache_bytes if mode in ("rr", "conv") else 0
    llama = LlamaProcess(args.llama_python, {"model": model_path, "n_ctx": args.n_ctx, "n_batch": args.n_batch,
                                             "n_threads": threads, "flash_attn": args.flash_attn,
                                             "cache_bytes": cache_bytes})
    res = ModeResult(loaded_rss_mib=float(llama.info["rss_mib"]))
    histories = {c: [Message(Role.SYSTEM, system)] for c in range(args.conversations)}
    for c, turn in serve_order(mode, args.conversations, args.turns):
        history = histories[c]
        history.append(Message(Role.USER, user_message(tok, args.message_tokens, c, turn, args.turns)))
        prompt = render(tok, history).token_ids
        if len(prompt) + args.reply_tokens > args.n_ctx:
            raise SystemExit(f"prompt of {len(prompt)} tokens + {args.reply_tokens} does not fit n_ctx {args.n_ctx}")
        a = llama.call({"op": "complete", "tokens": list(prompt), "max_tokens": args.reply_tokens,
                        "reset": mode == "nocache"})
        history.append(Message(Role.ASSISTANT, str(a["text"])))
        res.served.append(Served(c, turn, int(a["prompt_tokens"]), int(a["output_tokens"]), float(a["t_start"]),
                                 float(a["t_first"]), float(a["t_end"]), int(a["n_p_eval"]),
                                 float(a["t_p_eval_ms"]), int(a["n_eval"]), float(a["t_eval_ms"])))
        res.cache_entries, res.cache_bytes = int(a["cache_entries"]), int(a["cache_bytes"])
        if args.verbose:
            print(f"  c{c:02d} t{turn + 1} prompt {a['prompt_tokens']} (prefilled {a['n_p_eval']}) out "
                  f"{a['output_tokens']} ttft {a['t_first'] - a['t_start']:.2f} s total {a['t_end'] - a['t_start']:.2f}"
                  f" s cache {a['cache_entries']} entries {a['cache_bytes'] / 2**20:.0f} MiB rss {a['rss_mib']:.0f}"
                  f" MiB", flush=True)
    res.peak_rss_mib = llama.close()
    return res


def pct(xs: list[float], q: float) -> float:
    from bench.local_multiturn import pct as mt_pct  # the chatmesh bench's percentile, for like-for-like numbers
    return mt_pct(xs, q)


def report(mode: str, threads: int, res: ModeResult, args: argparse.Namespace) -> dict[str, Any]:
    s = res.served
    out_tokens = sum(x.output_tokens for x in s)
    busy = sum(x.t_end - x.t_start for x in s)
    wall = max(x.t_end for x in s) - min(x.t_start for x in s)
    later = [x for x in s if x.turn > 0]
    first = [x for x in s if x.turn == 0]
    ttft_later = [x.t_first - x.t_start for x in later]
    arrival = arrival_ttfts(s)
    arr_later = [arrival[(x.conversation, x.turn)] for x in later]
    arr_first = [arrival[(x.conversation, x.turn)] for x in first]
    n_p = sum(x.n_p_eval for x in s)
    t_p = sum(x.t_p_eval_ms for x in s) / 1000
    n_e = sum(x.n_eval for x in s)
    t_e = sum(x.t_eval_ms for x in s) / 1000
    prompt = sum(x.prompt_tokens for x in s)
    row: dict[str, Any] = {
        "mode": mode, "threads": threads, "requests": len(s), "conversations": len({x.conversation for x in s}),
        "turns": args.turns, "output_tokens": out_tokens, "capped_replies": sum(x.output_tokens >= args.reply_tokens
                                                                                 for x in s),
        "busy_s": busy, "wall_s": wall, "tok_s_busy": out_tokens / busy, "tok_s_wall": out_tokens / wall,
        "ttft_first_p50": statistics.median([x.t_first - x.t_start for x in first]),
        "ttft_later_p50": statistics.median(ttft_later), "ttft_later_p95": pct(ttft_later, 0.95),
        "ttft_later_mean": statistics.mean(ttft_later),
        "arrival_ttft_first_p50": statistics.median(arr_first), "arrival_ttft_later_p50": statistics.median(arr_later),
        "arrival_ttft_later_p95": pct(arr_later, 0.95),
        "prompt_tokens": prompt, "prefilled_tokens": n_p, "reused_tokens": prompt - n_p,
        "prefill_tok_s": n_p / t_p if t_p else float("nan"), "decode_tok_s": n_e / t_e if t_e else float("nan"),
        "peak_rss_mib": res.peak_rss_mib, "loaded_rss_mib": res.loaded_rss_mib,
        "cache_entries_end": res.cache_entries, "cache_mib_end": res.cache_bytes / 2**20,
        "cache_capacity_mib": (args.cache_bytes / 2**20) if mode in ("rr", "conv") else 0,
    }
    print(f"{mode:7s} threads {threads} | {len(s)} requests ({row['conversations']} conv x {args.turns} turns), "
          f"{out_tokens} output tok ({row['capped_replies']} replies at the cap) | {row['tok_s_busy']:5.1f} tok/s "
          f"served ({busy:.1f} s busy; {row['tok_s_wall']:.1f} over {wall:.1f} s wall) | TTFT from service start: "
          f"turn 1 p50 {row['ttft_first_p50']:.2f} s, turns 2..{args.turns} p50 {row['ttft_later_p50']:.2f} p95 "
          f"{row['ttft_later_p95']:.2f} mean {row['ttft_later_mean']:.2f} s | from arrival: turn 1 p50 "
          f"{row['arrival_ttft_first_p50']:.2f} s, turns 2..{args.turns} p50 {row['arrival_ttft_later_p50']:.2f} p95 "
          f"{row['arrival_ttft_later_p95']:.2f} s | prompt {prompt} tok, prefilled {n_p} ({row['prefill_tok_s']:.0f} "
          f"tok/s), reused {prompt - n_p}; decode {row['decode_tok_s']:.0f} tok/s | peak RSS "
          f"{res.peak_rss_mib:.0f} MiB (loaded {res.loaded_rss_mib:.0f}); cache at end {res.cache_entries} entries "
          f"{row['cache_mib_end']:.0f} MiB of {row['cache_capacity_mib']:.0f}", flush=True)
    return row


def run_raw(threads: int, args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    from bench.local_multiturn import text_of
    from chatmesh.model.tokenizer import load as load_tokenizer

    tok = load_tokenizer(os.path.dirname(model_path))
    ids = tok.encode(text_of(tok, 2200, 0) + " " + text_of(tok, 200, 5))
    assert len(ids) >= 2048, len(ids)
    llama = LlamaProcess(args.llama_python, {"model": model_path, "n_ctx": args.n_ctx, "n_batch": args.n_batch,
                                             "n_threads": threads, "flash_attn": args.flash_attn, "cache_bytes": 0})
    row: dict[str, Any] = {"mode": "raw", "threads": threads}
    for ctx in (0, 1536):
        runs = [llama.call({"op": "raw", "context": ids[:ctx], "prompt": ids[ctx:ctx + 512], "n_decode": 64})
                for _ in range(args.raw_reps + 1)][1:]  # the first is a warm-up
        row[f"prefill_tok_s@{ctx}"] = statistics.mean(r["n_p_eval"] / r["t_p_eval_ms"] * 1000 for r in runs)
        row[f"decode_tok_s@{ctx}"] = statistics.mean(r["n_eval"] / r["t_eval_ms"] * 1000 for r in runs)
        row[f"prefill_wall_tok_s@{ctx}"] = statistics.mean(512 / r["prefill_wall_s"] for r in runs)
        row[f"decode_wall_tok_s@{ctx}"] = statistics.mean(64 / r["decode_wall_s"] for r in runs)
    row["peak_rss_mib"] = llama.close()
    print(f"raw     threads {threads} | 512-token prompt on an empty context: prefill {row['prefill_tok_s@0']:.0f} "
          f"tok/s, then 64 greedy tokens {row['decode_tok_s@0']:.1f} tok/s | on top of 1,536 tokens: prefill "
          f"{row['prefill_tok_s@1536']:.0f} tok/s, decode {row['decode_tok_s@1536']:.1f} tok/s (llama.cpp's timers;"
          f" wall incl. Python sampling: {row['prefill_wall_tok_s@0']:.0f}/{row['decode_wall_tok_s@0']:.1f} and "
          f"{row['prefill_wall_tok_s@1536']:.0f}/{row['decode_wall_tok_s@1536']:.1f}) | peak RSS "
          f"{row['peak_rss_mib']:.0f} MiB", flush=True)
    return row


def main() -> None:
    if "--worker" in sys.argv[1:]:
        worker_main()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", default=os.environ.get("CHATMESH_LLAMA_PYTHON", sys.executable),
                    help="an interpreter with llama_cpp installed (default $CHATMESH_LLAMA_PYTHON, else this one)")
    ap.add_argument("--modes", default="rr,conv", help="comma-separated: rr, conv, nocache, raw")
    ap.add_argument("--threads", default="1,2", help="llama.cpp n_threads (= n_threads_batch) values to run")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--message-tokens", type=int, default=150)
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES,
                    help="LlamaRAMCache capacity in bytes (its default: 2 GiB)")
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp flash attention (off by default there)")
    ap.add_argument("--raw-reps", type=int, default=2)
    ap.add_argument("--json", help="append one JSON line per mode to this file")
    ap.add_argument("--verbose", action="store_true", help="one line per request")
    args = ap.parse_args()

    from chatmesh.mesh.config import Config
    from chatmesh.model.assets import gguf_path
    from chatmesh.model.settings import MODEL_DIR

    model_path = str(gguf_path(Config()[MODEL_DIR]))
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; model {model_path}; workload {args.conversations} conv x "
          f"{args.turns} turns, system {args.system_tokens} + message {args.message_tokens} tokens, replies <= "
          f"{args.reply_tokens}, greedy; n_ctx {args.n_ctx}, n_batch {args.n_batch}, flash_attn {args.flash_attn}; "
          f"worker {args.llama_python}", flush=True)
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        for mode in args.modes.split(","):
            if mode == "raw":
                row = run_raw(threads, args, model_path)
            elif mode in ("rr", "conv", "nocache"):
                row = report(mode, threads, run_mode(mode, threads, args, model_path), args)
            else:
                raise SystemExit(f"unknown mode {mode!r}")
            row["load_avg_end"] = os.getloadavg()
            rows.append(row)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
