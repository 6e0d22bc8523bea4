"""gRPC implementations of the chat core's ports: domain values in, protobuf on the wire, domain values out.

Failures of downstream calls become typed core errors here, in one place (`translate`), so the core and the
ChatService servicer never see a raw gRPC error. The store's messages are read with the store's own conversions
(`chatmesh.store.wire`), so both sides of that wire share one model.

Trust: every channel comes from `chatmesh.mesh.channels.open_channel` with chat's own trust (mutual TLS as
spiffe://chatmesh/chat, expecting the named service's certificate). Owner tokens: the ChatService servicer
verifies the token a request arrives with (`OwnerGuard`), which keeps it as the request's `tokens.current`;
every owner-scoped call below (store, engine, a peer chat process) carries it on with `tokens.forwarded()`. The
core never handles the credential: tasks it starts for a turn (the claimed turn, its heartbeat) copy the
request's context when they are created, so the token travels with the work it authorises, and a call made
outside any request carries none and is refused by the store (fail closed, never another owner's token). The
router and moderation act for no owner and get no token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import TypeVar

import grpc

from chatmesh.chat.ports import (
    ClaimRequest, EngineDelta, EngineEvent, EngineFinished, EngineStarted, EngineUnreachable, FinishReason, Generation,
    OutputScreen, Pick, PullSource, Replica, ResumeRefused, RouteLeaseId, Screening, TurnKey,
)
from chatmesh.chat.observe import ChatMetrics
from chatmesh.mesh import errors, tokens, tracing
from chatmesh.mesh.channels import open_channel
from chatmesh.mesh.trust import Trust
from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, ReplicaId, TurnId
from chatmesh.model.profile import ModelIdentity
from chatmesh.moderation.client import ModerationClient, OutputSession, Outcome, categories_of
from chatmesh.store import wire
from chatmesh.store.values import (
    Claim, Conversation, DailyUsage, Stored, History, Progress, Reply, Seed, Summary, TurnRecord,
)
from chatmesh.v1 import (
    chat_pb2, chat_pb2_grpc, generate_pb2, generate_pb2_grpc, route_pb2, route_pb2_grpc, store_pb2, store_pb2_grpc,
)

T = TypeVar("T")
CANCEL_TIMEOUT_S = 2.0  # a takeover's CancelTurn on one replica (claimed.py): best effort, never holds the turn up long


def _trailer(err: grpc.aio.AioRpcError, key: str) -> bool:
    metadata: object = err.trailing_metadata()  # grpc.aio hands (key, value) pairs
    return any(k == key for k, _ in (metadata or ()))  # type: ignore[attr-defined]
Req = TypeVar("Req")
Resp = TypeVar("Resp")

_BY_CODE: dict[grpc.StatusCode, type[errors.CoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.Conflict,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,  # the owner token, e.g. expired mid-turn
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
}


def translate(err: grpc.aio.AioRpcError, service: str) -> errors.CoreError:
    """A downstream gRPC failure as a core error; anything not the caller's fault is Unavailable."""
    kind = _BY_CODE.get(err.code(), errors.Unavailable)
    detail = err.details() or err.code().name
    if kind is errors.Unavailable:
        return errors.Unavailable(f"{service} unavailable ({err.code().name}): {detail}")
    return kind(detail)


async def call(service: str, awaitable: Awaitable[T]) -> T:
    try:
        return await awaitable
    except grpc.aio.AioRpcError as err:
        raise translate(err, service) from None


async def _owned(rpc: grpc.aio.UnaryUnaryMultiCallable[Req, Resp], request: Req) -> Resp:
    """A store call for the request's owner, carrying its owner token."""
    return await call("store", rpc(request, metadata=tokens.forwarded()))


class Channels:
    """One channel per (address, service), reused by every call (connection setup is the expensive part of a
    hop); `service` is the one whose certificate the channel expects there."""

    def __init__(self, trust: Trust) -> None:
        self.trust = trust
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}

    def get(self, address: str, service: str) -> grpc.aio.Channel:
        if (address, service) not in self._channels:
            self._channels[(address, service)] = open_channel(self.trust, address, service)
        return self._channels[(address, service)]

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close(None)
        self._channels.clear()


