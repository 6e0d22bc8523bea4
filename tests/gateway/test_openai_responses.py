"""The Responses API held against the Open Responses specification (tests/gateway/openresponses_spec.py: its
required fields, event order and error shapes), idempotency across conversations, and background responses
whose streams resume on another gateway; against real gateways in front of the in-test ChatService."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import Gateway, StartGateway, http
from tests.gateway.fake_chat import FakeChat
from tests.gateway.openai_client import MODEL, sdk
from chatmesh.gateway.openai import ids
from tests.gateway.openresponses_spec import check_compacted, check_error, check_response, check_stream


async def post(client: httpx.AsyncClient, body: dict[str, Any], **headers: str) -> httpx.Response:
    return await client.post("/openai/v1/responses", json={"model": MODEL, **body}, headers=headers)


async def test_the_object_has_every_required_field_and_retrieve_returns_it(gateway: Gateway, key: str,
                                                                          start_gateway: StartGateway) -> None:
    async with http(gateway, key) as c:
        made = await post(c, {"input": [
            {"type": "message", "role": "user", "content": "My name is Alice."},
            {"type": "message", "role": "assistant", "content": "Hello Alice!", "phase": "final_answer"},
            {"type": "message", "role": "user", "content": "What is my name?"}],
            "metadata": {"ticket": "T-1"}, "safety_identifier": "user-7", "prompt_cache_key": "k1",
            "truncation": "auto", "presence_penalty": 0, "frequency_penalty": 0, "top_logprobs": 0,
            "service_tier": "auto", "reasoning": None, "max_output_tokens": 64})
        assert made.status_code == 200, made.text
        body = made.json()
    check_response(body)
    assert body["status"] == "completed" and body["completed_at"] >= body["created_at"]
    assert (body["temperature"], body["top_p"]) == (0.0, 1.0)  # chat's defaults (CHATMESH_TEMPERATURE, _TOP_P)
    assert body["metadata"] == {"ticket": "T-1"} and body["safety_identifier"] == "user-7"
    assert body["prompt_cache_key"] == "k1" and body["truncation"] == "auto" and body["max_output_tokens"] == 64
    assert body["output"][0]["content"][0]["text"] == "Hello, world."
    other = await start_gateway()  # another gateway answers the same object
    async with http(other, key) as c:
        got = (await c.get(f"/openai/v1/responses/{body['id']}")).json()
    assert got == body


async def test_an_assistant_messages_phase_is_kept_and_listed_back(gateway: Gateway, key: str,
                                                                    start_gateway: StartGateway) -> None:
    """Open Responses' `phase` on an assistant input message is stored with the message (records.py) and sent
    back when the conversation's items are listed, from any gateway; a fork of the response keeps it too."""
    async with http(gateway, key) as c:
        made = await post(c, {"input": [
            {"type": "message", "role": "user", "content": "Plan it."},
            {"type": "message", "role": "assistant", "content": "Looking into it.", "phase": "commentary"},
            {"type": "message", "role": "assistant", "content": "Step one, then two.", "phase": "final_answer"},
            {"type": "message", "role": "assistant", "content": "No phase here."},
            {"type": "message", "role": "user", "content": "Go on."}]})
        assert made.status_code == 200, made.text
        conv = made.json()["conversation"]["id"]
        seeded = await c.post("/openai/v1/conversations", json={"items": [
            {"type": "message", "role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant", "content": "Thinking.", "phase": "commentary"}]})
        assert seeded.status_code == 200, seeded.text
        first = await post(c, {"input": "A", "previous_response_id": made.json()["id"]})
        forked = await post(c, {"input": "B", "previous_response_id": made.json()["id"]})  # made is not last now
        fork = forked.json()["conversation"]["id"]
        assert first.json()["conversation"]["id"] == conv != fork
    other = await start_gateway()
    async with http(other, key) as c:
        listed = (await c.get(f"/openai/v1/conversations/{conv}/items", params={"order": "asc"})).json()["data"]
        created = (await c.get(f"/openai/v1/conversations/{seeded.json()['id']}/items",
                               params={"order": "asc"})).json()["data"]
        in_fork = (await c.get(f"/openai/v1/conversations/{fork}/items", params={"order": "asc"})).json()["data"]
    phases = [("user", None), ("assistant", "commentary"), ("assistant", "final_answer"), ("assistant", None),
              ("user", None), ("assistant", None)]
    assert [(i["role"], i.get("phase")) for i in listed] == phases + [("user", None), ("assistant", None)]
    assert [(i["role"], i.get("phase")) for i in in_fork] == phases + [("user", None), ("assistant", None)]
    assert [i.get("phase") for i in created] == [None, "commentary"]


