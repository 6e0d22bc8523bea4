"""The `local` executor: runs each engine step through PagedLlama on the CPU and samples the next tokens.

It owns two KV pools: DEVICE (the blocks attention reads; block tables name these) and HOST (the spill tier).
On a CPU both are ordinary memory, so offloading and onboarding a block is a tensor copy between them, timed.
The pools are allocated lazily by the OS (calloc'd zeros), so their resident size grows with the blocks used.

Allocator: a step allocates and frees many temporaries of a few MB (gathered K/V widened to fp32, scores).
glibc hands such blocks back to the OS on free and takes them again on the next allocation, page faults and
zeroing included: widening 0.9 M int8 values took 0.95 ms that way against 0.09 ms into a reused buffer. So the
executor raises glibc's mmap and trim thresholds (`mallopt`, 32 MiB / 256 MiB) once per process: temporaries stay
in the heap and are reused; allocations above 32 MiB (the KV pools) are still mapped lazily.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time
from collections.abc import Sequence

import torch

from chatmesh.engine_adapter.executor import BlockCopy, KvFormat, SamplingParams, SeqWork, StepResult, Tier
from chatmesh.engine_adapter.local import native_attention
from chatmesh.engine_adapter.local.model import KV_DTYPES, KVPool, LoadedModel, PagedLlama, SeqSlice
from chatmesh.engine_adapter.local.sampling import new_generator, position_seed, sample


@functools.cache
def keep_freed_memory() -> bool:
    """Raises glibc's mmap threshold to 32 MiB and its trim threshold to 256 MiB (see the header); False where the
    C library is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 256 << 20))


class LocalExecutor:
    """Executor protocol (engine_adapter/executor.py) over a real SmolLM2 forward."""

    name = "local"

    def __init__(self, model: LoadedModel, device_blocks: int, host_blocks: int, block_size: int,
                 kv_dtype: torch.dtype = torch.float32, native: bool = True):
        """`native`: decode attention in the native kernel (built on first use, see native_attention.py); False,
        or a failed build, keeps the PyTorch path."""
        keep_freed_memory()
        self.model = model
        kernel = native_attention.load() if native else None
        self.net = PagedLlama(model.config, model.weights, kernel)
        self.block_size = block_size
        self.pools = {Tier.DEVICE: KVPool(model.config, device_blocks, block_size, kv_dtype),
                      Tier.HOST: KVPool(model.config, host_blocks, block_size, kv_dtype)}
        self._draws = new_generator(0)  # reseeded for every draw: seed and position (sampling.py)
        self.prefill_tokens = 0  # tokens run by steps of more than one token per sequence (counters for tests)
        self.decode_tokens = 0
        self.steps = 0
        self.last_logits: dict[int, torch.Tensor] = {}  # seq_id -> logits of its last sampled step (tests)
        self.keep_logits = False
        device = self.pools[Tier.DEVICE]
        dtype = next(name for name, t in KV_DTYPES.items() if t == kv_dtype)
        self._format = KvFormat(dtype, device.block_bytes, device.block_bytes)

    def execute(self, work: Sequence[SeqWork]) -> StepResult:
        t0 = time.perf_counter()
        slices = [SeqSlice(w.token_ids, w.start_pos, w.block_table) for w in work]
        rows: list[int] = []
        sampled: list[SeqWork] = []
        row = 0
        for w in work:
            n = len(w.token_ids)
            if n > 1:
                self.prefill_tokens += n
            else:
                self.decode_tokens += n
            row += n
            if w.sample:
                rows.append(row - 1)
                sampled.append(w)
        logits = self.net.forward(slices, self.pools[Tier.DEVICE], rows)
        next_tokens: dict[int, int] = {}
        greedy = [i for i, w in enumerate(sampled) if w.sampling.temperature <= 0.0]
        if greedy:
            picks = torch.argmax(logits[greedy], dim=-1).tolist()
            for i, tok in zip(greedy, picks):
                next_tokens[sampled[i].seq_id] = int(tok)
        for i, w in enumerate(sampled):
            if w.sampling.temperature > 0.0:
                self._draws.manual_seed(position_seed(w.sampling.seed, w.start_pos + len(w.token_ids)))
                next_tokens[w.seq_id] = sample(logits[i], w.sampling, self._draws)
            if self.keep_logits:
                self.last_logits[w.seq_id] = logits[i].clone()
        self.steps += 1
        return StepResult(next_tokens=next_tokens, duration_s=time.perf_counter() - t0)

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> float:
        t0 = time.perf_counter()
        groups: dict[tuple[Tier, Tier], tuple[list[int], list[int]]] = {}
        for c in copies:
            src, dst = groups.setdefault((c.src_tier, c.dst_tier), ([], []))
            src.append(c.src_block)
            dst.append(c.dst_block)
        for (src_tier, dst_tier), (src, dst) in groups.items():
            self.pools[src_tier].copy_to(self.pools[dst_tier], src, dst)
        return time.perf_counter() - t0

    def release(self, seq_id: int) -> None:
        self.last_logits.pop(seq_id, None)

    @property
    def kv_format(self) -> KvFormat:
        return self._format

    def export_blocks(self, blocks: Sequence[tuple[Tier, int]]) -> list[bytes]:
        out: list[bytes] = []
        i = 0
        while i < len(blocks):  # runs of one tier, each read in one gather
            tier = blocks[i][0]
            j = i
            while j < len(blocks) and blocks[j][0] is tier:
                j += 1
            out += self.pools[tier].export([b for _, b in blocks[i:j]])
            i = j
        return out

    def import_blocks(self, blocks: Sequence[int], payloads: Sequence[bytes]) -> None:
        self.pools[Tier.DEVICE].load(blocks, payloads)

    def transfer_s(self, nbytes: int) -> float:
        return 0.0  # the transfer is real: its time is its own
