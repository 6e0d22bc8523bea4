"""Values the store core takes and returns: frozen dataclasses and closed enums, no SQL, no protobuf."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, TurnId
from chatmesh.mesh.turn import TurnRecordState, Usage
from chatmesh.model.tools import ToolCall, ToolResult

__all__ = ["Role", "MessageStatus", "TurnRecordState", "Usage", "ToolCall", "ToolResult", "Conversation", "Message", "Summary", "History",
           "Seed", "Claimed", "InProgress", "Done", "Conflicted", "Claim", "Reply", "Stored", "Progress", "TurnRecord",
           "DailyUsage", "Purged"]


class Role(enum.Enum):
    """Who wrote a message."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"  # tool results a client sent back: a turn's input, like a user message


class MessageStatus(enum.Enum):
    """How a stored message ended."""

    COMPLETE = "complete"
    STOPPED = "stopped"
    BLOCKED = "blocked"


@dataclass(frozen=True)
class Conversation:
    conversation_id: ConversationId
    owner_id: OwnerId
    title: str
    system_prompt_version: str
    created_at_ms: int
    updated_at_ms: int
    message_count: int


@dataclass(frozen=True)
class Message:
    index: int
    role: Role
    content: str
    token_count: int
    status: MessageStatus
    turn_id: TurnId
    created_at_ms: int
    superseded: bool = False
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls, after its text
    tool_results: tuple[ToolResult, ...] = ()  # a TOOL message's results (its content is "")


@dataclass(frozen=True)
class Seed:
    """A message a conversation is created with (a client's earlier history), stored without generating it."""

    role: Role
    content: str
    token_count: int = 0
    tool_calls: tuple[ToolCall, ...] = ()
    tool_results: tuple[ToolResult, ...] = ()


@dataclass(frozen=True)
class Summary:
    """A stored summary of the messages with index <= `covers_through_index` (I3: stored, not recomputed)."""

    text: str
    covers_through_index: int
    token_count: int
    created_at_ms: int


@dataclass(frozen=True)
class History:
    """A conversation as ReadConversation returns it."""

    conversation: Conversation
    messages: list[Message]
    summary: Summary | None


# --- BeginTurn outcomes: exactly one of the four ---

@dataclass(frozen=True)
class Claimed:
    """The caller won the claim and must generate, then finish or fail the turn."""

    lease_id: LeaseId
    lease_expires_at_ms: int
    context: History | None = None
    """With `context_messages` > 0: the conversation, its summary and the newest messages after it."""
    options: str = ""
    """The turn's generation options as its first claim stored them (the caller's JSON, opaque to the store);
    "" when the record holds none (a new claim: the caller's own)."""
    resume_text: str = ""
    """The reply an earlier attempt at this turn left (its clients may have been shown it): the new attempt
    continues it. "" for a new turn, or one released with nothing shown."""
    taken_over: bool = False
    """The claim took the turn from a holder whose lease lapsed (that holder may still be generating)."""


@dataclass(frozen=True)
class InProgress:
    """Someone else holds a live lease on the turn."""

    lease_holder: str
    lease_expires_at_ms: int


@dataclass(frozen=True)
class Done:
    """The turn is stored; its reply and usage."""

    reply: Message
    usage: Usage


@dataclass(frozen=True)
class Conflicted:
    """The turn id is known with another fingerprint."""

    stored_fingerprint: str


Claim = Claimed | InProgress | Done | Conflicted


@dataclass(frozen=True)
class Reply:
    """What FinishTurn stores: the reply as the user saw it, and the turn's token counts."""

    user_token_count: int
    text: str
    token_count: int
    status: MessageStatus
    usage: Usage
    user_status: MessageStatus = MessageStatus.COMPLETE
    tool_calls: tuple[ToolCall, ...] = ()  # the reply's calls, stored with it


@dataclass(frozen=True)
class Stored:
    """FinishTurn's answer: the stored reply, and whether an earlier finish had stored it."""

    already_finished: bool
    reply: Message


@dataclass(frozen=True)
class Progress:
    """The result of a progress report: whether the caller still holds the lease, and until when."""

    held: bool
    lease_expires_at_ms: int


@dataclass(frozen=True)
class TurnRecord:
    """A turn as ReadTurn returns it, for attaching from another chat process."""

    turn_id: TurnId
    state: TurnRecordState
    fingerprint: str
    lease_holder: str
    lease_expires_at_ms: int
    partial_text: str
    event_sequence: int
    regenerates_turn_id: TurnId | None
    reply: Message | None
    usage: Usage


@dataclass(frozen=True)
class DailyUsage:
    day: str  # YYYY-MM-DD, UTC
    usage: Usage
    turns: int


@dataclass(frozen=True)
class Purged:
    """What a retention purge removed."""

    conversations: list[tuple[OwnerId, ConversationId]]
    abandoned_turns: int
