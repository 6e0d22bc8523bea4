"""Per-user limits at the edge: turns per minute, prompt tokens per hour (token buckets) and open streams.

Token bucket (the rate limiter the reference design reuses): a bucket holds at most `capacity` tokens and refills
continuously at `capacity / period` tokens per second; a request takes `cost` tokens if that many are there, else
it is refused with the time until they will be (Retry-After). Parameters:
- turns: capacity CHATMESH_LIMIT_TURNS_PER_MINUTE, period 60 s, cost 1 per turn (send or regenerate);
- prompt tokens: capacity CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR, period 3600 s, charged BEFORE the turn runs:
  admission takes a turn and, in the same step, reserves the owner's remaining prompt tokens up to the largest
  prompt the model takes (`Reservation`); the reservation is then settled to the true count (`settle`), giving
  back the excess or taking what more is owed (chatmesh.gateway.metering says when and to what). Under one
  token left, a turn is refused. Reservations come out of the bucket atomically, so concurrent turns cannot
  together spend more than it holds.
- open streams: a counter, not a rate: at most CHATMESH_LIMIT_OPEN_STREAMS turn streams (send, regenerate,
  attach) open at once; each open stream holds a lease released when the stream ends.

`MemoryLimits` keeps the state in this process. `RedisLimits` (chatmesh.gateway.redis_limits) keeps it in Redis
so several gateway processes share one budget per user.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from chatmesh.gateway.errors import ApiError
from chatmesh.mesh import ids


@dataclass(frozen=True)
class Budget:
    turns_per_minute: int
    open_streams: int
    prompt_tokens_per_hour: int


class StreamLease(Protocol):
    async def release(self) -> None: ...


@dataclass
class Reservation:
    """Prompt tokens held from an owner's bucket for one turn; `held` changes as the turn is settled."""

    owner: ids.OwnerId
    held: int


class LimitBackend(Protocol):
    async def admit_turn(self, owner: ids.OwnerId, reserve_up_to: int) -> Reservation:
        """Takes one turn from the owner's budget and reserves up to `reserve_up_to` prompt tokens (all that is
        left, when less); raises a 429 ApiError with Retry-After naming the limit when either is exhausted."""

    async def settle(self, reservation: Reservation, used: int) -> None:
        """Sets the reservation to `used` tokens: the difference goes back to the bucket (never above its
        capacity), or is taken from it (it may go below zero)."""

    async def open_stream(self, owner: ids.OwnerId) -> StreamLease:
        """Takes an open-stream slot or raises a 429 ApiError."""

    async def close(self) -> None: ...


def refused(what: str, retry_after_s: float) -> ApiError:
    return ApiError(429, "rate_limited", f"limit reached: {what}", retry_after_s=retry_after_s,
                    limit=what.replace(" ", "_"))


@dataclass
class Bucket:
    capacity: float
    per_second: float
    tokens: float
    at: float

    def refill(self, now: float) -> None:
        if now > self.at:  # a reading taken before the bucket was made must not drain it
            self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.per_second)
            self.at = now

    def take(self, cost: float, now: float) -> float:
        """Takes `cost` tokens and returns 0, or returns the seconds until they will be there."""
        self.refill(now)
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.per_second if self.per_second > 0 else math.inf


class _MemoryLease:
    def __init__(self, counts: dict[ids.OwnerId, int], owner: ids.OwnerId):
        self._counts = counts
        self._owner = owner
        self._released = False

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        left = self._counts.get(self._owner, 1) - 1
        if left > 0:
            self._counts[self._owner] = left
        else:
            self._counts.pop(self._owner, None)


class MemoryLimits:
    """The limits of one gateway process. Buckets of idle owners are dropped once full again."""

    def __init__(self, budget: Budget, clock: Callable[[], float] = time.monotonic):
        self._budget = budget
        self._clock = clock
        self._turns: dict[ids.OwnerId, Bucket] = {}
        self._prompt: dict[ids.OwnerId, Bucket] = {}
        self._streams: dict[ids.OwnerId, int] = {}

    def _bucket(self, table: dict[ids.OwnerId, Bucket], owner: ids.OwnerId, capacity: int, period_s: float) -> Bucket:
        bucket = table.get(owner)
        if bucket is None:
            now = self._clock()
            bucket = table[owner] = Bucket(capacity, capacity / period_s, capacity, now)
        return bucket

    async def admit_turn(self, owner: ids.OwnerId, reserve_up_to: int) -> Reservation:
        now = self._clock()
        prompt = self._bucket(self._prompt, owner, self._budget.prompt_tokens_per_hour, 3600.0)
        prompt.refill(now)
        if prompt.tokens < 1:
            raise refused("prompt tokens per hour", (1 - prompt.tokens) / prompt.per_second)
        wait = self._bucket(self._turns, owner, self._budget.turns_per_minute, 60.0).take(1, now)
        if wait > 0:
            raise refused("turns per minute", wait)
        held = max(1, min(int(prompt.tokens), reserve_up_to))
        prompt.tokens -= held
        self._sweep(now)
        return Reservation(owner, held)

    async def settle(self, reservation: Reservation, used: int) -> None:
        delta = reservation.held - used
        reservation.held = used
        if delta == 0:
            return
        bucket = self._bucket(self._prompt, reservation.owner, self._budget.prompt_tokens_per_hour, 3600.0)
        bucket.refill(self._clock())
        bucket.tokens = min(bucket.capacity, bucket.tokens + delta)

    async def open_stream(self, owner: ids.OwnerId) -> StreamLease:
        count = self._streams.get(owner, 0)
        if count >= self._budget.open_streams:
            raise refused("open streams", 1.0)
        self._streams[owner] = count + 1
        return _MemoryLease(self._streams, owner)

    async def close(self) -> None:
        return None

    def _sweep(self, now: float) -> None:
        if len(self._turns) < 10_000:
            return
        for table in (self._turns, self._prompt):
            for owner in [o for o, b in table.items() if b.tokens + (now - b.at) * b.per_second >= b.capacity]:
                del table[owner]
