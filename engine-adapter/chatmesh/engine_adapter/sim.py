"""The `sim` backend (first cut): deterministic tokens from text.PASSAGE at a fixed per-token delay.

No KV cache yet: every prompt is a miss. The engine core (block manager, scheduler, roofline executor) replaces
this behind the same `build_backend`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from chatmesh.engine_adapter import settings
from chatmesh.engine_adapter.backend import (
    Backend,
    Delta,
    EngineStats,
    Finished,
    FinishReason,
    GenerateEvent,
    GenerateParams,
    Started,
    TierStats,
    Usage,
)
from chatmesh.engine_adapter.text import PASSAGE, WordCodec
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import ResourceExhausted
from chatmesh.mesh.ids import ConversationId


class FixedStepSim:
    """Every running generation yields one token per `step_s`; at most `queue_limit` generations at once."""

    name = "sim"

    def __init__(self, replica_id: str, step_s: float, queue_limit: int, block_size: int = 32):
        self.replica_id = replica_id
        self.step_s = step_s
        self.queue_limit = queue_limit
        self.block_size = block_size
        self.codec = WordCodec()
        self._script = self.codec.encode(PASSAGE)
        self._running = 0
        self._generations = 0
        self._miss = 0
        self._open = False

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerateEvent]:
        if self._running >= self.queue_limit:
            raise ResourceExhausted(f"engine queue is full ({self.queue_limit})")
        self._running += 1
        self._generations += 1
        self._miss += len(params.prompt_token_ids)
        try:
            yield Started(cached_tokens=0, host_cached_tokens=0)
            decoder = self.codec.decoder()
            start = (params.sampling.seed * 7919 + len(params.prompt_token_ids)) % len(self._script)
            out = 0
            while out < params.max_tokens:
                await asyncio.sleep(self.step_s)
                token = self._script[(start + out) % len(self._script)]
                out += 1
                if token in params.stop_token_ids or token in self.codec.stop_token_ids:
                    yield Finished(FinishReason.STOP, Usage(len(params.prompt_token_ids), 0, out))
                    return
                yield Delta((token,), decoder.feed([token]))
            yield Finished(FinishReason.LENGTH, Usage(len(params.prompt_token_ids), 0, out))
        finally:
            self._running -= 1

    async def evict_conversation(self, conversation_id: ConversationId) -> int:
        return 0

    async def evict_salt(self, salt: bytes) -> int:
        return 0

    def stats(self) -> EngineStats:
        return EngineStats(self.replica_id, self.name, queue_depth=0, running_sequences=self._running,
                           block_size=self.block_size, device=TierStats(0, 0, 0), host=TierStats(0, 0, 0),
                           miss_tokens=self._miss, generations=self._generations)

    async def start(self) -> None:
        self._open = True

    async def close(self) -> None:
        self._open = False

    def ready(self) -> bool:
        return self._open


def build_backend(cfg: Config) -> Backend:
    step_ms = cfg[settings.SIM_STEP_MS] or 12.7
    return FixedStepSim(cfg[settings.REPLICA_ID], step_ms / 1000 / cfg[settings.SIM_SPEED],
                        cfg[settings.QUEUE_LIMIT], cfg[settings.BLOCK_SIZE])
