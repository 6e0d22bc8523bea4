"""The routes behind the skeleton's: stop, regenerate, attach with Last-Event-ID, list, delete, usage, export,
the OpenAPI document naming every route, and a turn streamed over HTTPS with a CA made here."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import uuid
from pathlib import Path

import httpx
from starlette.routing import Mount, Route, WebSocketRoute

from chatmesh.gateway.app import create_app, route_table, serve_hypercorn
from chatmesh.gateway.openapi import DOCUMENT
from chatmesh.mesh.config import Config
from tests.conftest import free_port, need
from tests.gateway.conftest import Gateway, StartGateway, until_listening
from tests.trust import gateway_env
from tests.gateway.fake_chat import FakeChat
from tests.gateway.sse_client import collect, frames, reply_text


async def test_stop_mid_reply_ends_the_stream_with_turn_stopped(gateway: Gateway, fake: FakeChat) -> None:
    fake.delay_s, fake.chunks = 0.1, ["w "] * 100
    async with gateway.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        turn = str(uuid.uuid4())
        seen = []
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": turn, "content": "x"}) as r:
            async for frame in frames(r):
                seen.append(frame)
                if frame.event == "turn.delta" and len(seen) == 3:
                    stop = await client.post(f"/v1/conversations/{conv}/turns/{turn}/stop")
                    assert stop.json() == {"stopped": True}
        again = await client.post(f"/v1/conversations/{conv}/turns/{turn}/stop")
        messages = (await client.get(f"/v1/conversations/{conv}")).json()["messages"]
    assert seen[-1].event == "turn.stopped"
    assert seen[-1].data["usage"]["prompt_tokens"] == 7
    assert again.json() == {"stopped": False}
    assert messages[-1]["status"] == "stopped" and len(messages[-1]["content"]) < 200


async def test_attach_resumes_after_last_event_id(gateway: Gateway) -> None:
    async with gateway.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        turn = str(uuid.uuid4())
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": turn, "content": "x"}) as r:
            full = await collect(r)
        async with client.stream("GET", f"/v1/conversations/{conv}/turns/{turn}/events",
                                 headers={"last-event-id": "3"}) as r:
            resumed = await collect(r)
        bad = await client.get(f"/v1/conversations/{conv}/turns/{turn}/events", headers={"last-event-id": "x"})
    assert [e.id for e in resumed] == ["4", "5", "6"]
    assert reply_text(full[:3]) + reply_text(resumed) == reply_text(full)
    assert resumed[-1].event == "turn.completed"
    assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["error"]["message"]


async def test_regenerate_streams_a_new_reply(gateway: Gateway, fake: FakeChat) -> None:
    async with gateway.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        turn = str(uuid.uuid4())
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": turn, "content": "x"}) as r:
            await collect(r)
        fake.chunks = ["again"]
        new = str(uuid.uuid4())
        async with client.stream("POST", f"/v1/conversations/{conv}/turns/{turn}/regenerate",
                                 json={"turn_id": new}) as r:
            events = await collect(r)
        missing = await client.post(f"/v1/conversations/{conv}/turns/{turn}/regenerate", json={})
    assert events[0].data["turn_id"] == new
    assert reply_text(events) == "again"
    assert missing.status_code == 400 and "turn_id" in missing.json()["error"]["message"]


async def test_list_delete_usage_export(gateway: Gateway) -> None:
    async with gateway.client() as client:
        first = (await client.post("/v1/conversations", json={"title": "one"})).json()["id"]
        second = (await client.post("/v1/conversations", json={"title": "two"})).json()["id"]
        listed = (await client.get("/v1/conversations", params={"page_size": 10})).json()["conversations"]
        bad_page = await client.get("/v1/conversations", params={"page_size": 0})
        deleted = await client.delete(f"/v1/conversations/{first}")
        gone = await client.get(f"/v1/conversations/{first}")
        usage = (await client.get("/v1/usage", params={"days": 7})).json()
        export = await client.get("/v1/export")
    assert {c["id"] for c in listed} == {first, second}
    assert {c["title"] for c in listed} == {"one", "two"}
    assert bad_page.status_code == 400
    assert deleted.status_code == 204 and gone.status_code == 404
    assert usage["days"][0]["usage"]["prompt_tokens"] == 7
    assert export.headers["content-disposition"].startswith("attachment")
    assert [c["id"] for c in export.json()["conversations"]] == [second]


async def test_body_over_the_cap_is_413(start_gateway: StartGateway) -> None:
    gw = await start_gateway(CHATMESH_MAX_BODY_BYTES="1000")
    async with gw.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        r = await client.post(f"/v1/conversations/{conv}/turns",
                              json={"turn_id": str(uuid.uuid4()), "content": "x" * 2000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


async def test_chat_service_down_is_503(start_gateway: StartGateway) -> None:
    gw = await start_gateway(CHATMESH_CHAT_ADDRESS="127.0.0.1:1")
    async with gw.client() as client:
        r = await client.post("/v1/conversations")
    assert r.status_code == 503
    assert "127.0.0.1" not in r.text


def test_openapi_documents_every_route() -> None:
    documented = {(path, method) for path, item in DOCUMENT["paths"].items()
                  for method in item if method != "parameters"}
    served = set()
    for route in route_table():
        if isinstance(route, (Mount, WebSocketRoute)):  # a WebSocket handshake is no OpenAPI operation
            continue
        assert isinstance(route, Route)
        for method in route.methods or ():
            if method != "HEAD" and route.path not in ("/", "/openapi.json"):
                served.add((route.path, method.lower()))
    assert served == documented


async def test_page_and_openapi_are_served(gateway: Gateway) -> None:
    async with gateway.client() as client:
        page = await client.get("/")
        script = await client.get("/static/app.js")
        doc = await client.get("/openapi.json")
    assert page.status_code == 200 and "<textarea" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert script.status_code == 200 and "readEvents" in script.text
    assert doc.json()["openapi"].startswith("3.1")


def make_ca_and_cert(tmp: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 it signed, made with the openssl command."""
    ca_key, ca, key, csr, cert, ext = (tmp / n for n in ("ca.key", "ca.pem", "key.pem", "server.csr", "cert.pem",
                                                         "ext.cnf"))
    ext.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
            "-subj", "/CN=chatmesh test CA", "-keyout", str(ca_key), "-out", str(ca))
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", str(key), "-out", str(csr))
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-days", "1", "-extfile", str(ext), "-out", str(cert))
    return ca, cert, key


