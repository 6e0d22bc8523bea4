"""Authentication at the edge: API keys (stored hashed, made by `chatmesh keys create`), browser sessions with
CSRF, and isolation: user B cannot touch user A's conversation on any route (404, never a hint)."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from pathlib import Path

import httpx
import pytest

from chatmesh.gateway.auth import SESSION_COOKIE
from chatmesh.gateway.cli import accounts_for
from chatmesh.gateway.login_throttle import DEVICE_COOKIE, LoginThrottle, Rate
from chatmesh.mesh.cli import main
from chatmesh.mesh.config import Config
from tests.gateway.conftest import Gateway, StartGateway
from tests.gateway.fake_chat import FakeChat
from tests.gateway.sse_client import collect, reply_text


async def cli(*argv: str) -> int:
    """`chatmesh ...` in a thread: the command runs its own event loop, as it does from a shell."""
    return await asyncio.to_thread(main, list(argv))


async def make_key(data_dir: Path, name: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert await cli("users", "create", name, "--data-dir", str(data_dir)) == 0
    assert await cli("keys", "create", name, "--data-dir", str(data_dir), "--label", "test") == 0
    out = capsys.readouterr().out.split()
    key = out[-1]
    assert key.startswith("cmk_")
    return key


@pytest.fixture
async def required(start_gateway: StartGateway) -> Gateway:
    return await start_gateway(CHATMESH_AUTH="required")


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_required_auth_refuses_anonymous_and_bad_keys(required: Gateway) -> None:
    async with required.client() as client:
        anonymous = await client.get("/v1/conversations")
        bad = await client.get("/v1/conversations", headers=bearer("cmk_nope"))
        malformed = await client.get("/v1/conversations", headers={"authorization": "Basic abc"})
        health = await client.get("/healthz")
    for r in (anonymous, bad, malformed):
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "unauthenticated"
    assert health.status_code == 200


async def test_keys_are_stored_hashed_and_work_as_bearer(
        required: Gateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = await make_key(tmp_path, "alice", capsys)
    async with required.client(headers=bearer(key)) as client:
        r = await client.post("/v1/conversations")
        me = await client.get("/v1/session")
    assert r.status_code == 201
    assert me.json()["via"] == "api_key"
    with sqlite3.connect(tmp_path / "chatmesh.db") as db:
        rows = db.execute("select key_digest, prefix from auth_api_keys").fetchall()
    assert len(rows) == 1
    assert rows[0][0] != key and key not in rows[0][0] and len(rows[0][0]) == 64
    assert (tmp_path / "chatmesh.db").read_bytes().find(key.encode()) < 0
    assert await cli("keys", "revoke", key, "--data-dir", str(tmp_path)) == 0


async def test_revoked_key_is_refused(start_gateway: StartGateway, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    key = await make_key(tmp_path, "carol", capsys)
    assert await cli("keys", "revoke", key, "--data-dir", str(tmp_path)) == 0
    assert capsys.readouterr().out.strip() == "revoked"
    gw = await start_gateway(CHATMESH_AUTH="required")
    async with gw.client(headers=bearer(key)) as client:
        assert (await client.get("/v1/conversations")).status_code == 401


async def test_user_b_gets_404_on_every_route_of_user_a(
        required: Gateway, fake: FakeChat, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key_a, key_b = await make_key(tmp_path, "a", capsys), await make_key(tmp_path, "b", capsys)
    fake.chunks = ["secret"]
    async with required.client(headers=bearer(key_a)) as a, required.client(headers=bearer(key_b)) as b:
        conv = (await a.post("/v1/conversations", json={"title": "mine"})).json()["id"]
        turn = str(uuid.uuid4())
        async with a.stream("POST", f"/v1/conversations/{conv}/turns", json={"turn_id": turn, "content": "x"}) as r:
            assert reply_text(await collect(r)) == "secret"
        base = f"/v1/conversations/{conv}"
        attempts = [
            await b.get(base),
            await b.delete(base),
            await b.post(f"{base}/turns", json={"turn_id": str(uuid.uuid4()), "content": "x"}),
            await b.post(f"{base}/turns/{turn}/stop"),
            await b.post(f"{base}/turns/{turn}/regenerate", json={"turn_id": str(uuid.uuid4())}),
            await b.get(f"{base}/turns/{turn}/events"),
        ]
        for r in attempts:
            assert r.status_code == 404, (r.request.method, r.request.url, r.text)
            assert r.json()["error"]["code"] == "not_found"
        listed = (await b.get("/v1/conversations")).json()["conversations"]
        exported = (await b.get("/v1/export")).text
        still = await a.get(base)
    assert listed == []
    assert conv not in exported and "secret" not in exported
    assert still.status_code == 200 and len(still.json()["messages"]) == 2
    assert len(set(fake.owners_seen)) == 2


async def test_browser_session_needs_csrf_for_state_changes(
        required: Gateway, tmp_path: Path) -> None:
    accounts = accounts_for(Config(env={"CHATMESH_DATA_DIR": str(tmp_path)}))
    await accounts.create_tables()
    await accounts.create_user("dora", "correct horse")
    await accounts.close()
    async with required.client() as client:
        wrong = await client.post("/v1/session", json={"username": "dora", "password": "nope"})
        assert wrong.status_code == 401
        ok = await client.post("/v1/session", json={"username": "dora", "password": "correct horse"})
        assert ok.status_code == 201
        cookie = ok.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        me = (await client.get("/v1/session")).json()
        assert me["via"] == "session" and me["csrf_token"] == ok.json()["csrf_token"]
        listed = await client.get("/v1/conversations")
        forged = await client.post("/v1/conversations")
        wrong_token = await client.post("/v1/conversations", headers={"x-csrf-token": "guess"})
        made = await client.post("/v1/conversations", headers={"x-csrf-token": me["csrf_token"]})
        assert listed.status_code == 200
        assert forged.status_code == 403 and forged.json()["error"]["code"] == "csrf"
        assert wrong_token.status_code == 403
        assert made.status_code == 201
        out = await client.delete("/v1/session", headers={"x-csrf-token": me["csrf_token"]})
        assert out.status_code == 204
        client.cookies.clear()
        client.cookies.set("chatmesh_session", ok.cookies["chatmesh_session"])
        assert (await client.get("/v1/conversations")).status_code == 401


async def test_session_login_with_an_api_key(required: Gateway, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    key = await make_key(tmp_path, "erin", capsys)
    async with required.client() as client:
        r = await client.post("/v1/session", json={"api_key": key})
        bad = await client.post("/v1/session", json={"api_key": key + "x"})
        me = (await client.get("/v1/session")).json()
    assert r.status_code == 201 and bad.status_code == 401
    assert me["via"] == "session"


def test_users_create_refuses_a_duplicate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["users", "create", "fred", "--data-dir", str(tmp_path)]) == 0
    assert main(["users", "create", "fred", "--data-dir", str(tmp_path)]) == 1
    assert "exists" in capsys.readouterr().err
    assert main(["keys", "create", "nobody", "--data-dir", str(tmp_path)]) == 1


async def test_local_identity_serves_plain_curl(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as client:
        me = (await client.get("/v1/session")).json()
    assert me == {"user": "local", "via": "local", "csrf_token": None}


async def test_a_key_revoked_elsewhere_stops_working_on_every_running_gateway(
        start_gateway: StartGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Revoked by another process (the CLI), the key is refused by every running gateway: with the lookup cache
    off, on the first request after the revocation (ordering, no clock; the cache's bound is the next test's)."""
    key = await make_key(tmp_path, "dora", capsys)
    gateways = [await start_gateway(CHATMESH_AUTH="required", CHATMESH_AUTH_CACHE_S="0") for _ in range(2)]
    clients = [gw.client(headers=bearer(key)) for gw in gateways]
    for client in clients:
        assert (await client.get("/v1/conversations")).status_code == 200
    assert await cli("keys", "revoke", key, "--data-dir", str(tmp_path)) == 0  # another process
    for client in clients:
        assert (await client.get("/v1/conversations")).status_code == 401
        await client.aclose()


