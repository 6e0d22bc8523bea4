"""What chat stores, as the OpenAI surface reads it: a conversation's messages and a turn's reply, converted from
ChatService's answers where they are read (`read_conversation`, `read_turn`), so the layers above work on domain
values. A read's errors are the call's: `read_conversation` answers them as ApiError (`Edge.unary`), `read_turn`
leaves the gRPC error to its caller (a response's NOT_FOUND is the response's, `responses._of_response`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from chatmesh.gateway import events
from chatmesh.gateway.openai.history import Point
from chatmesh.gateway.identity import Principal, Via
from chatmesh.gateway.openai.wire import Role
from chatmesh.gateway.owner_tokens import Metadata
from chatmesh.gateway.routes import Edge
from chatmesh.model.tools import ToolCall
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.v1 import chat_pb2, common_pb2

def owner_token(edge: Edge, owner: OwnerId, conversation: ConversationId | None = None) -> Metadata:
    """The owner token a ChatService call for `owner` carries (minted by the edge; see owner_tokens.py). The owner
    is the key's user or, for a trusted front-end, the end user it named (surface.py)."""
    return edge.tokens.metadata(Principal(owner, Via.API_KEY), conversation)


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


async def read_turn(edge: Edge, owner: OwnerId, point: Point) -> StoredTurn:
    turn = await edge.chat.GetTurn(chat_pb2.GetTurnRequest(
        owner_id=owner, conversation_id=point.conversation, turn_id=point.turn), timeout=edge.deadline_s,
        metadata=owner_token(edge, owner, point.conversation))
    usage = events.Usage.of(turn.usage)
    return StoredTurn(_end_of(turn, usage), turn.reply, usage, turn.stored_at_ms,
                      tuple(ToolCall(c.id, c.name, c.arguments) for c in turn.tool_calls))
