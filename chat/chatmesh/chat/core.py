"""The chat core: drives one turn through store, moderation, router and engine (see `turn.py` for the states).

Idempotency (I2), across chat processes. The store's turn row is the idempotency record: `BeginTurn` atomically
answers exactly one of claimed (this process generates, holding a lease), in progress (another process holds a
live lease), done (the stored reply) or conflict (same turn id, other content). A claimed turn runs as its own
task that publishes into a `LiveTurn`; the caller's stream, and any retry reaching this process, follow it.
While it runs, a heartbeat writes the reply so far to the turn row and renews the lease (`UpdateTurnProgress`,
every `progress_interval_s`). A retry or attach that reaches *another* chat process follows the turn by polling
that row (`ReadTurn`): new text is streamed as it appears, the stored reply ends it, and if the holder dies its
lease lapses and the retry claims the turn and generates it (the reference's Failed -> Queued path). Either way:
one generation, one bill. Progress goes through the store rather than Redis so the embedded default needs
nothing else running; the cost is one small write per turn per interval, off the token path.

Every exit frees the engine sequence and the router lease (I5): the engine stream is closed in a `finally`
(closing it cancels the RPC, which cancels the sequence), the lease is released in another, and the turn is
either stored once (FinishTurn, one transaction) or failed (FailTurn, nothing stored). A stop or a disconnect
stores the partial reply with the stopped marker, exactly the text the user was sent.

Summaries (I3): when the replayed history passes `summary_threshold_tokens`, older turns are summarised by the
engine at the turn boundary, before the prompt is built, and the summary is stored; later turns rebuild the same
prompt from the stored summary instead of recomputing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from chatmesh.chat import context
from chatmesh.chat.events import (
    Blocked, Completed, Delta, EventKind, Failed, LiveTurn, Started, Stopped, TurnEvent, Usage, resume_from,
)
from chatmesh.chat.ports import EnginePort, ModerationPort, OutputScreen, PeerPort, RouterPort, Screening, StorePort
from chatmesh.chat.turn import TurnMachine, TurnState
from chatmesh.mesh import errors, logs
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.v1 import common_pb2, generate_pb2, route_pb2, store_pb2

log = logs.get("chatmesh.chat")

MAX_CONTENT_BYTES = 512 * 1024
CONTEXT_MESSAGES = 1000  # messages after the summary a claim returns (the store's cap); more: a separate read
FOLLOW_POLL_S = 0.1

DEFAULT_SYSTEM_PROMPTS = {
    "v1": "You are a helpful, concise assistant. Answer the user's questions accurately and briefly.",
}
SUMMARY_PROMPT = ("You summarise conversations. Write a short factual summary of the conversation below, keeping "
                  "names, numbers, decisions and open questions. Write only the summary.")
SUMMARY_MAX_TOKENS = 200


@dataclass(frozen=True)
class ChatOptions:
    limits: context.Limits
    temperature: float
    top_p: float
    lease_ttl_ms: int
    progress_interval_s: float
    engine_deadline_s: float
    instance_id: str
    salt_secret: bytes
    system_prompts: dict[str, str]
    default_prompt_version: str
    summary_threshold_tokens: int
    keep_recent_messages: int
    advertise_address: str = ""  # where peers reach this process; recorded in the lease holder


TurnKey = tuple[OwnerId, ConversationId, TurnId]


class LeaseLost(errors.Unavailable):
    """Another process took the turn over (our lease lapsed); this process must not store it."""


def fingerprint(kind: str, content: str) -> str:
    return hashlib.sha256(f"{kind}\0{content}".encode()).hexdigest()


def validate_content(content: str) -> str:
    if not content or not content.strip():
        raise errors.InvalidArgument("content must be a non-empty string")
    if len(content.encode()) > MAX_CONTENT_BYTES:
        raise errors.InvalidArgument(f"content is over the {MAX_CONTENT_BYTES // 1024} KiB limit")
    return content


class _Early:
    """The replica pick and the input check of a turn, started together with its claim.

    Neither depends on the claim's answer, and the claim is almost always NEW, so waiting for it first would put a
    whole hop in front of every first token. When the claim says the turn is someone else's (done, in progress,
    conflict), `discard` drops the check and releases the lease as soon as the pick answers: the router's load is
    back where it was before the caller goes on. Blocked input still never reaches an engine: generation waits
    for the check.
    """

    def __init__(self, router: RouterPort, moderation: ModerationPort, conv: ConversationId,
                 content: str | None) -> None:
        self.router = router
        self.screening: asyncio.Future[Screening] | None = (
            asyncio.ensure_future(moderation.check_input(content, conv)) if content is not None else None)
        self.pick: asyncio.Future[route_pb2.PickReplicaResponse] = asyncio.ensure_future(router.pick(conv))

    async def discard(self) -> None:
        if self.screening is not None:
            self.screening.cancel()
            with contextlib.suppress(BaseException):
                await self.screening
        try:
            lease = (await self.pick).lease_id
        except Exception:  # the pick failed: no lease to release (its error is reported where it is awaited)
            return
        with contextlib.suppress(errors.CoreError):
            await self.router.release(lease)


@dataclass(frozen=True)
class _Job:
    """What a claimed turn generates: a reply to `content`, or (regenerate) a new reply to the last user message."""

    key: TurnKey
    content: str
    regenerates: TurnId | None
    store_lease: str
    early: _Early
    view: store_pb2.ReadConversationResponse | None  # the prompt's context read with the claim; None: read it


class ChatCore:
    def __init__(self, store: StorePort, router: RouterPort, engines: EnginePort, moderation: ModerationPort,
                 renderer: context.Renderer, count_tokens: Callable[[str], int], options: ChatOptions,
                 peers: PeerPort | None = None):
        self.peers = peers
        self.store = store
        self.router = router
        self.engines = engines
        self.moderation = moderation
        self.renderer = renderer
        self.count_tokens = count_tokens
        self.opt = options
        self.live: dict[TurnKey, LiveTurn] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    # ---- conversations -------------------------------------------------------------------------------------

    async def create_conversation(self, owner: OwnerId, title: str) -> common_pb2.Conversation:
        if len(title) > 200:
            raise errors.InvalidArgument("title must be at most 200 characters")
        resp = await self.store.insert_conversation(store_pb2.InsertConversationRequest(
            owner_id=owner, title=title, system_prompt_version=self.opt.default_prompt_version))
        return resp.conversation

    async def get_conversation(self, owner: OwnerId, conv: ConversationId) -> store_pb2.ReadConversationResponse:
        return await self.store.read_conversation(
            store_pb2.ReadConversationRequest(owner_id=owner, conversation_id=conv))

    async def list_conversations(self, owner: OwnerId, page_size: int) -> list[common_pb2.Conversation]:
        if page_size < 0 or page_size > 500:
            raise errors.InvalidArgument("page_size must be between 0 and 500")
        resp = await self.store.list_conversations(
            store_pb2.ListOwnerConversationsRequest(owner_id=owner, page_size=page_size or 50))
        return list(resp.conversations)

    async def delete_conversation(self, owner: OwnerId, conv: ConversationId) -> int:
        """Deletes every stored row, then evicts the conversation's KV blocks on every engine (I4)."""
        for key, live in list(self.live.items()):
            if key[:2] == (owner, conv):
                live.stop_requested.set()
        resp = await self.store.delete_conversation(
            store_pb2.DeleteStoredConversationRequest(owner_id=owner, conversation_id=conv))
        evicted = 0
        for replica in await self.router.replicas():
            for conversation_id in resp.evict_conversation_ids:
                try:
                    evicted += await self.engines.evict(replica.address, generate_pb2.EvictRequest(
                        conversation_id=conversation_id))
                except errors.Unavailable:
                    # A replica that is down holds nothing it could serve; its cache dies with it.
                    log.warning("evict_unreachable", replica_id=replica.replica_id, conversation_id=conv)
        return evicted

    async def usage(self, owner: OwnerId, days: int) -> store_pb2.ReadUsageResponse:
        if days < 0 or days > 366:
            raise errors.InvalidArgument("days must be between 0 and 366")
        return await self.store.usage(store_pb2.ReadUsageRequest(owner_id=owner, days=days or 30))

    async def export(self, owner: OwnerId) -> str:
        return (await self.store.export(store_pb2.ExportOwnerDataRequest(owner_id=owner))).json

    def cache_salt(self, owner: OwnerId) -> bytes:
        """Per-owner salt for KV reuse past the platform prefix (I1); keyed so salts cannot be guessed."""
        return hmac.new(self.opt.salt_secret, owner.encode(), hashlib.sha256).digest()[:16]

    # ---- turns ---------------------------------------------------------------------------------------------

    async def send_turn(self, owner: OwnerId, conv: ConversationId, turn: TurnId, content: str
                        ) -> AsyncIterator[TurnEvent]:
        validate_content(content)
        async for event in self._turn((owner, conv, turn), content, None, fingerprint("send", content)):
            yield event

    async def regenerate(self, owner: OwnerId, conv: ConversationId, turn: TurnId) -> AsyncIterator[TurnEvent]:
        """A new reply to the last user message under a new turn id; a retry of the same id replays it."""
        target = await self._regenerate_target(owner, conv, turn)
        async for event in self._turn((owner, conv, turn), "", target, fingerprint("regenerate", target)):
            yield event

    async def _regenerate_target(self, owner: OwnerId, conv: ConversationId, turn: TurnId) -> TurnId:
        with contextlib.suppress(errors.NotFound):  # a retry: keep the target the first attempt chose
            record = await self.store.read_turn(store_pb2.ReadTurnRequest(
                owner_id=owner, conversation_id=conv, turn_id=turn))
            if record.regenerates_turn_id:
                return TurnId(record.regenerates_turn_id)
            raise errors.Conflict(f"turn id {turn} was already used for a message; use a new turn id")
        view = await self.get_conversation(owner, conv)
        replies = [m for m in view.messages if m.role == common_pb2.ROLE_ASSISTANT and not m.superseded
                   and m.status != common_pb2.MESSAGE_STATUS_BLOCKED]
        if not replies or view.messages[-1].role != common_pb2.ROLE_ASSISTANT:
            raise errors.FailedPrecondition("there is no reply to regenerate in this conversation")
        return TurnId(replies[-1].turn_id)

    async def attach(self, owner: OwnerId, conv: ConversationId, turn: TurnId, after: int
                     ) -> AsyncIterator[TurnEvent]:
        if after < 0:
            raise errors.InvalidArgument("after_sequence must be >= 0")
        if (live := self.live.get((owner, conv, turn))) is not None:
            async for event in live.follow(after, replayed=True):
                yield event
            return
        async for event in self._follow_stored((owner, conv, turn), after, None):
            yield event

    @property
    def lease_holder(self) -> str:
        """This process as recorded in the turns it holds: `name@address`, so a peer can forward a stop here."""
        return f"{self.opt.instance_id}@{self.opt.advertise_address}" if self.opt.advertise_address \
            else self.opt.instance_id

    async def stop(self, owner: OwnerId, conv: ConversationId, turn: TurnId) -> bool:
        """Stops a turn in progress here, or forwards the stop to the chat process generating it."""
        live = self.live.get((owner, conv, turn))
        if live is not None and live.final is None:
            live.stop_requested.set()
            return True
        record = await self.store.read_turn(store_pb2.ReadTurnRequest(owner_id=owner, conversation_id=conv,
                                                                      turn_id=turn))
        if record.state not in (store_pb2.TURN_STATE_RECEIVED, store_pb2.TURN_STATE_RUNNING):
            return False
        _, _, address = record.lease_holder.partition("@")
        if not address or address == self.opt.advertise_address or self.peers is None:
            raise errors.FailedPrecondition(
                f"turn {turn} is generating in chat process {record.lease_holder!r}, which this process cannot reach")
        return await self.peers.stop(address, owner, conv, turn)

    async def _turn(self, key: TurnKey, content: str, regenerates: TurnId | None, fp: str
                    ) -> AsyncIterator[TurnEvent]:
        owner, conv, turn = key
        if (live := self.live.get(key)) is not None:  # a retry reached the process that is generating
            async for event in live.follow(0, replayed=True):
                yield event
            return
        early = _Early(self.router, self.moderation, conv, content if regenerates is None else None)
        try:
            claim = await self.store.begin_turn(store_pb2.BeginTurnRequest(
                owner_id=owner, conversation_id=conv, turn_id=turn, fingerprint=fp, content=content,
                lease_holder=self.lease_holder, lease_ttl_ms=self.opt.lease_ttl_ms,
                regenerates_turn_id=regenerates or "", context_max_messages=CONTEXT_MESSAGES))
        except BaseException:
            await asyncio.shield(early.discard())
            raise
        outcome = claim.WhichOneof("outcome")
        if outcome != "claimed":
            await early.discard()
        match outcome:
            case "claimed":
                job = _Job(key, content, regenerates, claim.claimed.lease_id, early, _whole_context(claim.claimed))
                async for event in self._own(job):
                    yield event
            case "done":
                for event in _replay(claim.done.reply, claim.done.usage, 0):
                    yield event
            case "in_progress":
                async for event in self._follow_stored(key, 0, (content, regenerates, fp)):
                    yield event
            case "conflict":
                raise errors.Conflict(f"turn id {turn} was already used for different content; use a new turn id")
            case other:
                raise errors.Unavailable(f"store answered BeginTurn with {other!r}")

    async def _own(self, job: _Job) -> AsyncIterator[TurnEvent]:
        """Starts generating a claimed turn and follows it; the caller going away stops it (I5)."""
        live = LiveTurn()
        self.live[job.key] = live
        task = asyncio.create_task(self._run(live, job))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        stream = live.follow(0)
        try:
            async for event in stream:
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            live.stop_requested.set()
            raise
        finally:
            await stream.aclose()

    async def _follow_stored(self, key: TurnKey, after: int, retry: tuple[str, TurnId | None, str] | None
                             ) -> AsyncIterator[TurnEvent]:
        """Follows a turn generated by another process through its stored progress. With `retry` (the caller
        has the turn's content), a lapsed lease is claimed and the turn generated here."""
        owner, conv, turn = key
        seen = after
        while True:
            record = await self.store.read_turn(store_pb2.ReadTurnRequest(owner_id=owner, conversation_id=conv,
                                                                          turn_id=turn))
            match record.state:
                case store_pb2.TURN_STATE_STORED | store_pb2.TURN_STATE_STOPPED:
                    for event in _replay(record.reply, record.usage, seen):
                        yield event
                    return
                case store_pb2.TURN_STATE_RECEIVED | store_pb2.TURN_STATE_RUNNING:
                    lapsed = record.lease_expires_at_ms < time.time() * 1000
                    if not (lapsed and retry is not None):
                        for event in resume_from(record.partial_text, None, seen, replayed=True):
                            yield event
                            seen = event.sequence
                        await asyncio.sleep(FOLLOW_POLL_S)
                        continue
                case store_pb2.TURN_STATE_FAILED:
                    if retry is None:
                        yield TurnEvent(max(seen + 1, 2), Failed("the turn failed; retry with the same turn id",
                                                                 retryable=True))
                        return
                case _:
                    raise errors.Unavailable(f"store reported turn state {record.state}")
            # The holder failed or its lease lapsed: this retry takes the turn over.
            assert retry is not None
            content, regenerates, fp = retry
            async for event in self._turn(key, content, regenerates, fp):
                if event.sequence > seen:
                    yield event
            return

    async def _run(self, live: LiveTurn, job: _Job) -> None:
        """Generates a claimed turn to its end; every path stores it once or fails it (I5)."""
        owner, conv, turn = job.key
        heartbeat = asyncio.create_task(self._heartbeat(live, job))
        try:
            await live.publish(Started(replayed=False))
            final = await self._generate(live, job)
        except errors.CoreError as err:
            log.warning("turn_failed", conversation_id=conv, turn_id=turn, error=type(err).__name__, reason=str(err))
            final = Failed(message=str(err), retryable=isinstance(err, errors.Unavailable))
            if not isinstance(err, LeaseLost):
                await self._fail(job, type(err).__name__)
        except Exception as err:  # a bug must still leave the turn failed, not half stored
            log.error("turn_crashed", conversation_id=conv, turn_id=turn, exc_info=err)
            final = Failed(message="internal error; retry with the same turn id", retryable=True)
            await self._fail(job, type(err).__name__)
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            self.live.pop(job.key, None)
        await live.publish(final)

    async def _heartbeat(self, live: LiveTurn, job: _Job) -> None:
        """Writes the reply so far and renews the turn's lease, so other processes can follow or take over."""
        owner, conv, turn = job.key
        while True:
            await asyncio.sleep(self.opt.progress_interval_s)
            try:
                resp = await self.store.update_turn_progress(store_pb2.UpdateTurnProgressRequest(
                    owner_id=owner, conversation_id=conv, turn_id=turn, lease_id=job.store_lease,
                    partial_text=live.text, event_sequence=1 + len(live.text), lease_ttl_ms=self.opt.lease_ttl_ms))
            except errors.CoreError as err:
                log.warning("progress_write_failed", turn_id=turn, error=type(err).__name__)
                continue
            if not resp.held:
                live.lease_lost = True
                live.stop_requested.set()
                return

    async def _fail(self, job: _Job, reason: str) -> None:
        owner, conv, turn = job.key
        with contextlib.suppress(errors.CoreError):
            await self.store.fail_turn(store_pb2.FailTurnRequest(
                owner_id=owner, conversation_id=conv, turn_id=turn, lease_id=job.store_lease, reason=reason))

    async def _generate(self, live: LiveTurn, job: _Job) -> EventKind:
        owner, conv, turn = job.key
        machine = TurnMachine()
        user_tokens = 0
        # The input check and the replica pick started with the claim (`_Early`), which brought the prompt's
        # context with it; only when it could not (more messages since the summary than one claim returns) is the
        # history read here, beside the other two. Each is a hop; in sequence they were most of the time the mesh
        # adds before the first token. A pick made for a turn that is then blocked is released at once and never
        # reaches the engine.
        screening_task = job.early.screening
        read_task = asyncio.ensure_future(self.get_conversation(owner, conv)) if job.view is None else None
        pick_task = job.early.pick
        try:
            await asyncio.gather(*(t for t in (screening_task, read_task, pick_task) if t is not None))
        except BaseException:
            if read_task is not None:
                read_task.cancel()
            await asyncio.shield(job.early.discard())
            raise
        pick = pick_task.result()
        try:
            if screening_task is not None:
                screening = screening_task.result()
                user_tokens = self.count_tokens(job.content)
                if screening.blocked:
                    machine.advance(TurnState.BLOCKED)
                    await self._finish(job, user_tokens, "", 0, common_pb2.MESSAGE_STATUS_BLOCKED, Usage())
                    log.info("input_blocked", conversation_id=conv, turn_id=turn, category=screening.category)
                    return Blocked(stage="input", category=screening.category, reason=screening.reason)
            view = job.view
            if view is None:
                assert read_task is not None  # started above exactly when the claim brought no whole context
                view = read_task.result()
            summary = await self._summary_for(owner, conv, view)
            rendered = self.render(view, summary, job.content if job.regenerates is None else None,
                                   job.regenerates)
            machine.advance(TurnState.QUEUED)
            return await self._stream(live, machine, job, rendered, pick.address, pick.replica_id, user_tokens)
        finally:
            with contextlib.suppress(errors.CoreError):
                await self.router.release(pick.lease_id)

    # ---- prompts -------------------------------------------------------------------------------------------

    def _system_prompt(self, view: store_pb2.ReadConversationResponse) -> str:
        version = view.conversation.system_prompt_version or self.opt.default_prompt_version
        prompt = self.opt.system_prompts.get(version)
        if prompt is None:
            raise errors.FailedPrecondition(f"system prompt version {version!r} is not configured")
        return prompt

    @staticmethod
    def history(view: store_pb2.ReadConversationResponse, regenerates: TurnId | None = None
                ) -> list[context.HistoryMessage]:
        """Stored messages as the prompt replays them: superseded and blocked ones are not replayed, nor the reply
        being regenerated."""
        blocked_turns = {m.turn_id for m in view.messages if m.status == common_pb2.MESSAGE_STATUS_BLOCKED}
        return [context.HistoryMessage(
            index=m.index, speaker=_SPEAKERS[m.role], content=m.content, turn_id=m.turn_id,
            replayable=(not m.superseded and m.turn_id not in blocked_turns
                        and not (regenerates and m.turn_id == regenerates and m.role == common_pb2.ROLE_ASSISTANT)))
            for m in view.messages]

    def render(self, view: store_pb2.ReadConversationResponse, summary: context.Summary | None,
               new_message: str | None, regenerates: TurnId | None = None) -> context.Rendered:
        return context.build(self.renderer, self.opt.limits, self._system_prompt(view), summary,
                             self.history(view, regenerates), new_message)

    async def next_prompt(self, owner: OwnerId, conv: ConversationId, new_message: str) -> context.Rendered:
        """The prompt the next turn with `new_message` would send (no summarising side effect)."""
        view = await self.get_conversation(owner, conv)
        return self.render(view, _stored_summary(view), new_message)

    async def _summary_for(self, owner: OwnerId, conv: ConversationId, view: store_pb2.ReadConversationResponse
                           ) -> context.Summary | None:
        """The stored summary, refreshed first when the replayed history is over the threshold."""
        summary = _stored_summary(view)
        history = self.history(view)
        counts = {m.index: m.token_count for m in view.messages}
        if context.history_tokens(history, summary, counts) <= self.opt.summary_threshold_tokens:
            return summary
        cut = context.summary_cut(history, summary, self.opt.keep_recent_messages)
        if cut is None:
            return summary
        start = summary.covers_until if summary else 0
        transcript = "\n".join(f"{m.speaker.value}: {m.content}" for m in history
                               if start <= m.index < cut and m.replayable)
        if summary is not None:
            transcript = f"Earlier summary: {summary.text}\n{transcript}"
        text = await self._summarise(owner, conv, transcript)
        saved = await self.store.save_summary(store_pb2.SaveSummaryRequest(
            owner_id=owner, conversation_id=conv, text=text, covers_through_index=cut - 1,
            token_count=self.count_tokens(text)))
        log.info("summary_stored", conversation_id=conv, covers_through_index=cut - 1)
        return context.Summary(saved.summary.text, saved.summary.covers_through_index + 1)

    async def _summarise(self, owner: OwnerId, conv: ConversationId, transcript: str) -> str:
        rendered = self.renderer.render([(context.Speaker.SYSTEM, SUMMARY_PROMPT), (context.Speaker.USER, transcript)])
        pick = await self.router.pick(conv)
        parts: list[str] = []
        try:
            stream = self.engines.generate(pick.address, generate_pb2.GenerateRequest(
                request_id=f"summary-{conv}", conversation_id=conv, prompt_token_ids=rendered.token_ids,
                cache_salt=self.cache_salt(owner), platform_prefix_tokens=rendered.platform_prefix_tokens,
                max_tokens=SUMMARY_MAX_TOKENS, temperature=0.0, top_p=1.0), self.opt.engine_deadline_s)
            try:
                async for resp in stream:
                    if resp.WhichOneof("event") == "delta":
                        parts.append(resp.delta.text)
            finally:
                await stream.aclose()
        finally:
            with contextlib.suppress(errors.CoreError):
                await self.router.release(pick.lease_id)
        text = "".join(parts).strip()
        if not text:
            raise errors.Unavailable("the engine returned an empty summary; retry the turn")
        return text

    # ---- streaming -----------------------------------------------------------------------------------------

    async def _stream(self, live: LiveTurn, machine: TurnMachine, job: _Job, rendered: context.Rendered,
                      address: str, replica_id: str, user_tokens: int) -> EventKind:
        owner, conv, turn = job.key
        request = generate_pb2.GenerateRequest(
            request_id=turn, conversation_id=conv, turn_id=turn, prompt_token_ids=rendered.token_ids,
            cache_salt=self.cache_salt(owner), platform_prefix_tokens=rendered.platform_prefix_tokens,
            max_tokens=self.opt.limits.reply_tokens, temperature=self.opt.temperature, top_p=self.opt.top_p)
        progress = _Progress(prompt_tokens=len(rendered.token_ids))
        screen = await self.moderation.open_output(conv)
        consume = asyncio.create_task(self._consume(live, machine, address, request, screen, progress))
        stop = asyncio.create_task(live.stop_requested.wait())
        try:
            await asyncio.wait({consume, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not consume.done():  # stop or disconnect: cancel the engine sequence, keep what the user saw
                consume.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consume
            await screen.close()
        if live.lease_lost:
            raise LeaseLost(f"turn {turn} was taken over by another chat process")
        outcome = _STOPPED if consume.cancelled() else consume.result()
        usage = Usage(progress.prompt_tokens, progress.cached_tokens, progress.output_tokens)
        match outcome:
            case _StopMarker() | generate_pb2.FINISH_REASON_CANCELLED:
                machine.advance(TurnState.STOPPED)
                await self._finish(job, user_tokens, live.text, progress.output_tokens,
                                   common_pb2.MESSAGE_STATUS_STOPPED, usage)
                return Stopped(usage=usage)
            case Blocked() as blocked:
                machine.advance(TurnState.BLOCKED)
                await self._finish(job, user_tokens, live.text, progress.output_tokens,
                                   common_pb2.MESSAGE_STATUS_BLOCKED, usage)
                return blocked
            case generate_pb2.FINISH_REASON_STOP | generate_pb2.FINISH_REASON_LENGTH:
                machine.advance(TurnState.STORED)
                await self._finish(job, user_tokens, live.text, progress.output_tokens,
                                   common_pb2.MESSAGE_STATUS_COMPLETE, usage)
                return Completed(usage=usage, replica_id=replica_id)
            case _:
                raise errors.Unavailable(f"engine {replica_id} ended the generation without finishing it "
                                         f"({progress.error or 'no reason'}); retry with the same turn id")

    async def _consume(self, live: LiveTurn, machine: TurnMachine, address: str,
                       request: generate_pb2.GenerateRequest, screen: OutputScreen, progress: _Progress
                       ) -> int | Blocked | None:
        """Relays engine events into the live turn, each chunk screened before the user sees it; returns the
        finish reason, a Blocked, or None if the stream ended without a finish."""
        stream = self.engines.generate(address, request, self.opt.engine_deadline_s)
        try:
            async for resp in stream:
                match resp.WhichOneof("event"):
                    case "started":
                        machine.advance(TurnState.PREFILL)
                        progress.cached_tokens = resp.started.cached_prompt_tokens
                    case "delta":
                        if machine.state is TurnState.PREFILL:
                            machine.advance(TurnState.DECODE)
                        progress.output_tokens += len(resp.delta.token_ids)
                        if resp.delta.text:
                            verdict = await screen.check(resp.delta.text)
                            if verdict.blocked:
                                return Blocked(stage="output", category=verdict.category, reason=verdict.reason)
                            await live.publish(Delta(resp.delta.text))
                    case "finished":
                        progress.output_tokens = max(progress.output_tokens, resp.finished.usage.output_tokens)
                        progress.error = resp.finished.error_message
                        reason: int = resp.finished.finish_reason
                        return reason
                    case _:
                        pass
            return None
        finally:
            await stream.aclose()

    async def _finish(self, job: _Job, user_tokens: int, reply: str, reply_tokens: int,
                      status: common_pb2.MessageStatus, usage: Usage) -> None:
        owner, conv, turn = job.key
        await self.store.finish_turn(store_pb2.FinishTurnRequest(
            owner_id=owner, conversation_id=conv, turn_id=turn, lease_id=job.store_lease,
            user_token_count=user_tokens, reply=reply, reply_token_count=reply_tokens, reply_status=status,
            usage=usage.to_proto()))

    async def close(self) -> None:
        for live in list(self.live.values()):
            live.stop_requested.set()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)


class _StopMarker:
    """The turn was stopped here (stop request or disconnect), not by the engine."""


_STOPPED = _StopMarker()


@dataclass
class _Progress:
    prompt_tokens: int
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


_SPEAKERS = {
    common_pb2.ROLE_SYSTEM: context.Speaker.SYSTEM,
    common_pb2.ROLE_USER: context.Speaker.USER,
    common_pb2.ROLE_ASSISTANT: context.Speaker.ASSISTANT,
}


def _whole_context(claimed: store_pb2.TurnClaimed) -> store_pb2.ReadConversationResponse | None:
    """The context the claim returned, if it holds every message after the summary (else None: read it)."""
    if not claimed.HasField("context"):
        return None
    view = claimed.context
    summary = _stored_summary(view)
    start = summary.covers_until if summary is not None else 0
    if view.messages and view.messages[0].index != start:
        return None  # truncated at CONTEXT_MESSAGES
    return view


def _stored_summary(view: store_pb2.ReadConversationResponse) -> context.Summary | None:
    if not view.HasField("summary") or not view.summary.text:
        return None
    return context.Summary(view.summary.text, view.summary.covers_through_index + 1)


def _replay(reply: common_pb2.Message, usage: common_pb2.Usage, after: int) -> Sequence[TurnEvent]:
    u = Usage.from_proto(usage)
    final: EventKind
    match reply.status:
        case common_pb2.MESSAGE_STATUS_STOPPED:
            final = Stopped(usage=u)
        case common_pb2.MESSAGE_STATUS_BLOCKED:
            final = Blocked(stage="output" if reply.content else "input", category="")
        case _:
            final = Completed(usage=u, replica_id="")
    return resume_from(reply.content, final, after, replayed=True)
