"""What a turn needs before an engine may start it, begun together with its claim: the replica pick and the
input check.

Neither depends on the claim's answer, and the claim is almost always a new one, so waiting for it first would
put a whole hop in front of every first token. When the claim says the turn is someone else's (done, in progress,
conflict), `discard` drops the check and releases the router lease as soon as the pick answers: the router's load
is back where it was before the caller goes on. Blocked input still never reaches an engine: generation waits for
the check (`ready`).

A check moderation could not make (down, failing, late: its failure policy decided) is not a verdict: a
fail-closed block from it fails the turn as retryable (`judged`, for input here and output in `stream.py`) rather
than storing it as blocked, which would answer every retry of that turn id with the outage for good.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from chatmesh.chat.ports import ModerationPort, Pick, RouterPort, Screening
from chatmesh.mesh import errors
from chatmesh.mesh.ids import ConversationId

T = TypeVar("T")


async def _screen_all(moderation: ModerationPort, conv: ConversationId, texts: Sequence[str]) -> Screening:
    """The input check of a send that seeds its new conversation with a client's history (the OpenAI surface):
    every user message of that history reaches the model in this turn's prompt just as the new message does, so
    each is checked like one, together; the first blocked one decides, else the new message's screening."""
    results = await asyncio.gather(*(moderation.check_input(text, conv) for text in texts))
    return next((r for r in results if r.blocked), results[-1])


class Admission:
    def __init__(self, router: RouterPort, moderation: ModerationPort, conv: ConversationId,
                 content: str | None, seeded: Sequence[str] = ()) -> None:
        self.router = router
        self.screening: asyncio.Future[Screening] | None = None
        if content is not None:
            self.screening = asyncio.ensure_future(
                _screen_all(moderation, conv, (*seeded, content)) if seeded else moderation.check_input(content, conv))
        self.pick: asyncio.Future[Pick] = asyncio.ensure_future(router.pick(conv))

    async def ready(self, beside: Awaitable[T] | None) -> tuple[Pick, Screening | None, T | None]:
        """The pick and the check (None for a regenerate, which has no new input), and `beside` awaited with them;
        if any fails, the others are dropped and the lease released before the error goes on."""
        extra = asyncio.ensure_future(beside) if beside is not None else None
        try:
            await asyncio.gather(*(t for t in (self.screening, extra, self.pick) if t is not None))
        except BaseException:
            if extra is not None:
                extra.cancel()
            await asyncio.shield(self.discard())
            raise
        return (self.pick.result(), self.screening.result() if self.screening is not None else None,
                extra.result() if extra is not None else None)

    async def discard(self) -> None:
        if self.screening is not None:
            self.screening.cancel()
            with contextlib.suppress(BaseException):
                await self.screening
        try:
            lease = (await self.pick).lease
        except Exception:  # the pick failed: no lease to release (its error is reported where it is awaited)
            return
        with contextlib.suppress(errors.CoreError):
            await self.router.release(lease)


class ModerationDown(errors.Unavailable):
    """Moderation could not judge the text (its failure policy blocked it): an outage, not a verdict."""


def judged(screening: Screening) -> Screening:
    """A screening that is a verdict; an outage's fail-closed block raises instead (nothing stored, nothing billed:
    the retry of the same turn id is checked again)."""
    if screening.blocked and screening.unavailable:
        raise ModerationDown(f"moderation unavailable ({screening.reason}); retry with the same turn id")
    return screening
