"""`chatmesh triton render`: a deployable Triton model repository for one replica.

Writes `<out>/<name>/config.pbtxt` (from triton_models/chatmesh_llm/config.pbtxt.in), `<out>/<name>/1/model.py`
(the shim) and `<out>/<name>/llm_config.json` (TensorRT-LLM LLM API arguments, see trtllm.py; its `tokenizer`
folder, end ids and model identity come from the model profile chat renders with, `Deployment.for_profile`,
so chat and Triton read the same tokenizer files), and validates
config.pbtxt by parsing it into Triton's own `ModelConfig` proto (tritonclient.grpc.model_config_pb2) with
google.protobuf.text_format, so a typo fails here rather than at `tritonserver` start-up.

Host offload sizing (`host_cache_size`, bytes per tensor-parallel rank) comes from the capacity planner
(chatmesh.router.capacity.plan): the host tier should hold this replica's share of the idle history, the
conversations between turns whose prefixes the next turn wants warm (reference, Part 1 "The cache problem"):

    host bytes per rank = idle_history_tokens / (nodes x replicas per node) x KV bytes per token per GPU

capped by `--host-memory-gib` (the pinned memory a node can give the KV tier) divided among its GPUs.
"""

from __future__ import annotations

import json
import shutil
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from chatmesh.engine_adapter.triton.launcher import TritonServer
from chatmesh.engine_adapter.triton.wire import MODEL_NAME
from chatmesh.model.profile import ModelIdentity, ModelProfile

TEMPLATE_DIR = Path(__file__).resolve().parents[3] / "triton_models" / MODEL_NAME
ENGINES = ("auto", "trtllm", "sim", "local")
SALT_POLICIES = ("owner", "none")
GIB = 1 << 30


