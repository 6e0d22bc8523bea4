"""Settings of the `local` backend (SmolLM2 on the CPU). Block counts, batch and budget are the engine's."""

from __future__ import annotations

import os

from chatmesh.mesh.config import Setting, parse_bool

THREADS = Setting("CHATMESH_LOCAL_THREADS", 0,
                  "torch threads for the local model; 0: half the cores, at most 4 (OpenMP stalls badly when "
                  "its threads compete for busy cores)", int)
KV_DTYPE = Setting("CHATMESH_LOCAL_KV_DTYPE", "int8",
                   "element type of the local backend's KV blocks: int8 (a scale per token and head, ~0.4% "
                   "rounding) holds a 64 k-token budget in 0.75 GiB; bfloat16 and float16 take twice that; "
                   "float32 is exact", str, choices=("int8", "float16", "bfloat16", "float32"))
WEIGHTS = Setting("CHATMESH_LOCAL_WEIGHTS", "float32",
                  "storage of the local model's weight matrices: float32 (the dequantised GGUF values exactly) or "
                  "float16 (fbgemm-packed, fp32 arithmetic, 256 MiB less, 1.6-3.9x faster decode; ~2e-4 rounding "
                  "of each weight can flip near-tied greedy choices)", str,
                  choices=("float16", "float32"))
NATIVE_ATTENTION = Setting("CHATMESH_LOCAL_NATIVE_ATTENTION", True,
                           "decode attention in a native kernel that reads the KV blocks in place, compiled once "
                           "per machine with the system C++ compiler (native_attention.py); false, or when it "
                           "cannot be built: the PyTorch path (same results, slower)", parse_bool)
KERNEL_DIR = Setting("CHATMESH_LOCAL_KERNEL_DIR", "~/.cache/chatmesh/kernels",
                     "folder for the local backend's compiled native kernels (keyed by source, compiler, torch "
                     "version and CPU)", os.path.expanduser)
