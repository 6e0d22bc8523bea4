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

Why the queue waits (`waiting_reason`, set by every schedule()): the head was not admitted because its first
chunk's blocks do not fit in the device tier (KV_MEMORY: free plus evictable blocks are too few, the batch is
memory-bound, as `chatmesh capacity` predicts at long contexts), because `max_batch` sequences run (BATCH_SLOTS),
or because this step's token budget is spent (STEP_BUDGET: it goes in a later step). Every waiting sequence is
counted under its head's reason (FIFO: they wait behind it), and `stall_steps` counts, per reason, the steps
that ended with sequences waiting: the since-start signal a scrape cannot miss between two gauges.

Preemption by recompute. When a running sequence needs a block and none is free or evictable, the most
recently admitted sequence is preempted: its blocks are released (full ones stay cached, so the re-prefill is
mostly a prefix hit), and it goes back to the head of the queue with every token it has produced so far.

Cancellation sets a flag; the next `schedule()` releases the sequence's blocks, so a cancelled stream's memory
returns within one step.

Pulled prefixes (transfer.py): a sequence whose blocks were pulled from another replica before it was queued
names their chain range (`add(..., pulled=(first, n))`); its first admission counts the prompt tokens of that
range it hit as pulled, apart from those its own cache held, so hit + pulled + miss = prompt tokens.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from chatmesh.engine_adapter.backend import FinishReason, GenerateParams
from chatmesh.engine_adapter.block_manager import BlockManager, PrefixHit
from chatmesh.engine_adapter.executor import BlockCopy, SamplingParams, SeqWork, StepResult
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


_WORK_FIELDS = ("seq_id", "token_ids", "start_pos", "block_table", "sample", "sampling")
assert tuple(f.name for f in dataclasses.fields(SeqWork)) == _WORK_FIELDS, "SeqWork changed: update _work"


def _work(seq_id: int, token_ids: list[int], start_pos: int, block_table: list[int], sample: bool,
          sampling: SamplingParams) -> SeqWork:
    """SeqWork(...) without its generated __init__, which sets the six fields of the frozen dataclass one
    object.__setattr__ at a time: at 256 sequences a step that is a quarter of the scheduler's 1 ms budget.
    The value is the same (tests compare it with the constructor's)."""
    work: SeqWork = _new(SeqWork)
    _setattr(work, "__dict__", {"seq_id": seq_id, "token_ids": token_ids, "start_pos": start_pos,
                                "block_table": block_table, "sample": sample, "sampling": sampling})
    return work


_new = object.__new__
_setattr = object.__setattr__


