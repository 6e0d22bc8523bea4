"""ChatService over gRPC: a thin servicer over `ChatCore` (protobuf <-> core values; errors mapped by the shared
decorators), and `build()` wiring the core to the store, router, engines and moderation.

Trust: who may call ChatService is `AUTHZ` (the gateway and internal clients acting for users; a peer chat
process forwarding a stop). Every RPC acts for the owner its request names, so with mutual TLS each needs an
owner token for that owner (bound to the request's conversation, or owner-wide for the owner-wide RPCs), checked
by `OwnerGuard` before the core runs; the guard keeps the token for the request, and chat's clients forward it
to the store, the engine and peer chat processes (clients.py)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import assert_never

import grpc

from chatmesh.chat import context, settings
from chatmesh.chat.clients import Channels, GrpcEngines, GrpcPeers, GrpcRouter, GrpcStore, Moderation
from chatmesh.chat.core import DEFAULT_SYSTEM_PROMPTS, ChatCore, ChatOptions
from chatmesh.chat.events import Blocked, Completed, TurnDelta, Failed, TurnStarted, Stopped, ToolCalled, TurnEvent
from chatmesh.chat.options import TurnOptions
from chatmesh.chat.turns import NewConversation
from chatmesh.mesh.turn import TurnRecordState
from chatmesh.store.values import MessageStatus, TurnRecord
from chatmesh.store.wire import conversation_pb, message_pb, seed_of, tool_call_pb, tool_results_of, usage_pb
from chatmesh.chat.observe import ChatMetrics
from chatmesh.chat.prompt import summary_threshold
from chatmesh.chat.prompting import ProfileRenderer
from chatmesh.mesh import identity, logs, metrics
from chatmesh.mesh import errors
from chatmesh.mesh import settings as mesh_settings
from chatmesh.mesh.config import Config, SettingRefused
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId, parse_turn_id
from chatmesh.mesh.message_size import MessageSize
from chatmesh.mesh.owner_guard import ConversationScoped, OwnerGuard, OwnerScoped
from chatmesh.mesh.server import Service, stream_errors, unary_errors
from chatmesh.mesh.trust import Trust
from chatmesh.model import profile as model_profile
from chatmesh.model.tools import AUTO, ChoiceMode, ToolChoice, ToolDefinition
from chatmesh.moderation.client import ModerationClient
from chatmesh.v1 import chat_pb2, chat_pb2_grpc

Ctx = grpc.aio.ServicerContext[object, object]

# Who may call what (authz.py): the gateway and internal clients that act for users (spiffe://chatmesh/client/*,
# with owner tokens from the gateway's OwnerTokenService); another chat process only forwards a stop to the
# process generating the turn (clients.GrpcPeers).
_FOR_USERS = [identity.GATEWAY, identity.ANY_CLIENT]
AUTHZ = {"chatmesh.v1.ChatService": {
    **{rpc: _FOR_USERS for rpc in (
        "CreateConversation", "GetConversation", "SendTurn", "AttachTurn", "RegenerateTurn", "ListConversations",
        "DeleteConversation", "GetUsage", "ExportUserData", "GetTurn", "DeleteTurn", "CompactConversation")},
    "StopTurn": [*_FOR_USERS, identity.CHAT],
}}


def event_to_proto(event: TurnEvent, turn: TurnId) -> chat_pb2.TurnEvent:
    out = chat_pb2.TurnEvent(sequence=event.sequence)
    match event.kind:
        case TurnStarted(replayed=replayed, prompt_tokens=prompt_tokens):
            out.started.turn_id = turn
            out.started.replayed = replayed
            if prompt_tokens is not None:
                out.started.prompt_tokens = prompt_tokens
        case TurnDelta(text=text):
            out.delta.text = text
        case ToolCalled(call=call, index=index):
            out.tool_call.call.CopyFrom(tool_call_pb(call))
            out.tool_call.index = index
        case Completed(usage=usage, replica_id=replica, finish_reason=reason):
            out.completed.usage.CopyFrom(usage_pb(usage))
            out.completed.replica_id = replica
            out.completed.finish_reason = reason
        case Stopped(usage=usage):
            out.stopped.usage.CopyFrom(usage_pb(usage))
        case Failed(message=message, retryable=retryable):
            out.failed.message = message
            out.failed.retryable = retryable
        case Blocked(stage=stage, category=category, reason=reason):
            out.blocked.stage = stage
            out.blocked.category = category
            out.blocked.reason = reason
        case _:
            assert_never(event.kind)
    return out


def options_of(o: chat_pb2.TurnOptions) -> TurnOptions:
    """A turn's options from the wire, checked: a bad value is INVALID_ARGUMENT naming the field."""
    temperature = o.temperature if o.HasField("temperature") else None
    top_p = o.top_p if o.HasField("top_p") else None
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise errors.InvalidArgument("options.temperature must be between 0 and 2")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise errors.InvalidArgument("options.top_p must be in (0, 1]")
    if o.max_tokens < 0:
        raise errors.InvalidArgument("options.max_tokens must be >= 0")
    if len(o.stop) > 4 or any(not s or len(s) > 64 for s in o.stop):
        raise errors.InvalidArgument("options.stop: at most 4 strings of 1-64 characters")
    threshold = o.compact_threshold_tokens if o.HasField("compact_threshold_tokens") else None
    if threshold is not None and threshold < 1:
        raise errors.InvalidArgument("options.compact_threshold_tokens must be at least 1")
    return TurnOptions(temperature=temperature, top_p=top_p, seed=o.seed if o.HasField("seed") else None,
                       stop=tuple(o.stop), max_tokens=o.max_tokens, instructions=o.instructions,
                       tools=tools_of(o.tools), tool_choice=tool_choice_of(o.tool_choice, o.tools),
                       parallel_tool_calls=o.parallel_tool_calls if o.HasField("parallel_tool_calls") else True,
                       compact_threshold_tokens=threshold)


