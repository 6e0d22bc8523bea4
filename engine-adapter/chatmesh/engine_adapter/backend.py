"""The Generate-level contract every engine backend implements (`sim`, `local`, `triton`).

`GenerateService` (service.py) converts protobuf to these values and back; nothing here knows gRPC. The
in-process engine (`EngineCore` over an `Executor`) and the Triton forwarder both implement `Backend`, so the
servicer and the conformance tests (tests/engine/conformance.py) run unchanged against each.

A generation's events, in order: one `Started` (the prompt was admitted; how much of it came from the prefix
cache, and from a pull), any number of `Delta`s (tokens coalesced since the previous one), one `Finished`. Closing
the event iterator early (the RPC was cancelled) cancels the sequence; its KV blocks are freed at the next step.

Prefix transfer (issue 29, transfer.py): a generation may name a source replica (`PullSource`); a backend that
receives pulls imports the prompt's cached blocks from it before prefill (`Started.pull` says what happened), and
one that serves them streams its blocks to a puller (`serve_prefix`). `TransferStats` says which a backend does.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from chatmesh.engine_adapter.executor import SamplingParams
from chatmesh.engine_adapter.residency import ResidencyChanges
from chatmesh.mesh.errors import FailedPrecondition, InvalidArgument
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.mesh.turn import Usage as Usage  # a generation's token counts: the value chat bills, the store sums
from chatmesh.model.profile import ModelIdentity


class PullOutcome(enum.Enum):
    """What became of a generation's prefix pull (the proto's PullOutcome)."""

    PULLED = "pulled"  # blocks were imported
    NOT_NEEDED = "not_needed"  # the replica's own cache held every full block, or the source is this replica
    NOT_HELD = "not_held"  # the source holds none of them (evicted, never there, another owner's)
    UNAVAILABLE = "unavailable"  # the source could not be reached, refused, or failed mid-transfer
    DEADLINE = "deadline"  # the transfer outlasted the pull deadline
    CORRUPT = "corrupt"  # a digest mismatch or a malformed transfer: all of it dropped
    UNSUPPORTED = "unsupported"  # this replica or the source cannot transfer, or their layouts differ
    NO_ROOM = "no_room"  # no device room to import into
    EVICTED = "evicted"  # the source lost blocks during the transfer (deletion): all of it dropped


@dataclass(frozen=True)
class PullSource:
    """The replica a generation may pull its prompt's cached prefix from (the router's pick names it)."""

    replica_id: str
    address: str  # host:port

    def __post_init__(self) -> None:
        if not self.replica_id or not self.address:
            raise InvalidArgument("source_replica_id and source_address go together (both set, or neither)")


@dataclass(frozen=True)
class KvLayout:
    """How a replica's KV blocks are laid out: blocks move only between replicas with equal layouts."""

    backend: str
    model: ModelIdentity
    block_size: int
    dtype: str  # int8 (with per-token scales), float16, bfloat16, float32; "none" for sim (no data)
    block_bytes: int  # bytes one block moves (sim: the modelled KV bytes; its payloads are empty)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size


@dataclass(frozen=True)
class PullReport:
    """One pull, as the generation's Started reports it: from where, what became of it, what it moved."""

    source_replica_id: str
    outcome: PullOutcome
    first_block: int = 0  # chain index of the first block asked for (the replica's own cache held the ones before)
    blocks: int = 0  # blocks imported
    bytes: int = 0  # bytes moved (imported or dropped)
    seconds: float = 0.0  # time the pull took, from the request to the import (modelled link time included)


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
    owner_id: OwnerId | None = None  # the verified owner (a pull names it to the source); None: plaintext, no owner
    source: PullSource | None = None  # pull the prompt's cached prefix from this replica before prefill
    # The prompt's last `resumed_tokens` are reply already shown (a continued turn): sampled on as if generated
    # here (draws keyed by seed and position); a backend that cannot continue it exactly raises ResumeRefused.
    resumed_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids must not be empty")
        if min(self.prompt_token_ids) < 0:
            raise InvalidArgument("prompt_token_ids must be non-negative token ids")
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.platform_prefix_tokens <= len(self.prompt_token_ids):
            raise InvalidArgument("platform_prefix_tokens must be between 0 and the prompt length")
        if not 0 <= self.resumed_tokens < len(self.prompt_token_ids):
            raise InvalidArgument("resumed_tokens must be between 0 and the prompt length minus one")
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
    """The prompt was admitted. cached_tokens came from the replica's own prefix cache (host_cached_tokens of them
    from its host tier), pulled_tokens from the source's (the rest was prefilled); `pull` is the pull the request
    asked for (None when it named no source)."""

    cached_tokens: int
    host_cached_tokens: int
    pulled_tokens: int = 0
    pull: PullReport | None = None


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
class KvBlockData:
    """One block in transfer: its chain hash, its contents in the layout's encoding, and their keyed digest."""

    hash: bytes
    payload: bytes
    digest: bytes


