"""The log-leak test (issue 17): a real mesh over mutual TLS, every service its own process logging at debug, and
a second edge on hypercorn beside uvicorn. The test drives every error path it can reach from outside, with a
marker in the password, the API keys, the cookies and the message text:

- at the edge: malformed, truncated, deeply nested, oversized and ill-typed bodies; clients that go away mid-body,
  send headers or a body too slowly, or send a malformed HTTP request; unknown routes and methods; wrong and
  malformed credentials; a client gone mid-stream (native SSE and the OpenAI surface);
- over gRPC, straight at chat, store, engine and moderation: requests their cores refuse (bad ids, a forged owner
  token, a message over the size policy, a prompt for another model), and bytes that are no protobuf at all;
- failing backends: the engine, moderation, the store and finally chat killed, each followed by turns that need it.

Then it asserts that no line any process wrote (each process's stdout and stderr, every log file) holds any marker
or the real key and session cookie, and that the error paths were driven (their answers are checked, and the
logs name the failures by type)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from chatmesh.gateway.cli import accounts_for
from chatmesh.mesh import identity as ident
from chatmesh.mesh import settings
from chatmesh.mesh.config import Config
from chatmesh.mesh.trust import certs_folder
from chatmesh.mesh.up import Mesh, http_answers
from chatmesh.v1 import (chat_pb2, chat_pb2_grpc, generate_pb2, generate_pb2_grpc, moderate_pb2,
                         moderate_pb2_grpc, store_pb2, store_pb2_grpc)
from tests.conftest import free_port
from tests.e2e.conftest import mesh_env
from tests.trust import channel_as

pytestmark = pytest.mark.slow

MARK = "zqleak" + secrets.token_hex(5)  # one string in every secret and text below, found by a plain search
PASSWORD = f"pw-{MARK}-password"
MESSAGE = f"please summarise {MARK}, the message text"
COOKIE = f"{MARK}-cookie"
BAD_KEY = f"cmk_{MARK}"
USER = "leaky"
SURPRISES: list[str] = []  # answers other than expected, reported after the leak check (one run shows them all)


def expect(ok: bool, what: object) -> None:
    if not ok:
        SURPRISES.append(repr(what)[:300])


@dataclass
class LeakMesh:
    mesh: Mesh
    urls: list[str]  # the uvicorn edge, then the hypercorn edge
    key: str

    def client(self, url: str, **kwargs: object) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, timeout=30, **kwargs)  # type: ignore[arg-type]

    def keyed(self, url: str) -> httpx.AsyncClient:
        return self.client(url, headers={"authorization": f"Bearer {self.key}", "cookie": f"theme={COOKIE}"})


def _gateway_process(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    full = {**os.environ, **env, "CHATMESH_GATEWAY_PORT": str(port), "CHATMESH_GATEWAY_SERVER": "hypercorn",
            "CHATMESH_GATEWAY_METRICS_PORT": "0", "CHATMESH_OWNER_TOKEN_ADDRESS": ""}
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "chatmesh.mesh.cli", "serve", "gateway"], env=full,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


async def _make_user(env: dict[str, str]) -> str:
    accounts = accounts_for(Config(env=env))
    try:
        await accounts.create_tables()
        await accounts.create_user(USER, PASSWORD)
        return await accounts.create_key(USER, label="log-leak test")
    finally:
        await accounts.close()


@pytest.fixture(scope="module")
def leaky(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LeakMesh]:
    tmp = tmp_path_factory.mktemp("leaks")
    env = mesh_env(tmp / "data", CHATMESH_AUTH="required", CHATMESH_MESH_PLAINTEXT="false",
                   CHATMESH_LOG_LEVEL="debug", CHATMESH_OWNER_TOKEN_ADDRESS=f"127.0.0.1:{free_port()}",
                   CHATMESH_EDGE_HEADER_TIMEOUT_S="1", CHATMESH_EDGE_BODY_TIMEOUT_S="1",
                   CHATMESH_SIM_STEP_MS="30", CHATMESH_MAX_REPLY_TOKENS="40")
    key = asyncio.run(_make_user(env))
    mesh = Mesh(env=env, log_dir=tmp / "logs", start_timeout_s=180)
    mesh.start()
    hyper, hyper_url = _gateway_process(env, mesh.log_dir / "gateway-hypercorn.log")
    try:
        for _ in range(600):
            if http_answers(hyper_url + "/healthz"):
                break
            assert hyper.poll() is None, "the hypercorn edge exited"
            asyncio.run(asyncio.sleep(0.1))
        yield LeakMesh(mesh, [mesh.gateway_url, hyper_url], key)
    finally:
        hyper.terminate()
        try:
            hyper.wait(10)
        except subprocess.TimeoutExpired:
            hyper.kill()
            hyper.wait()
        mesh.stop()


# ---- the edge ---------------------------------------------------------------------------------------------------

async def raw(url: str, request: bytes, *, close_after_s: float | None = None, read_s: float = 5.0) -> bytes:
    """Sends `request` byte for byte; closes after `close_after_s` (a client gone mid-request) or reads the
    answer until the server closes or `read_s` passes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    data = b""
    try:
        if close_after_s is not None:
            await asyncio.sleep(close_after_s)
        else:
            try:
                data = await asyncio.wait_for(reader.read(65536), read_s)
            except TimeoutError:
                pass
    finally:
        writer.close()
    return data


