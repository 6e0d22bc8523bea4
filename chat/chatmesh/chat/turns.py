"""The turn lifecycle's entry points: send, regenerate, attach and stop, and the claim that decides who generates.

Idempotency (I2), across chat processes. The store's turn record is the idempotency record: `BeginTurn`
atomically answers exactly one of claimed (this process generates, holding a lease), in progress (another process
holds a live lease), done (the stored reply) or conflict (same turn id, other content). Each answer is one path
of the state machine (`chatmesh.mesh.turn`), driven here for every attempt:

    claimed      -> a `ClaimedTurn` task generates the turn into a `LiveTurn` (claimed.py); the caller's
                    stream, and any retry reaching this process, follow it (ATTACHED for the retries)
    done         -> REPLAYED: the stored reply streamed again
    in progress  -> ATTACHED: follow the holder's stored progress (follow.py); if the holder dies, its lease
                    lapses and this retry takes the turn over as a new attempt, which continues the reply from
                    the text already sent (the client never gets it twice, and nothing contradicts it)

A turn claimed again (after a failure, or taken over from a lapsed lease) is generated with the options its
record kept from the first claim (`options.py`), and continues the reply its record kept (`Claimed.resume_text`:
the holder's last progress, or what a failed attempt showed), so a retry that reaches the store after the lease
lapsed continues rather than regenerates, whatever its client was sent.
    conflict     -> REJECTED, as is bad input and a regenerate with nothing to regenerate

Two guards the OpenAI-compatible surface asks for (it continues conversations its clients do not name): a send
may first create its conversation, seeded with the client's earlier history (`NewConversation`; an existing one
of the owner is used as it is, so a retry lands where the first attempt did), and may expect the conversation to
end with a given turn (`expect_last_turn_id`): a new claim whose context ends elsewhere is released at once and
REJECTED (FAILED_PRECONDITION), nothing stored, so a client whose history no longer matches is never answered
from another one. A known turn id replays or attaches before either guard is looked at. The seeded history's user
messages pass the input check before the conversation is created, as CreateConversation's do (`admission.
screen_seed`): one of them blocked refuses the send, nothing stored (a seed stored with only its turn blocked
would be replayed, unchecked, into the next turn's prompt).

Either way: one generation, one bill. The caller going away stops a turn it owns (I5: the partial reply the
user saw is stored as stopped), except when its client was shown nothing: nothing published yet, or its edge
says its client saw none of it (`release`: a stream cut at the response headers). Such a turn is released, not
stored, so its retry generates it instead of replaying an empty stopped reply; and when a retry already follows
it in this process it goes on for that retry. A stop or a release reaching a process that does not generate the
turn is forwarded to the one that does (the lease holder records `name@address`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from typing import assert_never

from chatmesh.chat.admission import Admission, screen_seed
from chatmesh.chat.claimed import ClaimedTurn, Job, input_text
from chatmesh.chat.events import LiveTurn, TurnEvent, replay
from chatmesh.chat.follow import NOTHING, Delivered, StoredFollower, agrees, continuing
from chatmesh.chat.options import DEFAULT_TURN, ChatOptions, TurnOptions
from chatmesh.chat.ports import ClaimRequest, Ports, TurnKey
from chatmesh.chat.prompt import Prompts
from chatmesh.mesh import errors
from chatmesh.mesh.ids import LeaseId, TurnId
from chatmesh.mesh.message_size import MessageSize
from chatmesh.mesh.turn import RECORD_ACTIVE, Move, TurnMachine, TurnState
from chatmesh.store.values import (
    Claimed, Conflicted, Done, History, InProgress, MessageStatus, Role, Seed, ToolResult, TurnRecord,
)

CONTEXT_MESSAGES = 1000  # messages after the summary a claim returns (the store's cap); more: a separate read
# The caller's own mistakes end an attempt as REJECTED; anything else (a dependency down) as FAILED.
REJECTIONS = (errors.InvalidArgument, errors.NotFound, errors.Conflict, errors.FailedPrecondition)


@dataclass(frozen=True)
class NewConversation:
    """A conversation a send creates first (if the owner does not have it yet), with a client's history."""

    title: str
    seed: tuple[Seed, ...]


def fingerprint(kind: str, content: str) -> str:
    return hashlib.sha256(f"{kind}\0{content}".encode()).hexdigest()


def results_json(results: tuple[ToolResult, ...]) -> str:
    return json.dumps([[r.tool_call_id, r.content] for r in results], ensure_ascii=False)


