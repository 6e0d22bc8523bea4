"""In-memory ports for the chat core's unit tests: a store with the real store's claim semantics (one record per
turn id, leases that lapse by a clock the test moves, the record moves of `chatmesh.mesh.turn`; tied to the real
store by the contract suite, tests/store/test_port_contract.py, which runs the same scenarios on both), a router that
counts open leases, a scripted engine that can pause, fail and tell whether it was cancelled, and moderation that
blocks on marker words. No I/O, no sleeps beyond what a test asks for."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field, replace

from chatmesh.chat import context
from chatmesh.chat.ports import (
    ClaimRequest, EngineDelta, EngineEvent, EngineFinished, EngineStarted, EngineUnreachable, FinishReason, Generation,
    OutputScreen, Pick, PullSource, Replica, ResumeRefused, RouteLeaseId, Screening, TurnKey,
)
from chatmesh.mesh import errors
from chatmesh.mesh.ids import ConversationId, LeaseId, OwnerId, ReplicaId, TurnId
from chatmesh.mesh.turn import RECORD_ACTIVE, RECORD_FINAL, TurnRecordState, Usage, require_record_move
from chatmesh.model.template import Message as PromptMessage
from chatmesh.model.template import as_messages
from chatmesh.model.tools import HERMES, ToolDefinition, ToolSyntax, hermes_reply_text, hermes_tools_text
from chatmesh.store.values import (
    Claim, Claimed, Conflicted, Conversation, DailyUsage, Done, Stored, History, InProgress, Message,
    MessageStatus, Progress, Reply, Role, Seed, Summary, ToolResult, TurnRecord,
)


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000.0

    def __call__(self) -> float:
        return self.ms


@dataclass
class _Record:
    state: TurnRecordState
    fingerprint: str
    content: str
    lease: LeaseId | None
    holder: str
    expires_ms: float
    regenerates: TurnId | None
    user_index: int | None = None  # the user message the turn answers (a regenerate's: its original's)
    partial: str = ""
    event_sequence: int = 0
    reply: Message | None = None
    usage: Usage = Usage()
    options: str = ""
    results: tuple[ToolResult, ...] = ()  # a tool turn's input


@dataclass
class _Conversation:
    conversation: Conversation
    messages: list[Message] = field(default_factory=list)
    summary: Summary | None = None


class FakeStore:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.conversations: dict[tuple[OwnerId, ConversationId], _Conversation] = {}
        self.records: dict[TurnKey, _Record] = {}
        self.leases = (LeaseId(f"lease-{n}") for n in itertools.count())
        self.down: set[str] = set()  # method names that answer Unavailable
        self.calls: list[str] = []
        self.renew_refused = False  # progress answers "not held" (another process took the turn over)
        self.reclaims = 0  # claims of a record that failed or whose lease lapsed
        self.finishes = 0  # replies stored

    def _enter(self, method: str) -> None:
        self.calls.append(method)
        if method in self.down:
            raise errors.Unavailable(f"store unavailable ({method})")

    def _conv(self, owner: OwnerId, conv: ConversationId) -> _Conversation:
        found = self.conversations.get((owner, conv))
        if found is None:
            raise errors.NotFound(f"conversation {conv} not found")
        return found

    @staticmethod
    def live(record: _Record, now: float) -> bool:
        """The lease rule: an active record's lease holds until its expiry (at the expiry it has lapsed)."""
        return record.state in RECORD_ACTIVE and record.expires_ms > now

    @staticmethod
    def held(record: _Record, lease: LeaseId) -> bool:
        """What finish, fail and progress need: the caller's lease on an active record (lapsed or not)."""
        return record.lease == lease and record.state in RECORD_ACTIVE

    @staticmethod
    def later_user_message(c: _Conversation, after: int | None) -> bool:
        return after is not None and any(m.role in (Role.USER, Role.TOOL) and m.index > after for m in c.messages)

    def _regenerated(self, key: TurnKey, c: _Conversation) -> int:
        """The user message index of the turn `key` regenerates, once it may be regenerated."""
        target = self.records.get(key)
        if target is None:
            raise errors.NotFound(f"turn {key.turn} (regenerates_turn_id) not found")
        if target.state not in RECORD_FINAL or target.user_index is None:
            raise errors.FailedPrecondition(f"turn {key.turn} (regenerates_turn_id) has no stored reply to regenerate")
        if self.later_user_message(c, target.user_index):
            raise errors.FailedPrecondition("only the reply to the conversation's last user message can be regenerated")
        return target.user_index

    def _history(self, c: _Conversation) -> History:
        return History(replace(c.conversation, message_count=len(c.messages)), list(c.messages), c.summary)

    def _claim_context(self, c: _Conversation, limit: int) -> History | None:
        """What a claim carries, as the store's: the summary and the newest `limit` messages after it."""
        if not limit:
            return None
        start = c.summary.covers_through_index + 1 if c.summary is not None else 0
        after = [m for m in c.messages if m.index >= start]
        return History(replace(c.conversation, message_count=len(c.messages)), after[-limit:], c.summary)

    async def insert_conversation(self, owner: OwnerId, title: str, system_prompt_version: str) -> Conversation:
        self._enter("insert_conversation")
        conv = ConversationId(f"00000000-0000-4000-8000-{len(self.conversations):012d}")
        made = Conversation(conv, owner, title, system_prompt_version, 0, 0, 0)
        self.conversations[(owner, conv)] = _Conversation(made)
        return made

    async def create_conversation(self, owner: OwnerId, conversation: ConversationId | None, title: str,
                                  system_prompt_version: str, seed: Sequence[Seed]) -> tuple[Conversation, bool]:
        self._enter("create_conversation")
        conv = conversation or ConversationId(f"00000000-0000-4000-8000-{len(self.conversations):012d}")
        if (owner, conv) in self.conversations:
            return self.conversations[(owner, conv)].conversation, False
        made = Conversation(conv, owner, title, system_prompt_version, 0, 0, len(seed))
        self.conversations[(owner, conv)] = _Conversation(made, [
            Message(i, m.role, m.content, m.token_count, MessageStatus.COMPLETE, TurnId(f"seed-{i}"), 0, False,
                    m.tool_calls, m.tool_results)
            for i, m in enumerate(seed)])
        return made, True

    async def delete_turn(self, key: TurnKey) -> list[ConversationId]:
        self._enter("delete_turn")
        c = self._conv(key.owner, key.conversation)
        record = self.records.get(key)
        if record is None or record.state is TurnRecordState.FAILED:
            raise errors.NotFound(f"turn {key.turn} not found")
        if record.state in RECORD_ACTIVE:
            raise errors.FailedPrecondition(f"turn {key.turn} is still running")
        gone = {key.turn} | {k.turn for k, r in self.records.items()
                             if (k.owner, k.conversation) == (key.owner, key.conversation) and r.regenerates == key.turn}
        c.messages = [m for m in c.messages if m.turn_id not in gone]
        for turn in gone:
            self.records.pop(TurnKey(key.owner, key.conversation, turn), None)
        return [key.conversation]

    async def read_conversation(self, owner: OwnerId, conversation: ConversationId) -> History:
        self._enter("read_conversation")
        return self._history(self._conv(owner, conversation))

    async def begin_turn(self, claim: ClaimRequest) -> Claim:
        self._enter("begin_turn")
        c = self._conv(claim.key.owner, claim.key.conversation)
        now = self.clock()
        user_index = None
        if claim.regenerates is not None:
            user_index = self._regenerated(claim.key._replace(turn=claim.regenerates), c)
        record = self.records.get(claim.key)
        if record is not None:
            if record.fingerprint != claim.fingerprint:
                return Conflicted(record.fingerprint)
            if record.state in RECORD_FINAL:
                assert record.reply is not None
                return Done(record.reply, record.usage)
            if self.live(record, now):
                return InProgress(record.holder, int(record.expires_ms))
            require_record_move(claim.key.turn, record.state, TurnRecordState.RECEIVED)
            # claimed again: the record keeps its options and the reply shown so far, for the new attempt
            lease = next(self.leases)
            taken = record.state in RECORD_ACTIVE
            record.state, record.content, record.lease, record.holder = (
                TurnRecordState.RECEIVED, claim.content, lease, claim.lease_holder)
            record.results = claim.tool_results
            record.expires_ms = now + claim.lease_ttl_ms
            self.reclaims += 1
            return Claimed(lease, int(record.expires_ms), self._claim_context(c, claim.context_messages),
                           record.options, record.partial, taken)
        lease = next(self.leases)
        self.records[claim.key] = _Record(TurnRecordState.RECEIVED, claim.fingerprint, claim.content, lease,
                                          claim.lease_holder, now + claim.lease_ttl_ms, claim.regenerates,
                                          user_index, options=claim.options, results=claim.tool_results)
        return Claimed(lease, int(now + claim.lease_ttl_ms), self._claim_context(c, claim.context_messages))

    def _record(self, key: TurnKey) -> _Record:
        record = self.records.get(key)
        if record is None:
            raise errors.NotFound(f"turn {key.turn} not found")
        return record

    async def finish_turn(self, key: TurnKey, lease: LeaseId, reply: Reply) -> Stored:
        self._enter("finish_turn")
        record = self._record(key)
        c = self._conv(key.owner, key.conversation)
        if record.state in RECORD_FINAL:
            assert record.reply is not None
            return Stored(True, record.reply)
        if not self.held(record, lease):
            raise errors.FailedPrecondition(f"turn {key.turn}: lease {lease} is not held")
        target = TurnRecordState.STOPPED if reply.status is MessageStatus.STOPPED else TurnRecordState.STORED
        require_record_move(key.turn, record.state, target)
        now = int(self.clock())
        if record.regenerates is None:
            record.user_index = len(c.messages)
            c.messages.append(Message(len(c.messages), Role.TOOL if record.results else Role.USER, record.content,
                                      reply.user_token_count, reply.user_status, key.turn, now,
                                      tool_results=record.results))
        else:
            if self.later_user_message(c, record.user_index):
                raise errors.FailedPrecondition(
                    "only the reply to the conversation's last user message can be regenerated")
            after = record.user_index if record.user_index is not None else -1
            c.messages = [replace(m, superseded=True) if m.role is Role.ASSISTANT and m.index > after else m
                          for m in c.messages]
        stored = Message(len(c.messages), Role.ASSISTANT, reply.text, reply.token_count, reply.status, key.turn, now,
                         tool_calls=reply.tool_calls)
        c.messages.append(stored)
        record.state, record.reply, record.usage, record.partial = target, stored, reply.usage, ""
        record.options = ""
        self.finishes += 1
        return Stored(False, stored)

    async def fail_turn(self, key: TurnKey, lease: LeaseId, reason: str, shown: str = "") -> bool:
        self._enter("fail_turn")
        record = self._record(key)
        if not self.held(record, lease):
            return False
        require_record_move(key.turn, record.state, TurnRecordState.FAILED)
        record.state, record.lease, record.partial, record.expires_ms = TurnRecordState.FAILED, None, shown, 0
        return True

    async def update_turn_progress(self, key: TurnKey, lease: LeaseId, partial_text: str, event_sequence: int,
                                   lease_ttl_ms: int) -> Progress:
        self._enter("update_turn_progress")
        record = self._record(key)
        if self.renew_refused or not self.held(record, lease):
            return Progress(False, int(record.expires_ms))
        require_record_move(key.turn, record.state, TurnRecordState.RUNNING)
        record.state, record.partial, record.event_sequence = TurnRecordState.RUNNING, partial_text, event_sequence
        record.expires_ms = self.clock() + lease_ttl_ms
        return Progress(True, int(record.expires_ms))

    async def read_turn(self, key: TurnKey) -> TurnRecord:
        self._enter("read_turn")
        record = self.records.get(key)
        if record is None:
            raise errors.NotFound(f"turn {key.turn} not found")
        return TurnRecord(key.turn, record.state, record.fingerprint, record.holder, int(record.expires_ms),
                          record.partial, record.event_sequence, record.regenerates, record.reply, record.usage)

    async def save_summary(self, owner: OwnerId, conversation: ConversationId, text: str,
                           covers_through_index: int, token_count: int) -> Summary:
        self._enter("save_summary")
        c = self._conv(owner, conversation)
        c.summary = Summary(text, covers_through_index, token_count, int(self.clock()))
        return c.summary

    async def list_conversations(self, owner: OwnerId, limit: int) -> list[Conversation]:
        self._enter("list_conversations")
        return [c.conversation for (o, _), c in self.conversations.items() if o == owner][:limit]

    async def delete_conversation(self, owner: OwnerId, conversation: ConversationId) -> list[ConversationId]:
        self._enter("delete_conversation")
        self._conv(owner, conversation)
        del self.conversations[(owner, conversation)]
        for key in [k for k in self.records if (k.owner, k.conversation) == (owner, conversation)]:
            del self.records[key]
        return [conversation]

    async def export(self, owner: OwnerId) -> str:
        self._enter("export")
        return json.dumps({"conversations": [c.conversation.conversation_id
                                             for (o, _), c in self.conversations.items() if o == owner]})

    async def usage(self, owner: OwnerId, days: int) -> list[DailyUsage]:
        self._enter("usage")
        total = Usage()
        for key, r in self.records.items():
            if key.owner == owner and r.state in RECORD_FINAL:
                total = Usage(total.prompt_tokens + r.usage.prompt_tokens,
                              total.cached_prompt_tokens + r.usage.cached_prompt_tokens,
                              total.output_tokens + r.usage.output_tokens)
        turns = sum(1 for k, r in self.records.items() if k.owner == owner and r.state in RECORD_FINAL)
        return [DailyUsage("2026-12-01", total, turns)]


