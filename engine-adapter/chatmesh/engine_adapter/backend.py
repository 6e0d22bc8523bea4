"""The Generate-level contract every engine backend implements (`sim`, `local`, `triton`).

`GenerateService` (service.py) converts protobuf to these values and back; nothing here knows gRPC. The
in-process engine (`EngineCore` over an `Executor`) and the Triton forwarder both implement `Backend`, so the
servicer and the conformance tests (tests/engine/conformance.py) run unchanged against each.

A generation's events, in order: one `Started` (the prompt was admitted; how much of it came from the prefix
cache), any number of `Delta`s (tokens coalesced since the previous one), one `Finished`. Closing the event
iterator early (the RPC was cancelled) cancels the sequence; its KV blocks are freed at the next step.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from chatmesh.engine_adapter.executor import SamplingParams
from chatmesh.engine_adapter.residency import ResidencyChanges
from chatmesh.mesh.errors import InvalidArgument
from chatmesh.mesh.ids import ConversationId, TurnId
from chatmesh.mesh.turn import Usage as Usage  # a generation's token counts: the value chat bills, the store sums
from chatmesh.model.profile import ModelIdentity


@dataclass(frozen=True)
class GenerateParams:
    """One generation request, validated on construction (InvalidArgument names the bad field)."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    request_id: str = ""
    conversation_id: ConversationId | None = None  # None: not tracked for eviction by conversation
    turn_id: TurnId | None = None
    cache_salt: bytes = b""  # the owner's salt; blocks past the platform prefix are reused only under it (I1)
    platform_prefix_tokens: int = 0  # leading prompt tokens shared across owners (the system prompt)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()  # extra stops; the backend's end-of-turn ids always stop
    expected_model: ModelIdentity | None = None  # the model the prompt was rendered for (checked by the servicer)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids must not be empty")
        if min(self.prompt_token_ids) < 0:
            raise InvalidArgument("prompt_token_ids must be non-negative token ids")
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.platform_prefix_tokens <= len(self.prompt_token_ids):
            raise InvalidArgument("platform_prefix_tokens must be between 0 and the prompt length")
        s = self.sampling
        if not 0.0 < s.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {s.top_p}")
        if not 0.0 <= s.temperature <= 100.0:
            raise InvalidArgument(f"temperature must be in [0, 100], got {s.temperature}")


class FinishReason(enum.Enum):
    """Why a generation ended."""

    LENGTH = "length"  # reached max_tokens
    STOP = "stop"  # sampled a stop token (not streamed)
    CANCELLED = "cancelled"  # the caller went away or the engine shut down
    ERROR = "error"  # the engine failed


@dataclass(frozen=True)
class Started:
    """The prompt was admitted. cached_tokens came from the prefix cache; host_cached_tokens of them from host."""

    cached_tokens: int
    host_cached_tokens: int


@dataclass(frozen=True)
class Delta:
    """Tokens produced since the previous event, and their text (never a split UTF-8 character)."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Finished:
    """The last event."""

    reason: FinishReason
    usage: Usage
    error: str = ""


GenerateEvent = Started | Delta | Finished


@dataclass(frozen=True)
class TierStats:
    """Occupancy of one KV tier, in blocks: used (referenced or cached) + free = total; `cached` of the used
    blocks are held by no running sequence (reusable by a prefix hit, reclaimed on demand)."""

    total: int
    used: int
    free: int
    cached: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A replica's gauges and since-start counters (the proto's EngineStats)."""

    replica_id: str
    backend: str
    queue_depth: int
    running_sequences: int
    block_size: int
    device: TierStats
    host: TierStats
    hit_tokens: int = 0
    miss_tokens: int = 0
    host_hit_tokens: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    preemptions: int = 0
    generations: int = 0
    # why sequences wait (scheduler.py, "Why the queue waits"); queue_depth - these two wait for a step's budget
    waiting_kv: int = 0  # behind a head whose blocks do not fit the device KV room: admission is memory-bound
    waiting_batch: int = 0  # behind a full batch (max_batch running)
    kv_stall_steps: int = 0  # since start: steps that ended with sequences waiting for KV room
    batch_stall_steps: int = 0  # ... for a batch slot


@dataclass(frozen=True)
class Residency:
    """Which conversations' private prefixes the replica caches, in tokens (device and host tiers; 0: none left):
    every one it holds (`full`), or those changed after the cursor the caller passed. `version` is the next cursor."""

    version: int
    full: bool
    conversations: tuple[tuple[ConversationId, int], ...]

    @classmethod
    def of(cls, changes: ResidencyChanges) -> Residency:
        """A journal's changes (residency.py) as this value."""
        return cls(changes.version, changes.full, tuple((ConversationId(c), n) for c, n in changes.conversations))


class Backend(Protocol):
    """One engine replica as GenerateService sees it."""

    @property
    def name(self) -> str:
        """The backend name: sim, local or triton."""
        ...

    @property
    def model(self) -> ModelIdentity:
        """The model this replica serves (its CHATMESH_MODEL profile's identity)."""
        ...

    def generate(self, params: GenerateParams) -> AsyncIterator[GenerateEvent]:
        """Streams Started, Deltas, Finished. Raises ResourceExhausted (admission queue full) before any event."""
        ...

    async def evict_conversation(self, conversation_id: ConversationId) -> int:
        """Drops every cached block of the conversation from every tier; returns how many."""
        ...

    async def evict_salt(self, salt: bytes) -> int:
        """Drops every cached block under the owner's salt from every tier; returns how many."""
        ...

    def stats(self) -> EngineStats:
        """The current statistics."""
        ...

    def residency(self, since: int) -> Residency | None:
        """Conversations' cached prefixes changed after cursor `since` (residency.FROM_START: list everything held);
        None when this backend cannot tell which conversations it holds."""
        ...

    async def start(self) -> None:
        """Starts the engine (its step loop, or its connection)."""
        ...

    async def close(self) -> None:
        """Stops the engine; open generations finish CANCELLED."""
        ...

    def ready(self) -> bool:
        """True when generate() can be served."""
        ...
