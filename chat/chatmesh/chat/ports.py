"""What the chat core needs from the other services, as protocols over domain values.

The store's answers are the store's own values (`chatmesh.store.values`: conversations, messages, history, claims,
turn records, usage), since they mean the same thing on both sides of the wire; the router's picks, the engine's
events and moderation's screenings are the small values below. `clients.py` implements the ports over gRPC and
turns gRPC failures into typed core errors; no module of the core imports grpc or protobuf (a test checks).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, NewType, Protocol

from chatmesh.mesh import errors
from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, ReplicaId, TurnId
from chatmesh.store.values import (
    Claim, Conversation, DailyUsage, Stored, History, Progress, Reply, Seed, Summary, ToolResult, TurnRecord,
)


class TurnKey(NamedTuple):
    """A turn's identity: the store's key of its record, and this process's key of its live stream."""

    owner: OwnerId
    conversation: ConversationId
    turn: TurnId


# ---- store ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimRequest:
    """BeginTurn: claim `key` for generation, with what a retry must match (`fingerprint`)."""

    key: TurnKey
    fingerprint: str
    content: str  # the user's message; "" for a regenerate
    lease_holder: str
    lease_ttl_ms: int
    regenerates: TurnId | None
    context_messages: int  # a new claim also returns the summary and this many messages after it
    options: str = ""  # the turn's options as JSON (options.TurnOptions.to_json): kept by a new record
    tool_results: tuple[ToolResult, ...] = ()  # a tool turn's input (content is then "")


class StorePort(Protocol):
    async def insert_conversation(self, owner: OwnerId, title: str, system_prompt_version: str) -> Conversation: ...

    async def create_conversation(self, owner: OwnerId, conversation: ConversationId | None, title: str,
                                  system_prompt_version: str, seed: Sequence[Seed]) -> tuple[Conversation, bool]:
        """A conversation with `seed` messages stored first; with `conversation` already the owner's, that one
        unchanged (False)."""
        ...

    async def delete_turn(self, key: TurnKey) -> list[ConversationId]:
        """Deletes one stored turn with its regenerations; returns the conversations whose blocks must go."""
        ...

    async def read_conversation(self, owner: OwnerId, conversation: ConversationId) -> History: ...

    async def begin_turn(self, claim: ClaimRequest) -> Claim:
        """A `Claimed` carries the prompt's context only when it is whole (every message after the summary)."""
        ...

    async def finish_turn(self, key: TurnKey, lease: LeaseId, reply: Reply) -> Stored: ...

    async def fail_turn(self, key: TurnKey, lease: LeaseId, reason: str, shown: str = "") -> bool:
        """Releases the claim; `shown` (the reply its clients were shown, "" for none) stays with the record, so
        the next claim continues it (`Claimed.resume_text`)."""
        ...

    async def update_turn_progress(self, key: TurnKey, lease: LeaseId, partial_text: str, event_sequence: int,
                                   lease_ttl_ms: int) -> Progress: ...

    async def read_turn(self, key: TurnKey) -> TurnRecord: ...

    async def save_summary(self, owner: OwnerId, conversation: ConversationId, text: str,
                           covers_through_index: int, token_count: int) -> Summary: ...

    async def list_conversations(self, owner: OwnerId, limit: int) -> list[Conversation]: ...

    async def delete_conversation(self, owner: OwnerId, conversation: ConversationId) -> list[ConversationId]:
        """Deletes every stored row; returns the conversations whose engine blocks must be evicted."""
        ...

    async def export(self, owner: OwnerId) -> str: ...

    async def usage(self, owner: OwnerId, days: int) -> list[DailyUsage]: ...


# ---- router -----------------------------------------------------------------------------------------------

RouteLeaseId = NewType("RouteLeaseId", str)  # the router's load lease on a replica (not the store's turn lease)


@dataclass(frozen=True)
class PullSource:
    """The replica to pull a prompt's cached prefix from before prefill, as the router named it."""

    replica_id: ReplicaId
    address: str


@dataclass(frozen=True)
class Pick:
    replica_id: ReplicaId
    address: str
    lease: RouteLeaseId
    source: PullSource | None = None  # the turn moved off its prefix: the picked replica pulls it from here


