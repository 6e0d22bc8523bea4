"""Browser sessions: log in (name and password under a guessing throttle that cannot lock others out, see
login_throttle.py; or an API key), who am I (with the CSRF token the page sends on state-changing requests), log
out. The cookie is HttpOnly (scripts cannot read it), SameSite=Strict (other sites
cannot make the browser send it) and Secure when the edge speaks TLS or CHATMESH_SECURE_COOKIES is set."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatmesh.gateway import bodies
from chatmesh.gateway.accounts import Accounts, NewSession
from chatmesh.gateway.auth import SESSION_COOKIE, unauthenticated
from chatmesh.gateway.errors import ApiError, bad_request
from chatmesh.gateway.identity import Via
from chatmesh.gateway.limits import refused
from chatmesh.gateway.login_throttle import DEVICE_COOKIE, DEVICE_MAX_AGE_S, LoginThrottle
from chatmesh.gateway.routes import edge_of


def _accounts(request: Request) -> Accounts:
    accounts: Accounts | None = request.app.state.accounts
    if accounts is None:
        raise ApiError(503, "unavailable", "sessions are not available")
    return accounts


def _secure(request: Request) -> bool:
    secure: bool = request.app.state.secure_cookies
    return secure or request.url.scheme == "https"


async def _password_login(request: Request, accounts: Accounts, name: str, password: str
                          ) -> tuple[NewSession | None, str | None]:
    """A password login under the guessing throttle (chatmesh.gateway.login_throttle); on success also the
    device cookie to set."""
    throttle: LoginThrottle = request.app.state.login_throttle
    address = request.client.host if request.client else ""
    device = throttle.device_for(request.cookies.get(DEVICE_COOKIE), name)
    trusted = device is not None
    if not trusted and (cookie := request.cookies.get(SESSION_COOKIE)):
        current = await accounts.session(cookie)
        trusted = current is not None and current.owner == await accounts.user_named(name)
    refusal = throttle.check(name, address, device, trusted)
    if refusal is not None:
        raise refused(refusal.what, refusal.retry_after_s)
    session = await accounts.login(name, password)
    if session is None:
        throttle.failed(name, address, device, trusted)
        return None, None
    return session, throttle.device_cookie(name)


async def login(request: Request) -> Response:
    edge = edge_of(request)
    accounts = _accounts(request)
    edge.auth.charge_unauthenticated(request)  # every attempt, before its body is read
    body = await bodies.json_object(request, edge.max_body_bytes)
    session: NewSession | None
    device_cookie: str | None = None
    if "api_key" in body:
        key = body["api_key"]
        if not isinstance(key, str) or not key:
            raise bad_request("api_key must be a non-empty string")
        owner = await accounts.owner_for_key(key)
        session = await accounts.start_session(owner) if owner is not None else None
    else:
        name, password = body.get("username"), body.get("password")
        if not isinstance(name, str) or not name:
            raise bad_request("username is required (a string)")
        if not isinstance(password, str) or not password:
            raise bad_request("password is required (a string)")
        session, device_cookie = await _password_login(request, accounts, name, password)
    if session is None:
        raise unauthenticated("wrong username, password or API key")
    response = JSONResponse({"user": session.owner, "csrf_token": session.csrf_token}, 201)
    response.set_cookie(SESSION_COOKIE, session.token, max_age=session.max_age_s, path="/", httponly=True,
                        samesite="strict", secure=_secure(request))
    if device_cookie is not None:
        response.set_cookie(DEVICE_COOKIE, device_cookie, max_age=DEVICE_MAX_AGE_S, path="/v1/session",
                            httponly=True, samesite="strict", secure=_secure(request))
    return response


async def whoami(request: Request) -> Response:
    edge = edge_of(request)
    who = await edge.auth.identify(request)
    out: dict[str, object] = {"user": who.owner, "via": who.via.value, "csrf_token": None}
    if who.via is Via.SESSION:
        found = await _accounts(request).session(request.cookies.get(SESSION_COOKIE, ""))
        out["csrf_token"] = found.csrf_token if found else None
    return JSONResponse(out)


async def logout(request: Request) -> Response:
    edge = edge_of(request)
    who = await edge.auth.identify(request)  # a session logout needs its CSRF token like any state change
    if who.via is Via.SESSION:
        await _accounts(request).end_session(request.cookies.get(SESSION_COOKIE, ""))
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=_secure(request))
    return response
