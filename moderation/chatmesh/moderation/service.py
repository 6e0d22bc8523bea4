"""ModerateService: the thin gRPC layer over the moderation core (`moderator.py`).

CheckInput judges one user message; CheckOutput judges a streamed reply chunk by chunk, one verdict per chunk
in order, through the sliding window of one `OutputCheck` per stream; CheckOutputBatch does the same for many
replies multiplexed on one stream (one `OutputCheck` per reply id), one message per batch of chunks, which
is what the client uses: gRPC's per-message cost in Python, not the check, is what limits a core.
Checks go through the `CheckBatcher` (batched across streams; inline, or on a worker thread with
CHATMESH_MODERATION_CHECK_THREAD) under CHATMESH_MODERATION_CHECK_DEADLINE_MS; past it (or if the check
raises) the direction's failure policy decides and the verdict says so (`fallback`, and why in `reason`).

Bad input is INVALID_ARGUMENT: an empty message, a message or chunk over CHATMESH_MAX_MESSAGE_BYTES (the one
message size policy, chatmesh.mesh.message_size),
and a request that does not parse (a string field that is not UTF-8, which a hand-built client can send):
requests are decoded by a lenient deserializer here so that case reaches the servicer instead of failing
inside gRPC. Logs carry conversation ids, actions and category names, never text. Metrics (served by the
bootstrap on CHATMESH_MODERATION_METRICS_PORT): checks by direction and action, fallbacks by direction and reason,
check latency.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections import Counter as Counter_
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, assert_never

import grpc
from google.protobuf.message import DecodeError, Message
from chatmesh.mesh import identity
from chatmesh.mesh import logs, metrics
from chatmesh.mesh import settings as mesh_settings
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import CoreError, InvalidArgument, ResourceExhausted
from chatmesh.mesh.server import Service, stream_errors, unary_errors
from chatmesh.moderation import settings
from chatmesh.moderation.batcher import CheckBatcher
from chatmesh.moderation.classifier import profanity_model
from chatmesh.moderation.guard import TritonGuard
from chatmesh.moderation.moderator import ALLOW, Moderator, OutputCheck, Verdict, scaled, validate_text
from chatmesh.moderation.policy import Action, Direction, FailureMode, load
from chatmesh.v1 import moderate_pb2

log = logs.get("chatmesh.moderation.service")

SERVICE_NAME = moderate_pb2.DESCRIPTOR.services_by_name["ModerateService"].full_name
# Who may call what (authz.py): chat screens input and output; no one else.
AUTHZ = {SERVICE_NAME: {"CheckInput": [identity.CHAT], "CheckOutput": [identity.CHAT],
                        "CheckOutputBatch": [identity.CHAT]}}
Context = grpc.aio.ServicerContext[Any, Any]
M = TypeVar("M", bound=Message)
T = TypeVar("T")
MAX_REPLY_ID_BYTES = 128
MAX_OPEN_REPLIES = 4096
LONG_TEXT_BYTES = 64 * 1024  # an input check over this runs on a worker thread (~25 ms of checking and more)


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes did not parse as its message (for example a string field that is not UTF-8)."""

    message: str


def lenient(cls: type[M]) -> Callable[[bytes], M | Undecodable]:
    def deserialize(data: bytes) -> M | Undecodable:
        try:
            return cls.FromString(data)
        except DecodeError:
            return Undecodable(cls.DESCRIPTOR.name)

    return deserialize


def action_pb(action: Action) -> moderate_pb2.ModerationAction:
    match action:
        case Action.ALLOW:
            return moderate_pb2.MODERATION_ACTION_ALLOW
        case Action.FLAG:
            return moderate_pb2.MODERATION_ACTION_FLAG
        case Action.BLOCK:
            return moderate_pb2.MODERATION_ACTION_BLOCK
        case _ as unreachable:
            assert_never(unreachable)


_ALLOW_PB = moderate_pb2.Verdict(action=moderate_pb2.MODERATION_ACTION_ALLOW)


def verdict_pb(verdict: Verdict) -> moderate_pb2.Verdict:
    if verdict is ALLOW:  # the common case, built once
        return _ALLOW_PB
    return moderate_pb2.Verdict(
        action=action_pb(verdict.action),
        categories=[moderate_pb2.CategoryScore(category=c.category, score=c.score) for c in verdict.categories],
        reason=verdict.reason, fallback=verdict.fallback)