MAX_TOOLS = 128


def tools_of(tools: Sequence[chat_pb2.ToolDefinition]) -> tuple[ToolDefinition, ...]:
    """The turn's tool definitions, checked: each a JSON function tool named as it says."""
    if len(tools) > MAX_TOOLS:
        raise errors.InvalidArgument(f"options.tools: at most {MAX_TOOLS} tools")
    out = []
    for i, t in enumerate(tools):
        try:
            definition = ToolDefinition.of(json.loads(t.definition_json))
        except (ValueError, KeyError, TypeError):
            raise errors.InvalidArgument(f"options.tools[{i}].definition_json must be a JSON function tool "
                                         '({"type": "function", "function": {"name": ...}})') from None
        if definition.name != t.name or not t.name:
            raise errors.InvalidArgument(f"options.tools[{i}]: name must be the definition's function name")
        out.append(definition)
    if len({t.name for t in out}) != len(out):
        raise errors.InvalidArgument("options.tools: tool names must be unique")
    return tuple(out)


def tool_choice_of(choice: chat_pb2.ToolChoice, tools: Sequence[chat_pb2.ToolDefinition]) -> ToolChoice:
    match choice.mode:
        case chat_pb2.TOOL_CHOICE_MODE_UNSPECIFIED | chat_pb2.TOOL_CHOICE_MODE_AUTO:
            return AUTO
        case chat_pb2.TOOL_CHOICE_MODE_NONE:
            return ToolChoice(ChoiceMode.NONE)
        case chat_pb2.TOOL_CHOICE_MODE_REQUIRED | chat_pb2.TOOL_CHOICE_MODE_NAMED if not tools:
            raise errors.InvalidArgument("options.tool_choice: a required or named tool needs options.tools")
        case chat_pb2.TOOL_CHOICE_MODE_REQUIRED:
            return ToolChoice(ChoiceMode.REQUIRED)
        case chat_pb2.TOOL_CHOICE_MODE_NAMED:
            if choice.name not in {t.name for t in tools}:
                raise errors.InvalidArgument(f"options.tool_choice.name {choice.name[:64]!r} is none of options.tools")
            return ToolChoice(ChoiceMode.NAMED, choice.name)
        case _:
            raise errors.InvalidArgument(f"options.tool_choice.mode: unknown value {choice.mode}")


