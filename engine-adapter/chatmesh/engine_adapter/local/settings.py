"""Settings of the `local` backend (SmolLM2 on the CPU). Block counts, batch and budget are the engine's."""

from __future__ import annotations

from chatmesh.mesh.config import Setting

THREADS = Setting("CHATMESH_LOCAL_THREADS", 0,
                  "torch threads for the local model; 0: half the cores, at most 4 (OpenMP stalls badly when "
                  "its threads compete for busy cores)", int)
KV_DTYPE = Setting("CHATMESH_LOCAL_KV_DTYPE", "bfloat16",
                   "element type of the local backend's KV blocks: bfloat16 halves their memory and widens to fp32 "
                   "cheaply; float16 is more precise but slow to widen on CPUs without F16C paths; float32 is exact",
                   str, choices=("float16", "bfloat16", "float32"))