def nested(depth: int, leaf: str) -> str:
    return "[" * depth + json.dumps(leaf) + "]" * depth


async def new_conversation(client: httpx.AsyncClient) -> str:
    r = await client.post("/v1/conversations", json={"title": f"title {MARK}"})
    assert r.status_code == 201, r.text
    conv: str = r.json()["id"]
    return conv


async def login_paths(url: str, lm: LeakMesh) -> dict[str, str]:
    """Login's error paths and a successful login; returns the session's secrets (cookie values, CSRF token)."""
    async with lm.client(url, headers={"cookie": f"chatmesh_session={COOKIE}; other={COOKIE}"}) as c:
        bodies = [
            '{"username": "%s", "password": "%s"' % (USER, PASSWORD),  # truncated JSON
            '{"username": "%s", "password": %s}' % (USER, nested(1000, PASSWORD)),
            '{"username": "%s", "password": %s}' % (USER, nested(100_000, PASSWORD)),
            '{"username": %s, "password": "%s"}' % (json.dumps([PASSWORD]), PASSWORD),  # ill-typed
            "username=%s&password=%s" % (USER, PASSWORD),  # not JSON at all
            '{"username": "%s", "password": "%s"}' % (USER, PASSWORD + "\udcff"),  # a lone surrogate, raw
            '{"username": "%s", "password": "%s\\udcff"}' % (USER, PASSWORD),  # ... and escaped
        ]
        for body in bodies:
            r = await c.post("/v1/session", content=body.encode("utf-8", "surrogatepass"),
                             headers={"content-type": "application/json"})
            expect(r.status_code == 400, (body[:80], r.status_code, r.text))
        wrong = await c.post("/v1/session", json={"username": USER, "password": PASSWORD + "-wrong"})
        nobody = await c.post("/v1/session", json={"username": f"u{MARK}", "password": PASSWORD})
        bad_key = await c.post("/v1/session", json={"api_key": BAD_KEY})
        expect((wrong.status_code, nobody.status_code, bad_key.status_code) == (401, 401, 401),
               ("login", wrong.status_code, nobody.status_code, bad_key.status_code))
    async with lm.client(url) as c:
        ok = await c.post("/v1/session", json={"username": USER, "password": PASSWORD})
        assert ok.status_code == 201, ok.text
        csrf = ok.json()["csrf_token"]
        cookies = {name: value for name, value in c.cookies.items()}
        no_csrf = await c.post("/v1/conversations", json={})  # a state change without the CSRF header
        wrong_csrf = await c.post("/v1/conversations", json={}, headers={"x-csrf-token": f"{MARK}"})
        expect(no_csrf.status_code == 403 and wrong_csrf.status_code == 403, ("csrf", no_csrf, wrong_csrf))
        conv = await c.post("/v1/conversations", json={}, headers={"x-csrf-token": csrf})
        assert conv.status_code == 201
        out = await c.delete("/v1/session", headers={"x-csrf-token": csrf})
        expect(out.status_code in (200, 204), ("logout", out.status_code))
    return {**{f"cookie:{k}": v for k, v in cookies.items()}, "csrf": csrf}


