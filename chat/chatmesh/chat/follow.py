"""Following a turn that another chat process is generating, through the progress it stores.

The holder writes the reply so far to the turn record every progress interval (`claimed.py`'s heartbeat); a
follower reads the record back every `poll_s` (`ReadTurn`) and streams the new text as it appears, and the
stored reply ends it. Progress goes through the store rather than Redis so the embedded default needs nothing else
running; the cost is one small read per follower per interval, off the generating process's token path.

When the holder is gone (its lease lapsed) or its attempt failed, a follower that has the turn's content (a
retry, `may_take_over`) stops and sets `take_over`: its caller claims the turn and generates it (the reference's
Failed -> Queued path). One without it (an attach by turn id) reports the failure so its client retries.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import assert_never

from chatmesh.chat.events import Failed, TurnEvent, replay, resume_from
from chatmesh.chat.ports import StorePort, TurnKey
from chatmesh.mesh import errors
from chatmesh.mesh.turn import TurnRecordState


class StoredFollower:
    def __init__(self, store: StorePort, key: TurnKey, after: int, may_take_over: bool, poll_s: float,
                 now_ms: Callable[[], float]):
        self.store = store
        self.key = key
        self.seen = after  # the last sequence sent to the client
        self.may_take_over = may_take_over
        self.poll_s = poll_s
        self.now_ms = now_ms
        self.take_over = False  # set when the follow ended because the caller should claim the turn

    async def events(self) -> AsyncIterator[TurnEvent]:
        while True:
            record = await self.store.read_turn(self.key)
            match record.state:
                case TurnRecordState.STORED | TurnRecordState.STOPPED:
                    if record.reply is None:
                        raise errors.Unavailable(f"the store reported turn {self.key.turn} finished without a reply")
                    for event in replay(record.reply, record.usage, self.seen):
                        yield event
                    return
                case TurnRecordState.RECEIVED | TurnRecordState.RUNNING:
                    lapsed = record.lease_expires_at_ms < self.now_ms()
                    if not (lapsed and self.may_take_over):
                        for event in resume_from(record.partial_text, None, self.seen, replayed=True):
                            yield event
                            self.seen = event.sequence
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