def whole_context(claimed: store_pb2.TurnClaimed) -> History | None:
    """The context a claim returned, if it holds every message after the summary (else None: the core reads it)."""
    if not claimed.HasField("context"):
        return None
    view = claimed.context
    start = view.summary.covers_through_index + 1 if view.HasField("summary") and view.summary.text else 0
    if view.messages and view.messages[0].index != start:
        return None  # truncated at the claim's context_max_messages
    return wire.history_of(view)


class GrpcStore:
    """Every store call acts for an owner: each carries the request's owner token (`_owned`)."""

    def __init__(self, channel: grpc.aio.Channel, observed: ChatMetrics | None = None):
        self.stub = store_pb2_grpc.StoreServiceStub(channel)
        self.observed = observed

    async def insert_conversation(self, owner: OwnerId, title: str, system_prompt_version: str) -> Conversation:
        resp = await _owned(self.stub.InsertConversation, store_pb2.InsertConversationRequest(
            owner_id=owner, title=title, system_prompt_version=system_prompt_version))
        return wire.conversation_of(resp.conversation)

    async def create_conversation(self, owner: OwnerId, conversation: ConversationId | None, title: str,
                                  system_prompt_version: str, seed: Sequence[Seed]) -> tuple[Conversation, bool]:
        resp = await _owned(self.stub.InsertConversation, store_pb2.InsertConversationRequest(
            owner_id=owner, title=title, system_prompt_version=system_prompt_version,
            conversation_id=conversation or "", messages=[wire.seed_pb(m) for m in seed]))
        return wire.conversation_of(resp.conversation), resp.created

    async def delete_turn(self, key: TurnKey) -> list[ConversationId]:
        resp = await _owned(self.stub.DeleteStoredTurn, store_pb2.DeleteStoredTurnRequest(
            owner_id=key.owner, conversation_id=key.conversation, turn_id=key.turn))
        return [ConversationId(c) for c in resp.evict_conversation_ids]

    async def read_conversation(self, owner: OwnerId, conversation: ConversationId) -> History:
        return wire.history_of(await _owned(self.stub.ReadConversation, store_pb2.ReadConversationRequest(
            owner_id=owner, conversation_id=conversation)))

    async def begin_turn(self, claim: ClaimRequest) -> Claim:
        owner, conv, turn = claim.key
        with tracing.span("claim"):
            resp = await _owned(self.stub.BeginTurn, store_pb2.BeginTurnRequest(
                owner_id=owner, conversation_id=conv, turn_id=turn, fingerprint=claim.fingerprint,
                content=claim.content, lease_holder=claim.lease_holder, lease_ttl_ms=claim.lease_ttl_ms,
                regenerates_turn_id=claim.regenerates or "", context_max_messages=claim.context_messages,
                generation_options=claim.options,
                tool_results=[wire.tool_result_pb(r) for r in claim.tool_results]))
        return wire.claim_of(resp, whole_context)

    async def finish_turn(self, key: TurnKey, lease: LeaseId, reply: Reply) -> Stored:
        with tracing.span("finish", {"chatmesh.reply.status": reply.status.value,
                                     "gen_ai.usage.output_tokens": reply.usage.output_tokens}):
            resp = await _owned(self.stub.FinishTurn, store_pb2.FinishTurnRequest(
                owner_id=key.owner, conversation_id=key.conversation, turn_id=key.turn, lease_id=lease,
                user_token_count=reply.user_token_count, reply=reply.text, reply_token_count=reply.token_count,
                reply_status=wire.STATUS_PB[reply.status], usage=wire.usage_pb(reply.usage),
                user_status=wire.STATUS_PB[reply.user_status],
                reply_tool_calls=[wire.tool_call_pb(c) for c in reply.tool_calls]))
        return wire.finished_of(resp)

    async def fail_turn(self, key: TurnKey, lease: LeaseId, reason: str, shown: str = "") -> bool:
        resp = await _owned(self.stub.FailTurn, store_pb2.FailTurnRequest(
            owner_id=key.owner, conversation_id=key.conversation, turn_id=key.turn, lease_id=lease, reason=reason,
            partial_text=shown))
        return resp.released

    async def update_turn_progress(self, key: TurnKey, lease: LeaseId, partial_text: str, event_sequence: int,
                                   lease_ttl_ms: int) -> Progress:
        resp = await _owned(self.stub.UpdateTurnProgress, store_pb2.UpdateTurnProgressRequest(
            owner_id=key.owner, conversation_id=key.conversation, turn_id=key.turn, lease_id=lease,
            partial_text=partial_text, event_sequence=event_sequence, lease_ttl_ms=lease_ttl_ms))
        return wire.progress_of(resp)

    async def read_turn(self, key: TurnKey) -> TurnRecord:
        resp = await _owned(self.stub.ReadTurn, store_pb2.ReadTurnRequest(
            owner_id=key.owner, conversation_id=key.conversation, turn_id=key.turn))
        return wire.turn_record_of(resp, key.turn)

    async def save_summary(self, owner: OwnerId, conversation: ConversationId, text: str,
                           covers_through_index: int, token_count: int) -> Summary:
        resp = await _owned(self.stub.SaveSummary, store_pb2.SaveSummaryRequest(
            owner_id=owner, conversation_id=conversation, text=text, covers_through_index=covers_through_index,
            token_count=token_count))
        if self.observed is not None:
            self.observed.summaries.inc()
        return wire.summary_of(resp.summary)

    async def list_conversations(self, owner: OwnerId, limit: int) -> list[Conversation]:
        resp = await _owned(self.stub.ListOwnerConversations, store_pb2.ListOwnerConversationsRequest(
            owner_id=owner, page_size=limit))
        return [wire.conversation_of(c) for c in resp.conversations]

    async def delete_conversation(self, owner: OwnerId, conversation: ConversationId) -> list[ConversationId]:
        resp = await _owned(self.stub.DeleteStoredConversation, store_pb2.DeleteStoredConversationRequest(
            owner_id=owner, conversation_id=conversation))
        return [ConversationId(c) for c in resp.evict_conversation_ids]

    async def export(self, owner: OwnerId) -> str:
        resp = await _owned(self.stub.ExportOwnerData, store_pb2.ExportOwnerDataRequest(owner_id=owner))
        return resp.json

    async def usage(self, owner: OwnerId, days: int) -> list[DailyUsage]:
        resp = await _owned(self.stub.ReadUsage, store_pb2.ReadUsageRequest(owner_id=owner, days=days))
        return [wire.daily_usage_of(d) for d in resp.days]


