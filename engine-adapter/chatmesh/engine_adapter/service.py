"""GenerateService: the thin gRPC layer over one `Backend` (backend.py).

It converts protobuf to core values and back; validation lives in `GenerateParams`, and typed core errors
(InvalidArgument, ResourceExhausted) become status codes in chatmesh.mesh.server's decorators. A request naming
the model its prompt was rendered for (`expected_model`) is checked against the backend's model first
(chatmesh.model.profile.check_agreement): another tokenizer is FAILED_PRECONDITION, before any engine work. The backend is
chosen by CHATMESH_ENGINE through `BACKENDS`: each entry is a module imported only when chosen (so `sim` needs
neither torch nor tritonclient) exposing `build_backend(cfg) -> Backend`.

Trust: Generate and Evict act for an owner, so with mutual TLS each needs an owner token for the request's
`owner_id` (mesh/owner_guard.py), and the cache salt is derived here, from the verified owner
(`OwnerSalts`: HMAC of CHATMESH_CACHE_SALT_SECRET), never taken from the caller: no caller can reuse or evict
another owner's cached prefix by naming its salt. Who may call what: `AUTHZ`. In plaintext a caller's owner id
is believed, and a request without one still uses the salt it carries (callers that predate owner_id).

Prefix pulls (transfer.py): PullPrefix is engine to engine. The source's servicer checks the owner token like
Generate's and derives the salt from the verified owner, so the block manager serves only that owner's blocks;
the puller's side is `GrpcPrefixPeer`, which dials the source as `spiffe://chatmesh/engine` (a certificate only
engines hold) and forwards the Generate call's owner token.

Draining (SIGTERM). The bootstrap sets health NOT_SERVING and awaits `Service.drain` before the server stops
taking calls: the backend refuses new generations (UNAVAILABLE: chat sends the turn elsewhere), running ones
finish, WatchStats streams stay open with `draining` set (the router moves this replica's conversations, naming
it as their source), and PullPrefix is served, for the whole grace period (CHATMESH_SHUTDOWN_GRACE_S; set it to
about the turn gap you want covered, and the pod's termination grace above it), or less when the replica has
nothing left to give: no generation running or queued, no transfer being served, no conversation cached.
Which host tier survives a restart: none (README, "Prefix transfer"): sim and local keep it in the engine
process, TensorRT-LLM's host_cache_size is its process's memory too; what carries the cache over is the drain.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Protocol, assert_never, cast

import grpc
from chatmesh.v1 import common_pb2, generate_pb2, generate_pb2_grpc

from chatmesh.engine_adapter import settings
from chatmesh.engine_adapter.backend import (
    Backend,
    Delta,
    EngineStats,
    Finished,
    FinishReason,
    GenerateEvent,
    GenerateParams,
    KvBlockData,
    KvLayout,
    PrefixEvicted,
    PullOutcome,
    PullSource,
    Residency,
    ResumeRefused,
    ServeRequest,
    Started,
    TierStats,
    TransferChunk,
    TransferEvent,
    TransferStarted,
    TransferStats,
)
from chatmesh.engine_adapter.engine import EngineCore, StepReport
from chatmesh.engine_adapter.executor import SamplingParams
from chatmesh.engine_adapter.observe import EngineMetrics
from chatmesh.engine_adapter.residency import FROM_START
from chatmesh.engine_adapter.transfer import (
    DEFAULT_MESSAGE_BYTES,
    HASH_BYTES,
    MAX_PULL_BLOCKS,
    PullFailed,
    PullRequest,
)
from chatmesh.mesh import identity, logs, tokens
from chatmesh.mesh import metrics as mesh_metrics
from chatmesh.mesh.channels import open_channel
from chatmesh.mesh.config import Config
from chatmesh.mesh import errors
from chatmesh.mesh.errors import InvalidArgument
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId, parse_conversation_id, parse_turn_id
from chatmesh.mesh.owner_guard import OwnerGuard
from chatmesh.mesh.server import Service, stream_errors, unary_errors
from chatmesh.mesh.trust import Trust, TrustRefused
from chatmesh.model.profile import ModelIdentity, check_agreement

log = logs.get("chatmesh.engine.service")

BACKENDS: dict[str, str] = {
    "sim": "chatmesh.engine_adapter.sim",
    "local": "chatmesh.engine_adapter.local",
    "triton": "chatmesh.engine_adapter.triton",
}
DEFAULT_WATCH_INTERVAL_MS = 1000
MIN_WATCH_INTERVAL_MS = 10
RESIDENCY_PER_UPDATE = 4096  # conversations per WatchStatsResponse; a longer listing spans several (~200 KiB each)


class _BackendModule(Protocol):
    def build_backend(self, cfg: Config) -> Backend: ...


def build_backend(cfg: Config) -> Backend:
    """The backend CHATMESH_ENGINE names, imported lazily."""
    module = cast(_BackendModule, importlib.import_module(BACKENDS[cfg[settings.ENGINE]]))
    return module.build_backend(cfg)


AUTHZ = {"chatmesh.v1.GenerateService": {
    "Generate": [identity.CHAT],
    "Evict": [identity.CHAT],
    "GetStats": [identity.ROUTER, identity.CHAT, identity.OPERATOR],
    "WatchStats": [identity.ROUTER, identity.CHAT, identity.OPERATOR],
    "PullPrefix": [identity.ENGINE],  # engine to engine only: a replica pulling a prefix before its prefill
    "CancelTurn": [identity.CHAT],  # a chat process that took a turn over cancels its old holder's sequences
}}


class OwnerSalts:
    """Per-owner cache salts (I1): blocks past the platform prefix are reused only under the same salt; keyed,
    so a salt cannot be computed without the secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._cache: dict[OwnerId, bytes] = {}

    def of(self, owner: OwnerId) -> bytes:
        salt = self._cache.get(owner)
        if salt is None:
            if len(self._cache) > 65_536:
                self._cache.clear()
            salt = self._cache[owner] = hmac.new(self._secret, owner.encode(), hashlib.sha256).digest()[:16]
        return salt


