"""`chatmesh triton render`: write (and validate) the Triton model repository for one replica."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from chatmesh.engine_adapter.triton import render as r
from chatmesh.mesh.config import Config
from chatmesh.model import profile
from chatmesh.model import settings as model_settings
from chatmesh.model.assets import ModelMissing

GIB = 1 << 30


def register(sub: Any) -> None:
    p = sub.add_parser("triton", help="chatmesh's Triton Inference Server model repository")
    actions = p.add_subparsers(dest="triton_action", required=True, metavar="ACTION")
    d = r.Deployment()
    q = actions.add_parser("render", help="write config.pbtxt, model.py and llm_config.json for one replica",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    q.add_argument("--out", type=Path, required=True, help="model repository folder to write into")
    q.add_argument("--name", default=d.name, help="model name in the repository")
    q.add_argument("--engine", choices=r.ENGINES, default=d.engine,
                   help="engine in the model: auto = TensorRT-LLM where it imports, else --fallback-engine")
    q.add_argument("--fallback-engine", choices=("sim", "local"), default=d.fallback_engine)
    q.add_argument("--cancel-check-ms", type=int, default=d.cancel_check_ms,
                   help="how often the model asks Triton whether each open request was cancelled")
    q.add_argument("--engine-env", action="append", default=[], metavar="CHATMESH_X=V",
                   help="a setting for a sim/local engine (repeatable)")
    q.add_argument("--profile", default=os.environ.get(model_settings.MODEL.env, "llama3"),
                   help="the model profile chat renders prompts with (CHATMESH_MODEL: llama3, a Hugging Face model "
                        "folder, ...; default: $CHATMESH_MODEL, else llama3, the tokenizer of the default "
                        "checkpoint): llm_config.json gets its tokenizer folder, end ids and identity")
    q.add_argument("--model-dir", default=None, help="folder of fetched model files (CHATMESH_MODEL_DIR)")
    g = q.add_argument_group("TensorRT-LLM (LLM API, PyTorch backend)")
    g.add_argument("--model", default=d.model, help="FP8 checkpoint: Hugging Face id or local folder")
    g.add_argument("--tp", type=int, default=d.tensor_parallel_size, help="tensor_parallel_size")
    g.add_argument("--kv-fraction", type=float, default=d.free_gpu_memory_fraction,
                   help="KvCacheConfig.free_gpu_memory_fraction")
    g.add_argument("--host-cache-gib", type=float, default=None,
                   help="KvCacheConfig.host_cache_size per rank, GiB; default: sized by the capacity planner")
    g.add_argument("--gpu", choices=("h100", "h200"), default="h100", help="GPU preset for the planner")
    g.add_argument("--host-memory-gib", type=float, default=1536.0,
                   help="pinned host memory a node can give the KV tier (caps the planned host cache)")
    g.add_argument("--tokens-per-block", type=int, default=d.tokens_per_block)
    g.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    g.add_argument("--max-num-tokens", type=int, default=d.max_num_tokens, help="chunked-prefill token budget")
    g.add_argument("--max-seq-len", type=int, default=d.max_seq_len)
    g.add_argument("--salt-policy", choices=r.SALT_POLICIES, default=d.salt_policy,
                   help="owner: cache_salt per owner (no sharing, system prompt included); none: no salt")
    g.add_argument("--replica-id", default=d.replica_id)
    q.set_defaults(handler=_render)


def _render(args: argparse.Namespace) -> int:
    env = {}
    for item in args.engine_env:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"--engine-env wants CHATMESH_X=VALUE, got {item!r}", file=sys.stderr)
            return 2
        env[name] = value
    host = (int(args.host_cache_gib * GIB) if args.host_cache_gib is not None
            else r.planned_host_cache_bytes(gpu=args.gpu, tp=args.tp, host_memory_gib=args.host_memory_gib))
    try:
        model_dir = args.model_dir or Config()[model_settings.MODEL_DIR]
        chosen = profile.load_spec(args.profile, model_dir)
        deployment = r.Deployment.for_profile(
            chosen, name=args.name, engine=args.engine, fallback_engine=args.fallback_engine, engine_env=env,
            cancel_check_ms=args.cancel_check_ms,
            model=args.model, tensor_parallel_size=args.tp, free_gpu_memory_fraction=args.kv_fraction,
            host_cache_bytes=host, tokens_per_block=args.tokens_per_block, max_batch_size=args.max_batch_size,
            max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len, salt_policy=args.salt_policy,
            replica_id=args.replica_id)
        folder = r.render(deployment, args.out)
    except (ValueError, text_format.ParseError, ModelMissing) as err:
        print(f"chatmesh triton render: {err}", file=sys.stderr)
        return 1
    print(f"wrote {folder}/config.pbtxt (parsed as ModelConfig), {folder}/1/model.py, {folder}/llm_config.json")
    print(f"  model {deployment.model}, TP {deployment.tensor_parallel_size}, KV fraction "
          f"{deployment.free_gpu_memory_fraction}, host cache {host / GIB:.1f} GiB per rank, salt {deployment.salt_policy}")
    print(f"  profile {chosen.identity.describe()}: tokenizer {deployment.tokenizer or '(none: a GGUF profile)'}, "
          f"end ids {list(deployment.end_ids)}")
    return 0
