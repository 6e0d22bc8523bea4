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
within CHATMESH_MODERATION_CLIENT_TIMEOUT_MS, per 32 KiB of a long input). Client failures are counted in the Prometheus counter
`chatmesh_moderation_client_failures_total{direction, reason}`.
An input check first waits up to CHATMESH_MODERATION_CLIENT_CONNECT_WAIT_MS for the service to be reachable (its
channel connected: a moderation restart, or a channel still in its reconnect backoff), and a check whose connection
drops is asked again within that wait: a brief restart delays the turns it catches instead of failing them. An
outage longer than that gets the failure policy, as before. (Output checks do not wait: they fail open by
default, and a reply's first chunk would hold up its first token.) An INVALID_ARGUMENT answer to an input check
(empty or oversized text), or an output chunk over CHATMESH_MAX_MESSAGE_BYTES, is the caller's error
and is raised as `InvalidArgument`, not failed over. Output sessions share one CheckOutputBatch stream; chunks
wait up to CHATMESH_MODERATION_CLIENT_BATCH_MS to share a message, except a reply's first chunk, which goes out at
once (with whatever is queued): it holds up the reply's first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import assert_never

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from chatmesh.mesh import logs, tracing
from chatmesh.mesh import identity
from chatmesh.mesh.channels import open_channel
from chatmesh.mesh.trust import Trust
from chatmesh.mesh import settings as mesh_settings
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import InvalidArgument
from chatmesh.moderation import settings
from chatmesh.moderation.moderator import scaled, validate_text
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
    linger_s: float = 0.0  # how long output chunks wait to share a message with other streams' chunks
    max_bytes: int = 1024 * 1024  # the message size policy's; an output chunk over it is refused here, not on the
    # shared stream
    connect_wait_s: float = 0.0  # how long an input check waits for the service to be reachable

    def mode(self, direction: Direction) -> FailureMode:
        match direction:
            case Direction.INPUT:
                return self.on_input
            case Direction.OUTPUT:
                return self.on_output
            case _ as unreachable:
                assert_never(unreachable)

    def outcome(self, direction: Direction, label: str, why: str, quiet: bool = False) -> Outcome:
        mode = self.mode(direction)
        self.failures.labels(direction.value, label).inc()
        if not quiet:
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
        self._mux = _OutputMux(self._stub, policy.timeout_s, policy.linger_s)
        self.policy = policy

    @classmethod
    def from_config(cls, cfg: Config, registry: CollectorRegistry = REGISTRY, trust: Trust | None = None
                    ) -> ModerationClient:
        """A client over its own channel; `trust` is the calling process's (default: what the settings say, as
        spiffe://chatmesh/chat, moderation's one caller)."""
        policy = FailurePolicy(FailureMode(cfg[settings.INPUT_FAILURE]), FailureMode(cfg[settings.OUTPUT_FAILURE]),
                               cfg[settings.CLIENT_TIMEOUT_MS] / 1000, failures_counter(registry),
                               cfg[settings.CLIENT_BATCH_MS] / 1000, cfg[mesh_settings.MAX_MESSAGE_BYTES],
                               connect_wait_s=cfg[settings.CLIENT_CONNECT_WAIT_MS] / 1000)
        trust = trust or Trust.from_config(cfg, identity.CHAT)
        return cls(open_channel(trust, cfg[mesh_settings.MODERATION_ADDRESS], "moderation"), policy, own_channel=True)

    async def check_input(self, text: str, conversation_id: str) -> Outcome:
        request = moderate_pb2.CheckInputRequest(text=text, conversation_id=conversation_id)
        timeout = scaled(self.policy.timeout_s, len(text.encode("utf-8", "surrogatepass")))
        loop = asyncio.get_running_loop()
        wait_until = loop.time() + self.policy.connect_wait_s
        while True:
            await self._connected(wait_until)
            try:
                reply = await self._stub.CheckInput(request, timeout=timeout)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidArgument(err.details() or "invalid moderation input") from None
                if err.code() == grpc.StatusCode.UNAVAILABLE and loop.time() + RETRY_PAUSE_S < wait_until:
                    await asyncio.sleep(RETRY_PAUSE_S)  # the connection dropped (a restart): wait for the next one
                    continue
                return self.policy.from_error(Direction.INPUT, err)
            return self.policy.from_verdict(Direction.INPUT, reply.verdict)

    async def _connected(self, until: float) -> None:
        """Returns once the channel is connected (a connection attempt, or the next one after the channel's
        reconnect backoff), or at the loop time `until`; a call made then on an unconnected channel fails at once,
        UNAVAILABLE."""
        left = until - asyncio.get_running_loop().time()
        if left <= 0 or self._channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._channel.channel_ready(), left)

    def output(self, conversation_id: str) -> OutputSession:
        """A session for one streamed reply; all sessions share one batched stream, opened on first use."""
        return OutputSession(self._mux, self.policy, conversation_id)

    async def close(self) -> None:
        await self._mux.close()
        if self._own_channel:
            await self._channel.close(None)


