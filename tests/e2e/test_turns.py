"""One turn end to end through the real mesh: HTTP + SSE at the gateway, gRPC behind it, each service a process."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable

import grpc
import httpx
import pytest

from chatmesh.mesh import identity as ident
from chatmesh.mesh.up import Mesh
from chatmesh.v1 import chat_pb2, chat_pb2_grpc, store_pb2, store_pb2_grpc
from tests.e2e.conftest import SseEvent, channel, read_sse


def send_turn(client: httpx.Client, conv: str, content: str, turn_id: str | None = None
              ) -> tuple[list[SseEvent], list[float]]:
    """Sends a turn and reads its SSE stream; returns the events and when each arrived."""
    body = {"turn_id": turn_id or str(uuid.uuid4()), "content": content}
    events, times = [], []
    with client.stream("POST", f"/v1/conversations/{conv}/turns", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for event in read_sse(resp):
            events.append(event)
            times.append(time.monotonic())
    return events, times


def new_conversation(client: httpx.Client) -> str:
    resp = client.post("/v1/conversations", json={})
    assert resp.status_code == 201, resp.text
    conv: str = resp.json()["id"]
    uuid.UUID(conv)
    return conv


def test_two_turns_stream_and_store_in_order(mesh: Mesh) -> None:
    with httpx.Client(base_url=mesh.gateway_url, timeout=60) as client:
        conv = new_conversation(client)
        first, times = send_turn(client, conv, "Hello there, who are you?")
        kinds = [e.event for e in first]
        assert kinds[0] == "turn.started"
        assert kinds[-1] == "turn.completed"
        deltas = [i for i, k in enumerate(kinds) if k == "turn.delta"]
        assert len(deltas) >= 2, kinds
        # Deltas arrive while the reply is still being generated, not all at the end.
        assert times[-1] - times[deltas[0]] > 0.05
        reply1 = "".join(first[i].data["text"] for i in deltas)
        usage1 = first[-1].data["usage"]
        assert usage1["output_tokens"] > 0 and reply1

        second, _ = send_turn(client, conv, "Tell me more.")
        assert second[-1].event == "turn.completed"
        usage2 = second[-1].data["usage"]
        # The second prompt carries the first turn: it is longer than the first prompt plus its reply, and
        # the engine served at least the first prompt's full blocks from its prefix cache.
        assert usage2["prompt_tokens"] > usage1["prompt_tokens"] + usage1["output_tokens"]
        assert usage2["cached_prompt_tokens"] >= usage1["prompt_tokens"] - 32

        got = client.get(f"/v1/conversations/{conv}")
        assert got.status_code == 200
        messages = got.json()["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
        assert messages[0]["content"] == "Hello there, who are you?"
        assert messages[1]["content"] == reply1
        assert messages[2]["content"] == "Tell me more."


@pytest.mark.parametrize("body, field", [
    ({"content": "hi"}, "turn_id"),
    ({"turn_id": "not-a-uuid", "content": "hi"}, "turn_id"),
    ({"turn_id": str(uuid.uuid4()), "content": ""}, "content"),
    ({"turn_id": str(uuid.uuid4()), "content": 42}, "content"),
])
def test_bad_turn_input_is_400_naming_the_field_and_stores_nothing(mesh: Mesh, body: dict[str, object],
                                                                    field: str) -> None:
    with httpx.Client(base_url=mesh.gateway_url, timeout=30) as client:
        conv = new_conversation(client)
        resp = client.post(f"/v1/conversations/{conv}/turns", json=body)
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert field in error["message"]
        assert client.get(f"/v1/conversations/{conv}").json()["messages"] == []


def test_malformed_json_and_unknown_conversation(mesh: Mesh) -> None:
    with httpx.Client(base_url=mesh.gateway_url, timeout=30) as client:
        conv = new_conversation(client)
        resp = client.post(f"/v1/conversations/{conv}/turns", content=b"{not json",
                           headers={"content-type": "application/json"})
        assert resp.status_code == 400
        assert "JSON" in resp.json()["error"]["message"] or "json" in resp.json()["error"]["message"]
        missing = str(uuid.uuid4())
        resp = client.post(f"/v1/conversations/{missing}/turns", json={"turn_id": str(uuid.uuid4()), "content": "x"})
        assert resp.status_code == 404
        assert resp.json()["error"]["code"]
        assert client.get(f"/v1/conversations/{missing}").status_code == 404


async def test_grpc_callers_get_invalid_argument_or_not_found_never_unknown(mesh: Mesh) -> None:
    async with channel(mesh, "chat", ident.GATEWAY, owner_tokens=True) as chat_ch, \
            channel(mesh, "store", ident.CHAT, owner_tokens=True) as store_ch:
        chat = chat_pb2_grpc.ChatServiceStub(chat_ch)
        store = store_pb2_grpc.StoreServiceStub(store_ch)
        cases: list[tuple[Awaitable[object], grpc.StatusCode, str]] = [
            (chat.GetConversation(chat_pb2.GetConversationRequest(owner_id="u1", conversation_id="nope")),
             grpc.StatusCode.INVALID_ARGUMENT, "conversation_id"),
            (chat.GetConversation(chat_pb2.GetConversationRequest(owner_id="u1",
                                                                  conversation_id=str(uuid.uuid4()))),
             grpc.StatusCode.NOT_FOUND, ""),
            (store.ReadConversation(store_pb2.ReadConversationRequest(owner_id="", conversation_id=str(uuid.uuid4()))),
             grpc.StatusCode.INVALID_ARGUMENT, "owner_id"),
        ]
        for call, code, word in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == code, info.value
            assert word in (info.value.details() or "")
        stream = chat.SendTurn(chat_pb2.SendTurnRequest(owner_id="u1", conversation_id=str(uuid.uuid4()),
                                                        turn_id="bad", content="x"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stream:
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "turn_id" in (info.value.details() or "")