def turn_pb(record: TurnRecord) -> chat_pb2.GetTurnResponse:
    """A stored turn record as GetTurn answers it."""
    reply = record.reply
    match record.state:
        case TurnRecordState.RECEIVED | TurnRecordState.RUNNING:
            return chat_pb2.GetTurnResponse(status=chat_pb2.TURN_STATUS_RUNNING, reply=record.partial_text)
        case TurnRecordState.FAILED:
            return chat_pb2.GetTurnResponse(status=chat_pb2.TURN_STATUS_FAILED)
        case TurnRecordState.STORED | TurnRecordState.STOPPED:
            assert reply is not None  # a stored turn has its reply
            status = {MessageStatus.COMPLETE: chat_pb2.TURN_STATUS_COMPLETED,
                      MessageStatus.STOPPED: chat_pb2.TURN_STATUS_STOPPED,
                      MessageStatus.BLOCKED: chat_pb2.TURN_STATUS_BLOCKED}[reply.status]
            return chat_pb2.GetTurnResponse(status=status, reply=reply.content, usage=usage_pb(record.usage),
                                            stored_at_ms=reply.created_at_ms,
                                            tool_calls=[tool_call_pb(c) for c in reply.tool_calls])
        case _:
            assert_never(record.state)


async def _first_text_timed(events: AsyncIterator[TurnEvent], observed: ChatMetrics | None
                            ) -> AsyncIterator[TurnEvent]:
    """`events`, timing a new turn's first text (a replayed turn's stored reply is not a first token)."""
    done = observed.first_text_timer() if observed is not None else None
    async for event in events:
        if done is not None:
            match event.kind:
                case TurnDelta():
                    done()
                    done = None
                case TurnStarted(replayed=True):
                    done = None
                case _:
                    pass
        yield event


