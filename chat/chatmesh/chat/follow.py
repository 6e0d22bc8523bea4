"""Following a turn that another chat process is generating, through the progress it stores, and continuing it
consistently when it is taken over.

The holder writes the reply so far to the turn record every progress interval (`claimed.py`'s heartbeat); a
follower reads the record back every `poll_s` (`ReadTurn`) and streams the new text as it appears, and the
stored reply ends it. Progress goes through the store rather than Redis so the embedded default needs nothing else
running; the cost is one small read per follower per interval, off the generating process's token path.

When the holder is gone (its lease lapsed) or its attempt failed, a follower that has the turn's content (a
retry, `may_take_over`) stops and sets `take_over`: its caller claims the turn and generates it (the reference's
Failed -> Queued path), continuing the reply from the text this follower already sent (`Delivered`), so the
client never gets that text twice and the new generation cannot contradict it. One without the content (an
attach by turn id) reports the failure so its client retries.

What a client receives is always a prefix of, and at the end equal to, the reply that is stored. Every source a
follower streams from is checked against what it already delivered (`Delivered`): the holder's progress, a
stored reply, a live turn in this process, a taken-over generation. If one ever disagrees (another retry, with
nothing delivered, re-claimed the turn and generated it afresh), the stream ends with a retryable failure rather
than a spliced text; the retry then replays or follows the one reply that is stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import assert_never

from chatmesh.chat.events import FINAL, TurnDelta, Failed, TurnStarted, ToolCalled, TurnEvent, TurnEventKind, replay
from chatmesh.chat.ports import StorePort, TurnKey
from chatmesh.mesh import errors
from chatmesh.mesh.turn import TurnRecordState

DIVERGED = "the turn was generated again elsewhere; retry with the same turn id"


@dataclass(frozen=True)
class Delivered:
    """What a client already received of a turn's reply: events up to `sequence`, the reply text `text`."""

    sequence: int = 0
    text: str = ""


NOTHING = Delivered()


def agrees(delivered: str, text: str) -> bool:
    """Whether `text` (a reply, whole or so far) and the delivered text could be the same reply."""
    return text.startswith(delivered) or delivered.startswith(text)


async def continuing(events: AsyncGenerator[TurnEvent, None], delivered: Delivered
                     ) -> AsyncGenerator[TurnEvent, None]:
    """A stream from its start, as a client that has `delivered` needs it: only what lies beyond, and a retryable
    failure instead of text that would contradict what it has (or a reply that ends short of it). Closing this
    closes `events` (a turn's own stream: its caller going away stops it)."""
    try:
        async for event in _continuing(events, delivered):
            yield event
    finally:
        await events.aclose()


async def _continuing(events: AsyncIterable[TurnEvent], delivered: Delivered) -> AsyncIterator[TurnEvent]:
    text = ""
    async for event in events:
        kind = event.kind
        match kind:
            case TurnStarted():
                if delivered.sequence < 1:
                    yield event
                continue
            case TurnDelta(text=chunk):
                text += chunk
                if not agrees(delivered.text, text):
                    break
                if len(text) > len(delivered.text):
                    yield TurnEvent(1 + len(text), TurnDelta(text[max(len(delivered.text), len(text) - len(chunk)):]))
                continue
            case ToolCalled():
                if len(text) < len(delivered.text):
                    break
                if event.sequence > delivered.sequence:
                    yield event
                continue
            case _:
                if len(text) < len(delivered.text) and not isinstance(kind, Failed):
                    break
                yield TurnEvent(max(event.sequence, delivered.sequence + 1), kind)
                return
    else:
        return
    yield TurnEvent(delivered.sequence + 1, Failed(DIVERGED, retryable=True))


async def listed(events: list[TurnEvent]) -> AsyncGenerator[TurnEvent, None]:
    for event in events:
        yield event


class StoredFollower:
    def __init__(self, store: StorePort, key: TurnKey, after: int, may_take_over: bool, poll_s: float,
                 now_ms: Callable[[], float]):
        self.store = store
        self.key = key
        self.seen = after  # the last sequence sent to the client
        # The reply text the client has; None until known (an attach after a sequence: the first record long
        # enough tells it).
        self.text: str | None = "" if after <= 1 else None
        self.may_take_over = may_take_over
        self.poll_s = poll_s
        self.now_ms = now_ms
        self.take_over = False  # set when the follow ended because the caller should claim the turn

    @property
    def delivered(self) -> Delivered:
        return Delivered(self.seen, self.text or "")

    def _known(self, text: str) -> bool:
        """Learns the client's text from `text` when it is not known yet; whether it is known now."""
        if self.text is None and len(text) >= self.seen - 1:
            self.text = text[:self.seen - 1]
        return self.text is not None

    async def events(self) -> AsyncIterator[TurnEvent]:
        while True:
            record = await self.store.read_turn(self.key)
            match record.state:
                case TurnRecordState.STORED | TurnRecordState.STOPPED:
                    if record.reply is None:
                        raise errors.Unavailable(f"the store reported turn {self.key.turn} finished without a reply")
                    events = listed(replay(record.reply, record.usage, 0))
                    if not self._known(record.reply.content):  # the client says it has more than the reply
                        events = listed(replay(record.reply, record.usage, self.seen))
                    async for event in continuing(events, self.delivered) if self.text is not None else events:
                        yield event
                    return
                case TurnRecordState.RECEIVED | TurnRecordState.RUNNING:
                    # The holder's last progress is sent even when it lapsed: the takeover continues from it.
                    if self._known(record.partial_text):
                        for event in self._progress(record.partial_text):
                            yield event
                            if isinstance(event.kind, FINAL):
                                return
                    if not (record.lease_expires_at_ms < self.now_ms() and self.may_take_over):
                        await asyncio.sleep(self.poll_s)
                        continue
                case TurnRecordState.FAILED:
                    if not self.may_take_over:
                        yield TurnEvent(max(self.seen + 1, 2), Failed("the turn failed; retry with the same turn id",
                                                                      retryable=True))
                        return
                case _:
                    assert_never(record.state)
            self.take_over = True
            return

    def _progress(self, partial: str) -> list[TurnEvent]:
        """The events the holder's stored progress adds for the client; a failure when it contradicts them."""
        assert self.text is not None
        out: list[TurnEvent] = []
        kind: TurnEventKind
        if not agrees(self.text, partial):
            kind = Failed(DIVERGED, retryable=True)
            out.append(TurnEvent(self.seen + 1, kind))
            return out
        if self.seen < 1:
            out.append(TurnEvent(1, TurnStarted(replayed=True)))
        if len(partial) > len(self.text):
            out.append(TurnEvent(1 + len(partial), TurnDelta(partial[len(self.text):])))
            self.text = partial
        if out:
            self.seen = out[-1].sequence
        return out
