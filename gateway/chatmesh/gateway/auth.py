"""Authentication at the edge: a request -> the Principal whose owner id every ChatService call carries.

Order: an `Authorization: Bearer <api key>` header; else the session cookie of a browser login, and then, for a
state-changing method (POST, PUT, PATCH, DELETE), the `X-CSRF-Token` header must equal the session's CSRF token
(a cross-site form or fetch cannot read it, so it cannot forge it: the synchroniser-token pattern on top of the
SameSite cookie); else, with CHATMESH_AUTH=local, the development identity, for requests to a loopback host
name that are not cross-site (`check_local_origin`: DNS rebinding and CSRF); else 401. Each refusal also takes one
request from its address's unauthenticated budget (chatmesh.gateway.anonymous): an empty one answers 429 instead.

Secrets are stored as keyed digests (HMAC-SHA256 under CHATMESH_KEY_PEPPER of a 256-bit random token: a slow
hash adds nothing at that entropy); see chatmesh.gateway.accounts for the tables.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit
from dataclasses import dataclass
from typing import Protocol

from starlette.requests import Request

from chatmesh.gateway.anonymous import AddressLimit
from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.identity import Principal, Via, is_loopback
from chatmesh.mesh import ids

SESSION_COOKIE = "chatmesh_session"
CSRF_HEADER = "x-csrf-token"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Session:
    owner: ids.OwnerId
    csrf_token: str


class Credentials(Protocol):
    """Where keys and sessions are looked up (the auth_ tables), by the secret itself (hashed there)."""

    async def owner_for_key(self, key: str) -> ids.OwnerId | None: ...

    async def session(self, token: str) -> Session | None: ...


def unauthenticated(message: str = "authentication required: an API key (Bearer) or a session") -> ApiError:
    return ApiError(401, "unauthenticated", message)


class Authenticator:
    def __init__(self, credentials: Credentials | None, local_owner: ids.OwnerId | None,
                 unauthenticated: AddressLimit | None = None):
        self._credentials = credentials
        self._local_owner = local_owner
        self._unauthenticated = unauthenticated

    @property
    def local(self) -> bool:
        return self._local_owner is not None

    def charge_unauthenticated(self, request: Request) -> None:
        """Takes one unauthenticated request of the request's address (a login attempt); 429 when none is left."""
        if self._unauthenticated is not None and (limited := self._unauthenticated.charge(request)) is not None:
            raise limited

    async def identify(self, request: Request) -> Principal:
        try:
            return await self._identify(request)
        except ApiError as err:
            if err.status in (401, 403, 421):  # not authenticated: counted against the address
                self.charge_unauthenticated(request)
            raise

    async def _identify(self, request: Request) -> Principal:
        header = request.headers.get("authorization")
        if header is not None:
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise unauthenticated("Authorization must be `Bearer <api key>`")
            owner = await self._credentials.owner_for_key(token.strip()) if self._credentials else None
            if owner is None:
                raise unauthenticated("unknown or revoked API key")
            return Principal(owner, Via.API_KEY)
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie and self._credentials is not None:
            session = await self._credentials.session(cookie)
            if session is not None:
                if request.method not in _SAFE_METHODS:
                    sent = request.headers.get(CSRF_HEADER, "")
                    if not hmac.compare_digest(sent.encode(), session.csrf_token.encode()):
                        raise ApiError(403, "csrf", f"missing or wrong {CSRF_HEADER} header for a session request")
                return Principal(session.owner, Via.SESSION)
        if self._local_owner is not None:
            check_local_origin(request)
            return Principal(self._local_owner, Via.LOCAL)
        raise unauthenticated()


def _host_part(authority: str) -> str:
    if authority.startswith("["):
        return authority[1:].partition("]")[0]
    return authority.rpartition(":")[0] if authority.count(":") == 1 else authority


def check_local_origin(request: Request) -> None:
    """The development identity answers only requests a page on this machine made. A web page elsewhere can
    point its own host name at 127.0.0.1 (DNS rebinding) and read the local user's data as same-origin, or
    post to it cross-site (CSRF): so the Host must be a loopback name, and a state-changing request that says
    where it comes from (`Origin`) must come from a loopback origin."""
    host = _host_part(request.headers.get("host", ""))
    if not is_loopback(host):
        raise ApiError(421, "misdirected_request",
                       "the development identity answers only loopback host names (localhost, 127.0.0.1, ::1)")
    origin = request.headers.get("origin")
    if request.method not in _SAFE_METHODS and origin is not None:
        parsed = urlsplit(origin)
        if parsed.hostname is None or not is_loopback(parsed.hostname):
            raise ApiError(403, "forbidden_origin", "cross-site requests cannot act as the development identity")
