"""The store's wire: protobuf messages <-> the store's values (`chatmesh.store.values`), both directions.

The StoreService servicer answers with these conversions, and the store's callers (chat's client) read the answers
back with them, so the store's values are the one domain model of conversations, messages and turns on both sides
of the wire and protobuf stays at the two edges.
"""

from __future__ import annotations

import typing

from chatmesh.mesh.errors import InvalidArgument, Unavailable
from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, TurnId
from chatmesh.store.values import (
    Claim, Claimed, Conflicted, Conversation, DailyUsage, Done, Stored, History, InProgress, Message,
    MessageStatus, Progress, Role, Seed, Summary, ToolCall, ToolResult, TurnRecord, TurnRecordState, Usage,
)
from chatmesh.v1 import common_pb2, store_pb2

# --- values -> protobuf (the servicer's answers) ---

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
            typing.assert_never(role)


def status_pb(status: MessageStatus) -> common_pb2.MessageStatus:
    match status:
        case MessageStatus.COMPLETE:
            return common_pb2.MESSAGE_STATUS_COMPLETE
        case MessageStatus.STOPPED:
            return common_pb2.MESSAGE_STATUS_STOPPED
        case MessageStatus.BLOCKED:
            return common_pb2.MESSAGE_STATUS_BLOCKED
        case _:
            typing.assert_never(status)


def parse_status(value: common_pb2.MessageStatus, field: str, default: MessageStatus | None = None) -> MessageStatus:
    if value == common_pb2.MESSAGE_STATUS_COMPLETE:
        return MessageStatus.COMPLETE
    if value == common_pb2.MESSAGE_STATUS_STOPPED:
        return MessageStatus.STOPPED
    if value == common_pb2.MESSAGE_STATUS_BLOCKED:
        return MessageStatus.BLOCKED
    if value == common_pb2.MESSAGE_STATUS_UNSPECIFIED and default is not None:
        return default
    raise InvalidArgument(f"{field} must be complete, stopped or blocked")


def usage_pb(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=usage.prompt_tokens, cached_prompt_tokens=usage.cached_prompt_tokens,
                            output_tokens=usage.output_tokens)


def parse_usage(usage: common_pb2.Usage) -> Usage:
    return Usage(usage.prompt_tokens, usage.cached_prompt_tokens, usage.output_tokens)


ROLE_PB = {role: role_pb(role) for role in Role}  # looked up per message: 20 per history read
STATUS_PB = {status: status_pb(status) for status in MessageStatus}


def tool_call_pb(c: ToolCall) -> common_pb2.ToolCall:
    return common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)


def tool_result_pb(r: ToolResult) -> common_pb2.ToolResult:
    return common_pb2.ToolResult(tool_call_id=r.tool_call_id, content=r.content)


def message_pb(m: Message) -> common_pb2.Message:
    out = common_pb2.Message(index=m.index, role=ROLE_PB[m.role], content=m.content, token_count=m.token_count,
                             status=STATUS_PB[m.status], turn_id=m.turn_id, created_at_ms=m.created_at_ms,
                             superseded=m.superseded)
    if m.tool_calls:
        out.tool_calls.extend(tool_call_pb(c) for c in m.tool_calls)
    if m.tool_results:
        out.tool_results.extend(tool_result_pb(r) for r in m.tool_results)
    return out


def summary_pb(summary: Summary) -> store_pb2.ConversationSummary:
    return store_pb2.ConversationSummary(text=summary.text, covers_through_index=summary.covers_through_index,
                                         token_count=summary.token_count, created_at_ms=summary.created_at_ms)


def turn_state_pb(state: TurnRecordState) -> store_pb2.TurnState:
    match state:
        case TurnRecordState.RECEIVED:
            return store_pb2.TURN_STATE_RECEIVED
        case TurnRecordState.RUNNING:
            return store_pb2.TURN_STATE_RUNNING
        case TurnRecordState.STORED:
            return store_pb2.TURN_STATE_STORED
        case TurnRecordState.STOPPED:
            return store_pb2.TURN_STATE_STOPPED
        case TurnRecordState.FAILED:
            return store_pb2.TURN_STATE_FAILED
        case _:
            typing.assert_never(state)