class _InConversation(Protocol):
    @property
    def conversation_id(self) -> str: ...


def conversation_of(req: _InConversation) -> ConversationId | None:
    return parse_conversation_id(req.conversation_id) if req.conversation_id else None


def params_from_proto(req: generate_pb2.GenerateRequest, cache_salt: bytes, owner: OwnerId | None = None
                      ) -> GenerateParams:
    """A validated GenerateParams (`owner`: the verified owner, None in plaintext without one); InvalidArgument
    names the bad field."""
    conversation = conversation_of(req)
    turn: TurnId | None = parse_turn_id(req.turn_id) if req.turn_id else None
    source = PullSource(req.source_replica_id, req.source_address) \
        if req.source_replica_id or req.source_address else None
    return GenerateParams(
        prompt_token_ids=tuple(req.prompt_token_ids),
        max_tokens=req.max_tokens,
        request_id=req.request_id,
        conversation_id=conversation,
        turn_id=turn,
        cache_salt=cache_salt,
        platform_prefix_tokens=req.platform_prefix_tokens,
        sampling=SamplingParams(temperature=req.temperature, top_p=req.top_p or 1.0, seed=req.seed),
        stop_token_ids=frozenset(req.stop_token_ids),
        expected_model=identity_from_proto(req.expected_model) if req.HasField("expected_model") else None,
        owner_id=owner,
        source=source,
        resumed_tokens=req.resumed_tokens,
    )


def identity_from_proto(m: generate_pb2.ModelIdentity) -> ModelIdentity:
    return ModelIdentity(m.model_id, m.tokenizer_digest)


def identity_to_proto(m: ModelIdentity) -> generate_pb2.ModelIdentity:
    return generate_pb2.ModelIdentity(model_id=m.model_id, tokenizer_digest=m.tokenizer_digest)


_REASONS = {
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.CANCELLED: generate_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: generate_pb2.FINISH_REASON_ERROR,
}


_OUTCOMES = {
    PullOutcome.PULLED: generate_pb2.PULL_OUTCOME_PULLED,
    PullOutcome.NOT_NEEDED: generate_pb2.PULL_OUTCOME_NOT_NEEDED,
    PullOutcome.NOT_HELD: generate_pb2.PULL_OUTCOME_NOT_HELD,
    PullOutcome.UNAVAILABLE: generate_pb2.PULL_OUTCOME_UNAVAILABLE,
    PullOutcome.DEADLINE: generate_pb2.PULL_OUTCOME_DEADLINE,
    PullOutcome.CORRUPT: generate_pb2.PULL_OUTCOME_CORRUPT,
    PullOutcome.UNSUPPORTED: generate_pb2.PULL_OUTCOME_UNSUPPORTED,
    PullOutcome.NO_ROOM: generate_pb2.PULL_OUTCOME_NO_ROOM,
    PullOutcome.EVICTED: generate_pb2.PULL_OUTCOME_EVICTED,
}
assert set(_OUTCOMES) == set(PullOutcome)