class ChatServicer(chat_pb2_grpc.ChatServiceServicer):
    def __init__(self, core: ChatCore, guard: OwnerGuard = OwnerGuard(None), observed: ChatMetrics | None = None):
        self.core = core
        self.guard = guard
        self.observed = observed

    def _owner(self, request: OwnerScoped, context: Ctx) -> OwnerId:
        return self.guard.owner_wide(context, request)

    def _in(self, request: ConversationScoped, context: Ctx) -> tuple[OwnerId, ConversationId]:
        return self.guard.in_conversation(context, request)

    @unary_errors
    async def CreateConversation(self, request: chat_pb2.CreateConversationRequest, context: Ctx
                                 ) -> chat_pb2.CreateConversationResponse:
        conv = await self.core.create_conversation(self._owner(request, context), request.title, tuple(
            seed_of(m, f"messages[{i}]") for i, m in enumerate(request.messages)))
        return chat_pb2.CreateConversationResponse(conversation=conversation_pb(conv))

    @unary_errors
    async def GetConversation(self, request: chat_pb2.GetConversationRequest, context: Ctx
                              ) -> chat_pb2.GetConversationResponse:
        view = await self.core.get_conversation(*self._in(request, context))
        return chat_pb2.GetConversationResponse(conversation=conversation_pb(view.conversation),
                                                messages=[message_pb(m) for m in view.messages])

    @stream_errors
    async def SendTurn(self, request: chat_pb2.SendTurnRequest, context: Ctx
                       ) -> AsyncIterator[chat_pb2.SendTurnResponse]:
        owner, conv = self._in(request, context)
        turn = parse_turn_id(request.turn_id)
        create = NewConversation(request.create.title, tuple(
            seed_of(m, f"create.messages[{i}]") for i, m in enumerate(request.create.messages))) \
            if request.HasField("create") else None
        expect = parse_turn_id(request.expect_last_turn_id, "expect_last_turn_id") \
            if request.expect_last_turn_id else None
        events = self.core.send_turn(owner, conv, turn, request.content, options_of(request.options), create, expect,
                                     tool_results_of(request.tool_results),
                                     self.guard.prompt_allowance(context, request.prompt_token_allowance))
        async for event in _first_text_timed(events, self.observed):
            yield chat_pb2.SendTurnResponse(event=event_to_proto(event, turn))

    @stream_errors
    async def AttachTurn(self, request: chat_pb2.AttachTurnRequest, context: Ctx
                         ) -> AsyncIterator[chat_pb2.AttachTurnResponse]:
        owner, conv = self._in(request, context)
        turn = parse_turn_id(request.turn_id)
        async for event in self.core.attach(owner, conv, turn, request.after_sequence):
            yield chat_pb2.AttachTurnResponse(event=event_to_proto(event, turn))

    @unary_errors
    async def StopTurn(self, request: chat_pb2.StopTurnRequest, context: Ctx) -> chat_pb2.StopTurnResponse:
        owner, conv = self._in(request, context)
        turn = parse_turn_id(request.turn_id)
        stopped = await (self.core.release(owner, conv, turn) if request.release else self.core.stop(owner, conv, turn))
        return chat_pb2.StopTurnResponse(stopped=stopped)

    @stream_errors
    async def RegenerateTurn(self, request: chat_pb2.RegenerateTurnRequest, context: Ctx
                             ) -> AsyncIterator[chat_pb2.RegenerateTurnResponse]:
        owner, conv = self._in(request, context)
        turn = parse_turn_id(request.turn_id)
        events = self.core.regenerate(owner, conv, turn, options_of(request.options),
                                      self.guard.prompt_allowance(context, request.prompt_token_allowance))
        async for event in _first_text_timed(events, self.observed):
            yield chat_pb2.RegenerateTurnResponse(event=event_to_proto(event, turn))

    @unary_errors
    async def ListConversations(self, request: chat_pb2.ListConversationsRequest, context: Ctx
                                ) -> chat_pb2.ListConversationsResponse:
        convs = await self.core.list_conversations(self._owner(request, context), request.page_size)
        return chat_pb2.ListConversationsResponse(conversations=[conversation_pb(c) for c in convs])

    @unary_errors
    async def DeleteConversation(self, request: chat_pb2.DeleteConversationRequest, context: Ctx
                                 ) -> chat_pb2.DeleteConversationResponse:
        evicted = await self.core.delete_conversation(*self._in(request, context))
        return chat_pb2.DeleteConversationResponse(blocks_evicted=evicted)

    @unary_errors
    async def GetUsage(self, request: chat_pb2.GetUsageRequest, context: Ctx) -> chat_pb2.GetUsageResponse:
        days = await self.core.usage(self._owner(request, context), request.days)
        return chat_pb2.GetUsageResponse(days=[chat_pb2.DailyUsage(day=d.day, usage=usage_pb(d.usage), turns=d.turns)
                                               for d in days])

    @unary_errors
    async def GetTurn(self, request: chat_pb2.GetTurnRequest, context: Ctx) -> chat_pb2.GetTurnResponse:
        owner, conv = self._in(request, context)
        return turn_pb(await self.core.get_turn(owner, conv, parse_turn_id(request.turn_id)))

    @unary_errors
    async def DeleteTurn(self, request: chat_pb2.DeleteTurnRequest, context: Ctx) -> chat_pb2.DeleteTurnResponse:
        owner, conv = self._in(request, context)
        evicted = await self.core.delete_turn(owner, conv, parse_turn_id(request.turn_id))
        return chat_pb2.DeleteTurnResponse(blocks_evicted=evicted)

    @unary_errors
    async def CompactConversation(self, request: chat_pb2.CompactConversationRequest, context: Ctx
                                  ) -> chat_pb2.CompactConversationResponse:
        owner, conv = self._in(request, context)
        expect = parse_turn_id(request.expect_last_turn_id, "expect_last_turn_id") \
            if request.expect_last_turn_id else None
        done = await self.core.compact(owner, conv, expect)
        return chat_pb2.CompactConversationResponse(
            summary_text=done.summary.text, covers_through_index=done.summary.covers_until - 1,
            token_count=done.token_count, prompt_tokens=done.prompt_tokens)

    @unary_errors
    async def ExportUserData(self, request: chat_pb2.ExportUserDataRequest, context: Ctx
                             ) -> chat_pb2.ExportUserDataResponse:
        return chat_pb2.ExportUserDataResponse(json=await self.core.export(self._owner(request, context)))