class Waiting(enum.Enum):
    """Why the head of the admission queue is not running after a step (module doc)."""

    NONE = "none"  # nothing waits
    KV_MEMORY = "kv_memory"
    BATCH_SLOTS = "batch_slots"
    STEP_BUDGET = "step_budget"


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Seq:
    """One generation inside the engine. Mutable; owned by the scheduler, read by the engine's streams."""

    __slots__ = ("seq_id", "params", "tokens", "prompt_len", "num_computed", "output_tokens", "state",
                 "cancelled", "stop_ids", "hit", "finish", "error", "new_tokens", "table", "sampling", "max_tokens",
                 "pulled", "pulled_tokens")

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
        self.table: list[int] = []  # the block table while running (the block manager's live list)
        self.sampling = params.sampling
        self.max_tokens = params.max_tokens
        self.pulled = (0, 0)  # (first chain block, blocks) imported for this prompt from another replica
        self.pulled_tokens = 0  # of hit.cached_tokens, those in the pulled range (set at first admission)

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
    waiting_reason: Waiting = Waiting.NONE
    kv_stall_steps: int = 0  # steps that ended with sequences waiting for KV room
    batch_stall_steps: int = 0  # ... for a batch slot
    pulled_tokens: int = 0


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
        self.hit_tokens = self.miss_tokens = self.host_hit_tokens = self.pulled_tokens = 0
        self.preemptions = self.generations = 0
        self.waiting_reason = Waiting.NONE
        self.stall_steps = dict.fromkeys(Waiting, 0)

    def check(self, params: GenerateParams) -> None:
        """What `add` would refuse: InvalidArgument (the prompt exceeds the KV room), ResourceExhausted (the
        admission queue is full)."""
        room = self.blocks.cfg.device_blocks * self.blocks.block_size
        if len(params.prompt_token_ids) >= room:
            raise InvalidArgument(f"prompt of {len(params.prompt_token_ids)} tokens exceeds the KV room ({room})")
        if len(self.waiting) >= self.cfg.queue_limit:
            raise ResourceExhausted(f"engine admission queue is full ({self.cfg.queue_limit} waiting)")

    def add(self, params: GenerateParams, pulled: tuple[int, int] = (0, 0)) -> Seq:
        """Queues a generation (`pulled`: the chain range of its prompt's blocks imported by a pull);
        refuses what `check` refuses."""
        self.check(params)
        self._next_id += 1
        seq = Seq(self._next_id, params, self.stop_ids)
        seq.pulled = pulled
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
                                 self.host_hit_tokens, self.preemptions, self.generations, self.waiting_reason,
                                 self.stall_steps[Waiting.KV_MEMORY], self.stall_steps[Waiting.BATCH_SLOTS],
                                 self.pulled_tokens)

    # ---- one step ------------------------------------------------------------------------------------------

    def schedule(self) -> Step:
        step = Step()
        if self._cancelled:
            self._reap_cancelled(step)
        budget = self.cfg.step_token_budget
        work = step.work  # in order: decodes, running prefills, admissions
        preempted = self.preemptions
        bs = self.blocks.block_size
        prefilling: list[Seq] = []
        for seq in list(self.running):  # decodes first: one token each, a new block every block_size steps
            c = seq.num_computed
            tokens = seq.tokens
            if c != len(tokens) - 1:
                prefilling.append(seq)
            elif budget > 0 and seq.state is SeqState.RUNNING and (
                    len(seq.table) * bs > c or self._grow(seq, c + 1, step)):
                work.append(_work(seq.seq_id, tokens[c:], c, seq.table, True, seq.sampling))
                budget -= 1
        for seq in prefilling:  # then chunks of prompts already running, in the budget left
            if budget <= 0:
                break
            if seq.state is not SeqState.RUNNING:  # preempted as a victim meanwhile
                continue
            c = seq.num_computed
            n = min(len(seq.tokens) - c, budget)
            if self._grow(seq, c + n, step):
                work.append(_work(seq.seq_id, seq.tokens[c:c + n], c, seq.table, c + n == len(seq.tokens),
                                  seq.sampling))
                budget -= n
        if self.preemptions != preempted:  # victims' planned tokens go back to the budget
            budget = self.cfg.step_token_budget - sum(len(w.token_ids) for w in work)
        while self.waiting and len(self.running) < self.cfg.max_batch and budget > 0:
            seq = self.waiting[0]
            hit = self.blocks.admit(seq.seq_id, seq.tokens, seq.params.platform_prefix_tokens,
                                    seq.params.cache_salt, seq.params.conversation_id)
            if hit is None:
                break
            c = hit.cached_tokens
            n = min(len(seq.tokens) - c, budget)
            if not self.blocks.grow(seq.seq_id, c + n):
                self.blocks.release(seq.seq_id)
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.state = SeqState.RUNNING
            seq.num_computed = c
            seq.table = self.blocks.table(seq.seq_id)
            if seq.hit is None:  # first admission (not a re-admission after preemption)
                seq.hit = hit
                first, n_pulled = seq.pulled
                if n_pulled:
                    seq.pulled_tokens = max(0, min(c // bs, first + n_pulled) - first) * bs
                    self.pulled_tokens += seq.pulled_tokens
                self.hit_tokens += c - seq.pulled_tokens
                self.host_hit_tokens += hit.host_cached_tokens
                self.miss_tokens += seq.prompt_len - c
                step.admitted.append(seq)
            work.append(_work(seq.seq_id, seq.tokens[c:c + n], c, seq.table, c + n == len(seq.tokens),
                              seq.sampling))
            budget -= n
        if not self.waiting:
            self.waiting_reason = Waiting.NONE
        else:  # the loop above ended on its condition, or broke on a head that does not fit
            self.waiting_reason = (Waiting.BATCH_SLOTS if len(self.running) >= self.cfg.max_batch
                                   else Waiting.STEP_BUDGET if budget <= 0 else Waiting.KV_MEMORY)
            self.stall_steps[self.waiting_reason] += 1
        step.copies = self.blocks.take_copies()
        return step

    def _grow(self, seq: Seq, num_tokens: int, step: Step) -> bool:
        """Gives `seq` blocks for `num_tokens`, preempting the newest running sequences until it fits.
        False when `seq` itself was preempted (or, alone and out of room, finished at its context limit)."""
        while not self.blocks.grow(seq.seq_id, num_tokens):
            if len(self.running) == 1:  # alone and still out of blocks: the KV tier is its context limit
                self._finish(seq, FinishReason.LENGTH)
                self.running = []
                step.finished.append(seq)
                return False
            victim = self.running[-1]
            step.work[:] = [w for w in step.work if w.seq_id != victim.seq_id]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def complete(self, step: Step, result: StepResult) -> list[Seq]:
        """Applies a step's sampled tokens; returns the sequences that produced tokens or finished."""
        touched: list[Seq] = []
        done = False
        bs = self.blocks.block_size
        by_id, next_tokens = self._by_id, result.next_tokens
        for w in step.work:
            seq = by_id[w.seq_id]
            start = w.start_pos
            end = start + len(w.token_ids)
            seq.num_computed = end
            if start // bs != end // bs:  # a block filled up: cache it
                self.blocks.commit(seq.seq_id, seq.tokens, end)
            if not w.sample:
                continue
            token = next_tokens[w.seq_id]
            seq.output_tokens += 1
            if token in seq.stop_ids:
                self._finish(seq, FinishReason.STOP)
                done = True
            else:
                seq.tokens.append(token)
                seq.new_tokens.append(token)
                if seq.output_tokens >= seq.max_tokens:
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
        seq.table = []
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _finish(self, seq: Seq, reason: FinishReason, error: str = "") -> None:
        if self.blocks.holds(seq.seq_id):
            self.blocks.release(seq.seq_id)
        seq.state = SeqState.FINISHED
        seq.table = []
        seq.finish = reason
        seq.error = error
        del self._by_id[seq.seq_id]
