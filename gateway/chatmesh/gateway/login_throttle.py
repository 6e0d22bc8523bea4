"""Password-guessing throttle for browser login that an attacker cannot turn into a lockout of someone else.

The scheme is OWASP's "device cookie" defence against online guessing. Failed logins are counted in token
buckets (`limits.Bucket`: `capacity` failures, refilled continuously at `per_hour` an hour) under three keys:

- (source address, user name): 5 failures, 30 an hour back. Guessing from one address stops there; it locks out
  only that address for that name.
- source address: 50 failures, 600 an hour back. One address spraying many names.
- user name, from untrusted clients only: 100 failures, 100 an hour back. The ceiling on a distributed attack
  (many addresses, one name). This is the only bucket an attacker can empty for another person's name, and it
  is why the bypass below exists.

A trusted client skips the name and address buckets and is counted only under its own device key (5 failures,
30 an hour back). A client is trusted for a name when it shows either
- a device cookie (`chatmesh_device`) for that name: issued by a successful password login, signed with
  CHATMESH_KEY_PEPPER, HttpOnly, scoped to /v1/session, valid a year; it proves that this browser has logged in as
  that user before; or
- a live session cookie of that user (re-login from a browser that is already in).
Logging in with an API key (`{"api_key": ...}`) is not password guessing and is never throttled here. So when
a distributed attack exhausts a name's bucket, its owner still logs in from any browser they used before, with
an API key, or from an existing session; new browsers wait for the bucket to refill (429 with Retry-After).

State is per gateway process (N gateways: N times the rates above). Source addresses are the TCP peer's, or,
from a proxy listed in CHATMESH_FORWARDED_ALLOW_IPS (empty by default), the address it forwards.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from chatmesh.gateway.limits import Bucket

DEVICE_COOKIE = "chatmesh_device"
DEVICE_MAX_AGE_S = 365 * 24 * 3600


@dataclass(frozen=True)
class Rate:
    capacity: float
    per_hour: float


PAIR = Rate(5, 30)
ADDRESS = Rate(50, 600)
NAME = Rate(100, 100)
DEVICE = Rate(5, 30)


@dataclass(frozen=True)
class Refusal:
    what: str
    retry_after_s: float


class LoginThrottle:
    """The buckets of the module header; `clock` is injected for tests."""

    def __init__(self, pepper: str, clock: Callable[[], float] = time.monotonic, max_keys: int = 100_000,
                 pair: Rate = PAIR, address: Rate = ADDRESS, name: Rate = NAME, device: Rate = DEVICE) -> None:
        self._rates = {"pair": pair, "address": address, "name": name, "device": device}
        self._key = hashlib.sha256(b"chatmesh-device\0" + pepper.encode()).digest()
        self._clock = clock
        self._max_keys = max_keys
        self._buckets: dict[tuple[str, ...], Bucket] = {}

    # ---- device cookies ------------------------------------------------------------------------------------

    def _sign(self, name: str, nonce: str) -> str:
        mac = hmac.new(self._key, f"{name}\0{nonce}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac[:18]).decode()

    def device_cookie(self, name: str) -> str:
        """A new device cookie value for `name` (set after a successful password login)."""
        nonce = secrets.token_urlsafe(12)
        label = base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")
        return f"{label}.{nonce}.{self._sign(name, nonce)}"

    def device_for(self, cookie: str | None, name: str) -> str | None:
        """The device id (its nonce) when `cookie` is a valid device cookie for `name`, else None."""
        if not cookie or cookie.count(".") != 2:
            return None
        label, nonce, sig = cookie.split(".")
        try:
            named = base64.urlsafe_b64decode(label + "=" * (-len(label) % 4)).decode()
        except (ValueError, UnicodeDecodeError):
            return None
        if named != name or not hmac.compare_digest(sig, self._sign(name, nonce)):
            return None
        return nonce

    # ---- buckets -------------------------------------------------------------------------------------------

    def _keys(self, name: str, address: str, device: str | None, trusted: bool) -> list[tuple[tuple[str, ...], Rate]]:
        r = self._rates
        if trusted:
            return [(("device", device or "session", name), r["device"])]
        return [(("pair", address, name), r["pair"]), (("address", address), r["address"]), (("name", name), r["name"])]

    def check(self, name: str, address: str, device: str | None, trusted: bool) -> Refusal | None:
        """None when this login attempt may go ahead; else which limit refused it and for how long."""
        now = self._clock()
        worst: Refusal | None = None
        for key, _ in self._keys(name, address, device, trusted):
            bucket = self._buckets.get(key)
            if bucket is None:
                continue
            bucket.refill(now)
            if bucket.tokens < 1:
                wait = (1 - bucket.tokens) / bucket.per_second
                if worst is None or wait > worst.retry_after_s:
                    worst = Refusal(f"failed logins ({key[0]})", wait)
        return worst

    def failed(self, name: str, address: str, device: str | None, trusted: bool) -> None:
        now = self._clock()
        if len(self._buckets) > self._max_keys:
            self._buckets = {k: b for k, b in self._buckets.items()
                             if b.tokens + (now - b.at) * b.per_second < b.capacity}
        for key, rate in self._keys(name, address, device, trusted):
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = Bucket(rate.capacity, rate.per_hour / 3600, rate.capacity, now)
            bucket.take(1, now)
