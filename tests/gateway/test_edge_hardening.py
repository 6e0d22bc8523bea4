"""The edge's answers to the abuse cases of the security reviews (issue 17): deeply nested JSON, redirects that
reflected the Host header, slow-header, slow-body and idle connections that were held forever, and clients that
go away mid-body; (issue 30) bodies wide rather than deep, unauthenticated requests without a per-address limit,
X-Forwarded-For believed from loopback, the development pepper on a public gateway bound to loopback."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from chatmesh.gateway.app import StartupRefused, create_app, serve_hypercorn, server_for
from chatmesh.gateway.cli import accounts_for
from chatmesh.mesh.config import Config
from tests.conftest import free_port
from tests.gateway.conftest import Gateway, StartGateway, until_listening
from tests.gateway.fake_chat import FakeChat
from tests.gateway.sse_client import collect, reply_text
from tests.trust import gateway_env


def nested(depth: int) -> str:
    return '{"turn_id": "%s", "content": "hi", "x": %s%s}' % (uuid.uuid4(), "[" * depth, "]" * depth)


@pytest.mark.parametrize("depth", [40, 1000, 100_000])
async def test_deeply_nested_json_is_400_naming_the_limit(gateway: Gateway, fake: FakeChat, depth: int) -> None:
    async with gateway.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        turn = await client.post(f"/v1/conversations/{conv}/turns", content=nested(depth),
                                 headers={"content-type": "application/json"})
        login = await client.post("/v1/session", content='{"username": "a", "password": %s"x"%s}'
                                  % ("[" * depth, "]" * depth))
        fine = await client.post(f"/v1/conversations/{conv}/turns", content=nested(20),
                                 headers={"content-type": "application/json"})
    for r in (turn, login):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "body: JSON nested deeper than 32 levels"
    assert fine.status_code == 200
    assert len(fake.convs[conv].turns) == 1  # the nested ones reached nothing


@pytest.mark.parametrize("text", ['"pw\\udcff"', '"\\ud800x"', '"x\\udfff\\ud800"'])
async def test_a_lone_surrogate_is_400_not_500(gateway: Gateway, fake: FakeChat, text: str) -> None:
    """JSON's \\uXXXX escapes (and json.loads, which decodes bytes with surrogatepass) let a lone surrogate into a
    string; it failed later wherever the text was encoded: password hashing, protobuf (500, and a traceback)."""
    raw_surrogate = '{"username": "a", "password": "pw'.encode() + b"\xed\xb3\xbf" + b'"}'
    async with gateway.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        login = await client.post("/v1/session", content='{"username": "a", "password": %s}' % text)
        raw_login = await client.post("/v1/session", content=raw_surrogate)
        turn = await client.post(f"/v1/conversations/{conv}/turns",
                                 content='{"turn_id": "%s", "content": %s}' % (uuid.uuid4(), text))
        key = await client.post(f"/v1/conversations/{conv}/turns",
                                content='{"turn_id": "%s", "content": "hi", %s: 1}' % (uuid.uuid4(), text))
    for r in (login, raw_login, turn, key):
        assert r.status_code == 400, r.text
        assert "lone surrogate" in r.json()["error"]["message"]
    assert fake.convs[conv].turns == {}


async def raw_request(gw: Gateway, request: bytes) -> bytes:
    """The response head to a request sent byte for byte (httpx normalises `//host/` paths away)."""
    url = urlsplit(gw.url)
    assert url.hostname is not None and url.port is not None
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(request)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.close()
    return head


async def test_slash_redirect_never_reflects_the_host_header(start_gateway: StartGateway) -> None:
    plain = await start_gateway()
    public = await start_gateway(CHATMESH_PUBLIC_ORIGIN="https://chat.example.com/",
                                 CHATMESH_KEY_PEPPER="a-test-pepper")  # a public origin: no development pepper
    evil = {"host": "evil.example"}
    async with plain.client(follow_redirects=False) as client:
        relative = await client.get("/v1/conversations/?page_size=2", headers=evil)
        static = await client.get("/static", headers=evil)
    scheme_relative = await raw_request(plain, b"GET //evil.example/ HTTP/1.1\r\nHost: evil.example\r\n\r\n")
    async with public.client(follow_redirects=False) as client:
        absolute = await client.get("/v1/conversations/", headers=evil)
    assert relative.status_code == 307 and relative.headers["location"] == "/v1/conversations?page_size=2"
    assert static.status_code == 307 and static.headers["location"] == "/static/"
    assert scheme_relative.startswith(b"HTTP/1.1 404") and b"location" not in scheme_relative.lower()
    assert absolute.status_code == 307
    assert absolute.headers["location"] == "https://chat.example.com/v1/conversations"
    for r in (relative, static, absolute):
        assert "evil" not in r.headers["location"]


async def _closed(reader: asyncio.StreamReader, limit_s: float) -> bytes:
    """What the server sent before it closed the connection (waiting at most `limit_s`: a timeout, not a
    measurement)."""
    return await asyncio.wait_for(reader.read(), limit_s)


async def test_slow_header_slow_body_and_idle_connections_are_dropped(start_gateway: StartGateway) -> None:
    gw = await start_gateway(CHATMESH_EDGE_HEADER_TIMEOUT_S="1", CHATMESH_EDGE_BODY_TIMEOUT_S="1",
                             CHATMESH_EDGE_IDLE_TIMEOUT_S="1")
    url = urlsplit(gw.url)
    assert url.hostname is not None and url.port is not None
    conns = [await asyncio.open_connection(url.hostname, url.port) for _ in range(30)]
    idle, slow_header, slow_body = conns[:10], conns[10:20], conns[20:]
    for _, writer in slow_header:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
    async with gw.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
    for _, writer in slow_body:
        writer.write(f"POST /v1/conversations/{conv}/turns HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json"
                     f"\r\ncontent-length: 1000\r\n\r\n{{\"turn_id\": \"".encode())
    for _, writer in slow_header + slow_body:
        await writer.drain()

    async def trickle() -> None:  # a byte every 0.3 s must not extend the header deadline
        for _ in range(20):
            await asyncio.sleep(0.3)
            for reader, writer in slow_header:
                if not reader.at_eof():
                    writer.write(b"X")

    feeder = asyncio.create_task(trickle())
    results = await asyncio.gather(*(_closed(reader, 8.0) for reader, _ in conns), return_exceptions=True)
    assert not feeder.done()  # every connection was dropped while the trickle went on: bytes do not extend it
    feeder.cancel()
    for _, writer in conns:
        writer.close()
    for group, answer in ((idle, b""), (slow_header, b"HTTP/1.1 408"), (slow_body, b"HTTP/1.1 408")):
        for reader, _ in group:
            data = results[conns.index((reader, _))]
            assert isinstance(data, bytes) and data.startswith(answer), data
    async with gw.client() as client:  # and the edge still serves
        assert (await client.get("/healthz")).status_code == 200


async def test_a_kept_alive_connection_is_closed_when_idle(start_gateway: StartGateway) -> None:
    gw = await start_gateway(CHATMESH_EDGE_IDLE_TIMEOUT_S="1")
    url = urlsplit(gw.url)
    assert url.hostname is not None and url.port is not None
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    assert await _closed(reader, 8.0) == b'{"status":"ok"}'  # the body, then closed by the idle timeout
    writer.close()


async def test_a_client_gone_mid_body_is_not_an_error(gateway: Gateway, fake: FakeChat) -> None:
    url = urlsplit(gateway.url)
    assert url.hostname is not None and url.port is not None
    async with gateway.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
    for _ in range(5):
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        writer.write(f"POST /v1/conversations/{conv}/turns HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: 500\r\n\r\n"
                     '{"turn_id": "'.encode())
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
    await asyncio.sleep(0.2)
    async with gateway.client() as client:
        assert (await client.get("/healthz")).status_code == 200
    assert fake.convs[conv].turns == {}


async def test_the_development_identity_refuses_rebound_host_names_and_cross_site_posts(gateway: Gateway) -> None:
    async with gateway.client() as client:
        rebound = await client.get("/v1/conversations", headers={"host": "evil.example"})
        cross_site = await client.post("/v1/conversations", json={}, headers={"origin": "https://evil.example"})
        own_page = await client.post("/v1/conversations", json={}, headers={"origin": gateway.url})
        by_name = await client.get("/v1/conversations", headers={"host": "localhost:8080"})
    assert rebound.status_code == 421 and rebound.json()["error"]["code"] == "misdirected_request"
    assert cross_site.status_code == 403 and cross_site.json()["error"]["code"] == "forbidden_origin"
    assert own_page.status_code == 201 and by_name.status_code == 200


async def test_on_hypercorn_slow_headers_are_dropped_and_a_long_silent_stream_is_not(
        fake_chat: tuple[FakeChat, str], tmp_path: Path, mesh_certs: Path) -> None:
    """hypercorn's read_timeout (once the header bound) bounds every read, so it cut any SSE stream whose client
    sent nothing for that long: with a 1 s header bound, a turn streaming for ~2 s was dropped before its first
    byte. The header and idle bounds are hypercorn's idle timer instead."""
    fake, address = fake_chat
    port = free_port()
    cfg = Config(env={**gateway_env(mesh_certs), "CHATMESH_CHAT_ADDRESS": address, "CHATMESH_DATA_DIR": str(tmp_path),
                      "CHATMESH_GATEWAY_SERVER": "hypercorn", "CHATMESH_SHUTDOWN_GRACE_S": "1",
                      "CHATMESH_EDGE_HEADER_TIMEOUT_S": "1", "CHATMESH_EDGE_IDLE_TIMEOUT_S": "5"})
    stop = asyncio.Event()
    task = asyncio.create_task(serve_hypercorn(cfg, create_app(cfg), port, stop))
    fake.delay_s, fake.chunks = 0.25, ["x"] * 8  # a first delta after 0.25 s, the last after ~2 s
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            await until_listening(client)
            conv = (await client.post("/v1/conversations")).json()["id"]
            started = time.monotonic()
            async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                     json={"turn_id": str(uuid.uuid4()), "content": "x"}) as r:
                events = await collect(r)
            streamed_s = time.monotonic() - started
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
        await writer.drain()
        dropped = await _closed(reader, 8.0)
        writer.close()
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    assert streamed_s > 1.5 and reply_text(events) == "x" * 8  # a stream outlives the header timeout
    assert dropped.startswith(b"HTTP/1.1 408") or dropped == b""  # and a slow header does not