def event_to_proto(event: GenerateEvent, replica_id: str) -> generate_pb2.GenerateResponse:
    match event:
        case Started():
            outcome = _OUTCOMES[event.pull.outcome] if event.pull else generate_pb2.PULL_OUTCOME_UNSPECIFIED
            return generate_pb2.GenerateResponse(started=generate_pb2.GenerateStarted(
                replica_id=replica_id, cached_prompt_tokens=event.cached_tokens,
                host_cached_prompt_tokens=event.host_cached_tokens, pulled_prompt_tokens=event.pulled_tokens,
                pull_outcome=outcome))
        case Delta():
            return generate_pb2.GenerateResponse(delta=generate_pb2.GenerateDelta(
                token_ids=event.token_ids, text=event.text))
        case Finished():
            u = event.usage
            return generate_pb2.GenerateResponse(finished=generate_pb2.GenerateFinished(
                finish_reason=_REASONS[event.reason], error_message=event.error,
                usage=common_pb2.Usage(prompt_tokens=u.prompt_tokens, cached_prompt_tokens=u.cached_prompt_tokens,
                                       output_tokens=u.output_tokens)))
        case _:
            raise AssertionError(f"unknown event {event!r}")


def _tier(t: TierStats) -> generate_pb2.KvTierStats:
    return generate_pb2.KvTierStats(blocks_total=t.total, blocks_used=t.used, blocks_free=t.free,
                                    blocks_cached=t.cached)


def layout_to_proto(layout: KvLayout) -> generate_pb2.KvLayout:
    return generate_pb2.KvLayout(backend=layout.backend, model=identity_to_proto(layout.model),
                                 block_size=layout.block_size, dtype=layout.dtype, block_bytes=layout.block_bytes)


def layout_from_proto(m: generate_pb2.KvLayout) -> KvLayout:
    return KvLayout(m.backend, identity_from_proto(m.model), m.block_size, m.dtype, m.block_bytes)


def _transfer(t: TransferStats) -> generate_pb2.PrefixTransferStats:
    return generate_pb2.PrefixTransferStats(
        serves=t.serves, receives=t.receives, layout=layout_to_proto(t.layout) if t.layout else None,
        kv_bytes_per_token=t.layout.kv_bytes_per_token if t.layout else 0, pulled_tokens=t.pulled_tokens,
        pulled_bytes=t.pulled_bytes, pulls=t.pulls, failed_pulls=t.failed_pulls, served_blocks=t.served_blocks,
        served_bytes=t.served_bytes)


def stats_to_proto(s: EngineStats, model: ModelIdentity) -> generate_pb2.EngineStats:
    return generate_pb2.EngineStats(
        model=identity_to_proto(model),
        replica_id=s.replica_id, backend=s.backend, queue_depth=s.queue_depth,
        running_sequences=s.running_sequences, block_size=s.block_size,
        device=_tier(s.device), host=_tier(s.host),
        hit_tokens=s.hit_tokens, miss_tokens=s.miss_tokens, host_hit_tokens=s.host_hit_tokens,
        device_evictions=s.device_evictions, host_evictions=s.host_evictions, preemptions=s.preemptions,
        generations=s.generations, prefix_transfer=_transfer(s.transfer), draining=s.draining)


def transfer_to_proto(event: TransferEvent) -> generate_pb2.PullPrefixResponse:
    match event:
        case TransferStarted():
            return generate_pb2.PullPrefixResponse(started=generate_pb2.PullPrefixStarted(
                blocks=event.blocks, block_bytes=event.block_bytes))
        case TransferChunk():
            return generate_pb2.PullPrefixResponse(chunk=generate_pb2.KvBlockChunk(blocks=[
                generate_pb2.KvBlock(block_hash=b.hash, payload=b.payload, digest=b.digest) for b in event.blocks]))
        case _:
            assert_never(event)


