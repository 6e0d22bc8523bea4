"""The OpenAI surface's calls to ChatService and its protobuf boundary: every call but the two that open a turn
(SendTurn, RegenerateTurn: turns.py, where the request is decided) is made here, its request built from domain
values (`options_pb`, `role_pb`, `seed_pb`) and its answer read into them: a conversation's messages
(`read_conversation`), a turn's reply (`read_turn`), a new conversation, a compaction; so the layers above work on
domain values (tests/gateway/test_openai_layers.py keeps protobuf to this module and turns.py). A call's errors
are the call's: `read_conversation` answers them as ApiError (`Edge.unary`); the others leave the gRPC error to
their caller, which knows what it means there (a response's NOT_FOUND is the response's,
`responses._of_response`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from chatmesh.gateway import events
from chatmesh.gateway.openai.history import Point
from chatmesh.gateway.identity import Principal, Via
from chatmesh.gateway.openai.wire import Options, Role
from chatmesh.gateway.owner_tokens import Metadata
from chatmesh.gateway.relay import TurnCall
from chatmesh.gateway.routes import Edge
from chatmesh.model.tools import AUTO, ChoiceMode, ToolCall
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.v1 import chat_pb2, common_pb2

def owner_token(edge: Edge, owner: OwnerId, conversation: ConversationId | None = None) -> Metadata:
    """The owner token a ChatService call for `owner` carries (minted by the edge; see owner_tokens.py). The owner
    is the key's user or, for a trusted front-end, the end user it named (surface.py)."""
    return edge.tokens.metadata(Principal(owner, Via.API_KEY), conversation)


def role_pb(role: Role) -> common_pb2.Role:
    match role:
        case Role.SYSTEM:
            return common_pb2.ROLE_SYSTEM
        case Role.USER:
            return common_pb2.ROLE_USER
        case Role.ASSISTANT:
            return common_pb2.ROLE_ASSISTANT
        case Role.TOOL:
            return common_pb2.ROLE_TOOL
        case _:
            assert_never(role)


_CHOICES = {ChoiceMode.AUTO: chat_pb2.TOOL_CHOICE_MODE_AUTO, ChoiceMode.NONE: chat_pb2.TOOL_CHOICE_MODE_NONE,
            ChoiceMode.REQUIRED: chat_pb2.TOOL_CHOICE_MODE_REQUIRED, ChoiceMode.NAMED: chat_pb2.TOOL_CHOICE_MODE_NAMED}


def options_pb(options: Options) -> chat_pb2.TurnOptions:
    """A turn's options as SendTurn and RegenerateTurn take them."""
    out = chat_pb2.TurnOptions(stop=list(options.stop), max_tokens=options.max_tokens or 0,
                               instructions=options.instructions)
    tools = options.tools
    out.tools.extend(chat_pb2.ToolDefinition(name=t.name, definition_json=t.definition_json)
                     for t in tools.definitions)
    if tools.choice != AUTO:
        out.tool_choice.CopyFrom(chat_pb2.ToolChoice(mode=_CHOICES[tools.choice.mode], name=tools.choice.name))
    if tools.parallel is not None:
        out.parallel_tool_calls = tools.parallel
    if options.compact_threshold is not None:
        out.compact_threshold_tokens = options.compact_threshold
    if options.temperature is not None:
        out.temperature = options.temperature
    if options.top_p is not None:
        out.top_p = options.top_p
    if options.seed is not None:
        out.seed = options.seed
    return out


def options_key(options: Options) -> str:
    """What a request digest holds of a turn's options: their form on the wire to chat (equal options agree)."""
    return options_pb(options).SerializeToString(deterministic=True).hex()


_ROLES = {common_pb2.ROLE_SYSTEM: Role.SYSTEM, common_pb2.ROLE_USER: Role.USER,
          common_pb2.ROLE_ASSISTANT: Role.ASSISTANT, common_pb2.ROLE_TOOL: Role.TOOL}


class MessageStatus(enum.Enum):
    COMPLETE = "complete"
    STOPPED = "stopped"
    BLOCKED = "blocked"
    UNKNOWN = "unknown"  # a status this edge does not know (a newer chat's)


_STATUSES = {common_pb2.MESSAGE_STATUS_COMPLETE: MessageStatus.COMPLETE,
             common_pb2.MESSAGE_STATUS_STOPPED: MessageStatus.STOPPED,
             common_pb2.MESSAGE_STATUS_BLOCKED: MessageStatus.BLOCKED}


@dataclass(frozen=True, slots=True)
class StoredMessage:
    index: int  # its position in the conversation, from 0
    role: Role  # a role this edge does not know reads as a user's
    content: str
    status: MessageStatus
    turn_id: TurnId | None  # the turn that stored it (None: seeded)
    superseded: bool  # a regenerated reply's old version
    tool_calls: tuple[ToolCall, ...] = ()
    tool_results: tuple[tuple[str, str], ...] = ()  # a tool message's (call id, output)

    @staticmethod
    def of(m: common_pb2.Message) -> StoredMessage:
        return StoredMessage(m.index, _ROLES.get(m.role, Role.USER), m.content,
                             _STATUSES.get(m.status, MessageStatus.UNKNOWN), TurnId(m.turn_id) if m.turn_id else None,
                             m.superseded, tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
                             tuple((r.tool_call_id, r.content) for r in m.tool_results))


@dataclass(frozen=True, slots=True)
class StoredConversation:
    id: ConversationId
    created_at_ms: int
    messages: tuple[StoredMessage, ...]

    @property
    def live(self) -> tuple[StoredMessage, ...]:
        """Its messages but superseded replies: what later prompts replay."""
        return tuple(m for m in self.messages if not m.superseded)


