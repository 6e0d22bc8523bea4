"""Continuous batching with chunked prefill (pure: no clock, no model, no asyncio).

What. Each engine step the scheduler picks the work of every running sequence and admits new ones, then
applies the sampled tokens. Sequences join and leave the batch at step granularity (Orca, OSDI 2022), so a
finished reply frees its slot at once and a new prompt does not wait for the batch to drain.

Token budget (Sarathi-Serve, OSDI 2024). A step runs at most `step_token_budget` tokens (default 512): first
one token for every decoding sequence, then prefill chunks (of running prompts, then of newly admitted ones)
in the budget that is left. A long prompt is thus prefilled over several steps interleaved with decode, and
no step grows past what the budget costs: the reference's 16,000-token prompt adds ~11 ms per 512-token chunk
instead of stalling every stream for ~360 ms. The budget should be at least `max_batch`, or some decodes wait.

Admission. At most `max_batch` sequences run; the rest wait in a FIFO of at most `queue_limit` (beyond it
`add` raises ResourceExhausted). Admission takes the prompt's cached prefix from the block manager, so only the
uncached tail is prefilled, and stops at the first prompt that does not fit.

Preemption by recompute. When a running sequence needs a block and none is free or evictable, the most
recently admitted sequence is preempted: its blocks are released (full ones stay cached, so the re-prefill is
mostly a prefix hit), and it goes back to the head of the queue with every token it has produced so far.

Cancellation sets a flag; the next `schedule()` releases the sequence's blocks, so a cancelled stream's memory
returns within one step.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from chatmesh.engine_adapter.backend import FinishReason, GenerateParams
from chatmesh.engine_adapter.block_manager import BlockManager, PrefixHit
from chatmesh.engine_adapter.executor import BlockCopy, SeqWork, StepResult
from chatmesh.mesh.errors import InvalidArgument, ResourceExhausted


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits: running sequences, tokens per step, and the admission queue."""

    max_batch: int = 256
    step_token_budget: int = 512
    queue_limit: int = 1024

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.step_token_budget < 1 or self.queue_limit < 0:
            raise ValueError(f"bad scheduler config {self}")


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Seq:
    """One generation inside the engine. Mutable; owned by the scheduler, read by the engine's streams."""

    __slots__ = ("seq_id", "params", "tokens", "prompt_len", "num_computed", "output_tokens", "state",
                 "cancelled", "stop_ids", "hit", "finish", "error", "new_tokens")

    def __init__(self, seq_id: int, params: GenerateParams, stop_ids: frozenset[int]):
        self.seq_id = seq_id
        self.params = params
        self.tokens: list[int] = list(params.prompt_token_ids)  # prompt, then every streamed output token
        self.prompt_len = len(self.tokens)
        self.num_computed = 0  # tokens whose KV is in the blocks
        self.output_tokens = 0  # sampled tokens, a final stop token included
        self.state = SeqState.WAITING
        self.cancelled = False
        self.stop_ids = stop_ids | params.stop_token_ids
        self.hit: PrefixHit | None = None  # set at first admission
        self.finish: FinishReason | None = None
        self.error = ""
        self.new_tokens: list[int] = []  # produced since the engine last took them

    def take_new(self) -> list[int]:
        out, self.new_tokens = self.new_tokens, []
        return out


@dataclass
class Step:
    """One step's plan, and what happened around it (admissions, cancellations)."""

    work: list[SeqWork] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)
    admitted: list[Seq] = field(default_factory=list)  # first admissions: their Started can be sent
    finished: list[Seq] = field(default_factory=list)  # ended before the step: cancelled, or out of KV room


@dataclass(frozen=True)
class SchedulerCounters:
    queue_depth: int
    running: int
    hit_tokens: int
    miss_tokens: int
    host_hit_tokens: int
    preemptions: int
    generations: int


