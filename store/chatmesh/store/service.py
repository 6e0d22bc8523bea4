"""StoreService: the thin gRPC layer over `chatmesh.store.core.ConversationStore`.

Converts protobuf to core values (ids parsed by `chatmesh.mesh.ids`, so a malformed id is INVALID_ARGUMENT
naming its field) and back; typed core errors become status codes in `chatmesh.mesh.server`. At start the
schema is migrated to head (Alembic; on PostgreSQL under an advisory lock, so replicas starting together
migrate once); the engine is closed at stop. A background task purges what is past retention every
CHATMESH_STORE_PURGE_INTERVAL_S seconds and logs the conversation ids it removed; the engines' copies of a
purged conversation age out of their LRU (the chat service evicts on explicit deletion).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from chatmesh.mesh import identity, logs, metrics, tracing
from chatmesh.mesh import settings as mesh_settings
from chatmesh.mesh.config import Config
from chatmesh.mesh.ids import ConversationId, OwnerId, parse_conversation_id, parse_lease_id, parse_turn_id
from chatmesh.mesh.owner_guard import ConversationScoped, OwnerGuard, OwnerScoped
from chatmesh.mesh.server import Service, unary_errors
from chatmesh.mesh.trust import Trust
from chatmesh.store import settings
from chatmesh.store.core import ConversationStore
from chatmesh.store.limits import FieldLimits
from chatmesh.store.db import database_url, make_engine
from chatmesh.store.migrate import prepare_schema
from chatmesh.store.values import Claim, Claimed, Conflicted, Done, InProgress, MessageStatus, Purged, Reply
from chatmesh.store.wire import (
    claim_pb, conversation_pb, history_pb, message_pb, parse_status, parse_usage, seed_of, summary_pb, tool_calls_of,
    tool_results_of, turn_record_pb,
    usage_pb,
)
from chatmesh.v1 import store_pb2, store_pb2_grpc

log = logs.get("chatmesh.store.service")

S = TypeVar("S")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("cancelled_call_ended", error_type=type(task.exception()).__name__)


def completes(fn: Callable[[S, Req, Context], Awaitable[Resp]]) -> Callable[[S, Req, Context], Awaitable[Resp]]:
    """Runs a store RPC's work to its end even when its caller goes away (a cancelled handler): an SQLAlchemy
    statement interrupted by a cancellation makes SQLAlchemy drop its connection mid-statement, which leaves
    asyncpg's future for it unretrieved (a "Future exception was never retrieved" line) and empties the pool
    for the calls after it. The statements are short and bounded; the cancelled caller gets its CANCELLED at
    once, the work's own outcome is discarded (its exception retrieved here)."""

    @functools.wraps(fn)
    async def wrapper(self: S, request: Req, context: Context) -> Resp:
        work = asyncio.ensure_future(fn(self, request, context))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(_retrieve)
            raise

    return wrapper


Context = grpc.aio.ServicerContext[Any, Any]


# Who may call what (authz.py): only chat reads or writes conversations, and each such call also needs the
# owner's token (owner_guard.py); the operator runs the retention purge.
AUTHZ = {"chatmesh.v1.StoreService": {
    **{rpc: [identity.CHAT] for rpc in (
        "InsertConversation", "ReadConversation", "BeginTurn", "FinishTurn", "FailTurn", "UpdateTurnProgress",
        "ReadTurn", "SaveSummary", "ListOwnerConversations", "DeleteStoredConversation", "DeleteStoredTurn",
        "DeleteOwnerData",
        "ExportOwnerData", "ReadUsage")},
    "PurgeExpired": [identity.OPERATOR],
}}


class StoreMetrics:
    """The store's own metrics (its calls by RPC and status code, with latency, come from the bootstrap):
    claims by answer, and what retention purges removed."""

    def __init__(self, registry: metrics.Registry) -> None:
        claims = registry.counter("chatmesh_store_claims", "BeginTurn answers: claimed, in_progress, done, conflict",
                                  ["answer"])
        self.claims: dict[type[Claim], metrics.CounterChild] = {kind: claims.labels(name) for kind, name in (
            (Claimed, "claimed"), (InProgress, "in_progress"), (Done, "done"), (Conflicted, "conflict"))}
        self.purges = registry.counter("chatmesh_store_purges", "retention purge runs by outcome", ["outcome"])
        self.purged = registry.counter("chatmesh_store_purged_conversations", "conversations purged past retention")
        self.abandoned = registry.counter("chatmesh_store_purged_abandoned_turns",
                                          "unfinished turns whose lease had long expired, purged")

    def purge(self, purged: Purged | None) -> None:
        self.purges.labels("ok" if purged is not None else "failed").inc()
        if purged is not None:
            self.purged.inc(len(purged.conversations))
            self.abandoned.inc(purged.abandoned_turns)