def conversation_pb(c: Conversation) -> common_pb2.Conversation:
    return common_pb2.Conversation(conversation_id=c.conversation_id, owner_id=c.owner_id, title=c.title,
                                   system_prompt_version=c.system_prompt_version, created_at_ms=c.created_at_ms,
                                   updated_at_ms=c.updated_at_ms)


def history_pb(history: History) -> store_pb2.ReadConversationResponse:
    response = store_pb2.ReadConversationResponse(conversation=conversation_pb(history.conversation),
                                                  messages=[message_pb(m) for m in history.messages],
                                                  message_count=history.conversation.message_count)
    if history.summary is not None:
        response.summary.CopyFrom(summary_pb(history.summary))
    return response


def claim_pb(claim: Claim) -> store_pb2.BeginTurnResponse:
    match claim:
        case Claimed(lease_id, expires, prompt_context, options, resume_text, taken_over):
            claimed = store_pb2.TurnClaimed(lease_id=lease_id, lease_expires_at_ms=expires,
                                            generation_options=options, resume_text=resume_text,
                                            taken_over=taken_over)
            if prompt_context is not None:
                claimed.context.CopyFrom(history_pb(prompt_context))
            return store_pb2.BeginTurnResponse(claimed=claimed)
        case InProgress(holder, expires):
            return store_pb2.BeginTurnResponse(in_progress=store_pb2.TurnInProgress(
                lease_holder=holder, lease_expires_at_ms=expires))
        case Done(reply, usage):
            return store_pb2.BeginTurnResponse(done=store_pb2.TurnDone(reply=message_pb(reply),
                                                                       usage=usage_pb(usage)))
        case Conflicted(stored):
            return store_pb2.BeginTurnResponse(conflict=store_pb2.TurnConflict(stored_fingerprint=stored))
        case _:
            typing.assert_never(claim)


def turn_record_pb(turn: TurnRecord) -> store_pb2.ReadTurnResponse:
    response = store_pb2.ReadTurnResponse(
        state=turn_state_pb(turn.state), fingerprint=turn.fingerprint, lease_holder=turn.lease_holder,
        lease_expires_at_ms=turn.lease_expires_at_ms, partial_text=turn.partial_text,
        event_sequence=turn.event_sequence, regenerates_turn_id=turn.regenerates_turn_id or "")
    if turn.reply is not None:
        response.reply.CopyFrom(message_pb(turn.reply))
        response.usage.CopyFrom(usage_pb(turn.usage))
    return response


# --- protobuf -> values (the callers' reading of the answers) ---

_ROLES = {common_pb2.ROLE_SYSTEM: Role.SYSTEM, common_pb2.ROLE_USER: Role.USER,
          common_pb2.ROLE_ASSISTANT: Role.ASSISTANT, common_pb2.ROLE_TOOL: Role.TOOL}
_STATES = {store_pb2.TURN_STATE_RECEIVED: TurnRecordState.RECEIVED, store_pb2.TURN_STATE_RUNNING: TurnRecordState.RUNNING,
           store_pb2.TURN_STATE_STORED: TurnRecordState.STORED, store_pb2.TURN_STATE_STOPPED: TurnRecordState.STOPPED,
           store_pb2.TURN_STATE_FAILED: TurnRecordState.FAILED}


def role_of(value: common_pb2.Role) -> Role:
    role = _ROLES.get(value)
    if role is None:
        raise InvalidArgument(f"unknown message role {value}")
    return role


def seed_pb(m: Seed) -> common_pb2.SeedMessage:
    return common_pb2.SeedMessage(role=role_pb(m.role), content=m.content, token_count=m.token_count,
                                  tool_calls=[tool_call_pb(c) for c in m.tool_calls],
                                  tool_results=[tool_result_pb(r) for r in m.tool_results])