class OutputSession:
    """The output check of one reply: `check(chunk)` returns that chunk's outcome, in order.

    A chunk whose verdict is late gets the failure policy at the client timeout (its late verdict is dropped).
    If the shared stream fails, the reply's window on the service is gone, so every further chunk of this reply
    gets the failure policy at once (the reason names the error); new replies open a new stream."""

    def __init__(self, mux: _OutputMux, policy: FailurePolicy, conversation_id: str) -> None:
        self._mux = mux
        self._policy = policy
        self._conversation_id = conversation_id
        self._reply_id = mux.new_reply_id()
        self._generation: int | None = None
        self._sent = 0
        self._finished = False
        self._broken: str | None = None

    async def check(self, chunk: str, final: bool = False) -> Outcome:
        if self._broken is None and self._generation is not None and self._generation != self._mux.generation:
            self._broken = self._mux.last_error or "moderation stream ended"
        if self._broken is not None:
            return self._policy.outcome(Direction.OUTPUT, "broken", self._broken, quiet=True)
        # checked here: the service would answer INVALID_ARGUMENT by ending the stream every reply shares
        validate_text(chunk, self._policy.max_bytes, "output chunk", allow_empty=True)
        first = self._sent == 0
        self._sent += 1
        self._finished = self._finished or final
        future, self._generation = self._mux.submit(moderate_pb2.OutputChunk(
            reply_id=self._reply_id, text=chunk, final=final,
            conversation_id=self._conversation_id if first else ""), urgent=first)
        try:
            verdict = await future  # the mux fails it with TimeoutError at the client timeout
        except TimeoutError:
            return self._policy.outcome(Direction.OUTPUT, "deadline",
                                        f"moderation did not answer within {self._policy.timeout_s * 1000:.0f} ms")
        except _StreamFailed as err:
            self._broken = err.why
            return self._policy.outcome(Direction.OUTPUT, err.label, err.why)
        return self._policy.from_verdict(Direction.OUTPUT, verdict)

    async def close(self) -> None:
        """Tells the service to forget this reply's window (when the last chunk was not marked final)."""
        if self._sent and not self._finished and self._broken is None and self._generation == self._mux.generation:
            self._finished = True
            future, _ = self._mux.submit(moderate_pb2.OutputChunk(reply_id=self._reply_id, text="", final=True))
            future.add_done_callback(_ignore)

    async def __aenter__(self) -> OutputSession:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


def _expire(futures: list[asyncio.Future[moderate_pb2.Verdict]]) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(TimeoutError())
            future.add_done_callback(_ignore)


class _StreamFailed(Exception):
    """The shared output stream failed; `label` names it for the failure counter, `why` for the outcome."""

    def __init__(self, label: str, why: str) -> None:
        super().__init__(why)
        self.label = label
        self.why = why


def _ignore(future: asyncio.Future[moderate_pb2.Verdict]) -> None:
    if not future.cancelled():
        future.exception()


Pending = list[tuple[moderate_pb2.OutputChunk, "asyncio.Future[moderate_pb2.Verdict]"]]


MAX_BATCH = 512
RETRY_PAUSE_S = 0.05  # before an input check whose connection dropped is asked again


