"""EngineCore: the in-process engine (block manager + scheduler + an Executor) as a `Backend`.

One asyncio task runs the step loop: schedule, run the queued tier copies and the step on the executor,
apply the sampled tokens, hand them to the streams, then pace. Pacing is the clock's: `RealClock` waits until
the step's modelled duration (divided by the speed factor) has passed, so `sim` runs at the node's speed and a
measured executor (`local`, whose duration is its own wall time) is never slowed; `VirtualClock` only advances
a counter, so tests run the roofline in virtual time as fast as the CPU allows.

Streaming efficiency: a stream is woken for its first token, then whenever its last send is at least
`flush_interval_s` old in clock time, and when it starts or finishes; it then sends everything produced since
its last send as one Delta. The message rate per stream is thus at most 1 / flush interval (40/s at 25 ms), whatever the step
rate, and detokenisation runs once per send, not once per token.

The `local` backend constructs this with its executor: `EngineCore(executor, BlockConfig(...),
SchedulerConfig(...), codec, offload=True)` (offload runs each step in a worker thread so the event loop
keeps serving RPCs while the model computes; prefix transfers move block data on a second thread, transfer.py).
That worker is one dedicated thread for the engine's life, not
the event loop's shared pool: with a pool, steps land on different threads, and each calling thread gets its own
OpenMP team (whose idle threads spin for a while after their last step, taking CPU from the next one) and its own
malloc arena (each keeping freed temporaries).

Prefix pulls: a generation naming a source replica first pulls what its prompt's cache lacks (`Transfers.pull`:
it never raises for the pull's own failures), then queues; its Started says what was pulled. Serving a pull
(`serve_prefix`) streams pinned blocks. Draining (SIGTERM: `mark_draining`, then the service waits out its grace
period, service.py): new generations are refused, running ones finish, and pulls are still served, so the router
can move this replica's conversations with it as the source.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from chatmesh.engine_adapter.backend import (
    Delta,
    EngineStats,
    Finished,
    GenerateEvent,
    GenerateParams,
    KvLayout,
    Residency,
    ServeRequest,
    Started,
    TierStats,
    TransferEvent,
    Usage,
)
from chatmesh.engine_adapter.block_manager import BlockConfig, BlockManager
from chatmesh.engine_adapter.executor import BlockCopy, Executor, SeqWork, StepResult
from chatmesh.engine_adapter.scheduler import Scheduler, SchedulerConfig, Seq, SeqState, Step, Waiting
from chatmesh.engine_adapter.text import TextCodec
from chatmesh.engine_adapter.transfer import PullConfig, Transfers
from chatmesh.mesh import logs
from chatmesh.mesh.errors import Unavailable
from chatmesh.mesh.ids import ConversationId, TurnId
from chatmesh.model.profile import ModelIdentity

log = logs.get("chatmesh.engine")
T = TypeVar("T")


class Clock(Protocol):
    """The engine's time: what `now` is, and how a step's modelled duration is waited out."""

    def now(self) -> float: ...

    async def pace(self, modelled_s: float, spent_s: float) -> None:
        """Called after each step: it was modelled to take `modelled_s` and took `spent_s` of wall time."""
        ...


class RealClock:
    """Wall time; a step lasts max(modelled / speed, what it really took)."""

    def __init__(self, speed: float = 1.0):
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.speed = speed

    def now(self) -> float:
        return time.monotonic()

    async def pace(self, modelled_s: float, spent_s: float) -> None:
        wait = modelled_s / self.speed - spent_s
        await asyncio.sleep(wait if wait > 0 else 0)


class VirtualClock:
    """Virtual time: a step advances `now` by its modelled duration and yields to the event loop once."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def pace(self, modelled_s: float, spent_s: float) -> None:
        self.t += modelled_s
        await asyncio.sleep(0)


@dataclass(frozen=True)
class StepReport:
    """One step, for observers (tests, metrics): its modelled duration and its shape."""

    duration_s: float
    decode_seqs: int
    prefill_tokens: int
    copies: int
    at: float  # clock time when the step's tokens were handed out (before pacing)


class _Stream:
    __slots__ = ("seq", "wake", "last_flush")

    def __init__(self, seq: Seq):
        self.seq = seq
        self.wake = asyncio.Event()
        self.last_flush = -math.inf  # the first token goes out at once: coalescing never delays TTFT