class StoreServicer(store_pb2_grpc.StoreServiceServicer):
    def __init__(self, store: ConversationStore, guard: OwnerGuard = OwnerGuard(None),
                 observed: StoreMetrics | None = None) -> None:
        self.store = store
        self.guard = guard
        self.metrics = observed or StoreMetrics(metrics.Registry(process=False))

    def _in_conversation(self, request: ConversationScoped, context: Context) -> tuple[OwnerId, ConversationId]:
        return self.guard.in_conversation(context, request)

    def _owner_wide(self, request: OwnerScoped, context: Context) -> OwnerId:
        return self.guard.owner_wide(context, request)

    @unary_errors
    @completes
    async def InsertConversation(self, request: store_pb2.InsertConversationRequest,
                                 context: Context) -> store_pb2.InsertConversationResponse:
        # Creating a named conversation (chat's SendTurn with `create`) needs a token for that conversation (or
        # an owner-wide one): the call can only make, or return, that one conversation of the owner.
        named = parse_conversation_id(request.conversation_id) if request.conversation_id else None
        owner = self._owner_wide(request, context) if named is None else \
            self.guard.owner(context, request.owner_id, named)
        conv, created = await self.store.conversations.create_conversation(
            owner, request.title, request.system_prompt_version, conversation=named,
            seed=[seed_of(m, f"messages[{i}]") for i, m in enumerate(request.messages)])
        return store_pb2.InsertConversationResponse(conversation=conversation_pb(conv), created=created)

    @unary_errors
    @completes
    async def ReadConversation(self, request: store_pb2.ReadConversationRequest,
                               context: Context) -> store_pb2.ReadConversationResponse:
        return history_pb(await self.store.conversations.read_conversation(
            *self._in_conversation(request, context),
            from_index=request.from_index, max_messages=request.max_messages))

    @unary_errors
    @completes
    async def BeginTurn(self, request: store_pb2.BeginTurnRequest, context: Context) -> store_pb2.BeginTurnResponse:
        outcome = await self.store.turns.begin_turn(
            *self._in_conversation(request, context),
            parse_turn_id(request.turn_id), content=request.content, lease_holder=request.lease_holder,
            fingerprint=request.fingerprint, lease_ttl_ms=request.lease_ttl_ms,
            regenerates=parse_turn_id(request.regenerates_turn_id, "regenerates_turn_id")
            if request.regenerates_turn_id else None, context_messages=request.context_max_messages,
            options=request.generation_options, tool_results=tool_results_of(request.tool_results))
        self.metrics.claims[type(outcome)].inc()
        tracing.annotate({"chatmesh.claim": type(outcome).__name__.lower()})
        return claim_pb(outcome)

    @unary_errors
    @completes
    async def FinishTurn(self, request: store_pb2.FinishTurnRequest,
                         context: Context) -> store_pb2.FinishTurnResponse:
        reply = Reply(user_token_count=request.user_token_count, text=request.reply,
                      token_count=request.reply_token_count,
                      status=parse_status(request.reply_status, "reply_status", MessageStatus.COMPLETE),
                      usage=parse_usage(request.usage),
                      user_status=parse_status(request.user_status, "user_status", MessageStatus.COMPLETE),
                      tool_calls=tool_calls_of(request.reply_tool_calls))
        finished = await self.store.turns.finish_turn(
            *self._in_conversation(request, context),
            parse_turn_id(request.turn_id), parse_lease_id(request.lease_id), reply)
        return store_pb2.FinishTurnResponse(already_finished=finished.already_finished,
                                            reply=message_pb(finished.reply))

    @unary_errors
    @completes
    async def FailTurn(self, request: store_pb2.FailTurnRequest, context: Context) -> store_pb2.FailTurnResponse:
        released = await self.store.turns.fail_turn(
            *self._in_conversation(request, context),
            parse_turn_id(request.turn_id), parse_lease_id(request.lease_id), request.reason, request.partial_text)
        return store_pb2.FailTurnResponse(released=released)

    @unary_errors
    @completes
    async def UpdateTurnProgress(self, request: store_pb2.UpdateTurnProgressRequest,
                                 context: Context) -> store_pb2.UpdateTurnProgressResponse:
        progress = await self.store.turns.update_turn_progress(
            *self._in_conversation(request, context),
            parse_turn_id(request.turn_id), parse_lease_id(request.lease_id), request.partial_text,
            request.event_sequence, request.lease_ttl_ms)
        return store_pb2.UpdateTurnProgressResponse(held=progress.held,
                                                    lease_expires_at_ms=progress.lease_expires_at_ms)

    @unary_errors
    @completes
    async def ReadTurn(self, request: store_pb2.ReadTurnRequest, context: Context) -> store_pb2.ReadTurnResponse:
        turn = await self.store.turns.read_turn(*self._in_conversation(request, context),
                                          parse_turn_id(request.turn_id))
        return turn_record_pb(turn)

    @unary_errors
    @completes
    async def SaveSummary(self, request: store_pb2.SaveSummaryRequest,
                          context: Context) -> store_pb2.SaveSummaryResponse:
        summary = await self.store.conversations.save_summary(
            *self._in_conversation(request, context), request.text,
            request.covers_through_index, request.token_count)
        return store_pb2.SaveSummaryResponse(summary=summary_pb(summary))

    @unary_errors
    @completes
    async def ListOwnerConversations(self, request: store_pb2.ListOwnerConversationsRequest,
                                     context: Context) -> store_pb2.ListOwnerConversationsResponse:
        convs = await self.store.conversations.list_conversations(self._owner_wide(request, context), request.page_size)
        return store_pb2.ListOwnerConversationsResponse(conversations=[conversation_pb(c) for c in convs])

    @unary_errors
    @completes
    async def DeleteStoredConversation(self, request: store_pb2.DeleteStoredConversationRequest,
                                       context: Context) -> store_pb2.DeleteStoredConversationResponse:
        evict = await self.store.lifecycle.delete_conversation(*self._in_conversation(request, context))
        return store_pb2.DeleteStoredConversationResponse(evict_conversation_ids=evict)

    @unary_errors
    @completes
    async def DeleteStoredTurn(self, request: store_pb2.DeleteStoredTurnRequest,
                               context: Context) -> store_pb2.DeleteStoredTurnResponse:
        evict, deleted = await self.store.lifecycle.delete_turn(*self._in_conversation(request, context),
                                                      parse_turn_id(request.turn_id))
        return store_pb2.DeleteStoredTurnResponse(evict_conversation_ids=evict, messages_deleted=deleted)

    @unary_errors
    @completes
    async def DeleteOwnerData(self, request: store_pb2.DeleteOwnerDataRequest,
                              context: Context) -> store_pb2.DeleteOwnerDataResponse:
        evict = await self.store.lifecycle.delete_user_data(self._owner_wide(request, context))
        return store_pb2.DeleteOwnerDataResponse(evict_conversation_ids=evict)

    @unary_errors
    @completes
    async def ExportOwnerData(self, request: store_pb2.ExportOwnerDataRequest,
                              context: Context) -> store_pb2.ExportOwnerDataResponse:
        document = await self.store.lifecycle.export_user_data(self._owner_wide(request, context))
        return store_pb2.ExportOwnerDataResponse(json=json.dumps(document, ensure_ascii=False))

    @unary_errors
    @completes
    async def ReadUsage(self, request: store_pb2.ReadUsageRequest, context: Context) -> store_pb2.ReadUsageResponse:
        days = await self.store.lifecycle.usage(self._owner_wide(request, context), request.days)
        return store_pb2.ReadUsageResponse(days=[
            store_pb2.UsageDay(day=d.day, usage=usage_pb(d.usage), turns=d.turns) for d in days])

    @unary_errors
    @completes
    async def PurgeExpired(self, request: store_pb2.PurgeExpiredRequest,
                           context: Context) -> store_pb2.PurgeExpiredResponse:
        purged = await self.store.lifecycle.purge_expired()
        self.metrics.purge(purged)
        return store_pb2.PurgeExpiredResponse(
            purged=[store_pb2.OwnedConversation(owner_id=o, conversation_id=c) for o, c in purged.conversations],
            abandoned_turns=purged.abandoned_turns)


