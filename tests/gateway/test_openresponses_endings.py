"""Every way a response ends, held against the Open Responses specification (tests/gateway/openresponses_spec.py):
the stream's every event (a failure's `error` then `response.failed`; a block's and a cancel's
`response.incomplete`), the non-streamed object, the object a cancel answers, a background response's first
object, and `retrieve` from another gateway reporting the status `create` did (issue 28, Deliver 5 and its
Done-when "cover every response object and stream event chatmesh sends"). Against real gateways in front of the
in-test ChatService (`FakeChat.ending` ends a reply failed or blocked)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from chatmesh.v1 import chat_pb2
from tests.gateway.conftest import Gateway, StartGateway, http
from tests.gateway.fake_chat import FakeChat
from tests.gateway.openai_client import MODEL
from tests.gateway.openresponses_spec import check_error, check_response, check_stream


async def streamed(c: httpx.AsyncClient, **body: Any) -> list[dict[str, Any]]:
    async with c.stream("POST", "/openai/v1/responses", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, await r.aread()
        return check_stream((await r.aread()).decode())


async def retrieved(gateway: Gateway, key: str, rid: str) -> dict[str, Any]:
    async with http(gateway, key) as c:
        r = await c.get(f"/openai/v1/responses/{rid}")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    check_response(body)
    return body


async def test_a_failed_reply_streams_an_error_then_response_failed(gateway: Gateway, key: str, fake: FakeChat,
                                                                   start_gateway: StartGateway) -> None:
    fake.ending = chat_pb2.TurnFailed(message="the engine went away", retryable=True)
    async with http(gateway, key) as c:
        events = await streamed(c, input="Hi")
        kinds = [e["type"] for e in events]
        assert kinds[-2:] == ["error", "response.failed"], kinds
        final = events[-1]["response"]
        assert final["status"] == "failed" and final["error"]["code"] and final["completed_at"] is None
        assert final["usage"] is None
        # not streamed: a failed turn is an error of the specification's shape (the SDK may retry it)
        r = await c.post("/openai/v1/responses", json={"model": MODEL, "input": "Hi again"})
        assert r.status_code == 503 and "x-should-retry" not in r.headers, r.text
        check_error(r.json())
    got = await retrieved(await start_gateway(), key, final["id"])
    assert got["status"] == "failed" and got["error"] is not None


async def test_a_blocked_reply_is_incomplete_for_content_filter_on_create_and_retrieve(
        gateway: Gateway, key: str, fake: FakeChat, start_gateway: StartGateway) -> None:
    fake.ending = chat_pb2.TurnBlocked(stage="output", category="violence", reason="policy")
    async with http(gateway, key) as c:
        events = await streamed(c, input="Hi")
        made = await c.post("/openai/v1/responses", json={"model": MODEL, "input": "Hi again"})
    assert events[-1]["type"] == "response.incomplete"
    final, body = events[-1]["response"], made.json()
    assert made.status_code == 200, made.text
    check_response(body)
    other = await start_gateway()
    for answered in (final, body):
        assert answered["status"] == "incomplete" and answered["incomplete_details"] == {"reason": "content_filter"}
        got = await retrieved(other, key, answered["id"])
        assert (got["status"], got["incomplete_details"]) == (answered["status"], answered["incomplete_details"])


async def test_a_cancelled_stream_and_the_cancel_answer_agree_with_retrieve(gateway: Gateway, key: str,
                                                                            fake: FakeChat,
                                                                            start_gateway: StartGateway) -> None:
    fake.chunks, fake.delay_s = ["x "] * 200, 0.02
    async with http(gateway, key) as c:
        raw = ""
        cancelled: dict[str, Any] = {}
        async with c.stream("POST", "/openai/v1/responses",
                            json={"model": MODEL, "input": "Long one", "stream": True}) as r:
            async for chunk in r.aiter_text():
                raw += chunk
                if not cancelled and raw.count("response.output_text.delta") >= 3:
                    rid = check_stream(raw.rsplit("\n\n", 1)[0] + "\n\n", done=False)[0]["response"]["id"]
                    answer = await c.post(f"/openai/v1/responses/{rid}/cancel")
                    assert answer.status_code == 200, answer.text
                    cancelled = answer.json()
        events = check_stream(raw)
    check_response(cancelled)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and final["status"] == cancelled["status"] == "cancelled"
    got = await retrieved(await start_gateway(), key, final["id"])
    assert got["status"] == "cancelled" and got["output"] == final["output"] == cancelled["output"]


async def test_a_background_responses_objects_follow_the_specification(gateway: Gateway, key: str,
                                                                       fake: FakeChat) -> None:
    fake.chunks, fake.delay_s = ["x "] * 200, 0.02
    async with http(gateway, key) as c:
        made = await c.post("/openai/v1/responses", json={"model": MODEL, "input": "Slow", "background": True})
        assert made.status_code == 200, made.text
        body = made.json()
        check_response(body)
        assert body["background"] is True and body["status"] in ("queued", "in_progress")
        running = (await c.get(f"/openai/v1/responses/{body['id']}")).json()
        check_response(running)
        answer = await c.post(f"/openai/v1/responses/{body['id']}/cancel")
        check_response(answer.json())
        assert answer.json()["status"] == "cancelled"
        fake.chunks, fake.delay_s = ["Done."], 0.0
        quick = (await c.post("/openai/v1/responses", json={"model": MODEL, "input": "Quick",
                                                            "background": True})).json()
        for _ in range(100):
            got = (await c.get(f"/openai/v1/responses/{quick['id']}")).json()
            if got["status"] != quick["status"]:
                break
            await asyncio.sleep(0.05)
    check_response(got)
    assert got["status"] == "completed" and got["output"][0]["content"][0]["text"] == "Done."