def validate_results(content: str, results: tuple[ToolResult, ...], size: MessageSize) -> None:
    """A tool turn's input: results each naming a call, no user text beside them, within the size policy."""
    if content:
        raise errors.InvalidArgument("a turn answering tool calls has no content")
    if any(not r.tool_call_id for r in results):
        raise errors.InvalidArgument("tool_results: every result names the call it answers (tool_call_id)")
    size.check_bytes(input_text(content, results))


def validate_content(content: str, size: MessageSize) -> str:
    """A user message: not blank, and within the one size policy (chatmesh.mesh.message_size) in bytes; its
    tokens are checked with the whole prompt."""
    if not content or not content.strip():
        raise errors.InvalidArgument("content must be a non-empty string")
    size.check_bytes(content)
    return content


def stored_options(kept: str, own: TurnOptions) -> TurnOptions:
    """The options a claimed turn generates with: those its record kept (the first attempt's), else its own."""
    return TurnOptions.from_json(kept) if kept else own


def continued(delivered: str, left: str) -> str:
    """The reply text a new attempt continues: what the record kept of earlier attempts (`left`), or what this
    retry's client was already sent when that is longer and agrees with it. When the two disagree the record
    wins; the client that has the other text is then told to retry (`follow.continuing`), never spliced."""
    return delivered if len(delivered) > len(left) and agrees(left, delivered) else left


async def attached(live: LiveTurn, after: int) -> AsyncIterator[TurnEvent]:
    """A retry or an attach following a turn generated in this process (closed with the caller's stream, so the
    live turn counts its watchers right)."""
    stream = live.follow(after, replayed=True)
    live.attached += 1
    try:
        async for event in stream:
            yield event
    finally:
        live.attached -= 1
        await stream.aclose()


@contextlib.contextmanager
def ending_on_error(machine: TurnMachine) -> Iterator[None]:
    """A step of an attempt still in RECEIVED: an error from it ends the attempt as REJECTED or FAILED."""
    try:
        yield
    except REJECTIONS:
        machine.advance(TurnState.REJECTED)
        raise
    except errors.CoreError:
        machine.advance(TurnState.FAILED)
        raise