class Scheduler:
    """Waiting FIFO + running batch over one BlockManager."""

    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager, stop_ids: Iterable[int] = ()):
        self.cfg = cfg
        self.blocks = blocks
        self.stop_ids = frozenset(stop_ids)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._by_id: dict[int, Seq] = {}
        self._next_id = 0
        self._cancelled: list[Seq] = []
        self.hit_tokens = self.miss_tokens = self.host_hit_tokens = 0
        self.preemptions = self.generations = 0

    def add(self, params: GenerateParams) -> Seq:
        """Queues a generation; ResourceExhausted when the admission queue is full."""
        room = self.blocks.cfg.device_blocks * self.blocks.block_size
        if len(params.prompt_token_ids) >= room:
            raise InvalidArgument(f"prompt of {len(params.prompt_token_ids)} tokens exceeds the KV room ({room})")
        if len(self.waiting) >= self.cfg.queue_limit:
            raise ResourceExhausted(f"engine admission queue is full ({self.cfg.queue_limit} waiting)")
        self._next_id += 1
        seq = Seq(self._next_id, params, self.stop_ids)
        self.waiting.append(seq)
        self._by_id[seq.seq_id] = seq
        self.generations += 1
        return seq

    def cancel(self, seq: Seq) -> None:
        """Marks a sequence cancelled; its blocks are released by the next schedule()."""
        if seq.state is not SeqState.FINISHED and not seq.cancelled:
            seq.cancelled = True
            self._cancelled.append(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._cancelled)

    def counters(self) -> SchedulerCounters:
        return SchedulerCounters(len(self.waiting), len(self.running), self.hit_tokens, self.miss_tokens,
                                 self.host_hit_tokens, self.preemptions, self.generations)

    # ---- one step ------------------------------------------------------------------------------------------

    def schedule(self) -> Step:
        step = Step()
        self._reap_cancelled(step)
        budget = self.cfg.step_token_budget
        planned: dict[int, tuple[int, int]] = {}  # seq_id -> (start, n)
        decoding = [s for s in self.running if s.num_computed == len(s.tokens) - 1]
        prefilling = [s for s in self.running if s.num_computed < len(s.tokens) - 1]
        for seq in decoding + prefilling:
            if budget <= 0:
                break
            if seq.state is not SeqState.RUNNING:  # preempted as a victim earlier in this loop
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self.blocks.grow(seq.seq_id, seq.num_computed + n):
                if len(self.running) == 1:  # alone and still out of blocks: the KV tier is its context limit
                    self._finish(seq, FinishReason.LENGTH)
                    self.running = []
                    step.finished.append(seq)
                    break
                victim = self.running[-1]
                budget += planned.pop(victim.seq_id, (0, 0))[1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                planned[seq.seq_id] = (seq.num_computed, n)
                budget -= n
        while self.waiting and len(self.running) < self.cfg.max_batch and budget > 0:
            seq = self.waiting[0]
            hit = self.blocks.admit(seq.seq_id, seq.tokens, seq.params.platform_prefix_tokens,
                                    seq.params.cache_salt, seq.params.conversation_id)
            if hit is None:
                break
            n = min(len(seq.tokens) - hit.cached_tokens, budget)
            if not self.blocks.grow(seq.seq_id, hit.cached_tokens + n):
                self.blocks.release(seq.seq_id)
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.state = SeqState.RUNNING
            seq.num_computed = hit.cached_tokens
            if seq.hit is None:  # first admission (not a re-admission after preemption)
                seq.hit = hit
                self.hit_tokens += hit.cached_tokens
                self.host_hit_tokens += hit.host_cached_tokens
                self.miss_tokens += seq.prompt_len - hit.cached_tokens
                step.admitted.append(seq)
            planned[seq.seq_id] = (hit.cached_tokens, n)
            budget -= n
        for seq_id, (start, n) in planned.items():
            seq = self._by_id[seq_id]
            end = start + n
            step.work.append(SeqWork(seq_id, seq.tokens[start:end], start, self.blocks.table(seq_id),
                                     end == len(seq.tokens), seq.params.sampling))
        step.copies = self.blocks.take_copies()
        return step

    def complete(self, step: Step, result: StepResult) -> list[Seq]:
        """Applies a step's sampled tokens; returns the sequences that produced tokens or finished."""
        touched: list[Seq] = []
        done = False
        for w in step.work:
            seq = self._by_id[w.seq_id]
            seq.num_computed = w.start_pos + len(w.token_ids)
            self.blocks.commit(seq.seq_id, seq.tokens, seq.num_computed)
            if not w.sample:
                continue
            token = result.next_tokens[w.seq_id]
            seq.output_tokens += 1
            if token in seq.stop_ids:
                self._finish(seq, FinishReason.STOP)
                done = True
            else:
                seq.tokens.append(token)
                seq.new_tokens.append(token)
                if seq.output_tokens >= seq.params.max_tokens:
                    self._finish(seq, FinishReason.LENGTH)
                    done = True
            touched.append(seq)
        if done:
            self.running = [s for s in self.running if s.state is SeqState.RUNNING]
        return touched

    def fail(self, seqs: Sequence[Seq], error: str) -> None:
        """Ends sequences whose step failed."""
        for seq in seqs:
            if seq.state is SeqState.RUNNING:
                self._finish(seq, FinishReason.ERROR, error)
        self.running = [s for s in self.running if s.state is SeqState.RUNNING]

    def abort_all(self) -> list[Seq]:
        """Ends every sequence (engine shutdown); returns them."""
        seqs = [*self.running, *self.waiting]
        for seq in seqs:
            self._finish(seq, FinishReason.CANCELLED)
        self.running, self.waiting, self._cancelled = [], deque(), []
        return seqs

    def seq(self, seq_id: int) -> Seq:
        return self._by_id[seq_id]

    # ---- internals ---------------------------------------------------------------------------------------

    def _reap_cancelled(self, step: Step) -> None:
        if not self._cancelled:
            return
        gone = {s.seq_id for s in self._cancelled if s.state is not SeqState.FINISHED}
        for seq in self._cancelled:
            if seq.state is not SeqState.FINISHED:
                self._finish(seq, FinishReason.CANCELLED)
                step.finished.append(seq)
        self._cancelled = []
        self.running = [s for s in self.running if s.seq_id not in gone]
        if any(s.seq_id in gone for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if s.seq_id not in gone)

    def _preempt(self, seq: Seq) -> None:
        self.blocks.release(seq.seq_id)
        self.running.remove(seq)
        seq.state = SeqState.WAITING
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _finish(self, seq: Seq, reason: FinishReason, error: str = "") -> None:
        if self.blocks.holds(seq.seq_id):
            self.blocks.release(seq.seq_id)
        seq.state = SeqState.FINISHED
        seq.finish = reason
        seq.error = error
        del self._by_id[seq.seq_id]
