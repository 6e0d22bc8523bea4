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
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol, cast

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
    Residency,
    Started,
    TierStats,
)
from chatmesh.engine_adapter.engine import EngineCore, StepReport
from chatmesh.engine_adapter.executor import SamplingParams
from chatmesh.engine_adapter.observe import EngineMetrics
from chatmesh.engine_adapter.residency import FROM_START
from chatmesh.mesh import identity
from chatmesh.mesh import metrics as mesh_metrics
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import InvalidArgument
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId, parse_conversation_id, parse_turn_id
from chatmesh.mesh.owner_guard import OwnerGuard
from chatmesh.mesh.server import Service, stream_errors, unary_errors
from chatmesh.mesh.trust import Trust
from chatmesh.model.profile import ModelIdentity, check_agreement

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


def conversation_of(req: generate_pb2.GenerateRequest) -> ConversationId | None:
    return parse_conversation_id(req.conversation_id) if req.conversation_id else None


def params_from_proto(req: generate_pb2.GenerateRequest, cache_salt: bytes) -> GenerateParams:
    """A validated GenerateParams; InvalidArgument names the bad field."""
    conversation = conversation_of(req)
    turn: TurnId | None = parse_turn_id(req.turn_id) if req.turn_id else None
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


def event_to_proto(event: GenerateEvent, replica_id: str) -> generate_pb2.GenerateResponse:
    match event:
        case Started():
            return generate_pb2.GenerateResponse(started=generate_pb2.GenerateStarted(
                replica_id=replica_id, cached_prompt_tokens=event.cached_tokens,
                host_cached_prompt_tokens=event.host_cached_tokens))
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


def stats_to_proto(s: EngineStats, model: ModelIdentity) -> generate_pb2.EngineStats:
    return generate_pb2.EngineStats(
        model=identity_to_proto(model),
        replica_id=s.replica_id, backend=s.backend, queue_depth=s.queue_depth,
        running_sequences=s.running_sequences, block_size=s.block_size,
        device=_tier(s.device), host=_tier(s.host),
        hit_tokens=s.hit_tokens, miss_tokens=s.miss_tokens, host_hit_tokens=s.host_hit_tokens,
        device_evictions=s.device_evictions, host_evictions=s.host_evictions, preemptions=s.preemptions,
        generations=s.generations)


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

    def _salt(self, context: grpc.aio.ServicerContext[object, object], owner_id: str,
              conversation: ConversationId | None, legacy: bytes) -> bytes:
        if not owner_id and self.guard.verifier is None:
            return legacy  # plaintext caller that names no owner: its own salt
        return self.salts.of(self.guard.owner(context, owner_id, conversation))

    @stream_errors
    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext[object, object]) -> AsyncIterator[generate_pb2.GenerateResponse]:
        params = params_from_proto(request, self._salt(context, request.owner_id, conversation_of(request),
                                                       request.cache_salt))
        if params.expected_model is not None:  # a prompt for another tokenizer: refused before any engine work
            check_agreement(params.expected_model, self.backend.model, self.replica_id)
        observed = self.metrics.generation(params, self.replica_id)
        # Cancelling the RPC cancels this coroutine inside backend.generate, whose cleanup cancels the sequence.
        async for event in self.backend.generate(params):
            observed.event(event)
            yield event_to_proto(event, self.replica_id)

    @unary_errors
    async def Evict(self, request: generate_pb2.EvictRequest,
                    context: grpc.aio.ServicerContext[object, object]) -> generate_pb2.EvictResponse:
        match request.WhichOneof("target"):
            case "conversation_id":
                conversation = parse_conversation_id(request.conversation_id)
                if request.owner_id or self.guard.verifier is not None:
                    self.guard.owner(context, request.owner_id, conversation)
                n = await self.backend.evict_conversation(conversation)
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

    async def PullPrefix(self, request: generate_pb2.PullPrefixRequest,
                         context: grpc.aio.ServicerContext[object, object]
                         ) -> AsyncIterator[generate_pb2.PullPrefixResponse]:
        if len(request.block_hashes) >= 0:  # always (the yield below only makes this an async generator)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this replica does not serve prefix pulls yet")
        yield generate_pb2.PullPrefixResponse()


def service_for(backend: Backend, replica_id: str, trust: Trust = Trust.insecure(), salt_secret: bytes = b""
                ) -> Service:
    """A Service running `backend` (tests build one around any backend)."""
    registry = mesh_metrics.Registry()
    observed = EngineMetrics(registry, backend)
    if isinstance(backend, EngineCore):  # step figures: the in-process engine's steps (Triton's run inside Triton)
        backend.on_step = _chain(backend.on_step, observed.on_step)
    servicer = GenerateServicer(backend, replica_id, OwnerGuard(trust.verifier), OwnerSalts(salt_secret), observed)

    def register(server: grpc.aio.Server) -> Sequence[str]:
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
        return [generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name]

    return Service(name="engine", register=register, start=backend.start, close=backend.close, authz=AUTHZ,
                   metrics=registry)


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