async def test_the_stream_follows_the_specification(gateway: Gateway, key: str) -> None:
    async with http(gateway, key) as c:
        async with c.stream("POST", "/openai/v1/responses",
                            json={"model": MODEL, "input": "Hi", "stream": True, "temperature": 0.5}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = (await r.aread()).decode()
    events = check_stream(raw)
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["temperature"] == 0.5
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello, world."


async def test_retrieve_reports_the_status_create_did(gateway: Gateway, key: str, fake: FakeChat,
                                                      start_gateway: StartGateway) -> None:
    """A reply cut by max_output_tokens is `incomplete`, on create and on every later GET (from any gateway)."""
    fake.finish_reason = "length"
    client = sdk(gateway.url, key)
    made = await client.responses.create(model=MODEL, input="Go on and on", max_output_tokens=16)
    assert made.status == "incomplete" and made.incomplete_details is not None
    assert made.incomplete_details.reason == "max_output_tokens"
    fake.finish_reason = "stop"  # what chat's stored turn says no longer matters: create's word is kept
    for gw in (gateway, await start_gateway()):
        got = await sdk(gw.url, key).responses.retrieve(made.id)
        assert got.status == "incomplete" and got.incomplete_details is not None
        assert got.incomplete_details.reason == "max_output_tokens"
        assert got.max_output_tokens == 16


async def test_a_key_reused_for_another_request_is_a_409_the_sdk_does_not_retry(gateway: Gateway, key: str,
                                                                                fake: FakeChat) -> None:
    client = sdk(gateway.url, key, max_retries=3)
    first = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A"}],
                                                 extra_headers={"Idempotency-Key": "k-1"})
    again = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A"}],
                                                 extra_headers={"Idempotency-Key": "k-1"})
    assert again.id == first.id and fake.generations == 1  # a retry replays
    with pytest.raises(openai.ConflictError) as conflict:  # another first message: another conversation
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "B"}],
                                             extra_headers={"Idempotency-Key": "k-1"})
    assert conflict.value.response.headers["x-should-retry"] == "false"
    check_error(conflict.value.response.json())
    assert conflict.value.code == "idempotency_key_reused" and fake.generations == 1
    with pytest.raises(openai.ConflictError):  # the same key on the Responses path
        await client.responses.create(model=MODEL, input="C", extra_headers={"Idempotency-Key": "k-1"})
    made = await client.responses.create(model=MODEL, input="C", extra_headers={"Idempotency-Key": "k-2"})
    with pytest.raises(openai.ConflictError):
        await client.responses.create(model=MODEL, input="D", extra_headers={"Idempotency-Key": "k-2"})
    assert (await client.responses.create(model=MODEL, input="C", extra_headers={"Idempotency-Key": "k-2"})
            ).id == made.id
    assert fake.generations == 2


async def test_a_key_reused_for_another_request_is_a_409_when_nothing_is_stored_too(gateway: Gateway, key: str,
                                                                                     fake: FakeChat) -> None:
    """store=false and a front end's background task keep no conversation, so a retry cannot replay; a key
    reused for other content is still refused (qa2: it was a 200 and a new reply)."""
    client = sdk(gateway.url, key, max_retries=3)
    await client.responses.create(model=MODEL, input="E", store=False, extra_headers={"Idempotency-Key": "k-3"})
    with pytest.raises(openai.ConflictError) as conflict:
        await client.responses.create(model=MODEL, input="F", store=False, extra_headers={"Idempotency-Key": "k-3"})
    assert conflict.value.response.headers["x-should-retry"] == "false"
    task = {"Idempotency-Key": "k-4", "X-OpenWebUI-Task": "title_generation"}
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "G"}], extra_headers=task)
    with pytest.raises(openai.ConflictError):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "H"}],
                                             extra_headers=task)
    assert fake.generations == 2