def transfer_from_proto(resp: generate_pb2.PullPrefixResponse) -> TransferEvent | None:
    """A source's message as the core's event (None: a kind this version does not know)."""
    match resp.WhichOneof("event"):
        case "started":
            return TransferStarted(resp.started.blocks, resp.started.block_bytes)
        case "chunk":
            return TransferChunk(tuple(KvBlockData(b.block_hash, b.payload, b.digest) for b in resp.chunk.blocks))
        case _:
            return None


def pull_request_to_proto(r: PullRequest) -> generate_pb2.PullPrefixRequest:
    return generate_pb2.PullPrefixRequest(
        request_id=r.request_id, owner_id=r.owner_id, conversation_id=r.conversation_id or "",
        block_hashes=r.hashes, layout=layout_to_proto(r.layout), max_message_bytes=r.max_message_bytes)


_PULL_FAILURES = {
    grpc.StatusCode.ABORTED: PullOutcome.EVICTED,
    grpc.StatusCode.DEADLINE_EXCEEDED: PullOutcome.DEADLINE,
    grpc.StatusCode.FAILED_PRECONDITION: PullOutcome.UNSUPPORTED,
    grpc.StatusCode.UNIMPLEMENTED: PullOutcome.UNSUPPORTED,
}


class GrpcPrefixPeer:
    """The puller's side of PullPrefix: one channel per source address, dialled as this engine's identity; each
    call forwards the current request's owner token and carries the pull's deadline."""

    def __init__(self, trust: Trust) -> None:
        self.trust = trust
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> generate_pb2_grpc.GenerateServiceAsyncStub:
        channel = self._channels.get(address)
        if channel is None:
            self.trust.check_address(address, "prefix pull from")
            channel = self._channels[address] = open_channel(
                self.trust, address, "engine", [("grpc.max_receive_message_length", DEFAULT_MESSAGE_BYTES + 65536)])
        return generate_pb2_grpc.GenerateServiceStub(channel)

    async def pull(self, source: PullSource, request: PullRequest, timeout_s: float
                   ) -> AsyncGenerator[TransferEvent, None]:
        try:
            stub = self._stub(source.address)
        except TrustRefused as err:
            raise PullFailed(PullOutcome.UNAVAILABLE, str(err)) from None
        call = stub.PullPrefix(pull_request_to_proto(request), timeout=timeout_s, metadata=tokens.forwarded())
        try:
            async for resp in call:
                event = transfer_from_proto(resp)
                if event is None:
                    raise PullFailed(PullOutcome.CORRUPT, "a message kind this replica does not know")
                yield event
        except grpc.aio.AioRpcError as err:
            raise PullFailed(_PULL_FAILURES.get(err.code(), PullOutcome.UNAVAILABLE),
                             f"{err.code().name}: {err.details() or ''}") from None
        finally:
            call.cancel()

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close(None)


