"""The turn state machine (the reference's failure-mode diagram, made executable).

    Received --> Replayed                  turn id already answered: the stored reply is streamed again
    Received --> Attached                  turn id being generated elsewhere: follow that stream
    Received --> Rejected                  bad input, conflict (same id, other content), unknown conversation
    Received --> Blocked                   input moderation blocked it: stored as blocked, never reaches an engine
    Received --> Queued                    claim won (a lease in the store), routed to a replica
    Queued   --> Prefill --> Decode        the engine admitted the prompt; tokens stream
    Decode   --> Stored                    end of reply: user message + reply + usage stored once
    Decode   --> Stopped                   stop request or disconnect: engine sequence cancelled, partial stored
    Decode   --> Blocked                   output moderation stopped the stream: partial stored as blocked
    Queued|Prefill|Decode --> Failed       replica lost or an error: nothing stored, lease released;
                                           a retry with the same turn id starts again at Received

Every exit from Queued, Prefill or Decode releases the router lease and the engine sequence (I5). The table
below refuses any other move, so a bug that would, say, store a failed turn raises instead.
"""

from __future__ import annotations

import enum

from chatmesh.mesh.errors import FailedPrecondition


class TurnState(enum.Enum):
    RECEIVED = "received"
    REPLAYED = "replayed"
    ATTACHED = "attached"
    REJECTED = "rejected"
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    STORED = "stored"
    STOPPED = "stopped"
    BLOCKED = "blocked"
    FAILED = "failed"


_S = TurnState
TRANSITIONS: dict[TurnState, frozenset[TurnState]] = {
    _S.RECEIVED: frozenset({_S.REPLAYED, _S.ATTACHED, _S.REJECTED, _S.BLOCKED, _S.QUEUED, _S.FAILED}),
    _S.QUEUED: frozenset({_S.PREFILL, _S.STOPPED, _S.FAILED}),
    _S.PREFILL: frozenset({_S.DECODE, _S.STORED, _S.STOPPED, _S.BLOCKED, _S.FAILED}),
    _S.DECODE: frozenset({_S.STORED, _S.STOPPED, _S.BLOCKED, _S.FAILED}),
    _S.REPLAYED: frozenset(),
    _S.ATTACHED: frozenset(),
    _S.REJECTED: frozenset(),
    _S.STORED: frozenset(),
    _S.STOPPED: frozenset(),
    _S.BLOCKED: frozenset(),
    _S.FAILED: frozenset(),
}
TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)


class IllegalTransition(FailedPrecondition):
    """A move the state machine does not allow."""


class TurnMachine:
    """One turn's current state; `advance` moves it or raises IllegalTransition."""

    def __init__(self) -> None:
        self.state = TurnState.RECEIVED
        self.history: list[TurnState] = [TurnState.RECEIVED]

    def advance(self, to: TurnState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"turn cannot move from {self.state.value} to {to.value}")
        self.state = to
        self.history.append(to)

    @property
    def done(self) -> bool:
        return self.state in TERMINAL
