"""The edge's routes against a FakeChat over real gRPC: the skeleton's three routes, their errors, the SSE
relay (ids, headers, heartbeats, disconnect cancels the turn), and the loopback rule of the local identity."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from chatmesh.gateway.app import StartupRefused, check_bind
from chatmesh.mesh.config import Config
from tests.gateway.conftest import Gateway, StartGateway
from tests.gateway.fake_chat import FakeChat
from tests.gateway.sse_client import collect, frames, reply_text


async def new_conversation(gw: Gateway) -> str:
    async with gw.client() as client:
        r = await client.post("/v1/conversations")
    assert r.status_code == 201, r.text
    conv_id: str = r.json()["id"]
    return conv_id


async def test_turn_streams_started_deltas_completed_then_get_shows_messages(gateway: Gateway) -> None:
    conv = await new_conversation(gateway)
    turn = str(uuid.uuid4())
    async with gateway.client() as client:
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": turn, "content": "hi"}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-accel-buffering"] == "no"
            assert "no-transform" in r.headers["cache-control"]
            events = await collect(r)
        got = await client.get(f"/v1/conversations/{conv}")
    assert [e.event for e in events] == ["turn.started"] + ["turn.delta"] * 4 + ["turn.completed"]
    assert [e.id for e in events] == [str(i) for i in range(1, 7)]
    assert events[0].data["turn_id"] == turn
    assert reply_text(events) == "Hello, world."
    assert events[-1].data["usage"] == {"prompt_tokens": 7, "cached_prompt_tokens": 2, "output_tokens": 4}
    assert got.status_code == 200
    messages = got.json()["messages"]
    assert [(m["role"], m["content"]) for m in messages] == [("user", "hi"), ("assistant", "Hello, world.")]
    assert [m["index"] for m in messages] == [0, 1]


async def test_unknown_conversation_is_404_json(gateway: Gateway) -> None:
    async with gateway.client() as client:
        missing = str(uuid.uuid4())
        for r in (await client.get(f"/v1/conversations/{missing}"),
                  await client.get("/v1/conversations/not-a-uuid"),
                  await client.post(f"/v1/conversations/{missing}/turns",
                                    json={"turn_id": str(uuid.uuid4()), "content": "x"})):
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "not_found"
            assert r.json()["error"]["message"]


@pytest.mark.parametrize(("body", "field"), [
    ({"content": "hi"}, "turn_id"),
    ({"turn_id": "nope", "content": "hi"}, "turn_id"),
    ({"turn_id": 12, "content": "hi"}, "turn_id"),
    ({"turn_id": "T", "content": ""}, "content"),
    ({"turn_id": "T", "content": "   "}, "content"),
    ({"turn_id": "T", "content": 5}, "content"),
    ({"turn_id": "T"}, "content"),
    ("{not json", "body"),
    ("[1, 2]", "body"),
])
async def test_bad_turn_body_is_400_naming_the_field_and_stores_nothing(
        gateway: Gateway, fake: FakeChat, body: object, field: str) -> None:
    conv = await new_conversation(gateway)
    async with gateway.client() as client:
        if isinstance(body, dict):
            if body.get("turn_id") == "T":
                body["turn_id"] = str(uuid.uuid4())
            r = await client.post(f"/v1/conversations/{conv}/turns", json=body)
        else:
            assert isinstance(body, str)
            r = await client.post(f"/v1/conversations/{conv}/turns", content=body,
                                  headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_argument"
    assert field in error["message"]
    assert fake.convs[conv].messages == []


async def test_turn_id_reused_with_other_content_is_409(gateway: Gateway) -> None:
    conv = await new_conversation(gateway)
    turn = str(uuid.uuid4())
    async with gateway.client() as client:
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": turn, "content": "one"}) as r:
            await collect(r)
        again = await client.post(f"/v1/conversations/{conv}/turns", json={"turn_id": turn, "content": "two"})
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": turn, "content": "one"}) as r:
            replay = await collect(r)
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "conflict"
    assert reply_text(replay) == "Hello, world."


async def test_client_disconnect_cancels_the_grpc_call(gateway: Gateway, fake: FakeChat) -> None:
    fake.delay_s = 0.3
    fake.chunks = ["x"] * 50
    conv = await new_conversation(gateway)
    turn = str(uuid.uuid4())
    async with gateway.client() as client:
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": turn, "content": "go"}) as r:
            async for frame in frames(r):
                if frame.event == "turn.delta":
                    break
    for _ in range(100):
        if turn in fake.cancelled:
            break
        await asyncio.sleep(0.05)
    assert fake.cancelled == [turn]


async def test_heartbeat_while_the_model_is_silent(start_gateway: StartGateway, fake: FakeChat) -> None:
    gw = await start_gateway(CHATMESH_SSE_HEARTBEAT_S="0.1")
    fake.delay_s = 0.45
    fake.chunks = ["a"]
    conv = await new_conversation(gw)
    async with gw.client() as client:
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": str(uuid.uuid4()), "content": "go"}) as r:
            seen = [f async for f in frames(r)]
    assert any(f.comment == "keepalive" for f in seen)
    assert seen[-1].event == "turn.completed"


async def test_unknown_route_and_method_are_json_errors(gateway: Gateway) -> None:
    async with gateway.client() as client:
        missing = await client.get("/v1/nothing")
        wrong = await client.put("/v1/conversations")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


def test_local_identity_refuses_a_public_address() -> None:
    check_bind(Config(env={"CHATMESH_HOST": "127.0.0.1"}))
    check_bind(Config(env={"CHATMESH_HOST": "::1"}))
    check_bind(Config(env={"CHATMESH_HOST": "0.0.0.0", "CHATMESH_AUTH": "required",
                           "CHATMESH_KEY_PEPPER": "a-secret-of-our-own"}))
    with pytest.raises(StartupRefused, match="CHATMESH_KEY_PEPPER"):  # the production guard (issue 17)
        check_bind(Config(env={"CHATMESH_HOST": "0.0.0.0", "CHATMESH_AUTH": "required"}))
    with pytest.raises(StartupRefused, match="loopback"):
        check_bind(Config(env={"CHATMESH_HOST": "0.0.0.0"}))


async def test_sigterm_like_exit_drains_then_ends_open_streams(start_gateway: StartGateway, fake: FakeChat) -> None:
    gw = await start_gateway()
    fake.delay_s = 0.5
    fake.chunks = ["x"] * 100
    conv = await new_conversation(gw)
    turn = str(uuid.uuid4())
    async with gw.client() as client:
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": turn, "content": "go"}) as r:
            stopping: asyncio.Task[None] | None = None
            async for frame in frames(r):
                if frame.event == "turn.started":
                    stopping = asyncio.create_task(gw.stop())
            assert stopping is not None
            await stopping
    assert gw.task.done() and gw.task.exception() is None
    for _ in range(40):
        if turn in fake.cancelled:
            break
        await asyncio.sleep(0.05)
    assert fake.cancelled == [turn]