def residency_to_proto(r: Residency) -> list[generate_pb2.ResidencyUpdate]:
    """One update, or for a long listing several in a row (only the first flagged full)."""
    items = r.conversations
    chunks = [items[i:i + RESIDENCY_PER_UPDATE] for i in range(0, len(items), RESIDENCY_PER_UPDATE)] or [()]
    return [generate_pb2.ResidencyUpdate(full=r.full and k == 0, conversations=[
        generate_pb2.ConversationResidency(conversation_id=c, cached_tokens=n) for c, n in chunk])
        for k, chunk in enumerate(chunks)]


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    """Protobuf <-> Backend."""

    def __init__(self, backend: Backend, replica_id: str, guard: OwnerGuard = OwnerGuard(None),
                 salts: OwnerSalts = OwnerSalts(b""), metrics: EngineMetrics | None = None) -> None:
        self.backend = backend
        self.replica_id = replica_id
        self.guard = guard
        self.salts = salts
        self.metrics = metrics or EngineMetrics(mesh_metrics.Registry(process=False), backend)

    def _owner(self, context: grpc.aio.ServicerContext[object, object], owner_id: str,
               conversation: ConversationId | None, legacy: bytes) -> tuple[OwnerId | None, bytes]:
        """The verified owner and its salt (None and the request's own salt: a plaintext caller naming no owner)."""
        if not owner_id and self.guard.verifier is None:
            return None, legacy
        owner = self.guard.owner(context, owner_id, conversation)
        return owner, self.salts.of(owner)

    @stream_errors
    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext[object, object]) -> AsyncIterator[generate_pb2.GenerateResponse]:
        owner, salt = self._owner(context, request.owner_id, conversation_of(request), request.cache_salt)
        params = params_from_proto(request, salt, owner)
        if params.expected_model is not None:  # a prompt for another tokenizer: refused before any engine work
            check_agreement(params.expected_model, self.backend.model, self.replica_id)
        observed = self.metrics.generation(params, self.replica_id)
        # Cancelling the RPC cancels this coroutine inside backend.generate, whose cleanup cancels the sequence.
        try:
            async for event in self.backend.generate(params):
                observed.event(event)
                yield event_to_proto(event, self.replica_id)
        except ResumeRefused:
            context.set_trailing_metadata(((errors.RESUME_REFUSED_TRAILER, "1"),))
            raise

    @unary_errors
    async def CancelTurn(self, request: generate_pb2.CancelTurnRequest,
                         context: grpc.aio.ServicerContext[object, object]) -> generate_pb2.CancelTurnResponse:
        conversation = parse_conversation_id(request.conversation_id)
        turn = parse_turn_id(request.turn_id)
        _, salt = self._owner(context, request.owner_id, conversation, b"")
        cancelled = self.backend.cancel_turn(salt, turn)
        if cancelled:
            log.info("turn_cancelled", turn_id=turn, generations=cancelled, reason="lease_moved")
        return generate_pb2.CancelTurnResponse(cancelled=cancelled)

    @unary_errors
    async def Evict(self, request: generate_pb2.EvictRequest,
                    context: grpc.aio.ServicerContext[object, object]) -> generate_pb2.EvictResponse:
        match request.WhichOneof("target"):
            case "conversation_id":
                conversation = parse_conversation_id(request.conversation_id)
                # only the owner's own blocks of it: a conversation id is no secret, and alice's token naming bob's
                # conversation must not evict his cache (issue 30)
                salt = None
                if request.owner_id or self.guard.verifier is not None:
                    salt = self.salts.of(self.guard.owner(context, request.owner_id, conversation))
                n = await self.backend.evict_conversation(conversation, salt)
            case "cache_salt":
                if self.guard.verifier is not None:
                    raise InvalidArgument("evict an owner's blocks by owner_id: the engine derives salts itself")
                if not request.cache_salt:
                    raise InvalidArgument("cache_salt must not be empty")
                n = await self.backend.evict_salt(request.cache_salt)
            case None if request.owner_id:
                owner = self.guard.owner(context, request.owner_id, owner_wide=True)
                n = await self.backend.evict_salt(self.salts.of(owner))
            case _:
                raise InvalidArgument("set conversation_id, or owner_id alone (every block of that owner)")
        return generate_pb2.EvictResponse(blocks_evicted=n)

    @unary_errors
    async def GetStats(self, request: generate_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext[object, object]) -> generate_pb2.GetStatsResponse:
        return generate_pb2.GetStatsResponse(stats=stats_to_proto(self.backend.stats(), self.backend.model))

    @stream_errors
    async def WatchStats(self, request: generate_pb2.WatchStatsRequest,
                         context: grpc.aio.ServicerContext[object, object],
                         ) -> AsyncIterator[generate_pb2.WatchStatsResponse]:
        if request.interval_ms < 0:
            raise InvalidArgument("interval_ms must not be negative")
        interval = max(request.interval_ms or DEFAULT_WATCH_INTERVAL_MS, MIN_WATCH_INTERVAL_MS) / 1000
        cursor = FROM_START  # this stream's residency cursor: a full listing first, then changes
        while True:
            stats = stats_to_proto(self.backend.stats(), self.backend.model)
            residency = self.backend.residency(cursor) if request.include_residency else None
            if residency is None:
                yield generate_pb2.WatchStatsResponse(stats=stats)
            else:
                cursor = residency.version
                for update in residency_to_proto(residency):
                    yield generate_pb2.WatchStatsResponse(stats=stats, residency=update)
            await asyncio.sleep(interval)

    @stream_errors
    async def PullPrefix(self, request: generate_pb2.PullPrefixRequest,
                         context: grpc.aio.ServicerContext[object, object]
                         ) -> AsyncIterator[generate_pb2.PullPrefixResponse]:
        if not request.owner_id:
            raise InvalidArgument("owner_id must name the turn's owner (only its blocks are served)")
        owner = self.guard.owner(context, request.owner_id, conversation_of(request))
        hashes = tuple(request.block_hashes)
        if not 1 <= len(hashes) <= MAX_PULL_BLOCKS:
            raise InvalidArgument(f"block_hashes must name 1 to {MAX_PULL_BLOCKS} blocks, got {len(hashes)}")
        if any(len(h) != HASH_BYTES for h in hashes):
            raise InvalidArgument(f"every block hash is {HASH_BYTES} bytes")
        if not request.HasField("layout"):
            raise InvalidArgument("layout must describe the blocks the puller imports")
        if request.max_message_bytes < 0:
            raise InvalidArgument("max_message_bytes must not be negative")
        serve = ServeRequest(self.salts.of(owner), hashes, layout_from_proto(request.layout),
                             request.max_message_bytes or DEFAULT_MESSAGE_BYTES, request.request_id)
        t0 = time.perf_counter()
        sent = 0
        try:
            async for event in self.backend.serve_prefix(serve):
                if isinstance(event, TransferChunk):
                    sent += len(event.blocks)
                yield transfer_to_proto(event)
        except PrefixEvicted as err:
            await context.abort(grpc.StatusCode.ABORTED, str(err))
        log.debug("prefix_served", request_id=request.request_id, blocks=sent,
                  seconds=round(time.perf_counter() - t0, 4))