class GrpcRouter:
    """The router, for picks and their leases. A pick waits up to `wait_s` for an answer with a replica: for the
    router's channel to connect (wait_for_ready: a router restarting, or one chat has not reconnected to yet) and
    through UNAVAILABLE answers (no replica serving yet: a router just started, before the engines' health answers
    reached it; the one replica restarting), asked again RETRY_PAUSE_S apart. So a brief router restart holds a
    turn for a moment instead of failing it back to the client's retry backoff; past `wait_s` the turn fails,
    retryable, as before."""

    RETRY_PAUSE_S = 0.05

    def __init__(self, channel: grpc.aio.Channel, wait_s: float = 1.5):
        self.stub = route_pb2_grpc.RouteServiceStub(channel)
        self.wait_s = wait_s

    async def _pick(self, request: route_pb2.PickReplicaRequest) -> route_pb2.PickReplicaResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while True:
            try:
                return await self.stub.PickReplica(request, wait_for_ready=True,
                                                   timeout=max(0.001, deadline - loop.time()))
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise errors.Unavailable(f"router unavailable: no pick within {self.wait_s * 1000:.0f} ms"
                                             ) from None
                if err.code() != grpc.StatusCode.UNAVAILABLE or loop.time() + self.RETRY_PAUSE_S >= deadline:
                    raise translate(err, "router") from None
            await asyncio.sleep(self.RETRY_PAUSE_S)

    async def pick(self, conversation: ConversationId, exclude: Sequence[ReplicaId] = ()) -> Pick:
        with tracing.span("route") as span:
            resp = await self._pick(route_pb2.PickReplicaRequest(conversation_id=conversation,
                                                                  exclude_replica_ids=list(exclude)))
            if span is not None:
                span.set_attribute("chatmesh.replica.id", resp.replica_id)
                span.set_attribute("chatmesh.route.spill", resp.outcome == route_pb2.PICK_OUTCOME_SPILL)
                if resp.source_replica_id:
                    span.set_attribute("chatmesh.route.source", resp.source_replica_id)
        source = PullSource(ReplicaId(resp.source_replica_id), resp.source_address) \
            if resp.source_replica_id and resp.source_address else None
        return Pick(ReplicaId(resp.replica_id), resp.address, RouteLeaseId(resp.lease_id), source)

    async def release(self, lease: RouteLeaseId) -> None:
        await call("router", self.stub.ReleaseLease(route_pb2.ReleaseLeaseRequest(lease_id=lease),
                                                    timeout=self.wait_s))

    async def replicas(self) -> list[Replica]:
        resp = await call("router", self.stub.ListReplicas(route_pb2.ListReplicasRequest()))
        return [Replica(ReplicaId(r.replica_id), r.address) for r in resp.replicas]