async def credential_paths(url: str, lm: LeakMesh) -> None:
    async with lm.client(url) as c:
        for headers in ({"authorization": f"Bearer {BAD_KEY}"}, {"authorization": f"Basic {MARK}"},
                        {"authorization": f"Bearer {lm.key}{MARK}"}, {"cookie": f"chatmesh_session={COOKIE}"},
                        {"authorization": f"Bearer {MARK} {MARK}"}):
            r = await c.get("/v1/conversations", headers=headers)
            expect(r.status_code == 401, (headers, r.status_code))
            r = await c.post("/openai/v1/chat/completions", headers=headers,
                             json={"model": "x", "messages": [{"role": "user", "content": MESSAGE}]})
            expect(r.status_code == 401, ("openai", headers, r.status_code))


async def body_paths(url: str, lm: LeakMesh) -> None:
    async with lm.keyed(url) as c:
        conv = await new_conversation(c)
        turns = f"/v1/conversations/{conv}/turns"
        turn_id = str(uuid.uuid4())
        bad = [
            '{"turn_id": "%s", "content": "%s"' % (turn_id, MESSAGE),  # truncated
            '{"turn_id": "%s", "content": %s}' % (turn_id, nested(1000, MESSAGE)),
            '{"turn_id": "%s", "content": %s}' % (turn_id, nested(100_000, MESSAGE)),
            '{"turn_id": "%s", "content": "%s"}' % (MARK, MESSAGE),  # not a UUID
            '{"turn_id": "%s", "content": %s}' % (turn_id, json.dumps({"text": MESSAGE})),  # ill-typed
            '{"turn_id": "%s", "content": "%s\\ud800"}' % (turn_id, MESSAGE),  # a lone surrogate
            MESSAGE,
        ]
        for body in bad:
            r = await c.post(turns, content=body, headers={"content-type": "application/json"})
            expect(r.status_code == 400, (body[:80], r.status_code, r.text[:200]))
        huge = await c.post(turns, json={"turn_id": str(uuid.uuid4()), "content": (MESSAGE + " ") * 50_000})
        expect(huge.status_code in (400, 413), huge.status_code)
        too_long = await c.post(turns, json={"turn_id": str(uuid.uuid4()), "content": (MESSAGE + " ") * 30_000})
        expect(too_long.status_code == 400 and "message_too_long" in too_long.text, ("too long", too_long.status_code))
        openai_bad = ['{"model": "m", "messages": [{"role": "user", "content": "%s"}' % MESSAGE,
                      '{"model": "m", "messages": %s}' % nested(1000, MESSAGE),
                      '{"model": "%s", "messages": [{"role": "%s", "content": "%s"}]}' % (MARK, MARK, MESSAGE),
                      '{"model": "m", "input": %s}' % json.dumps({"x": MESSAGE})]
        for body in openai_bad:
            r = await c.post("/openai/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            expect(400 <= r.status_code < 500, (body[:80], r.status_code))
            r = await c.post("/openai/v1/responses", content=body, headers={"content-type": "application/json"})
            expect(400 <= r.status_code < 500, (body[:80], r.status_code))


async def route_paths(url: str, lm: LeakMesh) -> None:
    async with lm.keyed(url) as c:
        for method, path in (("GET", f"/v1/{MARK}?q={MARK}"), ("POST", f"/v1/conversations/{MARK}/turns"),
                             ("GET", f"/v1/conversations/{uuid.uuid4()}"), ("DELETE", f"/v1/conversations/{MARK}"),
                             ("PUT", "/v1/session"), ("GET", f"/openai/v1/responses/{MARK}"),
                             ("GET", f"/openai/v1/conversations/{MARK}/items"), ("GET", f"/static/{MARK}.js"),
                             ("GET", f"/v1/conversations/{uuid.uuid4()}/turns/{MARK}/events"),
                             ("POST", f"/v1/conversations/{uuid.uuid4()}/turns/{uuid.uuid4()}/stop"),
                             ("GET", f"/v1/usage?days={MARK}"), ("GET", f"/v1/conversations?page_token={MARK}")):
            r = await c.request(method, path, json={"content": MESSAGE} if method in ("POST", "PUT") else None,
                                headers={"x-request-id": MARK, "referer": f"https://{MARK}.example/"})
            expect(r.status_code < 500, (method, path, r.status_code))


def _turn_head(lm: LeakMesh, conv: str, length: int) -> bytes:
    return (f"POST /v1/conversations/{conv}/turns HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"authorization: Bearer {lm.key}\r\ncookie: theme={COOKIE}\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n").encode()


async def connection_paths(url: str, lm: LeakMesh) -> None:
    """Clients gone mid-body, too slow with headers or body, and malformed HTTP; each carries the key."""
    async with lm.keyed(url) as c:
        conv = await new_conversation(c)
    partial = ('{"turn_id": "%s", "content": "%s' % (uuid.uuid4(), MESSAGE)).encode()
    gone = [raw(url, _turn_head(lm, conv, 5000) + partial, close_after_s=0.2) for _ in range(10)]
    slow_body = raw(url, _turn_head(lm, conv, 5000) + partial, read_s=4)
    slow_head = raw(url, f"GET /v1/conversations HTTP/1.1\r\nHost: x\r\nauthorization: Bearer {lm.key}\r\n"
                         f"cookie: s={COOKIE}\r\n".encode(), read_s=4)
    malformed = [
        raw(url, f"GET /v1/conversations HTTP/1.1\r\nHost: x\r\nauthorization: Bearer {lm.key}\r\n"
                 f"bad header {MARK}\r\n\r\n".encode()),
        raw(url, f"GET /{MARK} HTTP/9.9\r\nauthorization: Bearer {lm.key}\r\n\r\n".encode()),
        raw(url, f"\x00\x01{MARK}\r\n\r\n".encode()),
        raw(url, _turn_head(lm, conv, 10).replace(b"content-length: 10", f"content-length: {MARK}".encode())
            + partial),
        raw(url, (f"POST /v1/conversations/{conv}/turns HTTP/1.1\r\nHost: x\r\nauthorization: Bearer {lm.key}\r\n"
                  "transfer-encoding: chunked\r\n\r\nzz\r\n" + MESSAGE + "\r\n").encode()),
    ]
    answers = await asyncio.gather(*gone, slow_body, slow_head, *malformed)
    expect(answers[10].startswith(b"HTTP/1.1 408"), ("slow body", url, answers[10][:60]))  # the body deadline
    for answer in answers[12:]:
        expect(not answer or answer.startswith(b"HTTP/1.1 4"), ("malformed", url, answer[:60]))


async def stream_paths(url: str, lm: LeakMesh) -> None:
    """Turns that complete, turns whose client goes away after the first delta, a stopped turn."""
    async with lm.keyed(url) as c:
        conv = await new_conversation(c)
        turns = f"/v1/conversations/{conv}/turns"
        async with c.stream("POST", turns, json={"turn_id": str(uuid.uuid4()), "content": MESSAGE}) as r:
            assert r.status_code == 200
            body = (await r.aread()).decode()
        expect("turn.completed" in body, ("completed", body[-300:]))
        for _ in range(3):
            async with c.stream("POST", turns, json={"turn_id": str(uuid.uuid4()), "content": MESSAGE}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line == "event: turn.delta":
                        break
        turn_id = str(uuid.uuid4())
        async with c.stream("POST", turns, json={"turn_id": turn_id, "content": MESSAGE}) as r:
            async for line in r.aiter_lines():
                if line == "event: turn.delta":
                    stop = await c.post(f"{turns}/{turn_id}/stop")
                    expect(stop.status_code in (200, 202, 204, 409), stop.status_code)
                    break
        model = (await c.get("/openai/v1/models")).json()["data"][0]["id"]
        async with c.stream("POST", "/openai/v1/chat/completions", json={
                "model": model, "stream": True,
                "messages": [{"role": "user", "content": MESSAGE}]}) as r:
            expect(r.status_code == 200, ("openai stream", r.status_code))
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
        r = await c.post("/openai/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": MESSAGE}]})
        expect(r.status_code == 200, ("completion", r.status_code, r.text[:200]))
        conversation = await c.get(f"/v1/conversations/{conv}")
        assert MARK in conversation.text  # the text is stored and served: only the logs must not hold it