class Turns:
    def __init__(self, ports: Ports, prompts: Prompts, options: ChatOptions, observe: Callable[[Move], None] | None,
                 now_ms: Callable[[], float]):
        self.ports = ports
        self.store = ports.store
        self.prompts = prompts
        self.opt = options
        self.observe = observe
        self.now_ms = now_ms
        self.live: dict[TurnKey, LiveTurn] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.draining = False  # shutting down: a turn whose caller goes now is released for a retry, not stopped

    @property
    def lease_holder(self) -> str:
        """This process as recorded in the turns it holds: `name@address`, so a peer can forward a stop here."""
        return f"{self.opt.instance_id}@{self.opt.advertise_address}" if self.opt.advertise_address \
            else self.opt.instance_id

    async def send(self, key: TurnKey, content: str, options: TurnOptions = DEFAULT_TURN,
                   create: NewConversation | None = None, expect_last: TurnId | None = None,
                   results: tuple[ToolResult, ...] = (), allowance: int = 0) -> AsyncIterator[TurnEvent]:
        """A new turn answering `content` (a user message) or, when `results` are given (content then empty), the
        tool results answering the conversation's last reply's calls. `allowance`: the most prompt tokens the turn
        may use (0: no limit); a larger rendered prompt is refused (PromptOverAllowance) before any engine work."""
        machine = TurnMachine(self.observe)
        with ending_on_error(machine):
            if results:
                validate_results(content, results, self.opt.message_size)
            else:
                validate_content(content, self.opt.message_size)
            if options.tools or any(m.tool_calls or m.tool_results for m in (create.seed if create else ())):
                self.prompts.renderer.tool_syntax()  # a model without a tool format refuses before anything is stored
            if create is not None:
                await screen_seed(self.ports.moderation, key.conversation, create.seed)  # before anything is stored
                seed = tuple(replace(m, token_count=self.prompts.count_tokens(input_text(m.content, m.tool_results)))
                             for m in create.seed)
                await self.store.create_conversation(key.owner, key.conversation, create.title,
                                                     self.opt.default_prompt_version, seed)
        fp = fingerprint("tool", results_json(results)) if results else fingerprint("send", content)
        async for event in self._attempt(machine, key, content, None, fp, options, expect_last,
                                         results=results, allowance=allowance):
            yield event

    async def regenerate(self, key: TurnKey, options: TurnOptions = DEFAULT_TURN, allowance: int = 0
                         ) -> AsyncIterator[TurnEvent]:
        """A new reply to the last user message under a new turn id; a retry of the same id replays it."""
        machine = TurnMachine(self.observe)
        with ending_on_error(machine):
            target = await self._regenerate_target(key)
        async for event in self._attempt(machine, key, "", target, fingerprint("regenerate", target), options,
                                         allowance=allowance):
            yield event

    async def get(self, key: TurnKey) -> TurnRecord:
        """One turn as stored (while it runs: the reply so far); NotFound for no such turn of the owner's."""
        record = await self.store.read_turn(key)
        if (live := self.live.get(key)) is not None and live.final is None:
            return replace(record, partial_text=live.text)
        return record

    async def attach(self, key: TurnKey, after: int) -> AsyncIterator[TurnEvent]:
        machine = TurnMachine(self.observe)
        if after < 0:
            machine.advance(TurnState.REJECTED)
            raise errors.InvalidArgument("after_sequence must be >= 0")
        machine.advance(TurnState.ATTACHED)
        if (live := self.live.get(key)) is not None:
            async for event in attached(live, after):
                yield event
            return
        async for event in self._follow_stored(key, after, None):
            yield event

    async def stop(self, key: TurnKey) -> bool:
        """Stops a turn in progress here, or forwards the stop to the chat process generating it."""
        live = self.live.get(key)
        if live is not None and live.final is None:
            live.stop_requested.set()
            return True
        return await self._forward(key, release=False)

    async def release(self, key: TurnKey) -> bool:
        """The edge's client of this turn went away having been shown none of its reply: unless another stream
        follows the turn (a retry already attached), it is released rather than stopped, so nothing is stored and
        the retry generates it (an empty stopped reply would be replayed). Forwarded like a stop. True when a
        turn was released or left running for its other follower."""
        live = self.live.get(key)
        if live is not None and live.final is None:
            live.released = True
            if not live.attached:  # only its own caller's stream follows it, and that is going away
                live.handed_off = True
                live.stop_requested.set()
            return True
        return await self._forward(key, release=True)

    async def _forward(self, key: TurnKey, release: bool) -> bool:
        """A stop or release for a turn generated elsewhere, sent to its lease holder; False once it ended."""
        record = await self.store.read_turn(key)
        if record.state not in RECORD_ACTIVE:
            return False
        _, _, address = record.lease_holder.partition("@")
        if not address or address == self.opt.advertise_address or self.ports.peers is None:
            if release:
                return False  # nobody reachable generates it: the caller's own cancel ends it where it runs
            raise errors.FailedPrecondition(f"turn {key.turn} is generating in chat process "
                                            f"{record.lease_holder!r}, which this process cannot reach")
        return await self.ports.peers.stop(address, key, release=release)

    def mark_draining(self) -> None:
        """Shutdown began: turns cut off by it (their RPC cancelled at the end of the grace) are released as
        failed, so the retry, on another chat process, generates them (a stop would store them cut short)."""
        self.draining = True

    async def close(self) -> None:
        self.mark_draining()
        for live in list(self.live.values()):
            live.handed_off = True
            live.stop_requested.set()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _regenerate_target(self, key: TurnKey) -> TurnId:
        with contextlib.suppress(errors.NotFound):  # a retry: keep the target the first attempt chose
            record = await self.store.read_turn(key)
            if record.regenerates_turn_id:
                return record.regenerates_turn_id
            raise errors.Conflict(f"turn id {key.turn} was already used for a message; use a new turn id")
        view = await self.store.read_conversation(key.owner, key.conversation)
        replies = [m for m in view.messages if m.role is Role.ASSISTANT and not m.superseded
                   and m.status is not MessageStatus.BLOCKED]
        if not replies or view.messages[-1].role is not Role.ASSISTANT:
            raise errors.FailedPrecondition("there is no reply to regenerate in this conversation")
        return replies[-1].turn_id

    async def _attempt(self, machine: TurnMachine, key: TurnKey, content: str, regenerates: TurnId | None,
                       fp: str, options: TurnOptions = DEFAULT_TURN, expect_last: TurnId | None = None,
                       delivered: Delivered = NOTHING,
                       results: tuple[ToolResult, ...] = (), allowance: int = 0) -> AsyncIterator[TurnEvent]:
        """One attempt; with `delivered` (a retry whose client already has part of the reply, `follow.py`), its
        stream continues that part, and a claim won here generates the rest of it."""
        events = self._from_start(machine, key, content, regenerates, fp, options, expect_last, delivered.text,
                                  results, allowance)
        stream = continuing(events, delivered) if delivered.sequence > 0 else events
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    async def _from_start(self, machine: TurnMachine, key: TurnKey, content: str, regenerates: TurnId | None,
                          fp: str, options: TurnOptions, expect_last: TurnId | None, resume: str,
                          results: tuple[ToolResult, ...] = (), allowance: int = 0
                          ) -> AsyncGenerator[TurnEvent, None]:
        if (live := self.live.get(key)) is not None:  # a retry reached the process that is generating
            machine.advance(TurnState.ATTACHED)
            async for event in attached(live, 0):
                yield event
            return
        # The options a new record keeps (with a seed when they sample, so a continuation samples alike); a turn
        # claimed again generates with the ones its record kept instead.
        options = options.with_seed(self.opt.temperature)
        admission = Admission(self.ports.router, self.ports.moderation, key.conversation,
                              input_text(content, results) if regenerates is None else None)
        try:
            with ending_on_error(machine):
                claim = await self.store.begin_turn(ClaimRequest(
                    key=key, fingerprint=fp, content=content, lease_holder=self.lease_holder,
                    lease_ttl_ms=self.opt.lease_ttl_ms, regenerates=regenerates, context_messages=CONTEXT_MESSAGES,
                    options=options.to_json(), tool_results=results))
        except BaseException:
            await asyncio.shield(admission.discard())
            raise
        if not isinstance(claim, Claimed):
            await admission.discard()
        match claim:
            case Claimed(lease_id=lease, context=view, options=kept, resume_text=left, taken_over=taken):
                if expect_last is not None:
                    await self._expect(machine, key, lease, admission, view, expect_last)
                job = Job(key, content, regenerates, lease, admission, view, stored_options(kept, options),
                          continued(resume, left), taken, results, allowance)
                async for event in self._own(machine, job):
                    yield event
            case Done(reply=reply, usage=usage):
                machine.advance(TurnState.REPLAYED)
                for event in replay(reply, usage, 0):
                    yield event
            case InProgress():
                machine.advance(TurnState.ATTACHED)
                async for event in self._follow_stored(key, 0, (content, regenerates, fp, options, results,
                                                                allowance)):
                    yield event
            case Conflicted():
                machine.advance(TurnState.REJECTED)
                raise errors.Conflict(f"turn id {key.turn} was already used for different content; use a new turn id")
            case _:
                assert_never(claim)

    async def _expect(self, machine: TurnMachine, key: TurnKey, lease: LeaseId, admission: Admission,
                      view: History | None, expected: TurnId) -> None:
        """The expect_last_turn_id guard on a won claim (see the module header)."""
        if view is None or (not view.messages and view.summary is not None):
            # the claim brought no whole context, or only a summary that covers every message (a compaction):
            # the end of the conversation is read instead
            view = await self.store.read_conversation(key.owner, key.conversation)
        live = [m for m in view.messages if not m.superseded]
        if live and live[-1].turn_id == expected:
            return
        await asyncio.shield(admission.discard())
        with contextlib.suppress(errors.CoreError):
            await self.store.fail_turn(key, lease, "history moved on")
        machine.advance(TurnState.REJECTED)
        raise errors.FailedPrecondition(f"conversation {key.conversation} no longer ends with turn {expected}")

    async def _own(self, machine: TurnMachine, job: Job) -> AsyncIterator[TurnEvent]:
        """Starts generating a claimed turn and follows it; the caller going away stops it (I5)."""
        live = LiveTurn()
        self.live[job.key] = live
        claimed = ClaimedTurn(job, machine, live, self.ports, self.prompts, self.opt,
                              forget=lambda: self._forget(job.key))
        task = asyncio.create_task(claimed.run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        stream = live.follow(0)
        try:
            async for event in stream:
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            # The caller went away. A client shown nothing (its edge said so, or nothing was published yet) and
            # a turn cut by this process's shutdown are released for the retry; any other is stopped where the
            # user was (I5). A released turn another stream follows goes on for it.
            if not (live.released and live.attached):
                live.handed_off = live.handed_off or self.draining or live.released or not live.text
                live.stop_requested.set()
            raise
        finally:
            await stream.aclose()

    def _forget(self, key: TurnKey) -> None:
        self.live.pop(key, None)

    async def _follow_stored(self, key: TurnKey, after: int,
                             retry: tuple[str, TurnId | None, str, TurnOptions, tuple[ToolResult, ...], int] | None
                             ) -> AsyncIterator[TurnEvent]:
        """Follows a turn generated by another process; with `retry` (the caller has the turn's content), a
        lapsed or failed claim is taken over: a new attempt, claimed and generated here."""
        follower = StoredFollower(self.store, key, after, retry is not None, self.opt.follow_poll_s, self.now_ms)
        async for event in follower.events():
            yield event
        if not follower.take_over:
            return
        assert retry is not None
        content, regenerates, fp, options, results, allowance = retry
        async for event in self._attempt(TurnMachine(self.observe), key, content, regenerates, fp, options,
                                         delivered=follower.delivered, results=results, allowance=allowance):
            yield event
