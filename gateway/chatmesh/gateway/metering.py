"""Charging a turn's prompt tokens before the engine works, and settling them to the true count.

The denial-of-wallet case (the reference design's): prompt tokens charged only when a stream completed let a
client that disconnected after the first delta pay nothing, and let concurrent turns spend many times the
budget before the first refusal. So for each new turn (send or regenerate):

1. Admission (`LimitBackend.admit_turn`) takes one turn and reserves the owner's remaining prompt tokens up to
   `reserve_up_to`, the largest prompt the model takes; under one token left: 429 "prompt tokens per hour" with
   Retry-After. The reservation goes to chat as `prompt_token_allowance`. The contract (chat.proto): chat,
   which knows the rendered prompt's size before it calls an engine, refuses a prompt over the allowance
   (RESOURCE_EXHAUSTED with the size in the `chatmesh-prompt-tokens` trailer): nothing ran, the reservation goes
   back, and the answer is 429 naming the limit with Retry-After the time until the bucket holds the prompt (400
   when the prompt is larger than the whole hourly budget: waiting would not help). Chat checks it once the
   prompt is rendered, before it publishes turn.started (chatmesh.chat.claimed), and releases the turn's claim.
2. `turn.started` carries the prompt's size: the reservation is settled to it at once, so the excess is back in
   the bucket before the reply streams and a concurrent turn can use it.
3. At the end it is settled to `charge(...)`:
     completed, stopped                       -> the usage's prompt tokens (the true count)
     blocked at input                         -> 0 (nothing reached an engine)
     failed, blocked at output, client gone   -> the size turn.started reported (the prefill ran: a stop or a
                                                 disconnect is never a refund); when chat reported none, the
                                                 whole reservation stays charged (it covers the prompt)
     a replay of a stored turn (retry)        -> 0 (the original stream paid; I2: never a double bill)
   Attach streams reserve and charge nothing.

Bound. Every turn's tokens come out of its own reservation, and reservations come out of the bucket
atomically (in Redis, one Lua script across every gateway), so N concurrent turns against a budget of B spend at
most B (tests/e2e/test_prompt_limits.py, real chat, two gateways on one Redis). A chat that ignored the
allowance would let a turn admitted with less than its prompt overshoot: B plus one turn's prompt at most, since
the next admission finds the bucket empty (tests/gateway/test_limits.py keeps that case, against a fake chat).
"""

from __future__ import annotations

import asyncio

from chatmesh.gateway.errors import ApiError, bad_request
from chatmesh.gateway.events import Outcome, SseEvent
from chatmesh.gateway.limits import Budget, LimitBackend, Reservation, refused
from chatmesh.mesh import logs

log = logs.get("chatmesh.gateway.metering")


def charge(reserved: int, outcome: Outcome) -> int:
    """What a turn's prompt costs once its stream has ended (the table of the module header)."""
    if outcome.replayed:
        return 0
    started = outcome.started_prompt_tokens
    match outcome.kind:
        case SseEvent.COMPLETED | SseEvent.STOPPED:
            return outcome.prompt_tokens
        case SseEvent.BLOCKED if outcome.blocked_stage == "input":
            return 0
        case SseEvent.BLOCKED | SseEvent.FAILED | None:
            return started if started is not None else reserved
        case SseEvent.STARTED | SseEvent.DELTA | SseEvent.TOOL_CALL:
            raise ValueError(f"{outcome.kind} does not end a stream")


def over_allowance(budget: Budget, reserved: int, prompt_tokens: int) -> ApiError:
    """Chat refused a prompt larger than the reservation: 429 until the bucket can hold it, or 400 if it never can."""
    per_hour = budget.prompt_tokens_per_hour
    if prompt_tokens > per_hour:
        return bad_request(f"the prompt is {prompt_tokens:,} tokens, more than the whole prompt-token budget of "
                           f"{per_hour:,} per hour (CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR)")
    wait_s = (prompt_tokens - reserved) / (per_hour / 3600)
    return refused(f"prompt tokens per hour (the prompt is {prompt_tokens:,} tokens; {reserved:,} are left)", wait_s)


class TurnCharge:
    """One turn's reservation from admission to its last settlement. Settlements run in order (a lock), and a
    limits backend that fails while settling is logged, not raised: the stream is already the user's."""

    def __init__(self, limits: LimitBackend, reservation: Reservation) -> None:
        self._limits = limits
        self.reservation = reservation
        self.reserved = reservation.held
        self._lock = asyncio.Lock()

    async def _settle(self, used: int) -> None:
        async with self._lock:
            try:
                await self._limits.settle(self.reservation, used)
            except Exception as exc:  # noqa: BLE001 - logged with its type; the turn goes on
                log.warning("prompt_settle_failed", owner_id=self.reservation.owner, exc_info=exc)

    async def started(self, replayed: bool, prompt_tokens: int | None) -> None:
        if replayed:
            await self._settle(0)
        elif prompt_tokens is not None:
            await self._settle(prompt_tokens)

    async def ended(self, outcome: Outcome) -> None:
        await self._settle(charge(self.reserved, outcome))

    async def refund(self) -> None:
        """The turn never started (refused or failed before its first event)."""
        await self._settle(0)