def tool_calls_of(calls: typing.Iterable[common_pb2.ToolCall]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.id, c.name, c.arguments) for c in calls)


def tool_results_of(results: typing.Iterable[common_pb2.ToolResult]) -> tuple[ToolResult, ...]:
    return tuple(ToolResult(r.tool_call_id, r.content) for r in results)


def seed_of(m: common_pb2.SeedMessage, field: str = "message") -> Seed:
    if m.role == common_pb2.ROLE_UNSPECIFIED:
        raise InvalidArgument(f"{field}.role is required (system, user, assistant or tool)")
    return Seed(role_of(m.role), m.content, m.token_count, tool_calls_of(m.tool_calls),
                tool_results_of(m.tool_results))


def message_of(m: common_pb2.Message) -> Message:
    return Message(index=m.index, role=role_of(m.role), content=m.content, token_count=m.token_count,
                   status=parse_status(m.status, "message.status", MessageStatus.COMPLETE), turn_id=TurnId(m.turn_id),
                   created_at_ms=m.created_at_ms, superseded=m.superseded, tool_calls=tool_calls_of(m.tool_calls),
                   tool_results=tool_results_of(m.tool_results))


def conversation_of(c: common_pb2.Conversation, message_count: int = 0) -> Conversation:
    return Conversation(conversation_id=ConversationId(c.conversation_id), owner_id=OwnerId(c.owner_id),
                        title=c.title, system_prompt_version=c.system_prompt_version, created_at_ms=c.created_at_ms,
                        updated_at_ms=c.updated_at_ms, message_count=message_count)


def summary_of(s: store_pb2.ConversationSummary) -> Summary:
    return Summary(text=s.text, covers_through_index=s.covers_through_index, token_count=s.token_count,
                   created_at_ms=s.created_at_ms)


def history_of(r: store_pb2.ReadConversationResponse) -> History:
    return History(conversation_of(r.conversation, r.message_count), [message_of(m) for m in r.messages],
                   summary_of(r.summary) if r.HasField("summary") and r.summary.text else None)


def claim_of(r: store_pb2.BeginTurnResponse, context: typing.Callable[[store_pb2.TurnClaimed], History | None]
             ) -> Claim:
    """BeginTurn's answer; `context` decides what of a claim's prompt context the caller keeps."""
    match r.WhichOneof("outcome"):
        case "claimed":
            c = r.claimed
            return Claimed(LeaseId(c.lease_id), c.lease_expires_at_ms, context(c), c.generation_options,
                           c.resume_text, c.taken_over)
        case "in_progress":
            return InProgress(r.in_progress.lease_holder, r.in_progress.lease_expires_at_ms)
        case "done":
            return Done(message_of(r.done.reply), parse_usage(r.done.usage))
        case "conflict":
            return Conflicted(r.conflict.stored_fingerprint)
        case other:
            raise Unavailable(f"the store answered BeginTurn with {other!r}")


def finished_of(r: store_pb2.FinishTurnResponse) -> Stored:
    return Stored(r.already_finished, message_of(r.reply))


def progress_of(r: store_pb2.UpdateTurnProgressResponse) -> Progress:
    return Progress(r.held, r.lease_expires_at_ms)


def turn_record_of(r: store_pb2.ReadTurnResponse, turn: TurnId) -> TurnRecord:
    state = _STATES.get(r.state)
    if state is None:
        raise Unavailable(f"the store reported turn state {r.state}")
    return TurnRecord(turn_id=turn, state=state, fingerprint=r.fingerprint, lease_holder=r.lease_holder,
                      lease_expires_at_ms=r.lease_expires_at_ms, partial_text=r.partial_text,
                      event_sequence=r.event_sequence,
                      regenerates_turn_id=TurnId(r.regenerates_turn_id) if r.regenerates_turn_id else None,
                      reply=message_of(r.reply) if r.HasField("reply") else None, usage=parse_usage(r.usage))


def daily_usage_of(d: store_pb2.UsageDay) -> DailyUsage:
    return DailyUsage(d.day, parse_usage(d.usage), d.turns)