async def test_errors_have_the_specification_shape_and_say_not_to_retry(gateway: Gateway, key: str) -> None:
    async with http(gateway, key) as c:
        for body, param in (({"input": "x", "temperature": 9}, "temperature"),
                            ({"input": "x", "frobnicate": 1}, "frobnicate"),
                            ({"input": "x", "background": True, "store": False}, "background"),
                            ({"input": [{"role": "user", "content": "x", "phase": "commentary"}]},
                             "input[0].phase"),
                            ({"input": {"x": "an object is neither a string nor a list"}}, "input"),
                            ({"input": 7}, "input")):
            r = await post(c, body)
            assert r.status_code == 400 and r.headers["x-should-retry"] == "false", r.text
            check_error(r.json())
            assert r.json()["error"]["param"] == param
        r = await c.get("/openai/v1/responses/resp_" + "0" * 64)
        assert r.status_code == 404 and r.headers["x-should-retry"] == "false"
        check_error(r.json())


async def _events(c: httpx.AsyncClient, url: str, *, stop_after: int | None = None) -> str:
    """A stream's body; with `stop_after`, the connection is dropped once that many events have arrived."""
    raw = ""
    async with c.stream("GET", url) if not url.startswith("{") else c.stream(
            "POST", "/openai/v1/responses", json=json.loads(url)) as r:
        assert r.status_code == 200, await r.aread()
        async for chunk in r.aiter_text():
            raw += chunk
            if stop_after is not None and raw.count("\n\n") >= stop_after:
                cut = raw.split("\n\n")[:stop_after]
                return "\n\n".join(cut) + "\n\n"
    return raw


async def test_a_background_stream_dropped_and_resumed_on_another_gateway_joins_into_one_stream(
        gateway: Gateway, key: str, fake: FakeChat, start_gateway: StartGateway) -> None:
    fake.chunks = ["One", " two", " three", " four", " five", " six", " seven", " eight."]
    fake.delay_s = 0.05
    other = await start_gateway()
    async with http(gateway, key) as a, http(other, key) as b:
        start = json.dumps({"model": MODEL, "input": "Count", "background": True, "stream": True})
        head = check_stream(await _events(a, start, stop_after=6), done=False)
        assert head[0]["response"]["background"] is True and head[0]["response"]["status"] == "in_progress"
        rid, last = head[0]["response"]["id"], head[-1]["sequence_number"]
        # the turn goes on without its client; the stream resumes on another gateway after the last event seen
        tail = check_stream(await _events(b, f"/openai/v1/responses/{rid}?stream=true&starting_after={last}"),
                            first_sequence=last + 1)
        whole = check_stream(await _events(a, f"/openai/v1/responses/{rid}?stream=true"))
        assert head + tail == whole
        assert whole[-1]["type"] == "response.completed"
        text = "".join(e["delta"] for e in whole if e["type"] == "response.output_text.delta")
        assert text == "".join(fake.chunks) and fake.generations == 1
        got = (await b.get(f"/openai/v1/responses/{rid}")).json()
        check_response(got)
        assert got == whole[-1]["response"]
    # the SDK resumes the same way
    events = [e async for e in await sdk(other.url, key).responses.retrieve(rid, stream=True, starting_after=last)]
    assert [e.sequence_number for e in events] == [e["sequence_number"] for e in tail]


async def test_a_background_response_runs_without_its_client_and_cancels(gateway: Gateway, key: str,
                                                                         fake: FakeChat) -> None:
    client = sdk(gateway.url, key)
    fake.chunks = ["a", "b", "c"]
    made = await client.responses.create(model=MODEL, input="Quick", background=True)
    assert made.status == "in_progress" and made.background
    for _ in range(100):
        got = await client.responses.retrieve(made.id)
        if got.status != "in_progress":
            break
        await asyncio.sleep(0.05)
    assert got.status == "completed" and got.output_text == "abc" and got.completed_at is not None
    fake.chunks, fake.delay_s = ["x"] * 400, 0.02
    slow = await client.responses.create(model=MODEL, input="Slow", background=True)
    cancelled = await client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled"
    assert (await client.responses.retrieve(slow.id)).status == "cancelled"