_FINISH = {generate_pb2.FINISH_REASON_STOP: FinishReason.STOP, generate_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
           generate_pb2.FINISH_REASON_CANCELLED: FinishReason.CANCELLED}


def engine_event(resp: generate_pb2.GenerateResponse) -> EngineEvent | None:
    """One engine message as the core's event (None: a kind this version does not know, skipped)."""
    match resp.WhichOneof("event"):
        case "started":
            return EngineStarted(resp.started.cached_prompt_tokens)
        case "delta":
            return EngineDelta(resp.delta.text, len(resp.delta.token_ids))
        case "finished":
            done = resp.finished
            # An unspecified reason is no finish the core can store: treated as the engine's error.
            return EngineFinished(_FINISH.get(done.finish_reason, FinishReason.ERROR), done.usage.output_tokens,
                                  done.error_message)
        case _:
            return None


class GrpcEngines:
    """Engine replicas over gRPC. With `model` (the profile chat renders with), every generation names it as its
    expected model, and an engine serving another tokenizer refuses it with FAILED_PRECONDITION before any work
    (chatmesh.model.profile.check_agreement): a misconfigured mesh fails the turn loudly, naming both models."""

    def __init__(self, channels: Channels, observed: ChatMetrics | None = None, model: ModelIdentity | None = None):
        self.channels = channels
        self.observed = observed
        self.expected = None if model is None else generate_pb2.ModelIdentity(
            model_id=model.model_id, tokenizer_digest=model.tokenizer_digest)

    async def generate(self, address: str, generation: Generation, timeout_s: float
                       ) -> AsyncGenerator[EngineEvent, None]:
        stub = generate_pb2_grpc.GenerateServiceStub(self.channels.get(address, "engine"))
        figures = _StreamFigures(self.observed, len(generation.prompt_token_ids))
        # the span is current when the call starts, so the engine's Generate span is its child
        with tracing.span("generate", {"gen_ai.usage.input_tokens": len(generation.prompt_token_ids)}):
            rpc = stub.Generate(generate_pb2.GenerateRequest(
                request_id=generation.request_id, conversation_id=generation.conversation,
                turn_id=generation.turn or "", owner_id=generation.owner, prompt_token_ids=generation.prompt_token_ids,
                platform_prefix_tokens=generation.platform_prefix_tokens, max_tokens=generation.max_tokens,
                temperature=generation.temperature, top_p=generation.top_p, seed=generation.seed,
                resumed_tokens=generation.resumed_tokens,
                expected_model=self.expected,
                source_replica_id=generation.source.replica_id if generation.source is not None else "",
                source_address=generation.source.address if generation.source is not None else ""),
                timeout=timeout_s, metadata=tokens.forwarded())
            answered = False
            try:
                async for resp in rpc:
                    answered = True
                    if (event := engine_event(resp)) is not None:
                        figures.event(event)
                        yield event
            except grpc.aio.AioRpcError as err:
                failure = translate(err, f"engine at {address}")
                if err.code() == grpc.StatusCode.UNAVAILABLE and not answered:
                    # not connected (a restarted engine chat has not reconnected to yet), or gone before its first
                    # message: nothing was generated, another replica may take the turn (claimed.py)
                    raise EngineUnreachable(str(failure)) from None
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION and _trailer(err, errors.RESUME_REFUSED_TRAILER):
                    raise ResumeRefused(str(failure)) from None
                raise failure from None
            finally:
                rpc.cancel()  # a no-op after a normal end; otherwise cancels the engine sequence

    async def evict(self, address: str, owner: OwnerId, conversation: ConversationId) -> int:
        stub = generate_pb2_grpc.GenerateServiceStub(self.channels.get(address, "engine"))
        resp = await call(f"engine at {address}", stub.Evict(generate_pb2.EvictRequest(
            owner_id=owner, conversation_id=conversation), metadata=tokens.forwarded()))
        return resp.blocks_evicted

    async def cancel_turn(self, address: str, owner: OwnerId, conversation: ConversationId, turn: TurnId) -> int:
        stub = generate_pb2_grpc.GenerateServiceStub(self.channels.get(address, "engine"))
        resp = await call(f"engine at {address}", stub.CancelTurn(generate_pb2.CancelTurnRequest(
            owner_id=owner, conversation_id=conversation, turn_id=turn), timeout=CANCEL_TIMEOUT_S,
            metadata=tokens.forwarded()))
        return resp.cancelled