# ---- gRPC, straight at the services -----------------------------------------------------------------------------

LEAKY_METADATA = (("authorization", f"Bearer {MARK}"), ("x-leak", MARK), ("chatmesh-owner-token", f"x.{MARK}.y"))


async def _refused(call: object) -> grpc.StatusCode:
    try:
        result = await call  # type: ignore[misc]
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def _stream_refused(call: object) -> grpc.StatusCode:
    try:
        async for _ in call:  # type: ignore[attr-defined]
            pass
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def grpc_paths(lm: LeakMesh, owner: str) -> None:
    cfg = lm.mesh.cfg
    certs = certs_folder(cfg)
    conv, turn = str(uuid.uuid4()), str(uuid.uuid4())
    chat_addr, store_addr = cfg[settings.CHAT_ADDRESS], cfg[settings.STORE_ADDRESS]
    engine_addr, moderation_addr = cfg[settings.ENGINE_ADDRESS], cfg[settings.MODERATION_ADDRESS]
    garbage = b"\x0a\xff\xff\xff\x0f" + MARK.encode() + b"\x12\x80"
    codes: dict[str, grpc.StatusCode] = {}
    async with (channel_as(certs, ident.client("dev"), chat_addr, "chat", owner_tokens=True) as to_chat,
                channel_as(certs, ident.client("dev"), chat_addr, "chat") as to_chat_no_token,
                channel_as(certs, ident.service("chat"), store_addr, "store", owner_tokens=True) as to_store,
                channel_as(certs, ident.service("chat"), store_addr, "store") as to_store_no_token,
                channel_as(certs, ident.service("chat"), engine_addr, "engine", owner_tokens=True) as to_engine,
                channel_as(certs, ident.service("chat"), moderation_addr, "moderation") as to_moderation,
                channel_as(certs, ident.client("dev"), store_addr, "store") as wrong_peer):
        chat = chat_pb2_grpc.ChatServiceStub(to_chat)
        send = chat_pb2.SendTurnRequest
        codes["chat bad conversation id"] = await _stream_refused(chat.SendTurn(
            send(owner_id=owner, conversation_id=MARK, turn_id=turn, content=MESSAGE), metadata=LEAKY_METADATA[:2]))
        codes["chat unknown conversation"] = await _stream_refused(chat.SendTurn(
            send(owner_id=owner, conversation_id=conv, turn_id=turn, content=MESSAGE)))
        codes["chat bad turn id"] = await _stream_refused(chat.SendTurn(
            send(owner_id=owner, conversation_id=conv, turn_id=MARK, content=MESSAGE)))
        codes["chat too long"] = await _stream_refused(chat.SendTurn(
            send(owner_id=owner, conversation_id=conv, turn_id=turn, content=(MESSAGE + " ") * 40_000)))
        codes["chat forged token"] = await _stream_refused(chat_pb2_grpc.ChatServiceStub(to_chat_no_token).SendTurn(
            send(owner_id=owner, conversation_id=conv, turn_id=turn, content=MESSAGE), metadata=LEAKY_METADATA))
        codes["chat no protobuf"] = await _stream_refused(to_chat_no_token.unary_stream(
            "/chatmesh.v1.ChatService/SendTurn", request_serializer=None, response_deserializer=None)(
            garbage, metadata=LEAKY_METADATA))
        codes["chat no protobuf, unary"] = await _refused(to_chat_no_token.unary_unary(
            "/chatmesh.v1.ChatService/GetConversation", request_serializer=None, response_deserializer=None)(
            garbage, metadata=LEAKY_METADATA))
        store = store_pb2_grpc.StoreServiceStub(to_store)
        begin = store_pb2.BeginTurnRequest
        codes["store bad ids"] = await _refused(store.BeginTurn(
            begin(owner_id=owner, conversation_id=MARK, turn_id=MARK, fingerprint=MARK, content=MESSAGE,
                  lease_holder=MARK), metadata=LEAKY_METADATA[:2]))
        codes["store unknown conversation"] = await _refused(store.BeginTurn(
            begin(owner_id=owner, conversation_id=conv, turn_id=turn, fingerprint=MARK, content=MESSAGE,
                  lease_holder="t")))
        codes["store too long"] = await _refused(store.BeginTurn(
            begin(owner_id=owner, conversation_id=conv, turn_id=turn, fingerprint=MARK,
                  content=(MESSAGE + " ") * 40_000, lease_holder="t")))
        codes["store forged token"] = await _refused(store_pb2_grpc.StoreServiceStub(to_store_no_token).BeginTurn(
            begin(owner_id=owner, conversation_id=conv, turn_id=turn, content=MESSAGE), metadata=LEAKY_METADATA))
        codes["store wrong peer"] = await _refused(store_pb2_grpc.StoreServiceStub(wrong_peer).BeginTurn(
            begin(owner_id=owner, conversation_id=conv, turn_id=turn, content=MESSAGE)))
        codes["store no protobuf"] = await _refused(to_store_no_token.unary_unary(
            "/chatmesh.v1.StoreService/BeginTurn", request_serializer=None, response_deserializer=None)(
            garbage, metadata=LEAKY_METADATA))
        engine = generate_pb2_grpc.GenerateServiceStub(to_engine)
        codes["engine other model"] = await _stream_refused(engine.Generate(generate_pb2.GenerateRequest(
            request_id=MARK, conversation_id=conv, turn_id=turn, prompt_token_ids=[1, 2, 3], max_tokens=4,
            owner_id=owner,
            expected_model=generate_pb2.ModelIdentity(model_id=MARK, tokenizer_digest=f"sha256:{MARK}")),
            metadata=LEAKY_METADATA[:2]))
        maybe = await _stream_refused(engine.Generate(generate_pb2.GenerateRequest(
            request_id=MARK, conversation_id=MARK, turn_id=MARK, prompt_token_ids=[-5, 10**9], max_tokens=-1,
            owner_id=owner)))
        codes["engine no protobuf"] = await _stream_refused(to_engine.unary_stream(
            "/chatmesh.v1.GenerateService/Generate", request_serializer=None, response_deserializer=None)(
            garbage, metadata=LEAKY_METADATA))
        moderation = moderate_pb2_grpc.ModerateServiceStub(to_moderation)
        verdict = await moderation.CheckInput(moderate_pb2.CheckInputRequest(text=MESSAGE, conversation_id=MARK),
                                              metadata=LEAKY_METADATA[:2])
        assert verdict is not None
        codes["moderation too long"] = await _refused(moderation.CheckInput(
            moderate_pb2.CheckInputRequest(text=(MESSAGE + " ") * 40_000, conversation_id=conv)))
        codes["moderation no protobuf"] = await _refused(to_moderation.unary_unary(
            "/chatmesh.v1.ModerateService/CheckInput", request_serializer=None, response_deserializer=None)(
            garbage, metadata=LEAKY_METADATA))
    assert maybe is not None  # an engine may run or refuse a request with nonsense ids; either way no leak
    refused = {name: code for name, code in codes.items() if code != grpc.StatusCode.OK}
    expect(set(refused) == set(codes), {name: code for name, code in codes.items() if name not in refused})