def _decoded(request: M | Undecodable) -> M:
    if isinstance(request, Undecodable):
        raise InvalidArgument(f"request is not a valid {request.message} (string fields must be UTF-8)")
    return request


class Metrics:
    def __init__(self, registry: metrics.Registry) -> None:
        self.registry = registry
        self.checks = registry.counter("chatmesh_moderation_checks", "checks by direction and action",
                                       ["direction", "action"])
        self.fallbacks = registry.counter("chatmesh_moderation_fallbacks",
                                          "checks decided by the failure policy, by direction and reason",
                                          ["direction", "reason"])
        self.latency = registry.histogram(
            "chatmesh_moderation_check_seconds", "time from request to verdict of one check (a batch: all its chunks)",
            (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1), ["direction"])


@dataclass(frozen=True)
class CheckLimits:
    max_bytes: int
    deadline_s: float
    on_input_failure: FailureMode
    on_output_failure: FailureMode

    def failure(self, direction: Direction) -> FailureMode:
        match direction:
            case Direction.INPUT:
                return self.on_input_failure
            case Direction.OUTPUT:
                return self.on_output_failure
            case _ as unreachable:
                assert_never(unreachable)


def _log_failure(direction: Direction, exc: Exception) -> None:
    if isinstance(exc, CoreError):  # an expected failure, such as Unavailable from a guard model
        log.warning("check_failed", direction=direction.value, error=type(exc).__name__, detail=str(exc))
    else:
        log.error("check_failed", direction=direction.value, exc_info=exc)


