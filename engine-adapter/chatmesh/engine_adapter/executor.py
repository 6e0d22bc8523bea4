"""The executor contract: what the engine core (block manager + scheduler) asks a backend to compute.

The scheduler decides, each step, which sequences run and which tokens of each (a prefill chunk, or the one
last token for decode); the block manager gives each sequence a block table of physical device blocks. The
executor runs the model over that work and samples a next token for every sequence that reached the end of
its known tokens. `sim` models the step's duration with the reference's roofline; `local` runs SmolLM2 on the
CPU, its attention reading K/V from the blocks named in the table.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Tier(enum.Enum):
    """Where a KV block lives."""

    DEVICE = "device"  # accelerator memory: attention reads only from here
    HOST = "host"  # system memory: a spill tier, onboarded back to DEVICE before use


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. temperature 0 is greedy; top_p 1.0 disables nucleus sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class SeqWork:
    """One sequence's share of a step."""

    seq_id: int
    token_ids: Sequence[int]  # tokens to run now: a prefill chunk, or the last sampled token for decode
    start_pos: int  # position of token_ids[0] in the sequence
    block_table: Sequence[int]  # physical DEVICE block ids covering positions [0, start_pos + len(token_ids))
    sample: bool  # True when token_ids ends at the sequence's last known token: produce a next token
    sampling: SamplingParams


@dataclass(frozen=True)
class BlockCopy:
    """Move one block's K/V between tiers (offload to host, or onboard back to device)."""

    src_tier: Tier
    src_block: int
    dst_tier: Tier
    dst_block: int


@dataclass(frozen=True)
class KvFormat:
    """What one KV block is when it moves between replicas (transfer.py)."""

    dtype: str  # element type of K and V ("none": the executor holds no KV data, sim)
    block_bytes: int  # bytes a block moves over the link (sim: modelled)
    payload_bytes: int  # bytes of a block's payload on the wire (sim: 0)


@dataclass(frozen=True)
class StepResult:
    """What a step produced."""

    next_tokens: dict[int, int]  # seq_id -> sampled token, for each SeqWork with sample=True
    duration_s: float  # how long the step took: modelled (sim) or measured (local)


class Executor(Protocol):
    """A backend's compute. Calls are synchronous and made from one engine thread, never concurrently."""

    @property
    def name(self) -> str: ...

    def execute(self, work: Sequence[SeqWork]) -> StepResult:
        """Runs one step over `work` (non-empty) and samples where asked."""
        ...

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> float:
        """Copies block contents between tiers; returns the seconds it took (modelled or measured)."""
        ...

    def release(self, seq_id: int) -> None:
        """Forgets per-sequence state (sampling generator); the sequence's blocks are the block manager's.
        Called once per sequence when it ends, also for one that never reached `execute` (cancelled while
        queued): a no-op then."""
        ...

    @property
    def kv_format(self) -> KvFormat | None:
        """The blocks' transfer format; None when this executor cannot export or import blocks."""
        ...

    def export_blocks(self, blocks: Sequence[tuple[Tier, int]]) -> list[bytes]:
        """The payloads of cached blocks (pinned by the caller, so nothing writes them meanwhile). Unlike the other
        calls, made from the engine's transfer thread, concurrently with steps."""
        ...

    def import_blocks(self, blocks: Sequence[int], payloads: Sequence[bytes]) -> None:
        """Writes payloads into DEVICE blocks reserved for them (no step reads them yet). From the transfer
        thread, concurrently with steps."""
        ...

    def transfer_s(self, nbytes: int) -> float:
        """Modelled seconds to move `nbytes` between replicas (sim's link model); 0 where the transfer is real."""
        ...
