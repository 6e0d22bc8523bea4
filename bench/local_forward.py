"""Raw speed of the `local` backend's paged SmolLM2 forward on this CPU, no engine around it: prefill tokens/s
(a 512-token chunk from an empty cache and on top of 1,536 cached tokens) and decode tokens/s at batch 1 and 16
with 512 and 2,048 tokens of context, per torch thread count. Comparable to issue 6's figures for a dense
PyTorch forward of this shape (about 640 tokens/s prefill, 25 tokens/s decode at batch 1, 130 at batch 16).

    .venv/bin/python -m bench.local_forward [--threads 1,2] [--kv-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

from chatmesh.engine_adapter.local.backend import KV_DTYPES, load_model
from chatmesh.engine_adapter.local.model import KVPool, PagedLlama, SeqSlice
from chatmesh.mesh.config import Config
from chatmesh.model.settings import MODEL_DIR

BS = 32


def timed(fn: object, reps: int) -> float:
    assert callable(fn)
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=sorted(KV_DTYPES))
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    model = load_model(Config()[MODEL_DIR])
    net = PagedLlama(model.config, model.weights)
    per_seq = 2048 // BS + 1
    pool = KVPool(model.config, 16 * per_seq + 80, BS, KV_DTYPES[args.kv_dtype])
    prompt = list(range(1000, 1000 + 2048))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(16)]
    long_table = list(range(16 * per_seq, 16 * per_seq + 80))
    # fill every sequence's cache with real K/V (the values do not matter for speed)
    for t in tables:
        net.forward([SeqSlice(prompt[:64], 0, t)], pool, [63])
    for threads in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(threads)
        row = [f"threads {threads}:"]
        s = timed(lambda: net.forward([SeqSlice(prompt[:512], 0, long_table)], pool, [511]), args.reps)
        row.append(f"prefill 512 @0 {512 / s:6.0f} tok/s")
        s = timed(lambda: net.forward([SeqSlice(prompt[1536:2048], 1536, long_table)], pool, [511]), args.reps)
        row.append(f"prefill 512 @1536 {512 / s:6.0f} tok/s")
        for ctx in (512, 2048):
            for batch in (1, 16):
                work = [SeqSlice([5], ctx - 1, tables[i]) for i in range(batch)]
                s = timed(lambda: net.forward(work, pool, list(range(batch))), args.reps + 1)
                row.append(f"decode b{batch} ctx{ctx} {batch / s:5.1f} tok/s")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