class FakeRouter:
    def __init__(self, replicas: Sequence[str] = ("engine-0",)) -> None:
        self.replica_ids = [ReplicaId(r) for r in replicas]
        self.open: set[RouteLeaseId] = set()
        self.picks = 0
        self.excluded: list[tuple[ReplicaId, ...]] = []  # each pick's exclusions, in order
        self.sources: dict[ReplicaId, PullSource] = {}  # a pick of this replica names this pull source
        self.down = False
        self._ids = (RouteLeaseId(f"route-{n}") for n in itertools.count())

    async def pick(self, conversation: ConversationId, exclude: Sequence[ReplicaId] = ()) -> Pick:
        if self.down:
            raise errors.Unavailable("router unavailable")
        self.picks += 1
        self.excluded.append(tuple(exclude))
        usable = [r for r in self.replica_ids if r not in exclude]
        if not usable:
            raise errors.Unavailable(f"no healthy replica: all {len(self.replica_ids)} serving replicas are excluded")
        lease = next(self._ids)
        self.open.add(lease)
        return Pick(usable[0], f"addr-{usable[0]}", lease, self.sources.get(usable[0]))

    async def release(self, lease: RouteLeaseId) -> None:
        self.open.discard(lease)

    async def replicas(self) -> list[Replica]:
        return [Replica(r, f"addr-{r}") for r in self.replica_ids]