async def purge_periodically(store: ConversationStore, interval_s: float, observed: StoreMetrics) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            purged = await store.lifecycle.purge_expired()
            observed.purge(purged)
            if purged.conversations:
                log.info("purged_conversations", conversation_ids=[c for _, c in purged.conversations])
        except Exception:  # the next round retries; a failed purge must not stop the service
            observed.purge(None)
            log.exception("purge_failed")


def build(cfg: Config, trust: Trust | None = None) -> Service:
    """The store; `trust` is the process's (default: what the settings say, as spiffe://chatmesh/store)."""
    trust = trust or Trust.from_config(cfg, identity.STORE)
    url = database_url(cfg[settings.DATABASE_URL], cfg[mesh_settings.DATA_DIR])
    engine = make_engine(url, pool_size=cfg[settings.DATABASE_POOL_SIZE],
                         search_path=cfg[settings.DATABASE_SCHEMA] or None)
    store = ConversationStore(engine, FieldLimits(
        max_content_bytes=cfg[mesh_settings.MAX_MESSAGE_BYTES], lease_ttl_ms=cfg[settings.LEASE_TTL_MS],
        retention_days=cfg[settings.RETENTION_DAYS]))
    registry = metrics.Registry()
    observed = StoreMetrics(registry)
    servicer = StoreServicer(store, OwnerGuard(trust.verifier), observed)
    service = Service(name="store", register=lambda server: _register(server, servicer), authz=AUTHZ,
                      metrics=registry)

    async def start() -> None:
        await prepare_schema(engine)
        interval = cfg[settings.PURGE_INTERVAL_S]
        if interval > 0:
            service.background.append(asyncio.create_task(purge_periodically(store, interval, observed)))

    async def close() -> None:
        await store.close()
        await engine.dispose()

    service.start, service.close = start, close
    return service


def _register(server: grpc.aio.Server, servicer: StoreServicer) -> Sequence[str]:
    store_pb2_grpc.add_StoreServiceServicer_to_server(servicer, server)
    return [store_pb2.DESCRIPTOR.services_by_name["StoreService"].full_name]