async def test_only_a_background_response_streams_again(gateway: Gateway, key: str) -> None:
    client = sdk(gateway.url, key)
    made = await client.responses.create(model=MODEL, input="Hi")
    with pytest.raises(openai.BadRequestError):
        await client.responses.retrieve(made.id, stream=True)


async def test_websocket_mode_is_refused_with_a_clear_400(gateway: Gateway) -> None:
    host, port = gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /openai/v1/responses HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    await writer.drain()
    answer = (await asyncio.wait_for(reader.read(4096), 10)).decode()
    writer.close()
    status, _, rest = answer.partition("\r\n")
    assert status.split()[1] == "400", answer
    body = json.loads(rest.split("\r\n\r\n", 1)[1])
    check_error(body)
    assert body["error"]["code"] == "websocket_not_supported"


async def test_compaction_returns_the_stored_summary_and_continues_from_it(gateway: Gateway, key: str,
                                                                          fake: FakeChat) -> None:
    client = sdk(gateway.url, key)
    first = await client.responses.create(model=MODEL, input="Remember seven")
    second = await client.responses.create(model=MODEL, input="And blue", previous_response_id=first.id)
    assert second.conversation is not None
    async with http(gateway, key) as c:
        r = await c.post("/openai/v1/responses/compact", json={"model": MODEL, "previous_response_id": second.id})
        assert r.status_code == 200, r.text
        raw = r.json()
    check_compacted(raw)
    compacted = await client.responses.compact(model=MODEL, previous_response_id=second.id)
    kinds = [item.type for item in compacted.output]
    assert kinds == ["message", "message", "compaction"]  # the user messages, then the compaction
    conv_id = ids.parse_conversation(second.conversation.id)
    stored = fake.summaries[conv_id]
    item = raw["output"][-1]
    assert item["summary"] == stored[0] and stored[1] == len(fake.convs[conv_id].messages) - 1
    assert raw["usage"]["input_tokens"] == 11 and compacted.usage.input_tokens == 0  # the second found it stored
    # sent back with a new message, the compaction continues that conversation where it summarised
    sent_back: Any = [*[i.model_dump(warnings=False) for i in compacted.output],
                      {"role": "user", "content": "What did I say?"}]
    follow = await client.responses.create(model=MODEL, input=sent_back,
                                           context_management=[{"type": "compaction", "compact_threshold": 500}])
    assert follow.conversation is not None and follow.conversation.id == second.conversation.id
    assert [m.content for m in fake.convs[conv_id].messages][-2:] == ["What did I say?", "Hello, world."]
    assert fake.options[-1].compact_threshold_tokens == 500
    # the old point has moved on: compacting it is refused (422), nothing stored
    with pytest.raises(openai.UnprocessableEntityError):
        await client.responses.compact(model=MODEL, previous_response_id=second.id)
    # a history of the client's own is compacted as a conversation of its own
    own = await client.responses.compact(model=MODEL, input=[{"role": "user", "content": "Hi"},
                                                             {"role": "assistant", "content": "Hello"}])
    assert [i.type for i in own.output] == ["message", "compaction"]
    async with http(gateway, key) as c:
        for body, param in (({"previous_response_id": second.id, "instructions": "Be brief"}, "instructions"),
                            ({"input": [{"role": "user", "content": "Hi"}]}, "input[0]"),
                            ({"input": [{"type": "compaction", "encrypted_content": "forged"},
                                        {"role": "user", "content": "Hi"}]}, "input[1]"),
                            ({"input": [{"type": "compaction", "encrypted_content": "forged"}]}, "input"),
                            ({"input": {"x": "an object"}}, "input")):
            r = await c.post("/openai/v1/responses/compact", json={"model": MODEL, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = await post(c, {"input": [{"type": "compaction", "encrypted_content": "forged"},
                                     {"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