class EngineCore:
    """A Backend over an Executor."""

    def __init__(self, executor: Executor, blocks: BlockConfig, scheduler: SchedulerConfig, codec: TextCodec, *,
                 replica_id: str = "engine-0", flush_interval_s: float = 0.025, clock: Clock | None = None,
                 offload: bool = False, on_step: Callable[[StepReport], None] | None = None,
                 pulls: PullConfig = PullConfig()):
        self.executor = executor
        self.codec = codec
        self.replica_id = replica_id
        self.flush_interval_s = flush_interval_s
        self.clock: Clock = clock or RealClock()
        self.offload = offload
        self.on_step = on_step
        self.blocks = BlockManager(blocks)
        self.scheduler = Scheduler(scheduler, self.blocks, codec.stop_token_ids)
        self._streams: dict[int, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._worker: ThreadPoolExecutor | None = None  # the one thread offloaded steps run on (while started)
        self._transfer_worker: ThreadPoolExecutor | None = None  # block data of prefix transfers (while started)
        self._in_flight: asyncio.Future[tuple[float, StepResult | None]] | None = None  # the offloaded step running
        self.draining = False
        fmt = executor.kv_format
        layout = None if fmt is None else KvLayout(executor.name, codec.identity, blocks.block_size, fmt.dtype,
                                                   fmt.block_bytes)
        self.transfers = Transfers(self.blocks, executor, layout, replica_id, pulls, offload=self._off_loop,
                                   barrier=self._step_barrier, wait_modelled=self.clock.pace)

    @property
    def name(self) -> str:
        return self.executor.name

    @property
    def model(self) -> ModelIdentity:
        return self.codec.identity

    # ---- Backend -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._closed = False
            if self.offload and self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{self.replica_id}")
                self._transfer_worker = ThreadPoolExecutor(max_workers=1,
                                                           thread_name_prefix=f"transfer-{self.replica_id}")
            self._task = asyncio.create_task(self._loop(), name=f"engine-{self.replica_id}")

    async def close(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for seq in self.scheduler.abort_all():
            self._finished(seq)
        for worker in (self._worker, self._transfer_worker):
            if worker is not None:
                worker.shutdown(wait=False)
        self._worker = self._transfer_worker = None

    def ready(self) -> bool:
        return self._task is not None and not self._task.done()

    def mark_draining(self) -> None:
        self.draining = True

    def cancel_turn(self, salt: bytes, turn_id: TurnId) -> int:
        seqs = [s.seq for s in self._streams.values() if s.seq.params.turn_id == turn_id
                and s.seq.params.cache_salt == salt and s.seq.state is not SeqState.FINISHED and not s.seq.cancelled]
        for seq in seqs:
            self.scheduler.cancel(seq)  # reaped by the next step: its stream ends with Finished(CANCELLED)
        if seqs:
            self._wake.set()
        return len(seqs)

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerateEvent]:
        if not self.ready():
            raise Unavailable("engine is not running")
        if self.draining:
            raise Unavailable(f"engine {self.replica_id} is shutting down; send the turn to another replica")
        pull = None
        if params.source is not None:
            self.scheduler.check(params)  # a request the queue would refuse is refused before its pull
            pull = await self.transfers.pull(params)
            if not self.ready():
                raise Unavailable("engine stopped during the prefix pull")
        seq = self.scheduler.add(params, (pull.first_block, pull.blocks) if pull else (0, 0))
        stream = _Stream(seq)
        self._streams[seq.seq_id] = stream
        self._wake.set()
        decoder = self.codec.decoder()
        started = False
        try:
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                if not started and (seq.hit is not None or seq.state is SeqState.FINISHED):
                    started = True
                    hit = seq.hit
                    yield Started(hit.cached_tokens - seq.pulled_tokens if hit else 0,
                                  hit.host_cached_tokens if hit else 0, seq.pulled_tokens, pull)
                new = seq.take_new()
                if new:
                    yield Delta(tuple(new), decoder.feed(new))
                if seq.state is SeqState.FINISHED:
                    tail = decoder.flush()
                    if tail:
                        yield Delta((), tail)
                    assert seq.finish is not None
                    cached = seq.hit.cached_tokens if seq.hit else 0
                    log.debug("generation_finished", request_id=params.request_id, turn_id=params.turn_id,
                              reason=seq.finish.value, prompt_tokens=seq.prompt_len, cached_tokens=cached,
                              output_tokens=seq.output_tokens)
                    yield Finished(seq.finish, Usage(seq.prompt_len, cached, seq.output_tokens), seq.error)
                    return
        finally:
            self._streams.pop(seq.seq_id, None)
            if seq.state is not SeqState.FINISHED:
                self.scheduler.cancel(seq)  # freed by the next step
                self._wake.set()

    async def serve_prefix(self, request: ServeRequest) -> AsyncIterator[TransferEvent]:
        async for event in self.transfers.serve(request):
            yield event

    async def evict_conversation(self, conversation_id: ConversationId, salt: bytes | None = None) -> int:
        return self.blocks.evict_conversation(conversation_id, salt)

    async def evict_salt(self, salt: bytes) -> int:
        return self.blocks.evict_salt(salt)

    def stats(self) -> EngineStats:
        c = self.scheduler.counters()
        b = self.blocks.stats()
        return EngineStats(
            replica_id=self.replica_id, backend=self.name, queue_depth=c.queue_depth, running_sequences=c.running,
            block_size=self.blocks.block_size,
            device=TierStats(b.device_total, b.device_used, b.device_free, b.device_cached),
            host=TierStats(b.host_total, b.host_used, b.host_free, b.host_used),
            hit_tokens=c.hit_tokens, miss_tokens=c.miss_tokens, host_hit_tokens=c.host_hit_tokens,
            device_evictions=b.device_evictions, host_evictions=b.host_evictions, preemptions=c.preemptions,
            generations=c.generations,
            waiting_kv=c.queue_depth if c.waiting_reason is Waiting.KV_MEMORY else 0,
            waiting_batch=c.queue_depth if c.waiting_reason is Waiting.BATCH_SLOTS else 0,
            kv_stall_steps=c.kv_stall_steps, batch_stall_steps=c.batch_stall_steps,
            transfer=self.transfers.stats(c.pulled_tokens), draining=self.draining)

    def residency(self, since: int) -> Residency:
        return Residency.of(self.blocks.residency.changes(since))

    # ---- the step loop -------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while not self._closed:
            if not self.scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = time.perf_counter()
            step = self.scheduler.schedule()
            for seq in step.admitted:
                if (stream := self._streams.get(seq.seq_id)) is not None:
                    stream.wake.set()
            for seq in step.finished:
                self._finished(seq)
            if not step.work and not step.copies:
                if not step.admitted and not step.finished:  # blocked: wait for a cancel or a new request
                    self._wake.clear()
                    await self._wake.wait()
                continue
            try:
                if self._worker is not None:
                    self._in_flight = asyncio.get_running_loop().run_in_executor(
                        self._worker, self._run, step.copies, step.work)
                    try:
                        copy_s, result = await self._in_flight
                    finally:
                        self._in_flight = None
                else:
                    copy_s, result = self._run(step.copies, step.work)
            except Exception as exc:  # the executor failed: these sequences end with an error, the engine goes on
                log.error("step_failed", sequences=len(step.work), exc_info=exc)
                seqs = [self.scheduler.seq(w.seq_id) for w in step.work]
                self.scheduler.fail(seqs, f"engine step failed: {type(exc).__name__}")
                for seq in seqs:
                    self._finished(seq)
                continue
            modelled = copy_s + (result.duration_s if result else 0.0)
            now = self.clock.now()
            if result is not None:
                for seq in self.scheduler.complete(step, result):
                    if seq.state is SeqState.FINISHED:
                        self._finished(seq)
                    else:
                        stream = self._streams.get(seq.seq_id)
                        if stream is not None and now - stream.last_flush >= self.flush_interval_s:
                            stream.last_flush = now
                            stream.wake.set()
            if self.on_step is not None:
                self.on_step(_report(step, modelled, now))
            await self.clock.pace(modelled, time.perf_counter() - t0)

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        """Runs block-data work of a transfer on the transfer thread (inline when steps are not offloaded)."""
        if self._transfer_worker is None:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._transfer_worker, fn)

    async def _step_barrier(self) -> None:
        """Waits for the step in flight, if any (its tier copies may be filling blocks a transfer just took)."""
        step = self._in_flight
        if step is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(step)

    def _run(self, copies: Sequence[BlockCopy], work: Sequence[SeqWork]) -> tuple[float, StepResult | None]:
        copy_s = self.executor.copy_blocks(copies) if copies else 0.0
        return copy_s, (self.executor.execute(work) if work else None)

    def _finished(self, seq: Seq) -> None:
        self.executor.release(seq.seq_id)
        stream = self._streams.get(seq.seq_id)
        if stream is not None:
            stream.wake.set()


def _report(step: Step, duration_s: float, at: float) -> StepReport:
    decode = sum(1 for w in step.work if len(w.token_ids) == 1)
    prefill = sum(len(w.token_ids) for w in step.work if len(w.token_ids) > 1)
    return StepReport(duration_s, decode, prefill, len(step.copies), at)
