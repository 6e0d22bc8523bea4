"""A per-address rate limit for unauthenticated requests: what a client that has not (yet) proved who it is may
cost the edge.

Every request that fails authentication (no credential where one is required, an unknown or revoked key, a
session's missing CSRF token) and every login attempt (`POST /v1/session`, before its body is read) takes one
token from its address's bucket (`limits.Bucket`): `per_minute` tokens, refilled continuously at `per_minute` a
minute. An empty bucket answers 429 with Retry-After ("unauthenticated requests per minute") instead of the 401,
and the login is not tried. Authenticated requests never touch it (their owner's limits apply), nor do requests
the development identity serves (CHATMESH_AUTH=local, loopback only), nor /healthz.

The address is the request's client as the server sees it: the TCP peer, or, from a proxy listed in
CHATMESH_FORWARDED_ALLOW_IPS, the address it forwards (X-Forwarded-For); with no proxy listed a client cannot pick
its own address with that header. State is per gateway process, like the login throttle's (N gateways: N times
the rate); idle addresses are dropped once their bucket is full again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.requests import Request

from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.limits import Bucket, refused

MAX_ADDRESSES = 100_000  # buckets kept before the full (idle) ones are dropped


class AddressLimit:
    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        if per_minute <= 0:
            raise ValueError("CHATMESH_LIMIT_UNAUTHENTICATED_PER_MINUTE must be positive")
        self.per_minute = per_minute
        self._clock = clock
        self._buckets: dict[str, Bucket] = {}

    def charge(self, request: Request) -> ApiError | None:
        """Takes one unauthenticated request of the request's address; the 429 to answer when none is left."""
        now = self._clock()
        address = request.client.host if request.client else ""
        bucket = self._buckets.get(address)
        if bucket is None:
            if len(self._buckets) >= MAX_ADDRESSES:
                self._buckets = {a: b for a, b in self._buckets.items()
                                 if b.tokens + (now - b.at) * b.per_second < b.capacity}
            bucket = self._buckets[address] = Bucket(self.per_minute, self.per_minute / 60, self.per_minute, now)
        wait = bucket.take(1, now)
        return refused("unauthenticated requests per minute", wait) if wait > 0 else None
