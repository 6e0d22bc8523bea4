"""Background responses (`background: true`): the turn runs without its client, and its events can be streamed
again, from the start or after any event, from any gateway.

- Create. The turn opens as any response's does (the owner's stream slot and prompt-token reservation are taken,
  the turn started); its object is recorded (`records.py`) before the answer leaves, then a `Follower` on this
  gateway reads the turn's own stream to the end, for nobody: it keeps the turn alive when the client goes away
  (a foreground stream's client going away stops its turn), holds the slot and settles the reservation as any
  relay does (`replies.collect`), and records how the response ended. Without `stream` the answer is the object,
  `in_progress`; with it, the events (below).
- Events. `GET /responses/{id}?stream=true&starting_after=N`, and the create's own stream, attach to the turn
  (AttachTurn from its start: chat serves it from the live turn or the turn's stored progress, whichever chat
  process and gateway hold it) and frame it with `response_events.Aligned` deltas, so the events are a function of
  the stored response alone: a stream cut after event N and resumed with `starting_after=N`, on this gateway or
  another, joins into exactly the events of one uninterrupted stream. How it ended is decided the same way by
  every reader (`settled`): `incomplete` when the reply used its whole token cap, `completed_at` the time chat
  stored it. A resume holds a stream slot of its own (as chatmesh's attach route does); the create's stream
  rides the Follower's.
- Cancel (`POST /responses/{id}/cancel`) is chatmesh's stop, from any gateway; the follower records `cancelled`.

A background response outlives its client, not its gateway: when the gateway that started it shuts down, the
Follower is ended with the other streams after the drain grace, which stops the turn (its partial reply is kept,
and the response reads `cancelled`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response

from chatmesh.gateway import events
from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.openai import replies
from chatmesh.gateway.openai.errors import invalid
from chatmesh.gateway.openai.history import Point
from chatmesh.gateway.openai.records import Ended
from chatmesh.gateway.openai.response_events import Aligned, Ending, EventFraming, Outcome
from chatmesh.gateway.openai.response_object import Shape, status_of
from chatmesh.gateway.openai.surface import Surface
from chatmesh.gateway.openai.stored import attach_turn, read_turn
from chatmesh.gateway.openai.turns import Opened
from chatmesh.gateway.routes import StreamSlot
from chatmesh.gateway.sanitise import Sanitiser
from chatmesh.gateway.relay import Relay
from chatmesh.gateway.sse import TurnRelay, first_event
from chatmesh.mesh import logs
from chatmesh.mesh.ids import OwnerId

log = logs.get("chatmesh.gateway.openai")


def settled(surface: Surface, owner: OwnerId, point: Point, cap: int) -> Ending:
    """How a background response ended, decided from what chat stores only (so every reader agrees): the token
    cap (the stored turn keeps no finish reason) and the time the reply was stored."""
    async def ending(end: events.ReplyEnd) -> Outcome:
        usage = events.usage_of(end)
        status, reason = status_of(end.kind, "length" if cap and usage.output_tokens >= cap else "stop")
        completed_at = None
        if status == "completed":
            turn = await surface.edge.unary(read_turn(surface.edge, owner, point))
            completed_at = turn.stored_at_ms // 1000 or None
        return Outcome(status, reason, completed_at)
    return ending


@dataclass(eq=False)
class Follower:
    """Reads a background turn's stream to its end for nobody (module docstring); shutdown ends it."""

    surface: Surface
    owner: OwnerId
    opened: Opened
    cap: int
    task: asyncio.Task[None] | None = None

    def start(self, slot: StreamSlot) -> None:
        self.surface.edge.relays.open.add(self)
        self.task = asyncio.create_task(self._follow(slot))

    def end(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _follow(self, slot: StreamSlot) -> None:
        point = self.opened.point
        try:
            reply = await replies.collect(self.surface, slot, self.opened, self.cap)
            if reply.end is None or isinstance(reply.end, events.ReplyFailed):
                outcome = Outcome("failed", None, None)
            else:
                outcome = await settled(self.surface, self.owner, point, self.cap)(reply.end)
            await self.surface.records.end(self.owner, point.turn, Ended(outcome.status, outcome.reason,
                                                                         outcome.completed_at))
        except (ApiError, OSError, ValueError) as exc:  # a failure to record: retrieve then reads the turn itself
            log.warning("background_response_unrecorded", error=type(exc).__name__)
        finally:
            self.surface.edge.relays.open.discard(self)


async def start(surface: Surface, owner: OwnerId, slot: StreamSlot, opened: Opened, shape: Shape, cap: int,
                request_digest: str, stream: bool) -> Response:
    """A background response's create, once its turn has opened (module docstring)."""
    try:
        await surface.records.describe(owner, opened.point.turn, opened.point.conversation, request_digest,
                                       shape.recorded, cap)
    except BaseException:
        opened.call.cancel()
        await surface.edge.ended(slot, events.Outcome(None, 0))
        raise
    Follower(surface, owner, opened, cap).start(slot)
    if stream:
        return await _attach(surface, owner, opened.point, shape, cap, -1, None)
    return JSONResponse(shape.body("in_progress", None, None))


async def resume(surface: Surface, owner: OwnerId, point: Point, starting_after: int) -> Response:
    """`GET /responses/{id}?stream=true&starting_after=N`."""
    recorded = await surface.records.get(owner, point.turn)
    if recorded is None or not recorded.body.get("background") or recorded.conversation != point.conversation:
        raise invalid("stream", "only a response created with background: true can be streamed again; GET it "
                                "without stream for its object")
    slot = await surface.edge.take_stream(owner, new_turn=False)
    try:
        return await _attach(surface, owner, point, Shape(point, recorded.body), recorded.cap, starting_after,
                             slot)
    except BaseException as exc:
        raise await surface.edge.refuse(slot, exc) from None


async def _attach(surface: Surface, owner: OwnerId, point: Point, shape: Shape, cap: int, starting_after: int,
                  slot: StreamSlot | None) -> TurnRelay:
    call = attach_turn(surface.edge, owner, point)
    try:
        first = await first_event(call)
    except BaseException:
        call.cancel()
        raise
    framing = EventFraming(shape, settled(surface, owner, point, cap), Aligned(), starting_after)

    async def on_end(outcome: events.Outcome) -> None:
        if slot is not None:
            await surface.edge.ended(slot, outcome)

    return TurnRelay(Relay(call, first, Sanitiser(surface.edge.allowlist), on_end=on_end), surface.edge.heartbeat_s,
                     surface.edge.relays, framing)
