"""The gateway's own tables (prefixed `auth_`, beside the store's on the same database): users, API keys and
browser sessions. The gateway creates them at start (`create_all`, idempotent).

- auth_users: a user id (the owner id every ChatService call carries), a unique name, an optional password
  (scrypt, n=2^14 r=8 p=1, per-user salt).
- auth_api_keys: the key's digest, never the key; the key is shown once by `chatmesh keys create`.
  Keys are `cmk_` + 43 URL-safe characters (256 random bits), so a fast digest is enough.
- auth_sessions: the digest of the cookie value, the CSRF token handed to the page, and an expiry.
- auth_group_members: which users are in which named group (`chatmesh groups add NAME USER`), for the owner-token
  grants of internal clients that name a group (mesh/grants.py).
- auth_frontend_keys: the API keys marked as a trusted front-end (`chatmesh keys create NAME --frontend`): a
  service such as Open WebUI that serves many people through one key and names each end user in a header; only
  such a key may (see chatmesh.gateway.openai.surface).

Digests are HMAC-SHA256 keyed by CHATMESH_KEY_PEPPER (a secret kept outside the database), so a copy of the
tables alone cannot even confirm a guessed key. Changing the pepper invalidates every key and session.

Lookups on the request path are cached in this process for `cache_s` seconds (CHATMESH_AUTH_CACHE_S, 0.5 by
default), so a burst of requests with one key costs one query: a key revoked or a session ended anywhere (the
`chatmesh keys revoke` command, a logout on another gateway) stops working on every gateway within that bound,
and at once in the process that did it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from chatmesh.gateway.auth import Session
from chatmesh.gateway.settings import KEY_PEPPER
from chatmesh.mesh import errors, ids
from chatmesh.store.db import database_url as resolve_url

metadata = sa.MetaData()

users = sa.Table(
    "auth_users", metadata,
    sa.Column("user_id", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(128), nullable=False, unique=True),
    sa.Column("password_hash", sa.String(256), nullable=True),
    sa.Column("created_at_ms", sa.BigInteger, nullable=False),
)
api_keys = sa.Table(
    "auth_api_keys", metadata,
    sa.Column("key_digest", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(64), sa.ForeignKey("auth_users.user_id", ondelete="CASCADE"), nullable=False,
              index=True),
    sa.Column("label", sa.String(128), nullable=False, default=""),
    sa.Column("prefix", sa.String(16), nullable=False),
    sa.Column("created_at_ms", sa.BigInteger, nullable=False),
    sa.Column("revoked_at_ms", sa.BigInteger, nullable=True),
)
sessions = sa.Table(
    "auth_sessions", metadata,
    sa.Column("session_digest", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(64), sa.ForeignKey("auth_users.user_id", ondelete="CASCADE"), nullable=False,
              index=True),
    sa.Column("csrf_token", sa.String(64), nullable=False),
    sa.Column("expires_at_ms", sa.BigInteger, nullable=False, index=True),
)

frontend_keys = sa.Table(
    "auth_frontend_keys", metadata,
    sa.Column("key_digest", sa.String(64), sa.ForeignKey("auth_api_keys.key_digest", ondelete="CASCADE"),
              primary_key=True),
    sa.Column("created_at_ms", sa.BigInteger, nullable=False),
)

group_members = sa.Table(
    "auth_group_members", metadata,
    sa.Column("group_name", sa.String(128), primary_key=True),
    sa.Column("user_id", sa.String(64), sa.ForeignKey("auth_users.user_id", ondelete="CASCADE"), primary_key=True,
              index=True),
    sa.Column("created_at_ms", sa.BigInteger, nullable=False),
)

_SCRYPT = {"n": 2**14, "r": 8, "p": 1}


def hash_password(password: str) -> str:
    salt = secrets.token_bytes(16)
    dk = hashlib.scrypt(password.encode(), salt=salt, dklen=32, **_SCRYPT)
    return f"scrypt${_SCRYPT['n']}${_SCRYPT['r']}${_SCRYPT['p']}${salt.hex()}${dk.hex()}"


def check_password(password: str, stored: str) -> bool:
    try:
        scheme, n, r, p, salt, expected = stored.split("$")
    except ValueError:
        return False
    if scheme != "scrypt":
        return False
    dk = hashlib.scrypt(password.encode(), salt=bytes.fromhex(salt), dklen=32, n=int(n), r=int(r), p=int(p))
    return hmac.compare_digest(dk.hex(), expected)


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class NewSession:
    token: str
    csrf_token: str
    owner: ids.OwnerId
    max_age_s: int


class Accounts:
    """Users, keys and sessions on the auth_ tables; implements `auth.Credentials`."""

    def __init__(self, engine: AsyncEngine, session_ttl_s: int = 7 * 24 * 3600, cache_s: float = 0.5,
                 pepper: str = KEY_PEPPER.default):
        self._engine = engine
        self._pepper = pepper.encode()
        self._session_ttl_s = session_ttl_s
        self._cache_s = cache_s
        self._keys: dict[str, tuple[float, ids.OwnerId | None]] = {}
        self._sessions: dict[str, tuple[float, Session | None]] = {}
        self._frontends: dict[str, tuple[float, bool]] = {}

    def digest(self, secret: str) -> str:
        """What is stored for a key or session token: HMAC-SHA256 under the pepper, hex."""
        return hmac.new(self._pepper, secret.encode(), hashlib.sha256).hexdigest()

    async def create_tables(self) -> None:
        """Idempotent. Two gateways starting at once on PostgreSQL can race on CREATE TABLE; the loser retries
        and then finds the tables."""
        for attempt in range(3):
            try:
                async with self._engine.begin() as conn:
                    await conn.run_sync(metadata.create_all)
                return
            except sa.exc.DBAPIError:
                if attempt == 2:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))

    @property
    def engine(self) -> AsyncEngine:
        """The engine of the gateway's tables (the OpenAI surface keeps its history index beside them)."""
        return self._engine

    async def close(self) -> None:
        await self._engine.dispose()

    async def create_user(self, name: str, password: str | None = None) -> ids.OwnerId:
        if not name or len(name) > 128 or not name.isprintable():
            raise errors.InvalidArgument("name must be 1-128 printable characters")
        user_id = ids.OwnerId(str(uuid.uuid4()))
        try:
            async with self._engine.begin() as conn:
                await conn.execute(users.insert().values(
                    user_id=user_id, name=name, password_hash=hash_password(password) if password else None,
                    created_at_ms=_now_ms()))
        except sa.exc.IntegrityError:
            raise errors.Conflict(f"user {name!r} exists") from None
        return user_id

    async def user_named(self, name: str) -> ids.OwnerId | None:
        async with self._engine.connect() as conn:
            found = await conn.scalar(sa.select(users.c.user_id).where(users.c.name == name))
        return ids.OwnerId(found) if found is not None else None

    async def user_name(self, owner: ids.OwnerId) -> str | None:
        """The name of the user whose id is `owner` (None: no such user)."""
        async with self._engine.connect() as conn:
            found = await conn.scalar(sa.select(users.c.name).where(users.c.user_id == owner))
        return str(found) if found is not None else None

    async def in_group(self, owner: ids.OwnerId, group: str) -> bool:
        async with self._engine.connect() as conn:
            found = await conn.scalar(sa.select(group_members.c.user_id).where(
                group_members.c.group_name == group, group_members.c.user_id == owner))
        return found is not None

    async def set_group(self, group: str, name: str, member: bool) -> bool:
        """Puts user `name` in `group` (or, `member` false, takes it out); whether anything changed."""
        if not group or len(group) > 128 or not group.isprintable():
            raise errors.InvalidArgument("group must be 1-128 printable characters")
        owner = await self.user_named(name)
        if owner is None:
            raise errors.NotFound(f"no user {name!r}")
        async with self._engine.begin() as conn:
            if not member:
                done = await conn.execute(group_members.delete().where(
                    group_members.c.group_name == group, group_members.c.user_id == owner))
                return bool(done.rowcount)
            if await conn.scalar(sa.select(group_members.c.user_id).where(
                    group_members.c.group_name == group, group_members.c.user_id == owner)) is not None:
                return False
            await conn.execute(group_members.insert().values(group_name=group, user_id=owner,
                                                             created_at_ms=_now_ms()))
        return True

    async def create_key(self, name: str, label: str = "", *, frontend: bool = False) -> str:
        """A new API key of user `name`; `frontend` marks it a trusted front-end (it may name end users)."""
        owner = await self.user_named(name)
        if owner is None:
            raise errors.NotFound(f"no user {name!r}")
        key = "cmk_" + secrets.token_urlsafe(32)
        async with self._engine.begin() as conn:
            await conn.execute(api_keys.insert().values(
                key_digest=self.digest(key), user_id=owner, label=label, prefix=key[:10], created_at_ms=_now_ms()))
            if frontend:
                await conn.execute(frontend_keys.insert().values(key_digest=self.digest(key),
                                                                 created_at_ms=_now_ms()))
        return key

    async def is_frontend_key(self, key_digest: str) -> bool:
        """Whether a key is a trusted front-end's (cached like key lookups)."""
        cached = self._frontends.get(key_digest)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            return cached[1]
        async with self._engine.connect() as conn:
            found = await conn.scalar(sa.select(frontend_keys.c.key_digest).where(
                frontend_keys.c.key_digest == key_digest))
        if len(self._frontends) > 50_000:
            self._frontends.clear()
        self._frontends[key_digest] = (now + self._cache_s, found is not None)
        return found is not None

    async def revoke_key(self, key: str) -> bool:
        key_digest = self.digest(key)
        self._keys.pop(key_digest, None)
        self._frontends.pop(key_digest, None)
        async with self._engine.begin() as conn:
            done = await conn.execute(api_keys.update().where(
                api_keys.c.key_digest == key_digest, api_keys.c.revoked_at_ms.is_(None)).values(
                revoked_at_ms=_now_ms()))
        return bool(done.rowcount)

    async def owner_for_key(self, key: str) -> ids.OwnerId | None:
        key_digest = self.digest(key)
        cached = self._keys.get(key_digest)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            return cached[1]
        async with self._engine.connect() as conn:
            found = await conn.scalar(sa.select(api_keys.c.user_id).where(
                api_keys.c.key_digest == key_digest, api_keys.c.revoked_at_ms.is_(None)))
        owner = ids.OwnerId(found) if found is not None else None
        if len(self._keys) > 50_000:
            self._keys.clear()
        self._keys[key_digest] = (now + self._cache_s, owner)
        return owner

    async def login(self, name: str, password: str) -> NewSession | None:
        async with self._engine.connect() as conn:
            row = (await conn.execute(sa.select(users.c.user_id, users.c.password_hash).where(
                users.c.name == name))).first()
        if row is None or row.password_hash is None or not check_password(password, row.password_hash):
            return None
        return await self.start_session(ids.OwnerId(row.user_id))

    async def start_session(self, owner: ids.OwnerId) -> NewSession:
        token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        async with self._engine.begin() as conn:
            await conn.execute(sessions.delete().where(sessions.c.expires_at_ms < _now_ms()))
            await conn.execute(sessions.insert().values(
                session_digest=self.digest(token), user_id=owner, csrf_token=csrf,
                expires_at_ms=_now_ms() + self._session_ttl_s * 1000))
        return NewSession(token, csrf, owner, self._session_ttl_s)

    async def session(self, token: str) -> Session | None:
        session_digest = self.digest(token)
        cached = self._sessions.get(session_digest)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            return cached[1]
        async with self._engine.connect() as conn:
            row = (await conn.execute(sa.select(sessions.c.user_id, sessions.c.csrf_token).where(
                sessions.c.session_digest == session_digest, sessions.c.expires_at_ms > _now_ms()))).first()
        found = Session(ids.OwnerId(row.user_id), row.csrf_token) if row is not None else None
        if len(self._sessions) > 50_000:
            self._sessions.clear()
        self._sessions[session_digest] = (now + self._cache_s, found)
        return found

    async def end_session(self, token: str) -> None:
        session_digest = self.digest(token)
        self._sessions.pop(session_digest, None)
        async with self._engine.begin() as conn:
            await conn.execute(sessions.delete().where(sessions.c.session_digest == session_digest))


def open_accounts(database_url: str, data_dir: str, session_ttl_s: int = 7 * 24 * 3600, *, cache_s: float = 0.5,
                  pepper: str = KEY_PEPPER.default, schema: str = "") -> Accounts:
    """The auth_ tables on the store's database: `database_url` if set, else the embedded SQLite file (WAL and
    a busy timeout, so the gateway and the store processes can share it). On PostgreSQL, `schema`
    (CHATMESH_DATABASE_SCHEMA) is the search path, so the tables live beside the store's in that schema."""
    url = resolve_url(database_url, data_dir)
    if not url.startswith("sqlite"):
        connect_args = {"server_settings": {"search_path": schema}} if schema else {}
        return Accounts(create_async_engine(url, pool_size=5, max_overflow=5, connect_args=connect_args),
                        session_ttl_s, cache_s, pepper)
    engine = create_async_engine(url, connect_args={"timeout": 30})

    @sa.event.listens_for(engine.sync_engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return Accounts(engine, session_ttl_s, cache_s, pepper)
