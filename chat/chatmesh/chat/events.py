"""A turn's stream events, and the in-process broadcast that lets retries attach to a live turn.

Sequence numbers are derived from the reply text, so any process can rebuild them from stored progress:
`started` is 1; a delta's sequence is 1 + the number of characters of reply text up to its end; the final event is
2 + the full reply length. A client that saw up to sequence s has seen the first s - 1 characters, so resuming
after s means sending text[s - 1:] and then the final event (`resume_from`). Deltas are coalesced upstream (the
engine flushes every 25 ms), so one event carries many tokens.

Tool calls (issue 28) come after all of the reply's text (text the model writes after a call is not kept), each
an event of its own: call i is 2 + len(text) + i, and the final event is 2 + len(text) + the number of calls. A
reply without calls numbers exactly as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from chatmesh.mesh.errors import CoreError
from chatmesh.mesh.turn import Usage
from chatmesh.store.values import Message, MessageStatus, ToolCall


@dataclass(frozen=True)
class TurnStarted:
    replayed: bool
    # tokens of the rendered prompt (what the owner is charged for it whatever happens next); None when the stream
    # replays or attaches, or the turn ended before its prompt was built
    prompt_tokens: int | None = None


@dataclass(frozen=True)
class TurnDelta:
    text: str


@dataclass(frozen=True)
class ToolCalled:
    """The reply called a tool (whole: its arguments are known)."""

    call: ToolCall
    index: int  # among the reply's calls, from 0


@dataclass(frozen=True)
class Completed:
    usage: Usage
    replica_id: str
    finish_reason: str = ""  # "stop" or "length"; "" on a replay (the store keeps no reason)


@dataclass(frozen=True)
class Stopped:
    usage: Usage


@dataclass(frozen=True)
class Failed:
    message: str
    retryable: bool


@dataclass(frozen=True)
class Blocked:
    stage: str  # "input" or "output"
    category: str
    reason: str = ""  # why, never the checked text


TurnEventKind = TurnStarted | TurnDelta | ToolCalled | Completed | Stopped | Failed | Blocked
FINAL = (Completed, Stopped, Failed, Blocked)


@dataclass(frozen=True)
class TurnEvent:
    sequence: int
    kind: TurnEventKind


def resume_from(text: str, final: TurnEventKind | None, after: int, replayed: bool,
                started: TurnStarted | None = None, calls: tuple[ToolCall, ...] = ()) -> list[TurnEvent]:
    """The events a client that has seen up to sequence `after` still needs, given the reply so far (its text and
    its calls). `started`: the turn's own TurnStarted (with its prompt's size), sent to the client the turn is
    generated for."""
    out: list[TurnEvent] = []
    if after < 1:
        out.append(TurnEvent(1, TurnStarted(replayed=True) if replayed else started or TurnStarted(replayed=False)))
    seen = max(0, after - 1)
    if len(text) > seen:
        out.append(TurnEvent(1 + len(text), TurnDelta(text[seen:])))
    out += [TurnEvent(2 + len(text) + i, ToolCalled(c, i)) for i, c in enumerate(calls) if 2 + len(text) + i > after]
    if final is not None:
        out.append(TurnEvent(2 + len(text) + len(calls), final))
    return out


def replay(reply: Message, usage: Usage, after: int) -> list[TurnEvent]:
    """A stored reply as the events a client that has seen up to `after` still needs."""
    final: TurnEventKind
    match reply.status:
        case MessageStatus.STOPPED:
            final = Stopped(usage=usage)
        case MessageStatus.BLOCKED:
            final = Blocked(stage="output" if reply.content else "input", category="")
        case MessageStatus.COMPLETE:
            final = Completed(usage=usage, replica_id="", finish_reason="tool_calls" if reply.tool_calls else "")
    return resume_from(reply.content, final, after, replayed=True, calls=reply.tool_calls)


class LiveTurn:
    """A turn being generated in this process: its events so far, and a wakeup for followers."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: tuple[ToolCall, ...] = ()  # the reply's tool calls so far (after all its text)
        self.final: TurnEventKind | None = None
        self.started: TurnStarted | None = None  # published once the prompt is rendered (or the turn ended first)
        self._changed = asyncio.Condition()
        self.stop_requested = asyncio.Event()
        self.lease_lost = False  # set when another process took the turn over
        # set when the turn is released, not stopped: this process shuts down, or its client went away having been
        # shown nothing; it fails retryable, keeping what was shown for the retry to continue
        self.handed_off = False
        self.released = False  # its client's edge said the client was shown nothing (Turns.release)
        self.attached = 0  # streams following it besides its own caller's (retries, attaches in this process)
        self.refused: CoreError | None = None  # refused before its first event (over its allowance): followers raise

    async def publish(self, kind: TurnEventKind) -> None:
        async with self._changed:
            match kind:
                case TurnDelta(text=t):
                    assert not self.calls, "a reply's text comes before its calls"
                    self.text += t
                case ToolCalled(call=call):
                    self.calls += (call,)
                case TurnStarted():
                    self.started = kind
                case Completed() | Stopped() | Failed() | Blocked():
                    self.final = kind
            self._changed.notify_all()

    async def refuse(self, err: CoreError) -> None:
        """Ends the turn with no event: every follower raises `err` (its caller gets it as the call's status)."""
        async with self._changed:
            self.refused = err
            self._changed.notify_all()

    async def follow(self, after: int = 0, replayed: bool = False) -> AsyncGenerator[TurnEvent, None]:
        """Yields events after sequence `after` until the final one; every wait is an await (no spinning)."""
        seen = after
        while True:
            async with self._changed:
                if self.refused is not None:
                    raise self.refused
                # the turn's own client waits for its TurnStarted (it carries the prompt's size); attachers do not
                ready = replayed or seen >= 1 or self.started is not None or self.final is not None
                pending = resume_from(self.text, self.final, seen, replayed, self.started, self.calls) \
                    if ready else []
                if not pending:
                    await self._changed.wait()
                    continue
            for event in pending:
                yield event
                seen = event.sequence
            if isinstance(pending[-1].kind, FINAL):
                return