class EngineLost(Exception):
    """Marker in a script: the engine connection drops here."""


@dataclass
class Script:
    """What the engine does for one generation: `events` in order; before event i, wait for `gates[i]` if set."""

    events: list[EngineEvent | EngineLost]
    gates: dict[int, asyncio.Event] = field(default_factory=dict)


def reply_script(*chunks: str, reason: FinishReason = FinishReason.STOP, cached: int = 0) -> Script:
    events: list[EngineEvent | EngineLost] = [EngineStarted(cached)]
    events += [EngineDelta(c, 1 + c.count(" ")) for c in chunks]
    events.append(EngineFinished(reason, sum(1 + c.count(" ") for c in chunks)))
    return Script(events)


class FakeEngine:
    def __init__(self) -> None:
        self.scripts: list[Script] = []
        self.default = reply_script("Hello", " there", ".")
        self.generations: list[Generation] = []
        self.closed_early = 0  # streams the caller closed before the engine finished (cancelled sequences)
        self.running = 0
        self.evicted: list[tuple[str, OwnerId, ConversationId]] = []
        self.unreachable: set[str] = set()  # addresses whose calls fail before any event (not connected)
        self.addresses: list[str] = []  # where each call went, unreachable ones included
        self.on_unreachable: Callable[[], None] | None = None  # called as an unreachable call fails
        self.cancelled_turns: list[tuple[str, TurnId]] = []  # cancel_turn calls (a takeover's)
        self.refuse_resume = False  # a backend that cannot continue a reply exactly (ResumeRefused)

    def generate(self, address: str, generation: Generation, timeout_s: float) -> AsyncGenerator[EngineEvent, None]:
        self.addresses.append(address)
        if address in self.unreachable:
            return self._unreachable(address)
        if self.refuse_resume and generation.resumed_tokens:
            return self._refused(address)
        self.generations.append(generation)
        return self._run(self.scripts.pop(0) if self.scripts else self.default)

    async def _unreachable(self, address: str) -> AsyncGenerator[EngineEvent, None]:
        if self.on_unreachable is not None:
            self.on_unreachable()
        for event in self.default.events[:0]:  # no event comes before the failure (an async generator, as a stream)
            yield event  # type: ignore[misc]
        raise EngineUnreachable(f"engine at {address} unavailable (UNAVAILABLE): failed to connect")

    async def _refused(self, address: str) -> AsyncGenerator[EngineEvent, None]:
        for event in self.default.events[:0]:
            yield event  # type: ignore[misc]
        raise ResumeRefused(f"engine at {address} cannot continue a sampled reply exactly")

    async def _run(self, script: Script) -> AsyncGenerator[EngineEvent, None]:
        self.running += 1
        finished = False
        try:
            for i, event in enumerate(script.events):
                if (gate := script.gates.get(i)) is not None:
                    await gate.wait()
                if isinstance(event, EngineLost):
                    raise errors.Unavailable("engine at addr unavailable (UNAVAILABLE): connection lost")
                finished = isinstance(event, EngineFinished)
                yield event
                await asyncio.sleep(0)
        finally:
            self.running -= 1
            if not finished:
                self.closed_early += 1

    async def evict(self, address: str, owner: OwnerId, conversation: ConversationId) -> int:
        self.evicted.append((address, owner, conversation))
        return 1

    async def cancel_turn(self, address: str, owner: OwnerId, conversation: ConversationId, turn: TurnId) -> int:
        self.cancelled_turns.append((address, turn))
        return 0