class ModerateServicer:
    def __init__(self, moderator: Moderator, batcher: CheckBatcher, limits: CheckLimits,
                 metrics: Metrics) -> None:
        self._moderator = moderator
        self._batcher = batcher
        self._limits = limits
        self._metrics = metrics
        self._stopping = asyncio.Event()

    def end_streams(self) -> None:
        """Shutdown has begun: shared CheckOutputBatch streams end (status OK) instead of outliving the server.

        Such a stream lives as long as the chat process that opened it, so it would still be open when this
        process exits and be cancelled there, which grpc reports as an unhandled error. Ended here, its client
        sees the stream close and answers any chunk still waiting with its failure policy, as it would for a
        moderation service that went away."""
        self._stopping.set()

    async def _until_stopping(self, requests: AsyncIterator[T]) -> AsyncIterator[T]:
        """`requests` until the client ends them or shutdown begins."""
        it = aiter(requests)
        stopping = asyncio.ensure_future(self._stopping.wait())
        received: asyncio.Future[T] | None = None
        try:
            while True:
                received = asyncio.ensure_future(anext(it))
                await asyncio.wait({received, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not received.done():
                    return
                try:
                    item = received.result()
                except StopAsyncIteration:
                    return
                received = None
                yield item
        finally:
            stopping.cancel()
            # The RPC can be cancelled while a read is pending (its client died): the read ends too, usually with
            # StopAsyncIteration, before or after this, and nothing else would retrieve it ("Task exception was
            # never retrieved" in the log). Cancel it if it still runs, and retrieve whatever it ended with.
            if received is not None:
                received.cancel()
                received.add_done_callback(_retrieve)

    async def _run(self, direction: Direction, check: Callable[[], Verdict],
                   late: Callable[[], object] = lambda: None, text_bytes: int = 0) -> Verdict:
        start = time.perf_counter()
        deadline_s = scaled(self._limits.deadline_s, text_bytes)
        try:
            if text_bytes > LONG_TEXT_BYTES:  # a pasted document: off the loop, so other streams' checks go on
                verdict = await asyncio.wait_for(asyncio.to_thread(check), deadline_s)
            else:
                verdict = await self._batcher.run(check, late, deadline_s)
        except TimeoutError:
            verdict = self._fallback(direction, "deadline", "check deadline passed")
        except Exception as exc:  # the check failed (a guard model down, a bug): the failure policy answers
            _log_failure(direction, exc)
            verdict = self._fallback(direction, "error", f"check failed ({type(exc).__name__})")
        self._metrics.latency.labels(direction.value).observe(time.perf_counter() - start)
        self._metrics.checks.labels(direction.value, verdict.action.name.lower()).inc()
        return verdict

    async def _run_batch(self, checks: list[tuple[OutputCheck, str]]) -> list[Verdict]:
        """Judges the chunks of one CheckOutputBatch request as one batcher job."""
        start = time.perf_counter()
        try:
            def skip_all() -> None:
                for check, text in checks:
                    check.skip(text)

            verdicts = await self._batcher.run(functools.partial(self._moderator.check_outputs, checks), skip_all,
                                               self._limits.deadline_s)
        except TimeoutError:
            verdicts = [self._fallback(Direction.OUTPUT, "deadline", "check deadline passed")] * len(checks)
        except Exception as exc:  # the check failed (a guard model down, a bug): the failure policy answers
            _log_failure(Direction.OUTPUT, exc)
            verdicts = [self._fallback(Direction.OUTPUT, "error", f"check failed ({type(exc).__name__})")] * len(checks)
        self._metrics.latency.labels("output").observe(time.perf_counter() - start)
        for action, n in Counter_(v.action for v in verdicts).items():
            self._metrics.checks.labels("output", action.name.lower()).inc(n)
        return verdicts

    def _fallback(self, direction: Direction, label: str, why: str) -> Verdict:
        mode = self._limits.failure(direction)
        self._metrics.fallbacks.labels(direction.value, label).inc()
        return Verdict.failed(mode.action, f"{why}; failing {mode.value}")

    @unary_errors
    async def CheckInput(self, request: moderate_pb2.CheckInputRequest | Undecodable,
                         context: Context) -> moderate_pb2.CheckInputResponse:
        text = _decoded(request).text
        validate_text(text, self._limits.max_bytes, "text")
        verdict = await self._run(Direction.INPUT, functools.partial(self._moderator.check_input, text),
                                  text_bytes=len(text.encode("utf-8", "surrogatepass")))
        log.info("input_checked", conversation_id=_logged_id(_decoded(request).conversation_id), action=verdict.action.name,
                 categories=[c.category for c in verdict.categories], fallback=verdict.fallback)
        return moderate_pb2.CheckInputResponse(verdict=verdict_pb(verdict))

    @stream_errors
    async def CheckOutput(self, requests: AsyncIterator[moderate_pb2.CheckOutputRequest | Undecodable],
                          context: Context) -> AsyncIterator[moderate_pb2.CheckOutputResponse]:
        check = self._moderator.open_output()
        conversation_id, chunks, chars, worst = "", 0, 0, Action.ALLOW
        try:
            async for raw in requests:
                request = _decoded(raw)
                validate_text(request.text, self._limits.max_bytes, "chunk text", allow_empty=True)
                conversation_id = conversation_id or request.conversation_id
                verdict = await self._run(Direction.OUTPUT, functools.partial(check.check, request.text),
                                          functools.partial(check.skip, request.text))
                chars += len(request.text)
                worst = max(worst, verdict.action)
                yield moderate_pb2.CheckOutputResponse(chunk_index=chunks, verdict=verdict_pb(verdict),
                                                       checked_chars=chars)
                chunks += 1
                if request.final:
                    break
        finally:
            log.info("output_checked", conversation_id=_logged_id(conversation_id), chunks=chunks, chars=chars,
                     worst=worst.name)


    @stream_errors
    async def CheckOutputBatch(self, requests: AsyncIterator[moderate_pb2.CheckOutputBatchRequest | Undecodable],
                               context: Context) -> AsyncIterator[moderate_pb2.CheckOutputBatchResponse]:
        replies: dict[str, _Reply] = {}
        try:
            async for raw in self._until_stopping(requests):
                request = _decoded(raw)
                batch: list[tuple[str, _Reply, str, bool]] = []
                for chunk in request.chunks:
                    reply_id = chunk.reply_id
                    if not reply_id or len(reply_id.encode()) > MAX_REPLY_ID_BYTES:
                        raise InvalidArgument(f"reply_id must be 1-{MAX_REPLY_ID_BYTES} bytes")
                    validate_text(chunk.text, self._limits.max_bytes, "chunk text", allow_empty=True)
                    reply = replies.get(reply_id)
                    if reply is None:
                        if len(replies) >= MAX_OPEN_REPLIES:
                            raise ResourceExhausted(f"more than {MAX_OPEN_REPLIES} replies open on one stream")
                        reply = replies[reply_id] = _Reply(self._moderator.open_output(), chunk.conversation_id)
                    batch.append((reply_id, reply, chunk.text, chunk.final))
                verdicts = await self._run_batch([(reply.check, text) for _, reply, text, _ in batch])
                out = moderate_pb2.CheckOutputBatchResponse()
                for (reply_id, reply, text, final), verdict in zip(batch, verdicts):
                    reply.chars += len(text)
                    reply.worst = max(reply.worst, verdict.action)
                    out.verdicts.append(moderate_pb2.OutputVerdict(
                        reply_id=reply_id, chunk_index=reply.chunks, verdict=verdict_pb(verdict),
                        checked_chars=reply.chars))
                    reply.chunks += 1
                    if final and replies.pop(reply_id, None) is not None:
                        reply.log()
                yield out
        finally:
            for reply in replies.values():
                reply.log()


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class _Reply:
    """One reply open on a CheckOutputBatch stream."""

    def __init__(self, check: OutputCheck, conversation_id: str) -> None:
        self.check = check
        self.conversation_id = conversation_id
        self.chunks = 0
        self.chars = 0
        self.worst = Action.ALLOW

    def log(self) -> None:
        log.info("output_checked", conversation_id=_logged_id(self.conversation_id), chunks=self.chunks, chars=self.chars,
                 worst=self.worst.name)


def _register(server: grpc.aio.Server, servicer: ModerateServicer) -> Sequence[str]:
    handlers = {
        "CheckInput": grpc.unary_unary_rpc_method_handler(
            servicer.CheckInput, request_deserializer=lenient(moderate_pb2.CheckInputRequest),
            response_serializer=moderate_pb2.CheckInputResponse.SerializeToString),
        "CheckOutput": grpc.stream_stream_rpc_method_handler(
            servicer.CheckOutput, request_deserializer=lenient(moderate_pb2.CheckOutputRequest),
            response_serializer=moderate_pb2.CheckOutputResponse.SerializeToString),
        "CheckOutputBatch": grpc.stream_stream_rpc_method_handler(
            servicer.CheckOutputBatch, request_deserializer=lenient(moderate_pb2.CheckOutputBatchRequest),
            response_serializer=moderate_pb2.CheckOutputBatchResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    return [SERVICE_NAME]


def build(cfg: Config, moderator: Moderator | None = None) -> Service:
    """The service; `moderator` replaces the one the settings describe (tests use a slow one)."""
    guard: TritonGuard | None = None
    if moderator is None:
        if cfg[settings.GUARD_ADDRESS]:
            guard = TritonGuard(cfg[settings.GUARD_ADDRESS], cfg[settings.GUARD_MODEL],
                                timeout_s=cfg[settings.CHECK_DEADLINE_MS] / 1000)
        moderator = Moderator(load(cfg[settings.POLICY_FILE]), profanity_model(), guard)
    policy = moderator.policy
    limits = CheckLimits(max_bytes=cfg[mesh_settings.MAX_MESSAGE_BYTES], deadline_s=cfg[settings.CHECK_DEADLINE_MS] / 1000,
                    on_input_failure=FailureMode(cfg[settings.INPUT_FAILURE]),
                    on_output_failure=FailureMode(cfg[settings.OUTPUT_FAILURE]))
    registry = metrics.Registry()
    # a guard model waits on the network: checks then run on the worker thread, where the deadline can fire
    batcher = CheckBatcher(threaded=cfg[settings.CHECK_THREAD] or moderator.guard is not None)
    servicer = ModerateServicer(moderator, batcher, limits, Metrics(registry))

    async def start() -> None:
        log.info("moderation_ready", categories=[c.name for c in policy.categories],
                 input_failure=limits.on_input_failure.value, output_failure=limits.on_output_failure.value)

    async def close() -> None:
        batcher.close()
        if guard is not None:
            guard.close()

    return Service(name="moderation", register=lambda server: _register(server, servicer), start=start,
                   close=close, stopping=servicer.end_streams, metrics=registry, authz=AUTHZ)


def _logged_id(text: str) -> str:
    """A conversation id as a log line may carry it: the field is only "for logs" and unchecked, so anything but
    a UUID is the caller's free text, which no log holds (chatmesh.mesh.logs)."""
    try:
        return str(uuid.UUID(text)) if text else ""
    except ValueError:
        return "<not a uuid>"