# ---- failing backends --------------------------------------------------------------------------------------------

async def turn_status(lm: LeakMesh, url: str, conv: str) -> tuple[int, str]:
    async with lm.keyed(url) as c:
        try:
            async with c.stream("POST", f"/v1/conversations/{conv}/turns",
                                json={"turn_id": str(uuid.uuid4()), "content": MESSAGE}) as r:
                return r.status_code, (await r.aread()).decode(errors="replace")
        except httpx.TimeoutException:
            return 0, "no answer in 30 s"


KILLED = ("engine", "moderation", "store", "chat")  # in this order, by backend_failures


async def backend_failures(lm: LeakMesh) -> dict[str, list[tuple[int, str]]]:
    convs = {}
    for url in lm.urls:
        async with lm.keyed(url) as c:
            convs[url] = await new_conversation(c)
    seen: dict[str, list[tuple[int, str]]] = {}
    for name in KILLED:
        proc = lm.mesh.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        seen[name] = [await turn_status(lm, url, convs[url]) for url in lm.urls]
        async with lm.keyed(lm.urls[0]) as c:
            listing = await c.get("/v1/conversations")
            if name in ("store", "chat"):
                expect(listing.status_code >= 500, (name, listing.status_code))
    return seen


def _failed(answer: tuple[int, str]) -> bool:
    status, body = answer
    return status >= 500 or "turn.failed" in body or "event: error" in body