OUTAGE = Screening(blocked=True, category="moderation_unavailable", reason="moderation failed (UNAVAILABLE); failing "
                   "closed", unavailable=True)  # what the client's fail-closed policy answers while it is down


class _Screen:
    def __init__(self, words: set[str], moderation: FakeModeration) -> None:
        self.words = words
        self.moderation = moderation
        self.closed = False

    async def check(self, chunk: str, final: bool = False) -> Screening:
        if self.moderation.output_down:
            return OUTAGE
        hit = next((w for w in self.words if w in chunk), None)
        return Screening(blocked=hit is not None, category="abuse" if hit else "", reason="marker" if hit else "")

    async def close(self) -> None:
        self.closed = True


class FakeModeration:
    def __init__(self) -> None:
        self.input_words = {"BLOCKME"}
        self.output_words = {"BADWORD"}
        self.screens: list[_Screen] = []
        self.inputs_checked = 0
        self.input_down = False  # checks answer the fail-closed outage (the service is down)
        self.output_down = False

    async def check_input(self, text: str, conversation: ConversationId) -> Screening:
        self.inputs_checked += 1
        if self.input_down:
            return OUTAGE
        hit = any(w in text for w in self.input_words)
        return Screening(blocked=hit, category="abuse" if hit else "", reason="marker" if hit else "")

    async def open_output(self, conversation: ConversationId) -> OutputScreen:
        screen = _Screen(self.output_words, self)
        self.screens.append(screen)
        return screen


