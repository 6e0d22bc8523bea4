"""A claimed turn, generated to its end: what happens after this process won the turn's claim in the store.

`ClaimedTurn.run` is the owner of one attempt from the won claim to its terminal state, and the only code that
writes the turn's outcome. Its steps, with the state machine's moves (`chatmesh.mesh.turn`):

    RECEIVED   wait for the replica pick and the input check begun with the claim (`admission.py`)
               blocked input            -> BLOCKED (stored as blocked, never reaches an engine)
               moderation unavailable   -> FAILED (an outage is not a verdict: nothing stored as blocked,
                                           nothing billed; the retry is checked again), also for output
    -> QUEUED  the prompt built (a summary made first at a boundary, `prompt.py`), sent to the picked replica;
               a replica that fails before its first event (`EngineUnreachable`: down, restarted and not yet
               reconnected to, gone) generated nothing and sent nothing, so the router is asked for another one,
               the failed ones excluded, up to MAX_REROUTES times, still QUEUED: a dead replica costs a pick,
               not the turn
    -> PREFILL / DECODE  as the engine admits the prompt and streams (`stream.py`)
    -> STORED | STOPPED | BLOCKED  one FinishTurn: user message, reply as the user saw it, usage; one transaction
    -> FAILED  on any error: FailTurn (nothing stored, the claim released for a retry); also a turn cut off by
               this process shutting down (`LiveTurn.handed_off`): its retry is generated elsewhere

A turn claimed again (`Job.resume`: the record kept the reply an earlier attempt showed, its holder having died,
been cut off by a shutdown, or failed mid-reply) continues that text with the options the record kept: the text
is published first (up to its last word boundary: `resumable`) and its tokens follow the generation prompt
(`Generation.resumed_tokens` of them), so the engine generates the rest, and the stored reply starts with what any
client was sent (a reply shown to its token cap is stored as it is). The engines draw each sampled token by
seed and position, so the rest is what the first attempt would have generated (greedy or sampled); a backend that cannot continue a sampled reply exactly refuses it (`ResumeRefused`) and the turn fails
retryable with the shown text dropped, so its retry generates afresh rather than splice. The bill covers the reply
once: output tokens are the resumed ones plus the new, prompt tokens the prompt without the resumed reply.

A takeover from a holder whose lease lapsed (`Job.taken_over`: paused, partitioned from the store, or dead) first
cancels that turn's generations on every replica (`EnginePort.cancel_turn`, before its own starts), so a holder
that is only paused does not go on generating beside the successor: its sequence runs at most from its last
renewal until the takeover (the lease, 1.5 s by default, plus the follow poll and one claim) and never beside the
successor's. Were a replica unreachable then, its sequence runs until the holder's next renewal says the lease
moved (the holder then cancels it, `LeaseLost`), or the engine's keepalive drops the silent holder's connection.

A heartbeat writes the reply so far to the turn record and renews the lease every `progress_interval_s`, so
other chat processes can follow the turn and take it over if this one dies; when a renewal says the lease is no
longer ours (another process took the turn over), the stream is stopped at once, its engine sequence cancelled
and nothing is stored (`LeaseLost`).

A failure keeps the reply shown so far with the record (`fail_turn(shown=...)`) for the retry to continue; a turn
released because its client was shown nothing (`LiveTurn.released`, or nothing published yet) keeps nothing.

Every exit frees the engine sequence and the router lease (I5): the engine stream is closed in a `finally`
(closing it cancels the RPC, which cancels the sequence), the lease is released in another, and the turn is
either stored once or failed. A final state is entered only after its store write succeeded, so a failed write
still ends in FAILED.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import assert_never

from chatmesh.chat.admission import Admission, judged
from chatmesh.chat.context import Rendered
from chatmesh.chat.events import Blocked, Completed, TurnDelta, Failed, LiveTurn, TurnStarted, Stopped, TurnEventKind
from chatmesh.chat.options import DEFAULT_TURN, ChatOptions, TurnOptions
from chatmesh.chat.ports import (
    EngineFinished, EngineUnreachable, FinishReason, Generation, Pick, Ports, ResumeRefused, TurnKey,
)
from chatmesh.chat.prompt import Prompts
from chatmesh.chat.stream import Calls, Ending, OutputBlocked, StoppedHere, StopString, StreamCut, Tally, relay
from chatmesh.mesh import errors, logs
from chatmesh.mesh.ids import LeaseId, ReplicaId, TurnId
from chatmesh.mesh.turn import TurnMachine, TurnState, Usage
from chatmesh.model.tools import reply_scanner
from chatmesh.store.values import History, MessageStatus, Reply, ToolResult

log = logs.get("chatmesh.chat")

MAX_REROUTES = 2  # other replicas a turn tries when its replica fails before its first event (3 replicas: all)


def resumable(text: str) -> str:
    """The part of a reply shown so far that a continuation prefills: up to its last word boundary. The text is
    re-encoded, and a word cut short can encode to other tokens than the whole word's first ones (" acceler" alone
    is not the " acceler" of " accelerator"), which would shift every later position; the words before the cut
    encode as they were generated, and the last word is generated again, the same at the same positions."""
    cut = max(text.rfind(" "), text.rfind("\n"))
    return text[:cut] if cut > 0 else ""


class LeaseLost(errors.Unavailable):
    """Another process took the turn over (our lease lapsed); this process must not store it."""


def input_text(content: str, results: tuple[ToolResult, ...]) -> str:
    """A turn's input as text: its user message, or its tool results (what is counted and input-checked)."""
    return "\n".join(r.content for r in results) if results else content


