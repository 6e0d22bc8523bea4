"""Which conversation a request continues and which turn it is: continuity, idempotency, regenerate, fork.

A request asks for one reply to its last user message, `content`, after its earlier messages, `history`.

Turn id (the idempotency key, I2). An `Idempotency-Key` header, or Open WebUI's message id header, names the turn:
`uuid5(owner, key)`, for one request: the key is claimed with the request's digest before the turn opens, and the
same key with any other request is a 409 on every path (`records.py`). A throwaway ask (store=false, a front-end's
background task) keeps nothing to replay and ignores the key. Without one the turn id is derived from the request itself, `uuid5(owner, request digest)`,
so the SDK's own retry of a request it never got an answer to (marked `x-stainless-retry-count: N>=1`) reaches
the same turn and replays it or attaches to it: never a second generation, never a second bill. A request that
names no key and is not such a retry, yet reaches a turn already answered, was sent again on purpose: that is a
regenerate (a new reply to the same message, the old one kept as an alternative).

Conversation (see `history.py`): the conversation whose recorded history equals `history` (looked up by digest)
continues, guarded by `expect_last_turn_id`. When nothing matches or the stored conversation has moved on, the
request starts a conversation of its own, seeded with `history`; its id is derived from the request digest (and
the conversation it forks from), so a retry finds it again. Responses name their point explicitly instead
(`previous_response_id` = conversation + turn; `conversation` = append as stored).

Every path makes at most one ChatService call before the first token, except the rare ones (a regenerate, a
fork), which read the conversation first.

Racing continuations. The store writes a turn's user message together with its reply, when the turn finishes, so
while one request's turn generates, the conversation still ends where both it and a second request continuing
the same point expect: `expect_last_turn_id` alone lets both append. So this edge holds each point a request is
continuing (owner, conversation, turn) for that request's turn (`_hold`): another request continuing the same
point with another turn id meanwhile is treated as the conversation having moved on (it forks: a conversation
of its own, seeded with the history), while a retry of the same turn passes (it replays or attaches). A hold
lapses after HOLD_S, by when the point has moved on anyway if the turn was stored. It covers requests through
one gateway process; two gateways racing on one point can still both append (closing that needs the claim
itself to refuse a second open turn in the conversation, a store change).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.openai.errors import OpenAIError
from chatmesh.gateway.openai.history import HistoryIndex, Point
from chatmesh.gateway.openai.records import TurnRecords
from chatmesh.gateway.openai.stored import (
    MessageStatus, Seed, options_pb, owner_token, read_conversation, seed_pb,
)
from chatmesh.gateway.openai.wire import Message, Options, Phase, Role
from chatmesh.gateway.routes import Edge
from chatmesh.gateway.sse import TurnCall, first_event
from chatmesh.mesh import logs
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.v1 import chat_pb2, common_pb2

log = logs.get("chatmesh.gateway.openai")
_NAMESPACE = uuid.UUID("6f1d6c1e-2b7a-4c53-9a55-0c0a7e0b5f19")
MAX_FORKS = 3
HOLD_S = 300.0  # how long a point stays held for the turn continuing it (module docstring)
MAX_HOLDS = 100_000


async def keep_phases(records: TurnRecords, owner: OwnerId, conversation: ConversationId, seed: Seeded) -> None:
    """The phases of a conversation's seeded messages (records.py); a failure to keep them is logged: the
    conversation is stored, its items are then listed without them."""
    if not seed.phases:
        return
    try:
        await records.keep_phases(owner, conversation, dict(seed.phases))
    except Exception as exc:  # noqa: BLE001 - logged with its type; the turn goes on
        log.warning("phases_record_failed", error=type(exc).__name__)


def derived_id(*parts: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, "\0".join(parts)))


@dataclass(frozen=True)
class Ask:
    """One request for a reply, as Chat Completions and Responses both make it."""

    owner: OwnerId
    chat: str  # the client's own chat id (Open WebUI), or ""
    history: tuple[Message, ...]  # the client's messages before `content` (the seed of a new conversation)
    content: str
    options: Options
    request_digest: str  # of the whole request: messages, options and where it continues
    key: str | None = None  # Idempotency-Key or Open WebUI's message id
    retry: bool = False  # the SDK's own retry of this request
    results: tuple[tuple[str, str], ...] = ()  # tool results (call id, output) this request answers instead
    after: Point | None = None  # previous_response_id: continue right after this turn
    conversation: ConversationId | None = None  # conversation: append to it as stored
    seed_from: Point | None = None  # a fork seeds the stored history up to this point (Responses)
    fresh: bool = False  # a throwaway conversation of its own (store=false, a front-end's background task)
    allowance: int = 0  # the prompt tokens reserved for the turn (chatmesh.gateway.metering)


@dataclass
class Opened:
    """A turn stream whose first event has arrived, and where its reply lands."""

    call: TurnCall
    first: chat_pb2.TurnEvent
    point: Point
    created: bool  # this request created the conversation

    @property
    def replayed(self) -> bool:
        return self.first.WhichOneof("kind") == "started" and self.first.started.replayed


class Continuity:
    """Which conversation and turn each OpenAI request continues (the module header says how)."""

    def __init__(self, edge: Edge, index: HistoryIndex, records: TurnRecords,
                 clock: Callable[[], float] = time.monotonic):
        self.edge = edge
        self.index = index
        self.records = records
        self._clock = clock
        self._holds: dict[tuple[OwnerId, ConversationId, str], tuple[TurnId, float]] = {}

    def _hold(self, ask: Ask, point: Point, turn: TurnId) -> bool:
        """Holds `point` for `turn`; False when another turn of this process holds it (module docstring)."""
        now = self._clock()
        key = (ask.owner, point.conversation, point.turn)
        held = self._holds.get(key)
        if held is not None and held[0] != turn and held[1] > now:
            return False
        if len(self._holds) >= MAX_HOLDS:
            self._holds = {k: v for k, v in self._holds.items() if v[1] > now}
            if len(self._holds) >= MAX_HOLDS:
                self._holds.clear()
        self._holds[key] = (turn, now + HOLD_S)
        return True

    @staticmethod
    def _keyed(ask: Ask, key: str) -> TurnId:
        # A tool round trip answers one message in several requests under one key (Open WebUI's native function
        # calling sends the message id again with the results): each is a turn of its own, named by the key and
        # the calls it answers, so a follow-up is neither a replay nor a reused key.
        calls = "\0".join(call_id for call_id, _ in ask.results)
        return TurnId(derived_id("key", ask.owner, key, *(("tools", calls) if calls else ())))

    def turn_id(self, ask: Ask) -> TurnId:
        if ask.fresh:
            return TurnId(str(uuid.uuid4()))
        if ask.key is not None:
            return self._keyed(ask, ask.key)
        return TurnId(derived_id("request", ask.owner, ask.request_digest))

    async def open(self, ask: Ask) -> Opened:
        turn = self.turn_id(ask)
        if ask.key is not None:  # the key names this request only (records.py), whether or not it is kept:
            # a request that keeps nothing (fresh) has nothing to replay, but other content under its key is a 409
            await self.records.claim(ask.owner, self._keyed(ask, ask.key), ask.request_digest)
        if ask.fresh:
            return await self._start(ask, turn, ConversationId(str(uuid.uuid4())), forks=0)
        if ask.conversation is not None:
            return await self._append(ask, turn, ask.conversation)
        point = ask.after
        if point is None and any(m.role is Role.ASSISTANT for m in ask.history):
            point = await self.index.find(ask.owner, self.index.digest(ask.owner, ask.chat, ask.history))
        if point is None:
            return await self._start(ask, turn, self._new_conversation(ask, ""), forks=0)
        return await self._continue(ask, turn, point, recheck=ask.after is None)

    # ---- the paths --------------------------------------------------------------------------------------------

    async def _continue(self, ask: Ask, turn: TurnId, point: Point, *, recheck: bool) -> Opened:
        if not self._hold(ask, point, turn):  # another request of ours is continuing this very point
            return await self._resend(ask, turn, point, forks=0)
        try:
            opened = await self._send(ask, turn, point.conversation, expect=point.turn)
        except ApiError as err:
            if err.code == "not_found":  # deleted since it was recorded
                await self.index.forget(ask.owner, point.conversation)
                if ask.after is not None:
                    raise OpenAIError(404, "not_found", "previous response not found",
                                      "previous_response_id") from None
                return await self._start(ask, turn, self._new_conversation(ask, ""), forks=0)
            if err.code != "failed_precondition":
                raise
            if recheck:  # the in-process record may be stale: the shared one decides
                fresh = await self.index.find(ask.owner, self.index.digest(ask.owner, ask.chat, ask.history),
                                              fresh=True)
                if fresh is not None and fresh != point:
                    return await self._continue(ask, turn, fresh, recheck=False)
            return await self._resend(ask, turn, point, forks=0)
        if opened.replayed and not self._may_replay(ask):
            opened.call.cancel()
            return await self._resend(ask, turn, point, forks=0)
        return opened

    async def _append(self, ask: Ask, turn: TurnId, conversation: ConversationId) -> Opened:
        opened = await self._send(ask, turn, conversation)
        if opened.replayed and not self._may_replay(ask):  # the same input again, on purpose: a new response
            opened.call.cancel()
            opened = await self._send(ask, TurnId(str(uuid.uuid4())), conversation)
        return opened

    async def _start(self, ask: Ask, turn: TurnId, conversation: ConversationId, *, forks: int) -> Opened:
        seed = await self._seed(ask)
        create = chat_pb2.NewConversation(messages=[seed_pb(s) for s in seed.messages])
        opened = await self._send(ask, turn, conversation, create=create)
        if opened.replayed and not self._may_replay(ask):
            opened.call.cancel()
            return await self._resend(ask, turn, Point(conversation, TurnId("")), forks=forks,
                                      seeded=len(seed.messages))
        await keep_phases(self.records, ask.owner, conversation, seed)
        return opened

    async def _resend(self, ask: Ask, turn: TurnId, point: Point, *, forks: int, seeded: int | None = None
                      ) -> Opened:
        """The stored conversation does not end where the client's history does. If it ends with the client's
        history plus a reply to this very message, the client asks again: regenerate that reply. Otherwise
        (another request continued the conversation, an earlier reply was regenerated) fork."""
        live = (await read_conversation(self.edge, ask.owner, point.conversation)).live
        asks_again = (len(live) >= 2 and live[-1].role is Role.ASSISTANT
                      and live[-2].role is Role.USER and live[-2].content.strip() == ask.content.strip()
                      and (live[-3].turn_id == point.turn if point.turn and len(live) >= 3
                           else not point.turn and len(live) - 2 == seeded))
        if asks_again:
            again = TurnId(derived_id("regenerate", ask.owner, ask.request_digest, live[-1].turn_id or ""))
            call = self.edge.chat.RegenerateTurn(chat_pb2.RegenerateTurnRequest(
                owner_id=ask.owner, conversation_id=point.conversation, turn_id=again, options=options_pb(ask.options),
                prompt_token_allowance=ask.allowance), metadata=owner_token(self.edge, ask.owner, point.conversation))
            return Opened(call, await self._first(call), Point(point.conversation, again), created=False)
        if forks >= MAX_FORKS:
            raise OpenAIError(409, "conflict", "this request conflicts with the stored conversation; send it with a "
                                               "new Idempotency-Key")
        fork_ask = ask if ask.seed_from is not None or ask.after is None else \
            Ask(**{**ask.__dict__, "seed_from": ask.after})
        return await self._start(fork_ask, turn, self._new_conversation(ask, point.conversation), forks=forks + 1)

    # ---- calls ------------------------------------------------------------------------------------------------

    async def _send(self, ask: Ask, turn: TurnId, conversation: ConversationId, *, expect: str = "",
                    create: chat_pb2.NewConversation | None = None) -> Opened:
        req = chat_pb2.SendTurnRequest(owner_id=ask.owner, conversation_id=conversation, turn_id=turn,
                                       content=ask.content, options=options_pb(ask.options), expect_last_turn_id=expect,
                                       tool_results=[common_pb2.ToolResult(tool_call_id=i, content=c)
                                                     for i, c in ask.results],
                                       prompt_token_allowance=ask.allowance)
        if create is not None:
            req.create.CopyFrom(create)
        # creating the conversation is owner-wide (the store's InsertConversation refuses a conversation's token)
        token = owner_token(self.edge, ask.owner, None if create is not None else conversation)
        call = self.edge.chat.SendTurn(req, metadata=token)
        return Opened(call, await self._first(call), Point(conversation, turn), created=create is not None)

    @staticmethod
    async def _first(call: TurnCall) -> chat_pb2.TurnEvent:
        try:
            return await first_event(call)
        except BaseException:
            call.cancel()
            raise

    async def _seed(self, ask: Ask) -> Seeded:
        seed = Seeded()
        if ask.seed_from is not None:  # a fork of a stored conversation: its history up to that reply
            view = await read_conversation(self.edge, ask.owner, ask.seed_from.conversation)
            live = [m for m in view.live if m.status is not MessageStatus.BLOCKED]
            ends = [i for i, m in enumerate(live) if m.turn_id == ask.seed_from.turn]
            if not ends:
                raise OpenAIError(404, "not_found", "previous response not found", "previous_response_id")
            kept = await self.records.phases(ask.owner, ask.seed_from.conversation)
            forked = live[:ends[-1] + 1]
            seed = Seeded(tuple(Seed(m.role, m.content, m.tool_calls, m.tool_results) for m in forked),
                          tuple((i, kept[m.index]) for i, m in enumerate(forked) if m.index in kept))
        return seed + seeds_of(ask.history)

    @staticmethod
    def _may_replay(ask: Ask) -> bool:
        return ask.retry or ask.key is not None

    @staticmethod
    def _new_conversation(ask: Ask, base: str) -> ConversationId:
        return ConversationId(derived_id("conversation", ask.owner, ask.chat, ask.request_digest, base))


@dataclass(frozen=True, slots=True)
class Seeded:
    """The messages a new conversation is seeded with, and the phases of those that had one, by index (the store
    numbers seeded messages from 0 in order; records.py keeps the phases)."""

    messages: tuple[Seed, ...] = ()
    phases: tuple[tuple[int, Phase], ...] = ()

    def __add__(self, other: Seeded) -> Seeded:
        shift = len(self.messages)
        return Seeded(self.messages + other.messages,
                      self.phases + tuple((i + shift, p) for i, p in other.phases))


def seeds_of(messages: Sequence[Message]) -> Seeded:
    """A client's messages as seed messages: each run of tool results one tool message (as chat stores a tool
    turn), an assistant's calls with it, empty messages left out."""
    seed: list[Seed] = []
    phases: list[tuple[int, Phase]] = []
    for m in messages:
        if m.role is Role.TOOL:
            result = (m.tool_call_id, m.text)
            if seed and seed[-1].role is Role.TOOL:
                seed[-1] = Seed(Role.TOOL, tool_results=seed[-1].tool_results + (result,))
            else:
                seed.append(Seed(Role.TOOL, tool_results=(result,)))
        elif m.text.strip() or m.tool_calls:
            if m.phase is not None:
                phases.append((len(seed), m.phase))
            seed.append(Seed(m.role, m.text, m.tool_calls))
    return Seeded(tuple(seed), tuple(phases))
