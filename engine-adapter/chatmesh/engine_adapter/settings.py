"""Settings of one engine replica (GenerateService): which backend, KV blocks, scheduler limits, `sim` timing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chatmesh.mesh.config import Config, Setting, parse_bool

if TYPE_CHECKING:
    from chatmesh.engine_adapter.transfer import PullConfig

ENGINE = Setting("CHATMESH_ENGINE", "local", "engine backend: local (SmolLM2 on the CPU, the embedded default), sim "
                 "(roofline-timed simulator), triton (Triton Inference Server)", str, choices=("sim", "local", "triton"))
REPLICA_ID = Setting("CHATMESH_REPLICA_ID", "engine-0", "this engine replica's id, reported in streams and stats", str)
BLOCK_SIZE = Setting("CHATMESH_BLOCK_SIZE", 32, "tokens per KV block", int)
DEVICE_BLOCKS = Setting("CHATMESH_DEVICE_BLOCKS", -1,
                        "KV blocks in the device tier; -1: the backend's default (sim: the preset's KV room)", int)
HOST_BLOCKS = Setting("CHATMESH_HOST_BLOCKS", -1,
                      "KV blocks in the host (spill) tier; 0 disables it; -1: the backend's default", int)
MAX_BATCH = Setting("CHATMESH_MAX_BATCH", 256, "most sequences running (prefill or decode) at once", int)
STEP_TOKEN_BUDGET = Setting("CHATMESH_STEP_TOKEN_BUDGET", -1,
                            "most tokens per engine step, decode plus prefill chunks (Sarathi-Serve chunk size); -1: "
                            "the backend's default (sim: 512, the reference's chunk; local: 256, a step of about a "
                            "second on two CPU cores)", int)
QUEUE_LIMIT = Setting("CHATMESH_QUEUE_LIMIT", 1024,
                      "most requests waiting for admission; beyond it Generate answers RESOURCE_EXHAUSTED", int)
FLUSH_INTERVAL_MS = Setting("CHATMESH_FLUSH_INTERVAL_MS", 25.0,
                            "a stream sends the tokens produced since its last send at most this often (ms)", float)
SIM_PRESET = Setting("CHATMESH_SIM_PRESET", "h100-fp8",
                     "sim hardware and model: the reference's 70B-class model on 8 GPUs", str,
                     choices=("h100-fp8", "h200-fp8", "h100-bf16", "h200-bf16"))
SIM_SPEED = Setting("CHATMESH_SIM_SPEED", 1.0, "sim speed factor: 2 runs twice as fast as the modelled node", float)
SIM_STEP_MS = Setting("CHATMESH_SIM_STEP_MS", 0.0,
                      "sim fixed step time in ms (tests stream slowly with it); 0: the roofline step time", float)
SIM_REPLY_TOKENS = Setting(
    "CHATMESH_SIM_REPLY_TOKENS", 400,
    "sim's mean reply length in tokens (the reference workload's 400): a reply ends with the model's end-of-turn "
    "token after a length drawn from [half, 1.5 x] by its seed and prompt; 0: replies run to max_tokens", int)
SIM_REPLIES = Setting(
    "CHATMESH_SIM_REPLIES", "",
    "scripted sim replies (for tests): a JSON file, or the JSON itself, listing rules {\"when\": text, \"reply\": "
    "text} or {\"when\": text, \"tool_calls\": [{\"name\": N, \"arguments\": {...}}]}; a prompt whose last message "
    "contains `when` is answered `reply` (special tokens' texts as those tokens) or the calls in the model's own "
    "format, then the end-of-turn token; the first matching rule wins, other prompts get sim's usual text", str)
SIM_TEXT = Setting("CHATMESH_SIM_TEXT", "auto",
                   "sim token ids: tokenizer (the CHATMESH_MODEL profile's, needs its files), words (a built-in "
                   "word vocabulary; chat refuses to use it), auto (tokenizer when the model files are present)", str, choices=("auto", "tokenizer", "words"))

SIM_LINK_GBPS = Setting("CHATMESH_SIM_LINK_GBPS", 400.0,
                        "sim prefix pulls: each NIC's bandwidth in Gb/s (the reference's node: 400 Gb/s per GPU)", float)
SIM_LINK_NICS = Setting("CHATMESH_SIM_LINK_NICS", 8,
                        "sim prefix pulls: NICs a replica's GPUs send its KV over at once (TP 8: 8)", int)
SIM_LINK_LATENCY_MS = Setting("CHATMESH_SIM_LINK_LATENCY_MS", 0.5,
                              "sim prefix pulls: fixed cost of one transfer, ms (set-up and first chunk)", float)
PREFIX_PULLS = Setting("CHATMESH_PREFIX_PULLS", True,
                       "pull a moved turn's cached prefix from the replica the request names, and serve this "
                       "replica's blocks to pulling engines (false: neither; every moved turn prefills)", parse_bool)
PULL_TIMEOUT_MS = Setting("CHATMESH_PREFIX_PULL_TIMEOUT_MS", 5000.0,
                          "deadline of one prefix pull, ms; past it the turn prefills what the pull did not bring",
                          float)
PULL_MAX_SERVING = Setting("CHATMESH_PREFIX_PULL_MAX_SERVING", 8,
                           "most pulls this replica serves at once (each pins its blocks); more are refused and "
                           "those pullers prefill", int)


def pull_config(cfg: Config) -> PullConfig:
    """The prefix-pull settings as the engine core's PullConfig."""
    from chatmesh.engine_adapter.transfer import PullConfig

    return PullConfig(enabled=cfg[PREFIX_PULLS], timeout_s=cfg[PULL_TIMEOUT_MS] / 1000,
                      max_serving=cfg[PULL_MAX_SERVING])


def step_token_budget(cfg: Config, backend_default: int) -> int:
    """CHATMESH_STEP_TOKEN_BUDGET, or `backend_default` when it is -1; anything else below 1 is refused."""
    budget = cfg[STEP_TOKEN_BUDGET]
    if budget == -1:
        return backend_default
    if budget < 1:
        raise ValueError(f"CHATMESH_STEP_TOKEN_BUDGET must be at least 1 (or -1 for the backend's default), "
                         f"got {budget}")
    return budget
CACHE_SALT_SECRET = Setting(
    "CHATMESH_CACHE_SALT_SECRET", "chatmesh-dev-salt",
    "key for deriving per-owner cache salts (set a secret in production)", str)
