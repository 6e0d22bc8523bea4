"""The moderation client the chat service uses: typed outcomes, and the failure policy when moderation fails.

Usage (one client per process; one output session per streamed reply):

    from chatmesh.moderation.client import ModerationClient

    moderation = ModerationClient.from_config(cfg)         # CHATMESH_MODERATION_ADDRESS, failure modes, timeout
    outcome = await moderation.check_input(text, conversation_id)
    if outcome.blocked:
        ...  # refuse the turn; outcome.reason says why ("block: payment_card 1.00 (card_number)",
             # or "moderation unavailable (UNAVAILABLE); input failing closed")
    async with moderation.output(conversation_id) as session:
        async for chunk in reply:
            outcome = await session.check(chunk)            # one verdict per chunk, the window spans chunks
            if outcome.blocked:
                break                                        # stop the stream; store outcome.reason
    await moderation.close()

Every outcome says who decided (`decided_by`): the policy, the service's failure policy (its check deadline
passed), or this client's failure policy (the service is down, answered with an error, or did not answer
within CHATMESH_MODERATION_CLIENT_TIMEOUT_MS). Client failures are counted in the Prometheus counter
`chatmesh_moderation_client_failures_total{direction, reason}`. An INVALID_ARGUMENT answer to an input check
(empty or oversized text) is the caller's error and is raised as `InvalidArgument`, not failed over.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import assert_never

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from chatmesh.mesh import logs
from chatmesh.mesh import settings as mesh_settings
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import InvalidArgument
from chatmesh.moderation import settings
from chatmesh.moderation.policy import Action, Direction, FailureMode
from chatmesh.v1 import moderate_pb2, moderate_pb2_grpc

log = logs.get("chatmesh.moderation.client")

_COUNTERS: dict[int, Counter] = {}


def failures_counter(registry: CollectorRegistry = REGISTRY) -> Counter:
    """The client failure counter in `registry` (created once per registry)."""
    if id(registry) not in _COUNTERS:
        _COUNTERS[id(registry)] = Counter(
            "chatmesh_moderation_client_failures", "moderation checks the client's failure policy decided",
            ["direction", "reason"], registry=registry)
    return _COUNTERS[id(registry)]


class DecidedBy(enum.Enum):
    """Who chose an outcome's action."""

    POLICY = "policy"  # the moderation policy judged the text
    SERVICE_FAILURE_POLICY = "service_failure_policy"  # the service's check did not finish in time
    CLIENT_FAILURE_POLICY = "client_failure_policy"  # the service was down, failed or too slow


@dataclass(frozen=True)
class Scored:
    """A category and its score in [0, 1]."""

    category: str
    score: float


@dataclass(frozen=True)
class Outcome:
    """A moderation outcome: the action, the categories behind it, why (never the text), and who decided."""

    action: Action
    categories: tuple[Scored, ...]
    reason: str
    decided_by: DecidedBy

    @property
    def blocked(self) -> bool:
        return self.action is Action.BLOCK

    @property
    def fallback(self) -> bool:
        return self.decided_by is not DecidedBy.POLICY


def _action(value: int) -> Action | None:
    match value:
        case moderate_pb2.MODERATION_ACTION_ALLOW:
            return Action.ALLOW
        case moderate_pb2.MODERATION_ACTION_FLAG:
            return Action.FLAG
        case moderate_pb2.MODERATION_ACTION_BLOCK:
            return Action.BLOCK
        case _:
            return None


@dataclass(frozen=True)
class FailurePolicy:
    """Per-direction failure modes, the client's timeout, and where failures are counted."""

    on_input: FailureMode
    on_output: FailureMode
    timeout_s: float
    failures: Counter

    def mode(self, direction: Direction) -> FailureMode:
        match direction:
            case Direction.INPUT:
                return self.on_input
            case Direction.OUTPUT:
                return self.on_output
            case _ as unreachable:
                assert_never(unreachable)

    def outcome(self, direction: Direction, label: str, why: str) -> Outcome:
        mode = self.mode(direction)
        self.failures.labels(direction.value, label).inc()
        log.warning("moderation_failed", direction=direction.value, reason=label, failing=mode.value)
        return Outcome(mode.action, (), f"{why}; {direction.value} failing {mode.value}",
                       DecidedBy.CLIENT_FAILURE_POLICY)

    def from_verdict(self, direction: Direction, verdict: moderate_pb2.Verdict) -> Outcome:
        action = _action(verdict.action)
        if action is None:
            return self.outcome(direction, "protocol", "moderation answered without an action")
        decided_by = DecidedBy.SERVICE_FAILURE_POLICY if verdict.fallback else DecidedBy.POLICY
        return Outcome(action, tuple(Scored(c.category, c.score) for c in verdict.categories), verdict.reason,
                       decided_by)

    def from_error(self, direction: Direction, err: grpc.aio.AioRpcError) -> Outcome:
        code = err.code()
        label = "deadline" if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name.lower()
        return self.outcome(direction, label, f"moderation failed ({code.name})")