class _OutputMux:
    """Every output session of a client on one CheckOutputBatch stream: the chunks checked within
    CHATMESH_MODERATION_CLIENT_BATCH_MS of the first (or in one event-loop turn when it is 0; at most
    MAX_BATCH) go out as one request, so 256 streams at 40 chunks/s cost hundreds of messages/s, not 10,000,
    and each response's verdicts are handed back by position. Requests are written by one writer task, in
    order; responses come back in the same order; one timer per batch fails its chunks still waiting at the
    client timeout. A failed stream fails every waiting chunk, bumps
    `generation` (so replies begun on it know their window is gone) and the next chunk opens a new stream."""

    def __init__(self, stub: moderate_pb2_grpc.ModerateServiceAsyncStub, timeout_s: float, linger_s: float) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self._linger_s = linger_s
        self._ids = itertools.count()
        self._pending: Pending = []
        self._inflight: deque[list[asyncio.Future[moderate_pb2.Verdict]]] = deque()
        self._queue: asyncio.Queue[moderate_pb2.CheckOutputBatchRequest] | None = None
        self._call: grpc.aio.StreamStreamCall[moderate_pb2.CheckOutputBatchRequest,
                                              moderate_pb2.CheckOutputBatchResponse] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._timer: asyncio.Handle | None = None  # the scheduled flush of `_pending` (a TimerHandle if it lingers)
        self.generation = 0
        self.last_error = ""

    def new_reply_id(self) -> str:
        return str(next(self._ids))

    def submit(self, chunk: moderate_pb2.OutputChunk, urgent: bool = False
               ) -> tuple[asyncio.Future[moderate_pb2.Verdict], int]:
        """Queues a chunk for the next message. An `urgent` chunk (a reply's first: the user is waiting for their
        first token) does not linger; it goes out at the end of this event-loop turn with whatever is queued."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[moderate_pb2.Verdict] = loop.create_future()
        if urgent or self._linger_s <= 0:
            if self._timer is None or isinstance(self._timer, asyncio.TimerHandle):  # none, or one that lingers
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = loop.call_soon(self._flush)
        elif self._timer is None:
            self._timer = loop.call_later(self._linger_s, self._flush)
        self._pending.append((chunk, future))
        if len(self._pending) >= MAX_BATCH:
            self._flush()
        return future, self.generation

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if not batch:
            return
        if self._call is None or self._queue is None:
            self._open()
        assert self._queue is not None
        futures = [future for _, future in batch]
        asyncio.get_running_loop().call_later(self._timeout_s, _expire, futures)  # one timer per batch
        self._inflight.append(futures)
        self._queue.put_nowait(moderate_pb2.CheckOutputBatchRequest(chunks=[chunk for chunk, _ in batch]))

    def _open(self) -> None:
        # The stream outlives the turn that opens it and serves every turn of this process: it belongs to no trace.
        with tracing.detached():
            call = self._stub.CheckOutputBatch(None)
            queue: asyncio.Queue[moderate_pb2.CheckOutputBatchRequest] = asyncio.Queue()
            self._call, self._queue = call, queue
            self._tasks = [asyncio.create_task(self._write(call, queue)), asyncio.create_task(self._read(call))]

    async def _write(self, call: grpc.aio.StreamStreamCall[moderate_pb2.CheckOutputBatchRequest,
                                                           moderate_pb2.CheckOutputBatchResponse],
                     queue: asyncio.Queue[moderate_pb2.CheckOutputBatchRequest]) -> None:
        try:
            while True:
                await call.write(await queue.get())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the reader sees the call's status and fails the waiting chunks

    async def _read(self, call: grpc.aio.StreamStreamCall[moderate_pb2.CheckOutputBatchRequest,
                                                          moderate_pb2.CheckOutputBatchResponse]) -> None:
        try:
            async for response in call:
                futures = self._inflight.popleft() if self._inflight else []
                for future, verdict in zip(futures, response.verdicts):
                    if not future.done():
                        future.set_result(verdict.verdict)
            error = _StreamFailed("closed", "moderation stream ended")
        except grpc.aio.AioRpcError as err:
            code = err.code()
            label = "deadline" if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name.lower()
            error = _StreamFailed(label, f"moderation failed ({code.name})")
        self._fail(call, error)

    def _fail(self, call: object, error: _StreamFailed) -> None:
        if call is not self._call:
            return
        self.generation += 1
        self.last_error = error.why
        self._call, self._queue = None, None
        for futures in self._inflight:
            for future in futures:
                if not future.done():
                    future.set_exception(error)
                    future.add_done_callback(_ignore)
        self._inflight.clear()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def close(self) -> None:
        call = self._call
        self._call, self._queue = None, None
        if call is not None:
            call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def categories_of(outcome: Outcome) -> Sequence[str]:
    """The category names of an outcome, highest score first (for logs and turn records)."""
    return [c.category for c in outcome.categories]
