"""The turn state machine: the reference's failure-mode diagram, made executable, and what the store keeps of it.

One attempt at a turn, as chat drives it (`TurnState`, `TRANSITIONS`):

    RECEIVED --> REPLAYED      turn id already answered: the stored reply is streamed again
    RECEIVED --> ATTACHED      turn id being generated (here or by another chat process): follow that stream
    RECEIVED --> REJECTED      bad input, conflict (same id, other content), nothing to regenerate, a rendered
                               prompt over the turn's allowance (the claim released: nothing stored)
    RECEIVED --> BLOCKED       input moderation blocked it: stored as blocked, never reaches an engine
    RECEIVED --> QUEUED        claim won (a lease in the store), prompt built, routed to a replica
    QUEUED   --> PREFILL       the engine admitted the prompt
    PREFILL  --> DECODE        tokens stream
    PREFILL | DECODE --> STORED       end of reply: user message + reply + usage stored once
    QUEUED | PREFILL | DECODE --> STOPPED   stop request or disconnect: sequence cancelled, what the user saw stored
    DECODE   --> BLOCKED       output moderation stopped the stream: the partial reply stored as blocked
    RECEIVED | QUEUED | PREFILL | DECODE --> FAILED
                               replica lost, store or moderation down, lease taken over: nothing stored, leases
                               released; a retry with the same turn id is a new attempt that starts at RECEIVED

Every exit from QUEUED, PREFILL or DECODE releases the router lease and the engine sequence (I5). `TurnMachine`
refuses any other move, so a bug that would, say, store a failed turn raises instead.

What the store records durably for each state (`DURABLE`; the turn row, one per owner, conversation, turn id):

    chat's state                  the turn record              messages and usage
    RECEIVED (claimed)            RECEIVED, lease held         none
    QUEUED / PREFILL / DECODE     RUNNING once progress is     none (the reply so far is in the record, for
                                  written (lease renewed)      followers in other processes)
    STORED                        STORED                       user message + reply (complete), usage added
    STOPPED                       STOPPED                      user message + partial reply (stopped), usage
    BLOCKED                       STORED                       user message + reply (blocked; empty for input)
    FAILED                        FAILED, lease released       none
    REPLAYED / ATTACHED / REJECTED    unchanged (read only)    unchanged

The record's own moves (`RECORD_TRANSITIONS`, enforced by the store):

    (none) --claim--> RECEIVED --progress--> RUNNING --finish--> STORED | STOPPED      (final)
    RECEIVED | RUNNING --fail--> FAILED --claim--> RECEIVED                             (a retry)
    RECEIVED | RUNNING with an expired lease --claim--> RECEIVED                        (the holder died: the
                                                                                         reference's Failed -> Queued)
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from chatmesh.mesh.errors import FailedPrecondition


class TurnState(enum.Enum):
    """Where one attempt at a turn is, in chat."""

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


class TurnRecordState(enum.Enum):
    """The store's turn record: the durable projection of `TurnState`."""

    RECEIVED = "received"
    RUNNING = "running"
    STORED = "stored"
    STOPPED = "stopped"
    FAILED = "failed"


_S = TurnState
TRANSITIONS: dict[TurnState, frozenset[TurnState]] = {
    _S.RECEIVED: frozenset({_S.REPLAYED, _S.ATTACHED, _S.REJECTED, _S.BLOCKED, _S.QUEUED, _S.FAILED}),
    _S.QUEUED: frozenset({_S.PREFILL, _S.STOPPED, _S.FAILED}),
    _S.PREFILL: frozenset({_S.DECODE, _S.STORED, _S.STOPPED, _S.FAILED}),
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

_R = TurnRecordState
DURABLE: dict[TurnState, TurnRecordState | None] = {
    _S.RECEIVED: _R.RECEIVED,
    _S.QUEUED: _R.RUNNING,
    _S.PREFILL: _R.RUNNING,
    _S.DECODE: _R.RUNNING,
    _S.STORED: _R.STORED,
    _S.STOPPED: _R.STOPPED,
    _S.BLOCKED: _R.STORED,
    _S.FAILED: _R.FAILED,
    _S.REPLAYED: None,  # None: this attempt writes nothing
    _S.ATTACHED: None,
    _S.REJECTED: None,
}
RECORD_TRANSITIONS: dict[TurnRecordState, frozenset[TurnRecordState]] = {
    _R.RECEIVED: frozenset({_R.RUNNING, _R.STORED, _R.STOPPED, _R.FAILED, _R.RECEIVED}),
    _R.RUNNING: frozenset({_R.RUNNING, _R.STORED, _R.STOPPED, _R.FAILED, _R.RECEIVED}),
    _R.FAILED: frozenset({_R.RECEIVED}),
    _R.STORED: frozenset(),
    _R.STOPPED: frozenset(),
}
RECORD_ACTIVE = (_R.RECEIVED, _R.RUNNING)
RECORD_FINAL = (_R.STORED, _R.STOPPED)


@dataclass(frozen=True)
class Usage:
    """Token counts of a turn, of one generation, or a sum of turns; never text. The engine counts every sampled
    token as output, a final stop token included; chat bills what the engine counted; the store sums it."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0


class IllegalTransition(FailedPrecondition):
    """A move the state machine does not allow."""


def require_record_move(turn: str, current: TurnRecordState, target: TurnRecordState) -> None:
    """The store's guard on its turn record."""
    if target not in RECORD_TRANSITIONS[current]:
        raise IllegalTransition(f"turn {turn} is {current.value}; it cannot become {target.value}")


@dataclass(frozen=True)
class Move:
    source: TurnState
    target: TurnState


class TurnMachine:
    """One attempt's current state; `advance` moves it or raises IllegalTransition. `observe`, when given, sees
    every move (the chat core's tests check that every transition of the table is exercised)."""


    def __init__(self, observe: Callable[[Move], None] | None = None) -> None:
        self.state = TurnState.RECEIVED
        self._observe = observe

    def check(self, to: TurnState) -> None:
        """Raises IllegalTransition unless `to` may follow the current state (before a write that enters it)."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"turn cannot move from {self.state.value} to {to.value}")

    def advance(self, to: TurnState) -> None:
        self.check(to)
        if self._observe is not None:
            self._observe(Move(self.state, to))
        self.state = to