def service_for(backend: Backend, replica_id: str, trust: Trust = Trust.insecure(), salt_secret: bytes = b""
                ) -> Service:
    """A Service running `backend` (tests build one around any backend)."""
    registry = mesh_metrics.Registry()
    observed = EngineMetrics(registry, backend)
    if isinstance(backend, EngineCore):  # step figures: the in-process engine's steps (Triton's run inside Triton)
        backend.on_step = _chain(backend.on_step, observed.on_step)
    servicer = GenerateServicer(backend, replica_id, OwnerGuard(trust.verifier), OwnerSalts(salt_secret), observed)
    peer = GrpcPrefixPeer(trust)
    if isinstance(backend, EngineCore):
        backend.transfers.peer = peer

    def register(server: grpc.aio.Server) -> Sequence[str]:
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
        return [generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name]

    async def close() -> None:
        await backend.close()
        await peer.close()

    async def drain(grace_s: float) -> None:
        await drain_backend(backend, grace_s)

    return Service(name="engine", register=register, start=backend.start, close=close, authz=AUTHZ,
                   metrics=registry, drain=drain)


DRAIN_POLL_S = 0.1


def _keeps_anything(backend: Backend) -> bool:
    """Whether a draining replica still has something to give: generations, a transfer, a cached conversation."""
    s = backend.stats()
    if s.running_sequences or s.queue_depth or s.transfer.serving:
        return True
    if not s.transfer.serves:
        return False
    held = backend.residency(FROM_START)
    return held is not None and any(tokens for _, tokens in held.conversations)


async def drain_backend(backend: Backend, grace_s: float) -> None:
    """Marks the backend draining and waits out `grace_s`, or less once it keeps nothing (module header)."""
    backend.mark_draining()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    before = backend.stats().transfer
    log.info("draining", grace_s=grace_s, serves_pulls=before.serves)
    while (left := deadline - loop.time()) > 0 and _keeps_anything(backend):
        await asyncio.sleep(min(DRAIN_POLL_S, left))
    after = backend.stats().transfer
    log.info("drained", served_blocks=after.served_blocks - before.served_blocks,
             seconds=round(grace_s - max(0.0, deadline - loop.time()), 3))


def _chain(first: Callable[[StepReport], None] | None, then: Callable[[StepReport], None]
           ) -> Callable[[StepReport], None]:
    if first is None:
        return then

    def both(report: StepReport) -> None:
        first(report)
        then(report)

    return both


def build(cfg: Config, trust: Trust | None = None) -> Service:
    """The engine; `trust` is the process's (default: what the settings say, as spiffe://chatmesh/engine)."""
    return service_for(build_backend(cfg), cfg[settings.REPLICA_ID], trust or Trust.from_config(cfg, identity.ENGINE),
                       cfg[settings.CACHE_SALT_SECRET].encode())