class _StreamFigures:
    """One engine stream's contribution to chat's metrics and the `first_token` span (once per chunk, not token)."""

    __slots__ = ("observed", "prompt", "cached", "start_ns", "last")

    def __init__(self, observed: ChatMetrics | None, prompt_tokens: int) -> None:
        self.observed = observed
        self.prompt, self.cached = prompt_tokens, 0
        self.start_ns = time.time_ns()
        self.last = 0.0

    def event(self, event: EngineEvent) -> None:
        match event:
            case EngineStarted(cached_prompt_tokens=cached):
                self.cached = cached
            case EngineDelta(token_count=n):
                now = time.perf_counter()
                if not self.last:
                    tracing.record("first_token", self.start_ns, time.time_ns(),
                                   {"chatmesh.prompt.cached_tokens": self.cached})
                elif n and self.observed is not None:
                    self.observed.itl.observe((now - self.last) / n, n)
                self.last = now
            case EngineFinished(output_tokens=output):
                tracing.annotate({"chatmesh.prompt.cached_tokens": self.cached, "gen_ai.usage.output_tokens": output})
                if self.observed is not None:
                    self.observed.cached_tokens.inc(self.cached)
                    self.observed.prefilled_tokens.inc(self.prompt - self.cached)


def _screening(outcome: Outcome) -> Screening:
    """A moderation outcome as the turn records it; a failure-policy block names moderation, not a category."""
    if outcome.fallback:
        category = "moderation_unavailable"
    else:
        category = next(iter(categories_of(outcome)), "")
    return Screening(blocked=outcome.blocked, category=category, reason=outcome.reason, unavailable=outcome.fallback)


class ModerationOutput:
    """One reply's output session: chunks in order, one outcome each, the window spanning chunks. Its checks
    travel on a stream shared with other turns, so their span (`output_checks`) is timed here, open to close."""

    def __init__(self, session: OutputSession):
        self.session = session
        self.opened_ns = time.time_ns() if tracing.ON else 0
        self.chunks = 0

    async def check(self, chunk: str, final: bool = False) -> Screening:
        self.chunks += 1
        return _screening(await self.session.check(chunk, final=final))

    async def close(self) -> None:
        await self.session.close()
        if tracing.ON:
            tracing.record("output_checks", self.opened_ns, time.time_ns(), {"chatmesh.output.chunks": self.chunks})


class Moderation:
    """The moderation service through its client, which applies the configured failure policy per direction
    (fail closed or open) when the service is down, failing or slow, and says so in the outcome."""

    def __init__(self, client: ModerationClient):
        self.client = client

    async def check_input(self, text: str, conversation: ConversationId) -> Screening:
        with tracing.span("input_check"):
            return _screening(await self.client.check_input(text, conversation))

    async def open_output(self, conversation: ConversationId) -> OutputScreen:
        return ModerationOutput(self.client.output(conversation))

    async def close(self) -> None:
        await self.client.close()


class GrpcPeers:
    """Forwards a stop to the chat process that holds the turn's lease (as chat, with the stop's owner token)."""

    def __init__(self, channels: Channels):
        self.channels = channels

    async def stop(self, address: str, key: TurnKey, release: bool = False) -> bool:
        stub = chat_pb2_grpc.ChatServiceStub(self.channels.get(address, "chat"))
        resp = await call(f"chat process at {address}", stub.StopTurn(chat_pb2.StopTurnRequest(
            owner_id=key.owner, conversation_id=key.conversation, turn_id=key.turn, release=release), timeout=5,
            metadata=tokens.forwarded()))
        return resp.stopped
