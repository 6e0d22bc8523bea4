"""The edge keeps its word through a shutdown and a cut stream (issue 33): a draining gateway refuses every new
request, kept-alive connections' included, with a retryable 503 (Retry-After, Connection: close) while the
streams it has finish; a stream cut before any of the reply reached its client releases its turn rather than
leave an empty stopped reply to replay. Real uvicorn, the fake ChatService over mutual TLS."""

from __future__ import annotations

import asyncio
import uuid

import httpx

from chatmesh.gateway.drain import Drain
from tests.gateway.conftest import Gateway, StartGateway
from tests.gateway.fake_chat import FakeChat
from tests.gateway.sse_client import collect, frames, reply_text


async def _conversation(client: httpx.AsyncClient) -> str:
    return str((await client.post("/v1/conversations")).json()["id"])


async def test_a_draining_gateway_refuses_new_requests_on_kept_alive_connections(gateway: Gateway,
                                                                                  fake: FakeChat) -> None:
    async with gateway.client(limits=httpx.Limits(max_connections=1)) as client:
        conv = await _conversation(client)  # the connection is now open and kept alive
        drain: Drain = gateway.app.state.drain
        drain.begin()
        turn = await client.post(f"/v1/conversations/{conv}/turns", json={"turn_id": str(uuid.uuid4()),
                                                                           "content": "hi"})
        assert turn.status_code == 503 and turn.json()["error"]["code"] == "unavailable"
        assert turn.headers["retry-after"] == "1" and turn.headers["connection"] == "close"
        openai = await client.post("/openai/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert openai.status_code == 503 and openai.json()["error"]["type"] == "server_error"
        assert "x-should-retry" not in openai.headers  # the SDK retries it by itself
        assert (await client.get("/healthz")).status_code == 503  # load balancers take it out
    assert fake.generations == 0 and drain.refused == 3


async def test_shutdown_finishes_open_streams_and_refuses_turns_arriving_meanwhile(
        start_gateway: StartGateway, fake: FakeChat) -> None:
    gateway = await start_gateway(CHATMESH_SHUTDOWN_GRACE_S="5")
    fake.delay_s, fake.chunks = 0.05, ["w "] * 20  # about a second of reply
    async with gateway.client() as streaming, gateway.client(limits=httpx.Limits(max_connections=1)) as other:
        conv = await _conversation(streaming)
        await other.get("/healthz")  # a kept-alive connection, as a browser or the SDK holds one
        async with streaming.stream("POST", f"/v1/conversations/{conv}/turns",
                                    json={"turn_id": str(uuid.uuid4()), "content": "long"}) as r:
            it = frames(r)
            first = await anext(it)
            assert first.event == "turn.started"
            stopping = asyncio.create_task(gateway.stop())  # SIGTERM
            while not gateway.app.state.drain.draining:
                await asyncio.sleep(0.01)
            late = await other.post(f"/v1/conversations/{conv}/turns", json={"turn_id": str(uuid.uuid4()),
                                                                              "content": "late"})
            rest = [f async for f in it if f.comment is None]
        await stopping
    assert late.status_code == 503 and late.headers["connection"] == "close"
    assert rest[-1].event == "turn.completed" and reply_text(rest) == "w " * 20  # not cut at the grace
    assert fake.generations == 1 and fake.cancelled == []


async def test_a_stream_cut_before_any_text_releases_its_turn(gateway: Gateway, fake: FakeChat) -> None:
    fake.delay_s = 0.3  # the first text comes after the response headers
    async with gateway.client() as client:
        conv = await _conversation(client)
        turn = str(uuid.uuid4())
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": turn, "content": "hi"}) as r:
            assert r.status_code == 200  # headers in; the client goes before any delta
        for _ in range(100):
            if fake.cancelled:
                break
            await asyncio.sleep(0.02)
        assert fake.released == [(turn, True)] and fake.cancelled == [turn]  # released first, then cancelled
        fake.delay_s = 0.0
        later = str(uuid.uuid4())
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": later, "content": "again"}) as r:
            events = []
            async for frame in frames(r):
                events.append(frame)
                if frame.event == "turn.delta":
                    break  # gone after text reached it: a plain stop, no release
        for _ in range(100):
            if later in fake.cancelled or fake.generations and len(fake.cancelled) > 1:
                break
            await asyncio.sleep(0.02)
    assert [t for t, _ in fake.released] == [turn]


async def test_a_finished_stream_releases_nothing(gateway: Gateway, fake: FakeChat) -> None:
    async with gateway.client() as client:
        conv = await _conversation(client)
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": str(uuid.uuid4()), "content": "hi"}) as r:
            events = await collect(r)
    assert events[-1].event == "turn.completed" and fake.released == [] and fake.cancelled == []


async def test_a_turns_sampling_options_reach_chat_and_bad_ones_are_400(gateway: Gateway, fake: FakeChat) -> None:
    async with gateway.client() as client:
        conv = await _conversation(client)
        ok = await client.post(f"/v1/conversations/{conv}/turns", json={
            "turn_id": str(uuid.uuid4()), "content": "hi",
            "options": {"temperature": 0.7, "seed": 7, "max_tokens": 40, "stop": ["END"]}})
        assert ok.status_code == 200
        sent = fake.options[-1]
        assert (round(sent.temperature, 3), sent.seed, sent.max_tokens, list(sent.stop)) == (0.7, 7, 40, ["END"])
        assert not sent.HasField("top_p")
        bads: list[object] = [{"temperature": "hot"}, {"seed": -1}, {"beam": 4}, {"stop": [1]}, [],
                              {"max_tokens": 2 ** 31}, {"max_tokens": -2 ** 40}]  # past int32: was a 500
        for bad in bads:
            r = await client.post(f"/v1/conversations/{conv}/turns", json={
                "turn_id": str(uuid.uuid4()), "content": "hi", "options": bad})
            assert r.status_code == 400, bad