class FakePeers:
    def __init__(self) -> None:
        self.stops: list[tuple[str, TurnKey]] = []
        self.releases: list[tuple[str, TurnKey]] = []

    async def stop(self, address: str, key: TurnKey, release: bool = False) -> bool:
        (self.releases if release else self.stops).append((address, key))
        return True


class WordRenderer:
    """A prefix-stable renderer: each message encodes on its own (a role marker, then one id per word); tools in
    the ChatML `<tool_call>` convention (its definitions after the first message, a call as its text)."""

    MARKERS = {context.Speaker.SYSTEM: 1, context.Speaker.USER: 2, context.Speaker.ASSISTANT: 3,
               context.Speaker.TOOL: 4}

    def render(self, messages: Sequence[PromptMessage | tuple[context.Speaker, str]], tools: Sequence[ToolDefinition] = (),
               prefill: str = "") -> context.Rendered:
        ids: list[int] = []
        prefix = 0
        for i, m in enumerate(as_messages(messages)):
            ids.append(self.MARKERS[m.role])
            text = hermes_reply_text(m.text, m.tool_calls) if m.tool_calls else m.text
            ids.extend(10 + sum(map(ord, word)) % 1000 for word in text.split())
            if i == 0:
                prefix = len(ids)
                if tools:
                    ids.extend(10 + sum(map(ord, word)) % 1000 for word in hermes_tools_text(tools).split())
        ids.append(self.MARKERS[context.Speaker.ASSISTANT])
        ids.extend(self.continuation(prefill))
        return context.Rendered(tuple(ids), prefix)

    @staticmethod
    def tool_syntax() -> ToolSyntax:
        return HERMES

    @staticmethod
    def count(text: str) -> int:
        return len(text.split())

    @staticmethod
    def continuation(text: str) -> tuple[int, ...]:
        return tuple(10 + sum(map(ord, word)) % 1000 for word in text.split())
