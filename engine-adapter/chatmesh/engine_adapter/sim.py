"""The `sim` backend: the real engine core (block manager, scheduler, streams) over an executor that computes
nothing and times each step with the roofline model (roofline.py) of the configured node.

Tokens: each sampled token is the next token of a deterministic English text (text.PASSAGE, encoded by the
CHATMESH_MODEL profile's tokenizer, so they are real ids of the served model: SmolLM2's, or Llama 3's with
CHATMESH_MODEL=llama3, and prompts and usage count in them), read at an offset chosen by
the seed and the token's position, so streams read as words and the same seed and prompt give the same reply.
`sim` never samples a stop token by itself; replies end at max_tokens (or at a requested stop token id).
"""

from __future__ import annotations

from collections.abc import Sequence

from chatmesh.engine_adapter import settings
from chatmesh.engine_adapter.backend import Backend
from chatmesh.engine_adapter.block_manager import BlockConfig
from chatmesh.engine_adapter.engine import Clock, EngineCore, RealClock
from chatmesh.engine_adapter.executor import BlockCopy, SeqWork, StepResult
from chatmesh.engine_adapter.roofline import PRESETS, NodeModel
from chatmesh.engine_adapter.scheduler import SchedulerConfig
from chatmesh.engine_adapter.text import PASSAGE, TextCodec, WordCodec
from chatmesh.mesh import logs
from chatmesh.mesh.config import Config

log = logs.get("chatmesh.engine.sim")

DEFAULT_STEP_TOKENS = 512  # the reference's prefill chunk (Sarathi-Serve), which its step-time figures assume


class SimExecutor:
    """An Executor that samples from a script and reports roofline step times (or a fixed step time)."""

    name = "sim"

    def __init__(self, node: NodeModel, script: Sequence[int], block_size: int, fixed_step_s: float = 0.0):
        if not script:
            raise ValueError("the sim script must not be empty")
        self.node = node
        self.script = list(script)
        self.block_size = block_size
        self.fixed_step_s = fixed_step_s

    def execute(self, work: Sequence[SeqWork]) -> StepResult:
        kv_read = prefill = 0
        next_tokens: dict[int, int] = {}
        script, n_script = self.script, len(self.script)
        for w in work:
            n = len(w.token_ids)
            end = w.start_pos + n
            kv_read += end
            if n > 1:
                prefill += n
            if w.sample:
                next_tokens[w.seq_id] = script[(w.sampling.seed * 7919 + end) % n_script]
        duration = self.fixed_step_s or self.node.step_s(prefill, kv_read)
        return StepResult(next_tokens, duration)

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> float:
        return 0.0 if self.fixed_step_s else self.node.copy_s(len(copies), self.block_size)

    def release(self, seq_id: int) -> None:
        pass


def codec_for(cfg: Config) -> TextCodec:
    """The CHATMESH_MODEL profile when CHATMESH_SIM_TEXT allows and its files are there, else the word codec."""
    choice = cfg[settings.SIM_TEXT]
    if choice == "words":
        return WordCodec()
    from chatmesh.model import assets, profile

    try:
        return profile.load(cfg)
    except assets.ModelMissing:
        if choice == "tokenizer":
            raise
        log.warning("sim_text_words", reason="model file absent; sim streams use the word codec")
        return WordCodec()


def build_sim(cfg: Config, *, codec: TextCodec | None = None, clock: Clock | None = None) -> EngineCore:
    node = PRESETS[cfg[settings.SIM_PRESET]]
    bs = cfg[settings.BLOCK_SIZE]
    device = cfg[settings.DEVICE_BLOCKS]
    host = cfg[settings.HOST_BLOCKS]
    blocks = BlockConfig(bs, device if device >= 0 else int(node.kv_tokens // bs),
                         host if host >= 0 else int(node.host_kv_tokens // bs))
    sched = SchedulerConfig(cfg[settings.MAX_BATCH], settings.step_token_budget(cfg, DEFAULT_STEP_TOKENS),
                            cfg[settings.QUEUE_LIMIT])
    codec = codec or codec_for(cfg)
    executor = SimExecutor(node, codec.encode(PASSAGE), bs, cfg[settings.SIM_STEP_MS] / 1000)
    return EngineCore(executor, blocks, sched, codec, replica_id=cfg[settings.REPLICA_ID],
                      flush_interval_s=cfg[settings.FLUSH_INTERVAL_MS] / 1000,
                      clock=clock or RealClock(cfg[settings.SIM_SPEED]))


def build_backend(cfg: Config) -> Backend:
    return build_sim(cfg)
