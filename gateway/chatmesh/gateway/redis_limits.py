"""Per-user limits in Redis, shared by every gateway process (same buckets as `limits.MemoryLimits`).

Each check is ONE Lua script, so it is atomic across processes without locks or retries, and the clock is
Redis's own (`TIME`), so gateways with skewed clocks still refill one bucket at one rate:
- ADMIT: refill the prompt-token bucket and refuse under one token; refill the turn bucket and take one token or
  refuse; then reserve min(what is left, the cap) prompt tokens; answers (allowed, retry_after_ms, which,
  reserved). One script, so two gateways admitting the same owner's turns at once cannot both reserve the
  same tokens;
- SETTLE: refill the prompt-token bucket and add the reservation's excess back (capped at the capacity), or
  subtract what more the turn used (it may go negative);
- OPEN: drop expired stream leases from the owner's sorted set (score = expiry), refuse when the set is full,
  else add this lease.
Buckets are hashes {tokens, at_ms} that expire once they would be full again. A stream lease expires after
`lease_ttl_s` unless renewed: one task per process renews all its live leases every third of that, so a
crashed gateway frees its users' stream slots within `lease_ttl_s`. Redis unreachable -> 503 (fail closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.limits import Budget, Reservation, StreamLease, refused
from chatmesh.mesh import ids, logs

log = logs.get("chatmesh.gateway.limits")

_REFILL = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function level(key, cap, rate, now)
  local v = redis.call('HMGET', key, 'tokens', 'at')
  local tokens, at = tonumber(v[1]), tonumber(v[2])
  if tokens == nil or at == nil then return cap end
  return math.min(cap, tokens + (now - at) * rate)
end
local function store(key, tokens, cap, rate, now)
  redis.call('HSET', key, 'tokens', tostring(tokens), 'at', now)
  redis.call('PEXPIRE', key, math.ceil((cap - tokens) / rate) + 1000)
end
"""

ADMIT = _REFILL + """
local now = now_ms()
local tcap, trate = tonumber(ARGV[1]), tonumber(ARGV[2])
local pcap, prate, cap = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local p = level(KEYS[2], pcap, prate, now)
if p < 1 then return {0, math.ceil((1 - p) / prate), 'prompt', 0} end
local t = level(KEYS[1], tcap, trate, now)
if t < 1 then return {0, math.ceil((1 - t) / trate), 'turns', 0} end
store(KEYS[1], t - 1, tcap, trate, now)
local held = math.max(1, math.min(math.floor(p), cap))
store(KEYS[2], p - held, pcap, prate, now)
return {1, 0, '', held}
"""

SETTLE = _REFILL + """
local now = now_ms()
local pcap, prate, delta = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
store(KEYS[1], math.min(pcap, level(KEYS[1], pcap, prate, now) + delta), pcap, prate, now)
return 1
"""

OPEN = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= limit then return 0 end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
"""

RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', now + ttl, ARGV[i + 1])
  redis.call('PEXPIRE', key, ttl)
end
return #KEYS
"""


def _unavailable(err: RedisError) -> ApiError:
    log.warning("limits_backend_unavailable", error=type(err).__name__)
    return ApiError(503, "unavailable", "the limits backend is unavailable; retry later")


class _RedisLease:
    def __init__(self, limits: RedisLimits, key: str, lease: str):
        self._limits = limits
        self.key = key
        self.lease = lease

    async def release(self) -> None:
        if self._limits.live.pop(self.lease, None) is not None:
            await self._limits.redis.zrem(self.key, self.lease)


class RedisLimits:
    def __init__(self, url: str, budget: Budget, prefix: str = "chatmesh:limits:", lease_ttl_s: float = 90.0):
        # One immediate retry on a connection error: after Redis restarts, every pooled connection is dead and
        # the first command on each fails with "Connection closed by server" (a 503 to a user 2.5 s after Redis
        # was back, seen in bench/faults); the retry reconnects. Such a command never reached the server; one
        # that did and lost its reply would run twice (at worst a turn token and a reservation taken twice, both
        # refilled by their buckets), which is rarer and cheaper than refusing every user once per connection.
        self.redis: aioredis.Redis = aioredis.Redis.from_url(url, retry=Retry(NoBackoff(), 1))
        self._budget = budget
        self._prefix = prefix
        self._ttl_ms = int(lease_ttl_s * 1000)
        self._admit = self.redis.register_script(ADMIT)
        self._settle = self.redis.register_script(SETTLE)
        self._open = self.redis.register_script(OPEN)
        self._renew = self.redis.register_script(RENEW)
        self.live: dict[str, _RedisLease] = {}
        self._renewer: asyncio.Task[None] | None = None

    def _key(self, owner: ids.OwnerId, what: str) -> str:
        return f"{self._prefix}{{{owner}}}:{what}"  # one hash slot per owner (Redis Cluster)

    async def admit_turn(self, owner: ids.OwnerId, reserve_up_to: int) -> Reservation:
        b = self._budget
        try:
            allowed, retry_ms, which, held = await self._admit(
                keys=[self._key(owner, "turns"), self._key(owner, "prompt")],
                args=[b.turns_per_minute, b.turns_per_minute / 60_000, b.prompt_tokens_per_hour,
                      b.prompt_tokens_per_hour / 3_600_000, reserve_up_to])
        except RedisError as err:
            raise _unavailable(err) from None
        if not allowed:
            what = "prompt tokens per hour" if which == b"prompt" else "turns per minute"
            raise refused(what, int(retry_ms) / 1000)
        return Reservation(owner, int(held))

    async def settle(self, reservation: Reservation, used: int) -> None:
        delta = reservation.held - used
        reservation.held = used
        if delta == 0:
            return
        b = self._budget
        try:
            await self._settle(keys=[self._key(reservation.owner, "prompt")],
                               args=[b.prompt_tokens_per_hour, b.prompt_tokens_per_hour / 3_600_000, delta])
        except RedisError as err:
            raise _unavailable(err) from None

    async def open_stream(self, owner: ids.OwnerId) -> StreamLease:
        key, lease = self._key(owner, "streams"), uuid.uuid4().hex
        try:
            ok = await self._open(keys=[key], args=[lease, self._budget.open_streams, self._ttl_ms])
        except RedisError as err:
            raise _unavailable(err) from None
        if not ok:
            raise refused("open streams", 1.0)
        handle = self.live[lease] = _RedisLease(self, key, lease)
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_forever())
        return handle

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_ms / 3000)
            leases = list(self.live.values())
            for start in range(0, len(leases), 500):
                batch = leases[start:start + 500]
                try:
                    await self._renew(keys=[h.key for h in batch], args=[self._ttl_ms, *[h.lease for h in batch]])
                except RedisError as err:
                    log.warning("lease_renewal_failed", error=type(err).__name__, leases=len(batch))

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        await self.redis.aclose()