async def test_no_log_line_of_any_service_holds_a_secret_or_the_message(leaky: LeakMesh) -> None:
    session_secrets: dict[str, str] = {}
    for url in leaky.urls:
        session_secrets.update(await login_paths(url, leaky))
        await credential_paths(url, leaky)
        await body_paths(url, leaky)
        await route_paths(url, leaky)
        await connection_paths(url, leaky)
        await stream_paths(url, leaky)
    async with leaky.keyed(leaky.urls[0]) as c:
        owner = (await c.get("/v1/session")).json()["user"]
    await grpc_paths(leaky, owner)
    failures = await backend_failures(leaky)
    for name, answers in failures.items():
        expect(all(_failed(a) for a in answers), (name, answers))
    # Every process has ended before the scan, so every log holds every line written: those killed above wrote
    # theirs line by line (stderr is line-buffered), and the rest exit here by themselves (code 0, not killed).
    codes = leaky.mesh.stop()
    assert all(code == 0 for name, code in codes.items() if name not in KILLED), codes

    files = sorted(p for p in leaky.mesh.log_dir.rglob("*") if p.is_file())
    assert {p.stem for p in files} >= {"store", "moderation", "engine", "router", "chat", "gateway",
                                       "gateway-hypercorn"}
    secrets_found: list[str] = []
    needles = {"marker": MARK, "api key": leaky.key, **session_secrets}
    lines = 0
    for path in files:
        for number, line in enumerate(path.read_bytes().decode(errors="replace").splitlines(), 1):
            lines += 1
            for what, needle in needles.items():
                if needle and needle in line:
                    secrets_found.append(f"{path.name}:{number} holds the {what}: {line[:300]}")
    assert not secrets_found, "\n".join(secrets_found[:20])
    text = "".join(p.read_text(errors="replace") for p in files)
    assert '"error_type"' in text  # errors were logged, by type
    for path in files:  # log lines are JSON (no Python traceback printer wrote around the pipeline)
        for line in path.read_text(errors="replace").splitlines():
            if line.strip():
                json.loads(line)
    assert lines > 100
    assert not SURPRISES, "\n".join(SURPRISES)