def load_system_prompts(path: str) -> dict[str, str]:
    if not path:
        return dict(DEFAULT_SYSTEM_PROMPTS)
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError(f"{path}: expected a JSON object mapping version names to prompt text")
    return data


def context_tokens(cfg: Config, served: model_profile.ModelProfile) -> int:
    """The context a prompt plus its reply must fit: the served model's, within CHATMESH_CONTEXT_TOKENS (a
    deployment may run a model with less than it was trained for, e.g. a TensorRT-LLM engine's max_seq_len)."""
    return min(cfg[settings.CONTEXT_TOKENS], served.context_tokens)


def build(cfg: Config, trust: Trust | None = None) -> Service:
    """ChatService; `trust` is the process's (default: what the settings say, as spiffe://chatmesh/chat)."""
    trust = trust or Trust.from_config(cfg, identity.CHAT)
    channels = Channels(trust)
    served = model_profile.load(cfg)  # CHATMESH_MODEL: the same profile as every engine's (checked per generation)
    renderer = ProfileRenderer(served)
    logs.get("chatmesh.chat").info("model_profile", model_id=served.model_id,
                                   tokenizer_digest=served.identity.tokenizer_digest,
                                   chat_format=served.chat_format.name, context_tokens=served.context_tokens)
    prompts = load_system_prompts(cfg[settings.SYSTEM_PROMPTS])
    default_version = cfg[settings.SYSTEM_PROMPT_VERSION]
    if default_version not in prompts:
        raise SettingRefused(f"CHATMESH_SYSTEM_PROMPT_VERSION {default_version!r} is not among {sorted(prompts)}")
    limits = context.PromptLimits(context_tokens=context_tokens(cfg, served),
                                  prompt_cap_tokens=cfg[settings.PROMPT_CAP_TOKENS],
                                  reply_tokens=cfg[settings.MAX_REPLY_TOKENS])
    options = ChatOptions(
        limits=limits,
        temperature=cfg[settings.TEMPERATURE], top_p=cfg[settings.TOP_P],
        lease_ttl_ms=cfg[settings.LEASE_TTL_MS], engine_deadline_s=cfg[settings.ENGINE_DEADLINE_S],
        progress_interval_s=cfg[settings.PROGRESS_INTERVAL_MS] / 1000,
        summary_threshold_tokens=summary_threshold(limits, cfg[settings.SUMMARY_THRESHOLD_TOKENS]),
        keep_recent_messages=cfg[settings.KEEP_RECENT_MESSAGES],
        advertise_address=(cfg[settings.ADVERTISE_ADDRESS] or cfg[mesh_settings.LISTEN]
                           or cfg[mesh_settings.CHAT_ADDRESS]),
        instance_id=cfg[settings.INSTANCE_ID] or f"chat-{socket.gethostname()}-{os.getpid()}",
        system_prompts=prompts, default_prompt_version=default_version,
        message_size=MessageSize.from_config(cfg))
    registry = metrics.Registry()
    observed = ChatMetrics(registry)
    moderation = Moderation(ModerationClient.from_config(cfg, registry.prometheus, trust=trust))
    core = ChatCore(
        store=GrpcStore(channels.get(cfg[mesh_settings.STORE_ADDRESS], "store"), observed),
        router=GrpcRouter(channels.get(cfg[mesh_settings.ROUTER_ADDRESS], "router"),
                          wait_s=cfg[settings.ROUTER_WAIT_MS] / 1000),
        engines=GrpcEngines(channels, observed, model=served.identity),
        moderation=moderation,
        renderer=renderer, count_tokens=renderer.count, options=options, peers=GrpcPeers(channels),
        observe=observed.on_move)

    def register(server: grpc.aio.Server) -> list[str]:
        chat_pb2_grpc.add_ChatServiceServicer_to_server(ChatServicer(core, OwnerGuard(trust.verifier), observed), server)
        return [chat_pb2.DESCRIPTOR.services_by_name["ChatService"].full_name]

    async def close() -> None:
        await core.close()
        await moderation.close()
        await channels.close()

    return Service(name="chat", register=register, close=close, stopping=core.mark_draining, authz=AUTHZ, metrics=registry)