def call_id(turn: TurnId, index: int) -> str:
    """The id of a reply's call `index`: derived from the turn, so every attempt and replay names it the same."""
    return "call_" + hashlib.sha256(f"{turn}\0{index}".encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Job:
    """What a claimed turn generates: a reply to `content`, or (regenerate) a new reply to the last user message."""

    key: TurnKey
    content: str
    regenerates: TurnId | None
    lease: LeaseId  # the store's turn lease
    admission: Admission
    view: History | None  # the prompt's context read with the claim; None: read it
    options: TurnOptions = DEFAULT_TURN  # how to generate this reply (the record's, for a turn claimed again)
    resume: str = ""  # reply text an earlier attempt showed (the record kept it): the reply continues it
    taken_over: bool = False  # claimed from a holder whose lease lapsed: its sequences are cancelled first
    results: tuple[ToolResult, ...] = ()  # a tool turn's input: the results answering the last reply's calls
    allowance: int = 0  # the most prompt tokens the turn may use (chat.proto's prompt_token_allowance; 0: no limit)


class ClaimedTurn:
    def __init__(self, job: Job, machine: TurnMachine, live: LiveTurn, ports: Ports, prompts: Prompts,
                 options: ChatOptions, forget: Callable[[], None]):
        self.job = job
        self.machine = machine
        self.live = live
        self.store, self.router = ports.store, ports.router
        self.ports = ports
        self.prompts = prompts
        self.opt = options
        self.forget = forget  # drops the live turn from this process's registry, before the final event
        self.pick: Pick | None = None  # the replica the turn is on, while its router lease is open
        self.calls: Calls | None = None  # the reply's tool-call reader, when the turn offers tools

    async def run(self) -> None:
        """Generates the turn to its end and publishes the final event; every path stores it once or fails it."""
        turn = self.job.key
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            final = await self._generate()
        except errors.PromptOverAllowance as err:  # refused before any engine work: no event, a status
            log.info("turn_over_allowance", conversation_id=turn.conversation, turn_id=turn.turn,
                     prompt_tokens=err.prompt_tokens, allowance=err.allowance)
            self.machine.advance(TurnState.REJECTED)
            await self._fail(type(err).__name__)
            await self.live.refuse(err)
            return
        except errors.CoreError as err:
            log.warning("turn_failed", conversation_id=turn.conversation, turn_id=turn.turn,
                        error=type(err).__name__, reason=str(err))
            self.machine.advance(TurnState.FAILED)
            final = Failed(message=str(err), retryable=isinstance(err, errors.Unavailable))
            if not isinstance(err, LeaseLost):
                await self._fail(type(err).__name__, "" if isinstance(err, ResumeRefused) else None)
        except Exception as err:  # a bug must still leave the turn failed, not half stored
            log.error("turn_crashed", conversation_id=turn.conversation, turn_id=turn.turn, exc_info=err)
            self.machine.advance(TurnState.FAILED)
            final = Failed(message="internal error; retry with the same turn id", retryable=True)
            await self._fail(type(err).__name__)
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            self.forget()
        if self.live.started is None:  # ended before its prompt was built (blocked input, a failure)
            await self.live.publish(TurnStarted(replayed=False))
        await self.live.publish(final)

    async def _generate(self) -> TurnEventKind:
        owner, conv, _ = self.job.key
        # The pick and the input check started with the claim, which brought the prompt's context with it; only
        # when it could not (more messages since the summary than one claim returns) is the history read here,
        # beside the other two.
        read = self.store.read_conversation(owner, conv) if self.job.view is None else None
        pick, screening, fresh = await self.job.admission.ready(read)
        self.pick = pick
        try:
            user_tokens = 0
            if screening is not None:
                user_tokens = self.prompts.count_tokens(input_text(self.job.content, self.job.results))
                if judged(screening).blocked:
                    await self._end(TurnState.BLOCKED, lambda: self._finish(user_tokens, "", 0, MessageStatus.BLOCKED,
                                                                            Usage()))
                    log.info("input_blocked", conversation_id=conv, turn_id=self.job.key.turn,
                             category=screening.category)
                    return Blocked(stage="input", category=screening.category, reason=screening.reason)
            view = self.job.view if self.job.view is not None else fresh
            assert view is not None  # read above exactly when the claim brought no whole context
            options = self.job.options
            new = self.job.content if self.job.regenerates is None and not self.job.results else None
            prefill = self.prompts.renderer.tool_syntax().prefill(options.tool_choice) \
                if options.tools and not self.job.resume else ""
            rendered = await self.prompts.prompt_for(
                owner, conv, view, new, self.job.regenerates, options.instructions,
                options.max_reply_tokens(self.opt.limits.reply_tokens), self.job.results, options.tools, prefill,
                options.compact_threshold_tokens, self.job.allowance)
            self.calls = self._calls(prefill)
            if self.job.allowance and len(rendered.token_ids) > self.job.allowance:  # a summary it needed was
                # checked against the allowance before it was written (`Prompts.prompt_for`)
                raise errors.PromptOverAllowance(len(rendered.token_ids), self.job.allowance)
            await self.live.publish(TurnStarted(replayed=False, prompt_tokens=len(rendered.token_ids)))
            resumed: tuple[int, ...] = ()
            if self.job.resume:  # claimed again: continue what an earlier attempt showed
                cap = options.max_reply_tokens(self.opt.limits.reply_tokens)
                whole = self.prompts.renderer.continuation(self.job.resume)
                at_cap = len(whole) >= cap  # all of it was shown: stored as it is (`_stream`)
                resume = self.job.resume if at_cap else resumable(self.job.resume)
                resumed = whole if at_cap else self.prompts.renderer.continuation(resume) if resume else ()
                if resume:
                    await self.live.publish(TurnDelta(resume))
            if self.job.taken_over:
                await self._cancel_elsewhere()
            self.machine.advance(TurnState.QUEUED)
            return await self._stream(rendered, resumed, user_tokens)
        finally:
            await self._release()

    def _calls(self, prefill: str) -> Calls | None:
        options = self.job.options
        if not options.tools:
            return None
        syntax = self.prompts.renderer.tool_syntax()
        turn = self.job.key.turn
        return Calls(reply_scanner(syntax, options.tools, options.tool_choice, options.parallel_tool_calls),
                     lambda i: call_id(turn, i), prefill)

    async def _cancel_elsewhere(self) -> None:
        """Cancels the turn's sequences on every replica: the holder this claim took the lapsed lease from may be
        paused rather than dead, its sequence still generating. Best effort (an unreachable replica is skipped:
        its sequence ends with its holder's next renewal, or at its token cap)."""
        owner, conv, turn = self.job.key
        with contextlib.suppress(errors.CoreError):
            replicas = await self.router.replicas()
            counts = await asyncio.gather(*(self.ports.engines.cancel_turn(r.address, owner, conv, turn)
                                            for r in replicas), return_exceptions=True)
            log.info("turn_taken_over", conversation_id=conv, turn_id=turn,
                     cancelled=sum(c for c in counts if isinstance(c, int)),
                     unreachable=sum(1 for c in counts if isinstance(c, BaseException)))

    async def _release(self) -> None:
        pick, self.pick = self.pick, None
        if pick is not None:
            with contextlib.suppress(errors.CoreError):
                await self.router.release(pick.lease)

    async def _relay(self, generation: Generation) -> tuple[Ending, Tally, Pick]:
        """`relay` on the picked replica, or on another one when it fails before its first event (see the module
        header): the failed replicas excluded, up to MAX_REROUTES picks, while the turn is still QUEUED."""
        tried: list[ReplicaId] = []
        while True:
            pick = self.pick
            assert pick is not None
            try:
                ending, tally = await relay(self.ports.engines, self.ports.moderation, self.live, self.machine,
                                            pick.address, replace(generation, source=pick.source),
                                            self.opt.engine_deadline_s, self.job.options.stop, self.calls)
                return ending, tally, pick
            except EngineUnreachable as err:
                if len(tried) >= MAX_REROUTES or self.machine.state is not TurnState.QUEUED:
                    raise
                tried.append(pick.replica_id)
                log.info("engine_rerouted", conversation_id=generation.conversation, turn_id=generation.turn,
                         replica_id=pick.replica_id, reason=str(err))
            await self._release()
            self.pick = await self.router.pick(generation.conversation, tried)

    async def _stream(self, rendered: Rendered, resumed: tuple[int, ...], user_tokens: int) -> TurnEventKind:
        owner, conv, turn = self.job.key
        options = self.job.options
        cap = options.max_reply_tokens(self.opt.limits.reply_tokens)
        prompt_tokens = len(rendered.token_ids)
        generation = Generation(
            request_id=turn, conversation=conv, turn=turn, owner=owner, prompt_token_ids=rendered.token_ids + resumed,
            platform_prefix_tokens=rendered.platform_prefix_tokens,
            max_tokens=max(1, cap - len(resumed)),
            temperature=self.opt.temperature if options.temperature is None else options.temperature,
            top_p=self.opt.top_p if options.top_p is None else options.top_p,
            seed=options.seed or 0, resumed_tokens=len(resumed))
        ending: Ending
        if resumed and len(resumed) >= cap:  # the earlier attempt showed the whole reply and died before storing it
            ending, tally, pick = EngineFinished(FinishReason.LENGTH, 0), Tally(prompt_tokens), self.pick
            assert pick is not None
            self.machine.advance(TurnState.PREFILL)
        else:
            ending, tally, pick = await self._relay(generation)
        if self.live.lease_lost:
            raise LeaseLost(f"turn {turn} was taken over by another chat process")
        if self.live.handed_off and isinstance(ending, StoppedHere):
            if self.live.released or not self.live.text:
                raise errors.Unavailable(f"turn {turn} was released: its client went away before any of the reply "
                                         "reached it; retry with the same turn id")
            raise errors.Unavailable(f"chat process {self.opt.instance_id} is shutting down; retry turn {turn} "
                                     "with the same turn id")
        # One bill for the reply, across attempts: the resumed tokens were the prompt's tail here, but they are
        # reply the turn generated (once, by an earlier attempt), so they count as output, not as prompt.
        output = tally.output_tokens + len(resumed)
        usage = Usage(prompt_tokens, min(tally.cached_tokens, prompt_tokens), output)
        text = self.live.text

        async def store(to: TurnState, status: MessageStatus) -> None:
            await self._end(to, lambda: self._finish(user_tokens, text, output, status, usage))

        match ending:
            case StoppedHere():
                await store(TurnState.STOPPED, MessageStatus.STOPPED)
                return Stopped(usage=usage)
            case OutputBlocked(verdict=verdict):
                await store(TurnState.BLOCKED, MessageStatus.BLOCKED)
                return Blocked(stage="output", category=verdict.category, reason=verdict.reason)
            case StopString():
                await store(TurnState.STORED, MessageStatus.COMPLETE)
                return Completed(usage=usage, replica_id=pick.replica_id,
                                 finish_reason="tool_calls" if self.live.calls else "stop")
            case StreamCut():
                raise errors.Unavailable(f"engine {pick.replica_id} ended the generation without finishing it "
                                         "(no reason); retry with the same turn id")
            case EngineFinished(reason=reason, error=error):
                match reason:
                    case FinishReason.CANCELLED:
                        await store(TurnState.STOPPED, MessageStatus.STOPPED)
                        return Stopped(usage=usage)
                    case FinishReason.STOP | FinishReason.LENGTH:
                        await store(TurnState.STORED, MessageStatus.COMPLETE)
                        return Completed(usage=usage, replica_id=pick.replica_id,
                                         finish_reason="tool_calls" if self.live.calls else reason.value)
                    case FinishReason.ERROR:
                        raise errors.Unavailable(f"engine {pick.replica_id} ended the generation without finishing "
                                                 f"it ({error or 'no reason'}); retry with the same turn id")
                    case _:
                        assert_never(reason)
            case _:
                assert_never(ending)

    async def _end(self, to: TurnState, write: Callable[[], Awaitable[None]]) -> None:
        """A final move: checked first, entered once the store write succeeded."""
        self.machine.check(to)
        await write()
        self.machine.advance(to)

    async def _finish(self, user_tokens: int, reply: str, reply_tokens: int, status: MessageStatus,
                      usage: Usage) -> None:
        await self.store.finish_turn(self.job.key, self.job.lease, Reply(
            user_token_count=user_tokens, text=reply, token_count=reply_tokens, status=status, usage=usage,
            tool_calls=self.live.calls))

    async def _fail(self, reason: str, shown: str | None = None) -> None:
        """Releases the claim, keeping the reply its clients were shown (`shown`, default: all published; none
        for a turn released because its client saw nothing) for the retry to continue."""
        if shown is None:
            shown = "" if self.live.released else self.live.text
        with contextlib.suppress(errors.CoreError):
            await self.store.fail_turn(self.job.key, self.job.lease, reason, shown)

    async def _heartbeat(self) -> None:
        """Writes the reply so far and renews the turn's lease, so other processes can follow or take over."""
        while True:
            await asyncio.sleep(self.opt.progress_interval_s)
            text = self.live.text
            try:
                progress = await self.store.update_turn_progress(self.job.key, self.job.lease, text, 1 + len(text),
                                                                 self.opt.lease_ttl_ms)
            except errors.CoreError as err:
                log.warning("progress_write_failed", turn_id=self.job.key.turn, error=type(err).__name__)
                continue
            if not progress.held:
                self.live.lease_lost = True
                self.live.stop_requested.set()
                return
