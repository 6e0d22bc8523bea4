"""Raw speed of the `local` backend's paged SmolLM2 forward on this CPU, no engine around it, in the shapes of
issue 6's multi-turn workload: prefill tokens/s (a 512-token chunk from an empty cache; a later turn's ~180 new
tokens over 2,300 cached) and decode tokens/s for 16 sequences that share a 1,504-token system prompt (their first
47 blocks) with 2,500 and 3,300 tokens of context, and a batch of one. Per torch thread count, weight storage
and KV element type, with decode attention in the native kernel (built on first use) and/or PyTorch.

    .venv/bin/python -m bench.local_forward [--threads 1,2] [--weights float16] [--kv-dtype int8]
        [--attention native,torch]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from chatmesh.engine_adapter.local import native_attention
from chatmesh.engine_adapter.local.backend import load_model
from chatmesh.engine_adapter.local.executor import keep_freed_memory
from chatmesh.engine_adapter.local.model import KV_DTYPES, WEIGHT_DTYPES, KVPool, PagedLlama, SeqSlice
from chatmesh.mesh.config import Config
from chatmesh.model.settings import MODEL_DIR

BS = 32
SHARED = 47  # blocks of the shared system prompt


def timed(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--weights", default="float32", help=f"comma-separated, of {WEIGHT_DTYPES}")
    ap.add_argument("--kv-dtype", default="int8", choices=sorted(KV_DTYPES))
    ap.add_argument("--attention", default="native", help="comma-separated, of native, torch (decode attention)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    kernel = native_attention.load() if "native" in args.attention.split(",") else None
    keep_freed_memory()  # as the executor does
    for weights in args.weights.split(","):
        model = load_model(Config()[MODEL_DIR], weights)
        nets = {"native": PagedLlama(model.config, model.weights, kernel),
                "torch": PagedLlama(model.config, model.weights)}
        own = 3400 // BS - SHARED + 1
        pool = KVPool(model.config, SHARED + 16 * own + 8, BS, KV_DTYPES[args.kv_dtype])
        pool.touch()
        gen = torch.Generator().manual_seed(0)
        for t in (pool.k, pool.v):  # plausible values everywhere (their exact values do not matter for speed)
            if pool.quantized:
                t.copy_(torch.randint(-127, 128, t.shape, dtype=torch.int8, generator=gen))
            else:
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        for scales in (pool.k_scale, pool.v_scale):
            if scales is not None:
                scales.fill_(0.02)
        shared = list(range(SHARED))
        tables = [shared + list(range(SHARED + i * own, SHARED + (i + 1) * own)) for i in range(16)]
        prompt = list(range(1000, 1512))
        for threads, attention in ((int(x), a) for x in args.threads.split(",") for a in args.attention.split(",")):
            torch.set_num_threads(threads)
            net = nets[attention]
            path = "native" if net.decode_kernel is not None else "torch"
            row = [f"{weights} weights, {args.kv_dtype} KV, {threads} thread(s), {path} decode attention:"]
            s = timed(lambda: net.forward([SeqSlice(prompt, 0, tables[0])], pool, [511]), args.reps)
            row.append(f"prefill 512 @0 {512 / s:5.0f} tok/s")
            s = timed(lambda: net.forward([SeqSlice(prompt[:180], 2300, tables[0])], pool, [179]), args.reps)
            row.append(f"prefill 180 @2300 {180 / s:5.0f} tok/s")
            for ctx in (2500, 3300):
                for batch in (1, 16):
                    work = [SeqSlice([5], ctx - 1, tables[i]) for i in range(batch)]
                    s = timed(lambda: net.forward(work, pool, list(range(batch))), args.reps)
                    row.append(f"decode b{batch} ctx{ctx} {batch / s:5.1f} tok/s")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