async def test_a_body_of_a_million_empty_arrays_is_refused_before_it_is_parsed(gateway: Gateway) -> None:
    """Issue 30: depth was capped, breadth was not: 1.4 million empty arrays in 4 MiB were parsed on the event
    loop (~1.2 s each). A body is bounded in elements (commas and opening brackets) before it is parsed."""
    wide = '{"turn_id": "%s", "content": "hi", "x": [%s]}' % (uuid.uuid4(), ",".join(["[]"] * 1_390_000))
    assert len(wide) < 4 * 1024 * 1024  # under the byte cap: the element bound refuses it
    async with gateway.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        for path, status in ((f"/v1/conversations/{conv}/turns", 413), ("/v1/session", 413),
                             ("/openai/v1/chat/completions", 400)):  # the OpenAI surface answers in its own shape
            r = await client.post(path, content=wide, headers={"content-type": "application/json"})
            assert r.status_code == status and "more than 200,000 JSON elements" in r.text, (path, r.text)
        # a body under the bound is parsed as before
        fine = await client.post(f"/v1/conversations/{conv}/turns", json={
            "turn_id": str(uuid.uuid4()), "content": ", ".join(["word"] * 2_000)})
        assert fine.status_code == 200


async def test_unauthenticated_requests_are_limited_per_address_and_forwarded_for_is_believed_from_proxies_only(
        start_gateway: StartGateway, tmp_path: Path) -> None:
    """Issue 30: uvicorn believed X-Forwarded-For from 127.0.0.1, so a client behind a local proxy chose its own
    address for the per-address limits. Now only CHATMESH_FORWARDED_ALLOW_IPS' proxies are believed."""
    accounts = accounts_for(Config(env={"CHATMESH_DATA_DIR": str(tmp_path)}))
    await accounts.create_tables()
    await accounts.create_user("ann")
    key = await accounts.create_key("ann")
    await accounts.close()
    direct = await start_gateway(CHATMESH_AUTH="required", CHATMESH_LIMIT_UNAUTHENTICATED_PER_MINUTE="3")
    async with direct.client() as client:
        codes = [(await client.get("/v1/conversations", headers={"x-forwarded-for": f"198.51.100.{i}"})).status_code
                 for i in range(4)]
        assert codes == [401, 401, 401, 429]  # one address (the TCP peer's), whatever the header says
        login = await client.post("/v1/session", json={"username": "ann", "password": "x"})
        assert login.status_code == 429 and "unauthenticated requests per minute" in login.json()["error"]["message"]
        assert 1 <= int(login.headers["retry-after"]) <= 20
        # an authenticated request is not counted, and not refused
        assert (await client.get("/v1/conversations", headers={"authorization": f"Bearer {key}"})).status_code == 200
    proxied = await start_gateway(CHATMESH_AUTH="required", CHATMESH_LIMIT_UNAUTHENTICATED_PER_MINUTE="3",
                                  CHATMESH_FORWARDED_ALLOW_IPS="127.0.0.1", CHATMESH_KEY_PEPPER="a-test-pepper")
    async with proxied.client() as client:
        codes = [(await client.get("/v1/conversations", headers={"x-forwarded-for": f"198.51.100.{i % 2}"})
                  ).status_code for i in range(6)]
        assert codes == [401] * 6  # two clients behind the proxy, three each


async def test_a_public_gateway_on_loopback_does_not_start_with_the_development_pepper(
        fake_chat: tuple[FakeChat, str], tmp_path: Path, mesh_certs: Path) -> None:
    cfg = Config(env={**gateway_env(mesh_certs), "CHATMESH_CHAT_ADDRESS": fake_chat[1],
                      "CHATMESH_DATA_DIR": str(tmp_path), "CHATMESH_PUBLIC_ORIGIN": "https://chat.example.com"})
    with pytest.raises(StartupRefused, match="CHATMESH_KEY_PEPPER at the development default"):
        server_for(cfg, create_app(cfg), port=free_port())