async def test_tls_streams_a_turn_to_a_client_trusting_the_test_ca(start_gateway: StartGateway,
                                                                    tmp_path: Path) -> None:
    need(shutil.which("openssl") is not None, "the openssl command")
    ca, cert, key = make_ca_and_cert(tmp_path)
    gw = await start_gateway("https", CHATMESH_TLS_CERT=str(cert), CHATMESH_TLS_KEY=str(key),
                             CHATMESH_KEY_PEPPER="a-test-pepper")  # TLS: the development pepper is refused
    trusting = ssl.create_default_context(cafile=str(ca))
    async with httpx.AsyncClient(base_url=gw.url, verify=trusting, timeout=10) as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": str(uuid.uuid4()), "content": "x"}) as r:
            events = await collect(r)
    assert reply_text(events) == "Hello, world."
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as untrusting:
        try:
            await untrusting.get("/healthz")
            raise AssertionError("a client without the test CA must not connect")
        except httpx.ConnectError as err:
            assert "CERTIFICATE_VERIFY_FAILED" in str(err)


async def test_http2_over_tls_on_hypercorn(fake_chat: tuple[FakeChat, str], tmp_path: Path, mesh_certs: Path
                                           ) -> None:
    need(shutil.which("openssl") is not None, "the openssl command")
    ca, cert, key = make_ca_and_cert(tmp_path)
    port = free_port()
    cfg = Config(env={**gateway_env(mesh_certs), "CHATMESH_CHAT_ADDRESS": fake_chat[1], "CHATMESH_DATA_DIR": str(tmp_path),
                      "CHATMESH_GATEWAY_SERVER": "hypercorn", "CHATMESH_TLS_CERT": str(cert),
                      "CHATMESH_TLS_KEY": str(key), "CHATMESH_SHUTDOWN_GRACE_S": "1",
                      "CHATMESH_KEY_PEPPER": "a-test-pepper"})
    stop = asyncio.Event()
    task = asyncio.create_task(serve_hypercorn(cfg, create_app(cfg), port, stop))
    try:
        trusting = ssl.create_default_context(cafile=str(ca))
        async with httpx.AsyncClient(base_url=f"https://127.0.0.1:{port}", verify=trusting, http2=True,
                                     timeout=10) as client:
            await until_listening(client)
            conv = (await client.post("/v1/conversations")).json()["id"]
            async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                     json={"turn_id": str(uuid.uuid4()), "content": "x"}) as r:
                assert r.http_version == "HTTP/2"
                events = await collect(r)
        async with httpx.AsyncClient(base_url=f"https://127.0.0.1:{port}", verify=trusting, timeout=10) as h1:
            plain = await h1.get("/healthz")
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    assert reply_text(events) == "Hello, world."
    assert plain.http_version == "HTTP/1.1" and plain.status_code == 200
