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
from chatmesh.store.values import Role, Seed

T = TypeVar("T")


async def screen_seed(moderation: ModerationPort, conv: ConversationId, seed: Sequence[Seed]) -> None:
    """A client's earlier history, before it is stored as a new conversation's (CreateConversation's messages, a
    send's NewConversation): its user messages reach the model in every later prompt, so each passes the input
    check as it would as a turn, together; one blocked refuses the whole request (InvalidArgument naming it) and
    nothing is stored. The one policy for both entry points: a seed stored and only its turn blocked would be
    replayed, unchecked, into the next turn's prompt."""
    users = [(i, m.content) for i, m in enumerate(seed) if m.role is Role.USER]
    screenings = await asyncio.gather(*(moderation.check_input(text, conv) for _, text in users))
    for (i, _), screening in zip(users, screenings):
        if judged(screening).blocked:
            raise errors.InvalidArgument(f"messages[{i}] was blocked by moderation ({screening.category or 'policy'})")


class Admission:
    def __init__(self, router: RouterPort, moderation: ModerationPort, conv: ConversationId,
                 content: str | None) -> None:
        self.router = router
        self.screening: asyncio.Future[Screening] | None = None
        if content is not None:
            self.screening = asyncio.ensure_future(moderation.check_input(content, conv))
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