@dataclass(frozen=True)
class Replica:
    replica_id: ReplicaId
    address: str


class RouterPort(Protocol):
    async def pick(self, conversation: ConversationId, exclude: Sequence[ReplicaId] = ()) -> Pick: ...

    async def release(self, lease: RouteLeaseId) -> None: ...

    async def replicas(self) -> list[Replica]: ...


# ---- engine -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    """One generation on an engine replica: prompt tokens in, reply tokens out."""

    request_id: str
    conversation: ConversationId
    turn: TurnId | None  # None for work that is no turn of its own (a summary)
    owner: OwnerId  # whose generation: the engine salts KV past the platform prefix by this owner (I1)
    prompt_token_ids: tuple[int, ...]
    platform_prefix_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int = 0
    # The last `resumed_tokens` prompt tokens are reply a client was already shown (a turn taken over): the engine
    # continues that reply, sampling as if it had generated them; a backend that cannot continue it exactly refuses
    # (`ResumeRefused`) rather than splice.
    resumed_tokens: int = 0
    # The router's pick named a source (the turn moved off the replica caching its prefix): the engine pulls what
    # its own cache lacks from there before prefill, and prefills what the pull does not bring.
    source: PullSource | None = None


class FinishReason(enum.Enum):
    STOP = "stop"  # an end token
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the engine cancelled the sequence
    ERROR = "error"  # the engine failed it (see `EngineFinished.error`)


@dataclass(frozen=True)
class EngineStarted:
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class EngineDelta:
    text: str  # may be "" when the tokens so far end mid-character
    token_count: int


@dataclass(frozen=True)
class EngineFinished:
    reason: FinishReason
    output_tokens: int
    error: str = ""


EngineEvent = EngineStarted | EngineDelta | EngineFinished


class EngineUnreachable(errors.Unavailable):
    """The replica could not be reached (or went away) before it sent anything for the generation: no prompt was
    admitted and no token sampled, so the turn may go to another replica as it is."""


class ResumeRefused(errors.Unavailable):
    """The replica cannot continue a reply exactly (`Generation.resumed_tokens` with sampling its backend cannot
    reproduce): nothing was generated; the turn is failed retryable, its shown text dropped, never spliced."""


class EnginePort(Protocol):
    def generate(self, address: str, generation: Generation, timeout_s: float
                 ) -> AsyncGenerator[EngineEvent, None]:
        """Streams a generation; closing the iterator cancels the engine sequence. `EngineUnreachable` when the
        replica fails before its first event."""
        ...

    async def evict(self, address: str, owner: OwnerId, conversation: ConversationId) -> int: ...

    async def cancel_turn(self, address: str, owner: OwnerId, conversation: ConversationId, turn: TurnId) -> int:
        """Cancels the replica's generations of `turn` (a holder whose lease moved); how many it cancelled."""
        ...


# ---- moderation ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Screening:
    """A moderation outcome as the turn sees it."""

    blocked: bool
    category: str  # the deciding category when blocked or flagged, else ""
    reason: str  # why, for the turn's outcome and logs (never the text)
    unavailable: bool = False  # moderation could not judge (down, failing, late): the failure policy decided.
    # A block then is an outage, not a verdict: the turn fails retryably, nothing is stored as blocked.


class OutputScreen(Protocol):
    async def check(self, chunk: str, final: bool = False) -> Screening: ...

    async def close(self) -> None: ...


class ModerationPort(Protocol):
    async def check_input(self, text: str, conversation: ConversationId) -> Screening: ...

    async def open_output(self, conversation: ConversationId) -> OutputScreen: ...


# ---- other chat processes -------------------------------------------------------------------------------------


class PeerPort(Protocol):
    """Other chat processes: a stop reaching the wrong process is forwarded to the one generating the turn."""

    async def stop(self, address: str, key: TurnKey, release: bool = False) -> bool:
        """Stops (or, with `release`, releases: `Turns.release`) the turn in the process at `address`."""
        ...


@dataclass(frozen=True)
class Ports:
    """The other services, as the core's modules reach them."""

    store: StorePort
    router: RouterPort
    engines: EnginePort
    moderation: ModerationPort
    peers: PeerPort | None = None
