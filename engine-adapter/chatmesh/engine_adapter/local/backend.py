"""The `local` backend's construction: SmolLM2-135M-Instruct on the CPU (PyTorch) under the engine core.

`build_backend(cfg)` loads the GGUF CHATMESH_MODEL names (weights and profile, once per process; weight matrices in fp32 by
default, see CHATMESH_LOCAL_WEIGHTS), sizes the KV tiers and returns an EngineCore over a LocalExecutor that runs
each step in a worker thread. KV defaults: 2,048 device blocks of 32 tokens (a 64 k-token budget) in int8, and
no host tier: on a CPU both tiers are the same RAM, so a spill tier would only copy blocks within it; all of the
budget goes to the tier attention reads (CHATMESH_HOST_BLOCKS > 0 still adds one). Decode attention runs in a
native kernel compiled on the first start (CHATMESH_LOCAL_NATIVE_ATTENTION, native_attention.py). Steps take at
most 256 tokens unless CHATMESH_STEP_TOKEN_BUDGET says otherwise: on two cores a 512-token step of prefill runs
~2 s, and every turn whose prefill shares it (and every stream decoding beside it) waits that long; at 256 the
benchmark's later-turn TTFT p95 fell from 3.6 to 2.0-2.3 s at the same output rate; cold prompts prefill ~25%
slower in smaller steps (BENCHMARKS.md). The model file is a setup step
(`chatmesh model fetch`); without it this raises ModelMissing naming that command.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from chatmesh.engine_adapter import settings as engine_settings
from chatmesh.engine_adapter.block_manager import BlockConfig
from chatmesh.engine_adapter.engine import Clock, EngineCore
from chatmesh.engine_adapter.local import settings as local_settings
from chatmesh.engine_adapter.local.executor import LocalExecutor
from chatmesh.engine_adapter.local.model import KV_DTYPES, LoadedModel, load_gguf
from chatmesh.engine_adapter.scheduler import SchedulerConfig
from chatmesh.mesh.config import Config
from chatmesh.model import profile
from chatmesh.model.settings import MODEL, MODEL_DIR

DEFAULT_KV_TOKENS = 65_536
DEFAULT_STEP_TOKENS = 256  # see the header


@functools.lru_cache(maxsize=2)
def _load(path: str, weights: str) -> LoadedModel:
    return load_gguf(path, weights)


def load_model(model_dir: str | Path, weights: str = "float32", model: str = "smollm2") -> LoadedModel:
    """The GGUF CHATMESH_MODEL names (`model`, resolved under `model_dir`) with its matrices stored as
    `weights`, loaded once per process (raises ModelMissing when not fetched, ProfileError when it names a
    tokenizer folder: this engine runs a GGUF file's weights)."""
    path = profile.resolve(model, model_dir)
    if path.is_dir():
        raise profile.ProfileError(f"CHATMESH_MODEL={model} is a tokenizer folder; the local engine runs a GGUF "
                                   "file's weights (smollm2, or a path to a .gguf)")
    return _load(str(path.resolve()), weights)


def default_threads() -> int:
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def build_local(cfg: Config, *, model: LoadedModel | None = None, clock: Clock | None = None) -> EngineCore:
    model = model or load_model(cfg[MODEL_DIR], cfg[local_settings.WEIGHTS], cfg[MODEL])
    threads = cfg[local_settings.THREADS]
    torch.set_num_threads(threads if threads > 0 else default_threads())
    bs = cfg[engine_settings.BLOCK_SIZE]
    device = cfg[engine_settings.DEVICE_BLOCKS]
    host = cfg[engine_settings.HOST_BLOCKS]
    blocks = BlockConfig(bs, device if device >= 0 else DEFAULT_KV_TOKENS // bs,
                         host if host >= 0 else 0)
    executor = LocalExecutor(model, blocks.device_blocks, blocks.host_blocks, bs,
                             KV_DTYPES[cfg[local_settings.KV_DTYPE]], cfg[local_settings.NATIVE_ATTENTION])
    sched = SchedulerConfig(cfg[engine_settings.MAX_BATCH],
                            engine_settings.step_token_budget(cfg, DEFAULT_STEP_TOKENS),
                            cfg[engine_settings.QUEUE_LIMIT])
    return EngineCore(executor, blocks, sched, model.profile, replica_id=cfg[engine_settings.REPLICA_ID],
                      flush_interval_s=cfg[engine_settings.FLUSH_INTERVAL_MS] / 1000, clock=clock, offload=True)

