"""The production engine inside chatmesh's Triton model: TensorRT-LLM's LLM API (PyTorch backend).

Since 2026 the TensorRT-engine path (`trtllm-build`) is gone; a replica loads an FP8 checkpoint (ModelOpt, e.g.
nvidia/Llama-3.1-70B-Instruct-FP8) with `tensorrt_llm.LLM(model=..., backend="pytorch", tensor_parallel_size=8)`
and the LLM spawns its own tensor-parallel workers. `llm_config.json` (written by `chatmesh triton render`) holds
the LLM's keyword arguments verbatim, `kv_cache_config` becoming a `KvCacheConfig`:

    enable_block_reuse      paged KV with prefix reuse across requests (the point of conversation affinity)
    free_gpu_memory_fraction  share of free GPU memory, after weights, for KV blocks
    host_cache_size         bytes of pinned host memory for offloaded blocks (sized by `chatmesh capacity`)
    event_buffer_max_size   KV events kept for `get_kv_cache_events_async` (block stored/removed)
    tokens_per_block, dtype (fp8 KV)

and `enable_chunked_prefill`, `max_batch_size`, `max_num_tokens`, `max_seq_len`, `enable_iter_perf_stats` (the
iteration stats this backend reads KV occupancy from). A `chatmesh` section carries our own knobs. The KV event
stream (`get_kv_cache_events_async`) gives evictions and, mapped to conversations by kv_events.py, the residency
the router places turns by.

The salt: `generate_async(..., cache_salt=...)` salts the KV block hashes from the FIRST block, so two owners never
share a block, the system prompt included; chatmesh's own block manager salts only after the platform prefix.
`salt_policy` chooses: `owner` (default: per-owner salt, I1 holds, the system prompt is prefilled once per owner)
or `none` (everything shared across owners; only for single-tenant deployments). docs/triton.md quantifies the cost.

This module runs only where tensorrt_llm imports (a GPU node); `tensorrt_llm` names are looked up at run time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from chatmesh.engine_adapter.backend import (
    Delta,
    EngineStats,
    Finished,
    FinishReason,
    GenerateEvent,
    GenerateParams,
    Residency,
    ServeRequest,
    Started,
    TierStats,
    TransferEvent,
    Usage,
    cannot_transfer,
)
from chatmesh.engine_adapter.triton.kv_events import KvEventMap
from chatmesh.mesh import logs
from chatmesh.mesh.ids import ConversationId, TurnId
from chatmesh.model.profile import ModelIdentity

log = logs.get("chatmesh.triton.trtllm")

_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "cancelled": FinishReason.CANCELLED,
            "timeout": FinishReason.ERROR}
STATS_POLL_S = 1.0


class TrtLlmBackend:
    """A `Backend` over `tensorrt_llm.LLM.generate_async` with streaming."""

    name = "trtllm"

    def __init__(self, llm_args: Mapping[str, Any], *, replica_id: str = "triton", salt_policy: str = "owner",
                 end_ids: frozenset[int] = frozenset(), model: ModelIdentity | None = None):
        if salt_policy not in ("owner", "none"):
            raise ValueError(f"salt_policy must be owner or none, got {salt_policy!r}")
        self.llm_args = dict(llm_args)
        self.replica_id = replica_id
        self.salt_policy = salt_policy
        self.end_ids = end_ids  # the profile's end-of-turn ids (Llama 3.1: <|eot_id|>, <|eom_id|>, <|end_of_text|>)
        # the profile's identity, as `chatmesh triton render` wrote it beside the tokenizer folder it names
        self.model = model or ModelIdentity(str(self.llm_args.get("model", "")), "")
        self.block_size = int(self.llm_args.get("kv_cache_config", {}).get("tokens_per_block", 32))
        self._llm: Any = None
        self._iteration: dict[str, Any] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._device_evictions = 0
        self._generations = 0
        self._hit_tokens = 0
        self._miss_tokens = 0
        self.kv_map = KvEventMap(self.block_size)  # residency from the KV event stream (kv_events.py)

    @classmethod
    def from_file(cls, path: str) -> TrtLlmBackend:
        with open(path) as f:
            raw = json.load(f)
        ours = raw.pop("chatmesh", {})
        model = ModelIdentity(str(ours["model_id"]), str(ours["tokenizer_digest"])) if "model_id" in ours else None
        return cls(raw, replica_id=ours.get("replica_id", "triton"), salt_policy=ours.get("salt_policy", "owner"),
                   end_ids=frozenset(int(t) for t in ours.get("end_ids", ())), model=model)

    async def start(self) -> None:
        if not self.end_ids or "tokenizer" not in self.llm_args:
            raise ValueError("llm_config.json has no end ids or tokenizer folder: render it with "
                             "`chatmesh triton render --profile <the model chat uses>`")
        from tensorrt_llm import LLM  # type: ignore[import-not-found]
        from tensorrt_llm.llmapi import KvCacheConfig  # type: ignore[import-not-found]

        args = dict(self.llm_args)
        args["kv_cache_config"] = KvCacheConfig(**args.get("kv_cache_config", {}))
        loop = asyncio.get_running_loop()
        self._llm = await loop.run_in_executor(None, lambda: LLM(**args))
        self._tasks = [asyncio.create_task(self._poll_stats()), asyncio.create_task(self._drain_kv_events())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._llm is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._llm.shutdown)
            self._llm = None

    def ready(self) -> bool:
        return self._llm is not None

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerateEvent]:
        from tensorrt_llm import SamplingParams

        s = params.sampling
        sampling = SamplingParams(
            max_tokens=params.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
            stop_token_ids=sorted(params.stop_token_ids) or None, return_perf_metrics=True)
        salt = params.cache_salt.hex() if self.salt_policy == "owner" and params.cache_salt else None
        self._generations += 1
        output = self._llm.generate_async(list(params.prompt_token_ids), sampling_params=sampling, streaming=True,
                                          cache_salt=salt)
        key = object()  # this generation, in the KV event map's index
        if params.conversation_id is not None:
            self.kv_map.started(key, params.conversation_id, params.prompt_token_ids, params.platform_prefix_tokens)
        finished = False
        started = False
        sent = 0
        cached = 0
        try:
            async for result in output:
                completion = result.outputs[0]
                if not started:
                    cached = self._cached_tokens(completion, len(params.prompt_token_ids))
                    self._hit_tokens += cached
                    self._miss_tokens += len(params.prompt_token_ids) - cached
                    started = True
                    yield Started(cached_tokens=cached, host_cached_tokens=0)
                new = tuple(completion.token_ids[sent:])
                sent = len(completion.token_ids)
                self.kv_map.extended(key, new)
                if result.finished:
                    finished = True
                    reason = _REASONS.get(str(completion.finish_reason), FinishReason.ERROR)
                    sampled = sent
                    if reason is FinishReason.STOP:
                        # The Backend contract: a stop token is counted, never streamed. Whether the LLM API put
                        # it in token_ids depends on the stop kind, so look at the last token itself.
                        if new and new[-1] in params.stop_token_ids | self.end_ids:
                            new = new[:-1]
                        else:
                            sampled += 1
                    if new:
                        yield Delta(new, completion.text_diff)
                    yield Finished(reason, Usage(len(params.prompt_token_ids), cached, sampled))
                    return
                if new:
                    yield Delta(new, completion.text_diff)
        finally:
            if not finished:
                output.abort()  # cancelled or failed: the sequence stops and its blocks return to the pool

    def _cached_tokens(self, completion: Any, prompt_tokens: int) -> int:
        metrics = getattr(completion, "request_perf_metrics", None)
        kv = getattr(metrics, "kv_cache_metrics", None)
        reused = int(getattr(kv, "num_reused_blocks", 0) or 0)
        return min(reused * self.block_size, prompt_tokens)

    async def _poll_stats(self) -> None:
        while True:
            async for iteration in self._llm.get_stats_async(timeout=STATS_POLL_S):
                self._iteration = json.loads(iteration) if isinstance(iteration, str) else dict(iteration)
            await asyncio.sleep(STATS_POLL_S)

    async def _drain_kv_events(self) -> None:
        """KV events (KvCacheConfig.event_buffer_max_size): blocks `removed` from the device pool are evictions;
        stored and removed blocks also give the residency the router places turns by (kv_events.py)."""
        while True:
            async for event in self._llm.get_kv_cache_events_async(timeout=STATS_POLL_S):
                event = json.loads(event) if isinstance(event, str) else event
                data = event.get("data", event) if isinstance(event, dict) else {}
                if data.get("type") == "removed":
                    self._device_evictions += len(data.get("block_hashes", ()))
                if isinstance(event, dict):
                    self.kv_map.apply([event])
            await asyncio.sleep(STATS_POLL_S)

    async def evict_conversation(self, conversation_id: ConversationId, salt: bytes | None = None) -> int:
        log.info("trtllm_evict_unsupported", target="conversation")  # salted blocks age out by LRU
        return 0

    async def evict_salt(self, salt: bytes) -> int:
        log.info("trtllm_evict_unsupported", target="salt")
        return 0

    def residency(self, since: int) -> Residency | None:
        return Residency.of(self.kv_map.journal.changes(since))

    def serve_prefix(self, request: ServeRequest) -> AsyncIterator[TransferEvent]:
        raise cannot_transfer(self.name)

    def mark_draining(self) -> None:
        pass  # Triton drains its own models

    def cancel_turn(self, salt: bytes, turn_id: TurnId) -> int:
        return 0  # inside Triton each request is its own stream: the forwarder cancels it (TritonBackend.cancel_turn)

    def stats(self) -> EngineStats:
        kv = self._iteration.get("kvCacheStats", {})
        total = int(kv.get("maxNumBlocks", 0))
        free = int(kv.get("freeNumBlocks", 0))
        return EngineStats(
            replica_id=self.replica_id, backend=self.name,
            queue_depth=int(self._iteration.get("numQueuedRequests", 0)),
            running_sequences=int(self._iteration.get("numActiveRequests", 0)),
            block_size=int(kv.get("tokensPerBlock", self.block_size)),
            device=TierStats(total=total, used=int(kv.get("usedNumBlocks", total - free)), free=free),
            host=TierStats(0, 0, 0),
            hit_tokens=self._hit_tokens, miss_tokens=self._miss_tokens, generations=self._generations,
            device_evictions=self._device_evictions)