class ModerationClient:
    """A typed client of ModerateService that never leaves a turn without an outcome."""

    def __init__(self, channel: grpc.aio.Channel, policy: FailurePolicy, own_channel: bool = False) -> None:
        self._channel = channel
        self._stub = moderate_pb2_grpc.ModerateServiceStub(channel)
        self._own_channel = own_channel
        self.policy = policy

    @classmethod
    def from_config(cls, cfg: Config, registry: CollectorRegistry = REGISTRY) -> ModerationClient:
        policy = FailurePolicy(FailureMode(cfg[settings.INPUT_FAILURE]), FailureMode(cfg[settings.OUTPUT_FAILURE]),
                               cfg[settings.CLIENT_TIMEOUT_MS] / 1000, failures_counter(registry))
        return cls(grpc.aio.insecure_channel(cfg[mesh_settings.MODERATION_ADDRESS]), policy, own_channel=True)

    async def check_input(self, text: str, conversation_id: str) -> Outcome:
        request = moderate_pb2.CheckInputRequest(text=text, conversation_id=conversation_id)
        try:
            reply = await self._stub.CheckInput(request, timeout=self.policy.timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(err.details() or "invalid moderation input") from None
            return self.policy.from_error(Direction.INPUT, err)
        return self.policy.from_verdict(Direction.INPUT, reply.verdict)

    def output(self, conversation_id: str) -> OutputSession:
        """A session for one streamed reply; the stream opens on the first check."""
        return OutputSession(self._stub, self.policy, conversation_id)

    async def close(self) -> None:
        if self._own_channel:
            await self._channel.close(None)


class OutputSession:
    """The output check of one reply: `check(chunk)` returns that chunk's outcome, in order.

    Verdicts arrive on a reader task and are matched to chunks by index, so a chunk whose verdict is late gets
    the failure policy at the client timeout and its late verdict is dropped. Once the stream fails, every
    further chunk gets the failure policy at once (the reason names the error)."""

    def __init__(self, stub: moderate_pb2_grpc.ModerateServiceAsyncStub, policy: FailurePolicy,
                 conversation_id: str) -> None:
        self._stub = stub
        self._policy = policy
        self._conversation_id = conversation_id
        self._call: grpc.aio.StreamStreamCall[moderate_pb2.CheckOutputRequest,
                                              moderate_pb2.CheckOutputResponse] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: dict[int, asyncio.Future[moderate_pb2.Verdict]] = {}
        self._sent = 0
        self._broken: Outcome | None = None

    async def check(self, chunk: str, final: bool = False) -> Outcome:
        if self._broken is not None:
            return self._policy.outcome(Direction.OUTPUT, "broken", self._broken.reason.split(";")[0])
        index = self._sent
        self._sent += 1
        future: asyncio.Future[moderate_pb2.Verdict] = asyncio.get_running_loop().create_future()
        self._waiting[index] = future
        request = moderate_pb2.CheckOutputRequest(text=chunk, final=final,
                                                  conversation_id=self._conversation_id if index == 0 else "")
        try:
            call = self._open()
            await asyncio.wait_for(call.write(request), self._policy.timeout_s)
            verdict = await asyncio.wait_for(future, self._policy.timeout_s)
        except TimeoutError:
            return self._policy.outcome(Direction.OUTPUT, "deadline",
                                        f"moderation did not answer within {self._policy.timeout_s * 1000:.0f} ms")
        except grpc.aio.AioRpcError as err:
            return self._fail(self._policy.from_error(Direction.OUTPUT, err))
        except asyncio.InvalidStateError:  # the call ended between chunks
            return self._fail(self._policy.outcome(Direction.OUTPUT, "closed", "moderation stream ended"))
        finally:
            self._waiting.pop(index, None)
        return self._policy.from_verdict(Direction.OUTPUT, verdict)

    async def close(self) -> None:
        if self._call is not None and self._broken is None:
            try:
                await asyncio.wait_for(self._call.done_writing(), self._policy.timeout_s)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
                pass  # the stream is being torn down either way
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    async def __aenter__(self) -> OutputSession:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def _open(self) -> grpc.aio.StreamStreamCall[moderate_pb2.CheckOutputRequest, moderate_pb2.CheckOutputResponse]:
        if self._call is None:
            self._call = self._stub.CheckOutput(None)
            self._reader = asyncio.create_task(self._read(self._call))
        return self._call

    async def _read(self, call: grpc.aio.StreamStreamCall[moderate_pb2.CheckOutputRequest,
                                                          moderate_pb2.CheckOutputResponse]) -> None:
        try:
            async for reply in call:
                future = self._waiting.get(reply.chunk_index)
                if future is not None and not future.done():
                    future.set_result(reply.verdict)
        except grpc.aio.AioRpcError as err:
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(err)
            self._broken = self._broken or Outcome(Action.ALLOW, (), f"moderation failed ({err.code().name})",
                                                   DecidedBy.CLIENT_FAILURE_POLICY)

    def _fail(self, outcome: Outcome) -> Outcome:
        self._broken = outcome
        return outcome


def categories_of(outcome: Outcome) -> Sequence[str]:
    """The category names of an outcome, highest score first (for logs and turn records)."""
    return [c.category for c in outcome.categories]
