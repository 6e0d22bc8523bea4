"""Browser sessions: log in (name and password, or an API key), who am I (with the CSRF token the page sends on
state-changing requests), log out. The cookie is HttpOnly (scripts cannot read it), SameSite=Strict (other sites
cannot make the browser send it) and Secure when the edge speaks TLS or CHATMESH_SECURE_COOKIES is set."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatmesh.gateway import bodies
from chatmesh.gateway.accounts import Accounts, NewSession
from chatmesh.gateway.auth import SESSION_COOKIE, digest, unauthenticated
from chatmesh.gateway.errors import ApiError, bad_request
from chatmesh.gateway.identity import Via
from chatmesh.gateway.limits import Bucket, refused
from chatmesh.gateway.routes import edge_of


# Password guessing: each user name has a bucket of 10 failed logins refilled at one per minute, in this
# process (with N gateways an attacker gets N buckets: still ~N per minute, against a 256-bit key or a password).
_FAILURES_CAPACITY, _FAILURES_PER_S = 10.0, 1 / 60
_failures: dict[str, Bucket] = {}


def _check_failures(name: str) -> None:
    bucket = _failures.get(name)
    if bucket is not None:
        bucket.refill(time.monotonic())
        if bucket.tokens < 1:
            raise refused("failed logins", (1 - bucket.tokens) / _FAILURES_PER_S)


def _record_failure(name: str) -> None:
    now = time.monotonic()
    if len(_failures) > 100_000:
        _failures.clear()
    bucket = _failures.setdefault(name, Bucket(_FAILURES_CAPACITY, _FAILURES_PER_S, _FAILURES_CAPACITY, now))
    bucket.take(1, now)


def _accounts(request: Request) -> Accounts:
    accounts: Accounts | None = request.app.state.accounts
    if accounts is None:
        raise ApiError(503, "unavailable", "sessions are not available")
    return accounts


def _secure(request: Request) -> bool:
    secure: bool = request.app.state.secure_cookies
    return secure or request.url.scheme == "https"


async def login(request: Request) -> Response:
    edge = edge_of(request)
    accounts = _accounts(request)
    body = await bodies.json_object(request, edge.max_body_bytes)
    session: NewSession | None
    if "api_key" in body:
        key = body["api_key"]
        if not isinstance(key, str) or not key:
            raise bad_request("api_key must be a non-empty string")
        owner = await accounts.owner_for_key(digest(key))
        session = await accounts.start_session(owner) if owner is not None else None
    else:
        name, password = body.get("username"), body.get("password")
        if not isinstance(name, str) or not name:
            raise bad_request("username is required (a string)")
        if not isinstance(password, str) or not password:
            raise bad_request("password is required (a string)")
        _check_failures(name)
        session = await accounts.login(name, password)
        if session is None:
            _record_failure(name)
    if session is None:
        raise unauthenticated("wrong username, password or API key")
    response = JSONResponse({"user": session.owner, "csrf_token": session.csrf_token}, 201)
    response.set_cookie(SESSION_COOKIE, session.token, max_age=session.max_age_s, path="/", httponly=True,
                        samesite="strict", secure=_secure(request))
    return response


async def whoami(request: Request) -> Response:
    edge = edge_of(request)
    who = await edge.auth.identify(request)
    out: dict[str, object] = {"user": who.owner, "via": who.via.value, "csrf_token": None}
    if who.via is Via.SESSION:
        found = await _accounts(request).session(digest(request.cookies.get(SESSION_COOKIE, "")))
        out["csrf_token"] = found.csrf_token if found else None
    return JSONResponse(out)


async def logout(request: Request) -> Response:
    edge = edge_of(request)
    who = await edge.auth.identify(request)  # a session logout needs its CSRF token like any state change
    if who.via is Via.SESSION:
        await _accounts(request).end_session(digest(request.cookies.get(SESSION_COOKIE, "")))
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=_secure(request))
    return response