async def test_a_cached_key_lookup_ends_at_the_cache_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway that looked a key up keeps the answer CHATMESH_AUTH_CACHE_S (0.5 s) and no longer: on a clock
    the test moves, the revoked key still opens requests before the bound and is refused after it."""
    now = [1000.0]
    monkeypatch.setattr("chatmesh.gateway.accounts.time.monotonic", lambda: now[0])
    cfg = Config(env={"CHATMESH_DATA_DIR": str(tmp_path)})
    serving, elsewhere = accounts_for(cfg), accounts_for(cfg)
    try:
        await serving.create_tables()
        await serving.create_user("erin")
        key = await serving.create_key("erin")
        owner = await serving.owner_for_key(key)
        assert owner is not None
        assert await elsewhere.revoke_key(key)
        now[0] += 0.49
        assert await serving.owner_for_key(key) == owner  # within the bound: the cached answer
        now[0] += 0.02
        assert await serving.owner_for_key(key) is None  # past it: read again, revoked
    finally:
        await serving.close()
        await elsewhere.close()


def from_address(gw: Gateway, address: str) -> httpx.AsyncClient:
    """A client whose connections come from `address` (any of 127.0.0.0/8 on Linux)."""
    return httpx.AsyncClient(base_url=gw.url, timeout=10,
                             transport=httpx.AsyncHTTPTransport(local_address=address))


async def test_guessing_cannot_lock_the_user_out(start_gateway: StartGateway, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Per (address, name) the attacker locks out only themselves; a distributed attack can exhaust the name's
    bucket (small rates here), and then the user still logs in from a browser that logged in before (device
    cookie), from an existing session, or with an API key."""
    key = await make_key(tmp_path, "gina", capsys)
    accounts = accounts_for(Config(env={"CHATMESH_DATA_DIR": str(tmp_path)}))
    await accounts.create_tables()
    await accounts.create_user("gina-pw", "right")
    await accounts.close()
    gw = await start_gateway(CHATMESH_AUTH="required")
    gw.app.state.login_throttle = LoginThrottle("chatmesh-dev-pepper", pair=Rate(3, 30), name=Rate(8, 8))
    right = {"username": "gina-pw", "password": "right"}
    async with from_address(gw, "127.0.0.3") as victim:
        assert (await victim.post("/v1/session", json=right)).status_code == 201  # a device cookie now
        assert DEVICE_COOKIE in victim.cookies
        session_cookie = victim.cookies[SESSION_COOKIE]
        async with from_address(gw, "127.0.0.2") as attacker:
            statuses = [(await attacker.post("/v1/session", json={**right, "password": f"guess{i}"})).status_code
                        for i in range(4)]
            assert statuses == [401, 401, 401, 429]
            assert (await attacker.post("/v1/session", json=right)).status_code == 429  # locked: this address
        async with from_address(gw, "127.0.0.4") as elsewhere:  # the same name from another address: fine
            assert (await elsewhere.post("/v1/session", json=right)).status_code == 201
        for n in range(5, 8):  # a distributed attack empties the name's bucket
            async with from_address(gw, f"127.0.0.{n}") as bot:
                for i in range(3):
                    await bot.post("/v1/session", json={**right, "password": f"bot{i}"})
        async with from_address(gw, "127.0.0.9") as new_browser:
            locked = await new_browser.post("/v1/session", json=right)
            assert locked.status_code == 429 and "name" in locked.json()["error"]["message"]
            assert int(locked.headers["retry-after"]) >= 1
            new_browser.cookies.set(SESSION_COOKIE, session_cookie)  # ... unless it has a session of the user
            assert (await new_browser.post("/v1/session", json=right)).status_code == 201
        async with from_address(gw, "127.0.0.10") as by_key:
            assert (await by_key.post("/v1/session", json={"api_key": key})).status_code == 201
        victim.cookies.delete(SESSION_COOKIE)
        assert (await victim.post("/v1/session", json=right)).status_code == 201  # the device cookie
        forged = httpx.AsyncClient(base_url=gw.url, timeout=10, cookies={
            DEVICE_COOKIE: victim.cookies[DEVICE_COOKIE][:-4] + "AAAA"})
        async with forged:
            assert (await forged.post("/v1/session", json=right)).status_code == 429