async def read_conversation(edge: Edge, owner: OwnerId, conversation: ConversationId) -> StoredConversation:
    view = await edge.unary(edge.chat.GetConversation(chat_pb2.GetConversationRequest(
        owner_id=owner, conversation_id=conversation), timeout=edge.deadline_s,
        metadata=owner_token(edge, owner, conversation)))
    return StoredConversation(ConversationId(view.conversation.conversation_id or conversation),
                              view.conversation.created_at_ms, tuple(StoredMessage.of(m) for m in view.messages))


@dataclass(frozen=True, slots=True)
class StoredTurn:
    end: events.ReplyEnd | None  # how it ended, as its final event would have said it; None: still running
    reply: str  # as stored (not yet sanitised)
    usage: events.Usage
    stored_at_ms: int
    tool_calls: tuple[ToolCall, ...]


def _end_of(turn: chat_pb2.GetTurnResponse, usage: events.Usage) -> events.ReplyEnd | None:
    match turn.status:
        case chat_pb2.TURN_STATUS_COMPLETED:
            return events.ReplyCompleted(0, usage, finish_reason=turn.finish_reason)
        case chat_pb2.TURN_STATUS_STOPPED:
            return events.ReplyStopped(0, usage)
        case chat_pb2.TURN_STATUS_BLOCKED:
            return events.ReplyBlocked(0, "")
        case chat_pb2.TURN_STATUS_FAILED:
            return events.ReplyFailed(0, "", False)
        case _:
            return None


@dataclass(frozen=True, slots=True)
class Seed:
    """A message a new conversation is stored with, as given (a client's earlier history, a fork's)."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_results: tuple[tuple[str, str], ...] = ()  # a tool message's (call id, output)


def seed_pb(s: Seed) -> common_pb2.SeedMessage:
    return common_pb2.SeedMessage(
        role=role_pb(s.role), content=s.content,
        tool_calls=[common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in s.tool_calls],
        tool_results=[common_pb2.ToolResult(tool_call_id=i, content=c) for i, c in s.tool_results])


async def create_conversation(edge: Edge, owner: OwnerId, seed: Sequence[Seed]) -> StoredConversation:
    """A new conversation holding `seed` (its messages are not read back: `messages` is empty)."""
    made = (await edge.chat.CreateConversation(chat_pb2.CreateConversationRequest(
        owner_id=owner, messages=[seed_pb(s) for s in seed]), timeout=edge.deadline_s,
        metadata=owner_token(edge, owner))).conversation  # owner-wide: the conversation does not exist yet
    return StoredConversation(ConversationId(made.conversation_id), made.created_at_ms, ())


@dataclass(frozen=True, slots=True)
class Compacted:
    summary: str
    prompt_tokens: int  # of the summary's prompt; 0 when chat had a current summary already
    token_count: int  # of the summary


async def compact_conversation(edge: Edge, owner: OwnerId, conversation: ConversationId, expect: str) -> Compacted:
    done = await edge.chat.CompactConversation(chat_pb2.CompactConversationRequest(
        owner_id=owner, conversation_id=conversation, expect_last_turn_id=expect),
        timeout=edge.deadline_s * 6, metadata=owner_token(edge, owner, conversation))  # an engine writes it
    return Compacted(done.summary_text, done.prompt_tokens, done.token_count)


def attach_turn(edge: Edge, owner: OwnerId, point: Point) -> TurnCall:
    """The turn's events from its start (chat serves them live or from the stored progress)."""
    return edge.chat.AttachTurn(chat_pb2.AttachTurnRequest(
        owner_id=owner, conversation_id=point.conversation, turn_id=point.turn, after_sequence=0),
        metadata=owner_token(edge, owner, point.conversation))


async def delete_conversation(edge: Edge, owner: OwnerId, conversation: ConversationId, timeout_s: float) -> None:
    await edge.chat.DeleteConversation(chat_pb2.DeleteConversationRequest(
        owner_id=owner, conversation_id=conversation), timeout=timeout_s,
        metadata=owner_token(edge, owner, conversation))


async def delete_turn(edge: Edge, owner: OwnerId, point: Point) -> None:
    await edge.chat.DeleteTurn(chat_pb2.DeleteTurnRequest(
        owner_id=owner, conversation_id=point.conversation, turn_id=point.turn), timeout=edge.deadline_s,
        metadata=owner_token(edge, owner, point.conversation))


async def stop_turn(edge: Edge, owner: OwnerId, point: Point) -> None:
    """chatmesh's stop: the partial reply is stored and kept."""
    await edge.chat.StopTurn(chat_pb2.StopTurnRequest(
        owner_id=owner, conversation_id=point.conversation, turn_id=point.turn), timeout=edge.deadline_s,
        metadata=owner_token(edge, owner, point.conversation))


async def read_turn(edge: Edge, owner: OwnerId, point: Point) -> StoredTurn:
    turn = await edge.chat.GetTurn(chat_pb2.GetTurnRequest(
        owner_id=owner, conversation_id=point.conversation, turn_id=point.turn), timeout=edge.deadline_s,
        metadata=owner_token(edge, owner, point.conversation))
    usage = events.Usage.of(turn.usage)
    return StoredTurn(_end_of(turn, usage), turn.reply, usage, turn.stored_at_ms,
                      tuple(ToolCall(c.id, c.name, c.arguments) for c in turn.tool_calls))