@dataclass(frozen=True)
class Deployment:
    """One replica's Triton model: the engine, the checkpoint and its KV cache budget."""

    name: str = MODEL_NAME
    engine: str = "auto"  # auto: TensorRT-LLM where it imports, else fallback_engine
    fallback_engine: str = "sim"
    engine_env: Mapping[str, str] = field(default_factory=dict)  # CHATMESH_* settings for a sim/local engine
    cancel_check_ms: int = 50  # each check is one IPC per open request: 256 open at 50 ms = 5,120/s
    model: str = "nvidia/Llama-3.1-70B-Instruct-FP8"
    tensor_parallel_size: int = 8
    free_gpu_memory_fraction: float = 0.9
    host_cache_bytes: int = 0  # per rank; 0: no host tier
    tokens_per_block: int = 32
    kv_dtype: str = "fp8"
    kv_event_buffer: int = 1024
    max_batch_size: int = 256
    max_num_tokens: int = 8192
    max_seq_len: int = 131072
    salt_policy: str = "owner"
    replica_id: str = "triton-0"
    # From the model profile chat renders with (`for_profile`): the ids that end a turn, the folder holding
    # its tokenizer.json (TensorRT-LLM's `tokenizer` argument, so Triton detokenises with the same files) and
    # its identity (what the model reports in its stats, checked against what chat rendered for).
    end_ids: tuple[int, ...] = ()
    tokenizer: str = ""
    served_model: ModelIdentity | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES or self.fallback_engine not in ("sim", "local"):
            raise ValueError(f"engine must be one of {ENGINES} and fallback_engine sim or local")
        if self.salt_policy not in SALT_POLICIES:
            raise ValueError(f"salt_policy must be one of {SALT_POLICIES}")
        if not 0 < self.free_gpu_memory_fraction <= 1:
            raise ValueError("free_gpu_memory_fraction must be in (0, 1]")
        if self.tensor_parallel_size < 1 or self.host_cache_bytes < 0 or self.tokens_per_block < 2:
            raise ValueError("tensor_parallel_size >= 1, host_cache_bytes >= 0, tokens_per_block >= 2")
        for k, v in self.engine_env.items():
            if not k.startswith("CHATMESH_") or any(c in v for c in ';"\\\n'):
                raise ValueError(f"engine_env {k}: names start with CHATMESH_, values hold no ; \" \\ or newline")

    @classmethod
    def for_profile(cls, profile: ModelProfile, **fields: Any) -> Deployment:
        """A deployment whose end ids, tokenizer folder and identity are `profile`'s."""
        return cls(end_ids=tuple(sorted(profile.stop_token_ids)),
                   tokenizer=str(profile.tokenizer_dir) if profile.tokenizer_dir else "",
                   served_model=profile.identity, **fields)

    def llm_config(self) -> dict[str, object]:
        """tensorrt_llm.LLM keyword arguments (kv_cache_config -> KvCacheConfig) plus chatmesh's own section."""
        kv: dict[str, object] = {
            "enable_block_reuse": True,
            "free_gpu_memory_fraction": self.free_gpu_memory_fraction,
            "tokens_per_block": self.tokens_per_block,
            "dtype": self.kv_dtype,
            "event_buffer_max_size": self.kv_event_buffer,
        }
        if self.host_cache_bytes:
            kv["host_cache_size"] = self.host_cache_bytes
        if self.engine == "trtllm" and not (self.end_ids and self.tokenizer and self.served_model):
            raise ValueError("a TensorRT-LLM deployment takes its end ids and tokenizer folder from the model "
                             "profile chat uses (--profile: llama3 or a Hugging Face model folder, not a GGUF)")
        ours: dict[str, object] = {"replica_id": self.replica_id, "salt_policy": self.salt_policy,
                                   "end_ids": list(self.end_ids)}
        if self.served_model is not None:
            ours |= {"model_id": self.served_model.model_id,
                     "tokenizer_digest": self.served_model.tokenizer_digest}
        tokenizer = {"tokenizer": self.tokenizer} if self.tokenizer else {}
        return {
            "model": self.model,
            **tokenizer,
            "backend": "pytorch",
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_batch_size": self.max_batch_size,
            "max_num_tokens": self.max_num_tokens,
            "max_seq_len": self.max_seq_len,
            "enable_chunked_prefill": True,
            "enable_iter_perf_stats": True,
            "kv_cache_config": kv,
            "chatmesh": ours,
        }

    def config_pbtxt(self) -> str:
        template = string.Template((TEMPLATE_DIR / "config.pbtxt.in").read_text())
        return template.substitute(
            name=self.name, engine=self.engine, fallback_engine=self.fallback_engine,
            engine_env=";".join(f"{k}={v}" for k, v in sorted(self.engine_env.items())),
            cancel_check_ms=str(self.cancel_check_ms))


def parse_model_config(text: str) -> object:
    """config.pbtxt parsed into Triton's ModelConfig proto; text_format.ParseError says where it is wrong."""
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def render(deployment: Deployment, repository: Path) -> Path:
    """Writes the model into `repository`; returns the model's folder. Validates config.pbtxt first."""
    text = deployment.config_pbtxt()
    parse_model_config(text)
    folder = repository / deployment.name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(text)
    shutil.copyfile(TEMPLATE_DIR / "1" / "model.py", folder / "1" / "model.py")
    (folder / "llm_config.json").write_text(json.dumps(deployment.llm_config(), indent=2) + "\n")
    return folder


def planned_host_cache_bytes(gpu: str = "h100", tp: int = 8, host_memory_gib: float = 1536.0) -> int:
    """Host tier bytes per rank from the capacity planner's idle history (module doc), capped by host memory."""
    from chatmesh.router import capacity

    hardware = capacity.Hardware(gpu=capacity.GPUS[gpu], tp=tp)
    p = capacity.plan(hardware=hardware)
    replicas = p.nodes * p.replicas_per_node
    wanted = p.idle_history_tokens / replicas * p.kv_bytes_per_token_gpu
    cap = host_memory_gib * GIB / hardware.gpus_per_node
    return int(min(wanted, cap))


def local_server(deployment: Deployment, repository: Path, **kwargs: Any) -> TritonServer:
    """Renders `deployment` into `repository` and returns a (not yet started) local tritonserver serving it."""
    render(deployment, repository)
    return TritonServer(repository, models=[deployment.name], **kwargs)