@dataclass(frozen=True)
class TransferStarted:
    """First event of a transfer: how many blocks follow (the leading run of those named that the source holds)."""

    blocks: int
    block_bytes: int


@dataclass(frozen=True)
class TransferChunk:
    """Consecutive blocks of a transfer, in the order they were named."""

    blocks: tuple[KvBlockData, ...]


TransferEvent = TransferStarted | TransferChunk


@dataclass(frozen=True)
class ServeRequest:
    """A puller's request, once the servicer has verified its owner: the salt is derived here, never sent."""

    salt: bytes
    hashes: tuple[bytes, ...]
    layout: KvLayout
    max_message_bytes: int
    request_id: str = ""


@dataclass(frozen=True)
class TransferStats:
    """What a replica does in prefix transfer and what it has moved since start (the proto's PrefixTransferStats).
    `outcomes` counts pulls by PullOutcome value."""

    serves: bool = False
    receives: bool = False
    layout: KvLayout | None = None
    pulled_tokens: int = 0
    pulled_bytes: int = 0
    pulls: int = 0
    failed_pulls: int = 0
    served_blocks: int = 0
    served_bytes: int = 0
    outcomes: tuple[tuple[str, int], ...] = ()
    serving: int = 0  # transfers being served now (not on the wire: the drain waits for them)


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
    transfer: TransferStats = field(default_factory=TransferStats)
    draining: bool = False  # SIGTERM seen: refuses new generations, still serves pulls until its grace ends


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


def cannot_transfer(backend: str) -> FailedPrecondition:
    """The refusal of a backend that keeps its KV where chatmesh cannot reach it (triton: inside TensorRT-LLM)."""
    return FailedPrecondition(f"the {backend} backend cannot serve or import KV blocks (docs/triton.md); the router "
                              f"never plans a pull to or from it")


class ResumeRefused(FailedPrecondition):
    """This backend cannot continue a sampled reply exactly (GenerateRequest.resumed_tokens): refused before any
    work, so the turn is failed retryable rather than spliced."""


class PrefixEvicted(Exception):
    """A block being served was evicted for deletion during the transfer (the servicer answers ABORTED)."""


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

    async def evict_conversation(self, conversation_id: ConversationId, salt: bytes | None = None) -> int:
        """Drops every cached block of the conversation from every tier (with `salt`: only the blocks under that
        owner's salt); returns how many."""
        ...

    async def evict_salt(self, salt: bytes) -> int:
        """Drops every cached block under the owner's salt from every tier; returns how many."""
        ...

    def serve_prefix(self, request: ServeRequest) -> AsyncIterator[TransferEvent]:
        """Streams the leading run of the named blocks cached under the request's salt: TransferStarted, then
        TransferChunks. FailedPrecondition when this backend cannot serve blocks or its layout differs;
        ResourceExhausted when it serves as many transfers as it may; PrefixEvicted when a block it pinned
        was evicted for deletion meanwhile."""
        ...

    def mark_draining(self) -> None:
        """Shutdown began: refuse new generations (Unavailable), keep serving pulls and running generations."""
        ...

    def cancel_turn(self, salt: bytes, turn_id: TurnId) -> int:
        """Cancels the running generations of `turn_id` under the owner's `salt` (its lease moved to another chat
        process): each ends with Finished(CANCELLED), as if its caller had cancelled it. Returns how many."""
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
