"""The OpenAI-compatible surface end to end: the official `openai` SDK against the real edge and mesh (every
service its own process, the `sim` engine): what the issue's Done-when lines ask, with the engine's own
statistics as the witness of how many generations ran and the store's usage as the witness of what was billed."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import ResponseIncompleteEvent

from chatmesh.mesh import settings
from chatmesh.mesh.up import Mesh, http_answers
from chatmesh.v1 import generate_pb2, generate_pb2_grpc
from tests.conftest import free_port
from tests.e2e.conftest import channel, start_mesh
from tests.gateway.openai_client import dropping_proxy, make_key, sdk
from tests.gateway.openresponses_spec import check_response, check_stream

MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the default model profile's id (CHATMESH_MODEL=smollm2)
BLOCK = 32


@pytest.fixture(scope="module")
def openai_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("openai"), CHATMESH_MAX_REPLY_TOKENS="24")
    try:
        yield m
    finally:
        m.stop()


def data_dir(mesh: Mesh) -> Path:
    return Path(mesh.cfg[settings.DATA_DIR])


async def generations(mesh: Mesh) -> int:
    async with channel(mesh, "engine") as ch:
        resp = await generate_pb2_grpc.GenerateServiceStub(ch).GetStats(generate_pb2.GetStatsRequest())
        return resp.stats.generations


async def client_of(mesh: Mesh, name: str) -> openai.AsyncOpenAI:
    return sdk(mesh.gateway_url, await make_key(data_dir(mesh), name))


async def test_models_and_a_second_turn_served_from_the_cache(openai_mesh: Mesh) -> None:
    client = await client_of(openai_mesh, f"u-{uuid.uuid4().hex[:8]}")
    assert [m.id for m in (await client.models.list()).data] == [MODEL]
    first = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}])
    reply = first.choices[0].message.content or ""
    assert reply and first.usage is not None
    stream = await client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                  messages=[{"role": "user", "content": "Hello there"},
                                                            {"role": "assistant", "content": reply},
                                                            {"role": "user", "content": "Tell me more."}])
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    # the history was recognised: the first turn's prompt (its full blocks) came from the prefix cache
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= first.usage.prompt_tokens - BLOCK


async def test_idempotency_key_and_the_sdk_retry_generate_once_and_bill_once(openai_mesh: Mesh) -> None:
    name = f"u-{uuid.uuid4().hex[:8]}"
    client = await client_of(openai_mesh, name)
    before = await generations(openai_mesh)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to three."}]}
    a = await client.chat.completions.create(**body, extra_headers={"Idempotency-Key": "once"})  # type: ignore[call-overload]
    b = await client.chat.completions.create(**body, extra_headers={"Idempotency-Key": "once"})  # type: ignore[call-overload]
    assert a.choices[0].message.content == b.choices[0].message.content
    assert await generations(openai_mesh) == before + 1
    key = await make_key(data_dir(openai_mesh), name)
    port = int(openai_mesh.gateway_url.rsplit(":", 1)[1])
    async with dropping_proxy(port) as (proxy, proxy_port):
        retrying = sdk(f"http://127.0.0.1:{proxy_port}", key, max_retries=2)
        done = await retrying.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Again?"}])
    assert proxy.connections == 2 and done.choices[0].message.content
    assert await generations(openai_mesh) == before + 2
    async with httpx.AsyncClient(base_url=openai_mesh.gateway_url) as http:
        usage = (await http.get("/v1/usage", headers={"authorization": f"Bearer {key}"})).json()
    assert sum(d["turns"] for d in usage["days"]) == 2  # one charge each


async def test_responses_state_stream_retrieve_delete_cancel(openai_mesh: Mesh) -> None:
    client = await client_of(openai_mesh, f"u-{uuid.uuid4().hex[:8]}")
    first = await client.responses.create(model=MODEL, input="Hi", instructions="Be terse.")
    second = await client.responses.create(model=MODEL, input="And?", previous_response_id=first.id,
                                           instructions="Be terse.")
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - BLOCK
    assert second.conversation is not None and first.conversation is not None
    third = await client.responses.create(model=MODEL, input="More", conversation=first.conversation.id)
    assert third.conversation is not None and third.conversation.id == first.conversation.id
    stream = await client.responses.create(model=MODEL, input="Stream it", previous_response_id=third.id,
                                           stream=True)
    events = [e async for e in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    terminal = [e.type for e in events if e.type in ("response.completed", "response.incomplete", "response.failed")]
    # sim replies run to the token cap (CHATMESH_MAX_REPLY_TOKENS=24): incomplete, reason max_output_tokens
    last = events[-1]
    assert events[0].type == "response.created" and terminal == ["response.incomplete"]
    assert isinstance(last, ResponseIncompleteEvent) and last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    got = await client.responses.retrieve(last.response.id)
    assert got.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert got.status == "incomplete" and got.incomplete_details == last.response.incomplete_details  # create's
    await client.responses.delete(got.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(got.id)
    # cancel mid-stream: the partial reply is kept
    stream = await client.responses.create(model=MODEL, input="A long answer, please", stream=True)
    seen = []
    async for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta" and len(seen) == 5:
            assert (await client.responses.cancel(seen[0].response.id)).status == "cancelled"  # type: ignore[union-attr,unused-ignore]
    assert seen[-1].type == "response.incomplete"
    partial = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    kept = await client.responses.retrieve(seen[0].response.id)  # type: ignore[union-attr]
    assert kept.status == "cancelled" and kept.output_text == partial and partial
    assert seen[-1].response.status == kept.status  # the stream's final word is retrieve's


async def test_conversations_crud_and_isolation(openai_mesh: Mesh) -> None:
    alice = await client_of(openai_mesh, f"a-{uuid.uuid4().hex[:8]}")
    bob = await client_of(openai_mesh, f"b-{uuid.uuid4().hex[:8]}")
    conv = await alice.conversations.create(items=[{"type": "message", "role": "user", "content": "Remember 7."}])
    made = await alice.responses.create(model=MODEL, input="Which number?", conversation=conv.id)
    items = await alice.conversations.items.list(conv.id, order="asc")
    assert [i.role for i in items.data] == ["user", "user", "assistant"]  # type: ignore[union-attr]
    for call in (bob.conversations.retrieve(conv.id), bob.responses.retrieve(made.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    assert (await alice.conversations.delete(conv.id)).deleted
    with pytest.raises(openai.NotFoundError):
        await alice.responses.retrieve(made.id)


async def test_frontend_end_users_are_owners_of_their_own(openai_mesh: Mesh) -> None:
    webui = sdk(openai_mesh.gateway_url, await make_key(data_dir(openai_mesh), "webui", frontend=True))
    ask = [{"role": "user", "content": "What should I cook tonight with rice and beans?"}]

    async def as_user(end_user: str) -> openai.types.chat.ChatCompletion:
        return await webui.chat.completions.create(model=MODEL, messages=ask,  # type: ignore[arg-type]
                                                   extra_headers={"X-OpenWebUI-User-Id": end_user})

    ann = await as_user("ann")
    ben = await as_user("ben")  # the very same prompt from another end user
    assert ann.usage is not None and ben.usage is not None and ben.usage.prompt_tokens_details is not None
    # only the shared system prompt's blocks can be a hit across owners (owner-salted cache)
    assert (ben.usage.prompt_tokens_details.cached_tokens or 0) < ann.usage.prompt_tokens - BLOCK
    plain = await client_of(openai_mesh, f"c-{uuid.uuid4().hex[:8]}")
    with pytest.raises(openai.PermissionDeniedError):
        await plain.chat.completions.create(model=MODEL, messages=ask,  # type: ignore[arg-type]
                                            extra_headers={"X-OpenWebUI-User-Id": "ann"})


async def test_bad_input_is_a_400_and_stores_nothing(openai_mesh: Mesh) -> None:
    client = await client_of(openai_mesh, f"u-{uuid.uuid4().hex[:8]}")
    # tools are served since issue 28: a tool without a name, or a tool_choice naming no tool, is what is refused
    extras: list[dict[str, object]] = [{"tools": [{"type": "function", "function": {"parameters": {}}}]},
              {"tools": [{"type": "function", "function": {"name": "f"}}],
               "tool_choice": {"type": "function", "function": {"name": "g"}}},
              {"temperature": "hot"}, {"messages": [{"role": "robot", "content": "hi"}]}, {"messages": []}]
    for extra in extras:
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 extra_body=extra)
    async with httpx.AsyncClient(base_url=openai_mesh.gateway_url) as http:
        listed = await http.get("/v1/conversations", headers={"authorization": f"Bearer {client.api_key}"})
    assert listed.json()["conversations"] == []


async def test_a_seeded_history_passes_input_moderation(openai_mesh: Mesh) -> None:
    """A history chatmesh does not hold seeds a new conversation; its user messages are input-checked like the
    new message (they reach the model in every later prompt): a blocked one refuses the request, naming it, as a
    Conversations API create does, before anything is stored or any engine runs."""
    client = await client_of(openai_mesh, f"u-{uuid.uuid4().hex[:8]}")
    before = await generations(openai_mesh)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\] was blocked by moderation") as refused:
        await client.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "Please charge my card 4111 1111 1111 1111, expiry 12/29."},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "What is a good name for a cat?"}])
    assert refused.value.response.headers["x-should-retry"] == "false"
    async with httpx.AsyncClient(base_url=openai_mesh.gateway_url, timeout=30,
                                 headers={"authorization": f"Bearer {client.api_key}"}) as native:
        assert (await native.get("/v1/conversations")).json()["conversations"] == []  # nothing stored
    assert await generations(openai_mesh) == before, "a blocked seeded message reached an engine"
    clean = await client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "What is a good name for a cat?"}])
    assert clean.choices[0].finish_reason in ("stop", "length") and clean.choices[0].message.content
    assert await generations(openai_mesh) == before + 1


async def test_racing_requests_with_one_history_append_it_once(openai_mesh: Mesh) -> None:
    """Two requests resending the same stored history at once, each with its own next message: the stored
    conversation takes exactly one of them (expect_last_turn_id, checked on the claim's own context); the other
    is answered in a conversation of its own, seeded with the history. Neither is lost, neither appends twice."""
    client = await client_of(openai_mesh, f"u-{uuid.uuid4().hex[:8]}")
    first = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Start here"}])
    history: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Start here"},
        {"role": "assistant", "content": first.choices[0].message.content or ""}]
    before = await generations(openai_mesh)
    a, b = await asyncio.gather(*(client.chat.completions.create(
        model=MODEL, messages=[*history, {"role": "user", "content": text}]) for text in ("Path A", "Path B")))
    assert a.choices[0].message.content and b.choices[0].message.content
    assert await generations(openai_mesh) == before + 2
    headers = {"authorization": f"Bearer {client.api_key}"}
    async with httpx.AsyncClient(base_url=openai_mesh.gateway_url, headers=headers) as http:
        listed = (await http.get("/v1/conversations")).json()["conversations"]
        views = [(await http.get(f"/v1/conversations/{c['id']}")).json()["messages"] for c in listed]
    contents = sorted([m["content"] for m in v if m["role"] == "user"] for v in views)
    assert contents == [["Start here", "Path A"], ["Start here", "Path B"]], contents
    # each continues where it was recorded: the next turn of either path lands in its own conversation
    follow = await client.chat.completions.create(model=MODEL, messages=[
        *history, {"role": "user", "content": "Path B"}, {"role": "assistant", "content": b.choices[0].message.content},
        {"role": "user", "content": "Path B, next"}])
    assert follow.choices[0].message.content
    async with httpx.AsyncClient(base_url=openai_mesh.gateway_url, headers=headers) as http:
        assert len((await http.get("/v1/conversations")).json()["conversations"]) == 2


@contextlib.asynccontextmanager
async def another_gateway(mesh: Mesh) -> AsyncIterator[str]:
    """A second gateway process of the mesh (its own ports; the same chat service and gateway database)."""
    port = free_port()
    proc = mesh._spawn("gateway", name=f"gateway-{port}", env={
        "CHATMESH_GATEWAY_PORT": str(port), "CHATMESH_GATEWAY_METRICS_PORT": str(free_port()),
        "CHATMESH_OWNER_TOKEN_ADDRESS": f"127.0.0.1:{free_port()}"})
    url = mesh.gateway_url.rsplit(":", 1)[0] + f":{port}"
    try:
        deadline = time.monotonic() + 60
        while not await asyncio.to_thread(http_answers, url + "/healthz"):
            assert proc.poll() is None and time.monotonic() < deadline, "the second gateway did not start"
            await asyncio.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)


async def _stream_text(client: httpx.AsyncClient, method: str, url: str, *, stop_after: int | None = None,
                       **kwargs: object) -> str:
    raw = ""
    async with client.stream(method, url, **kwargs) as r:  # type: ignore[arg-type]
        assert r.status_code == 200, await r.aread()
        async for chunk in r.aiter_text():
            raw += chunk
            if stop_after is not None and raw.count("\n\n") >= stop_after:
                return "\n\n".join(raw.split("\n\n")[:stop_after]) + "\n\n"  # the client goes away here
    return raw


async def test_a_background_stream_cut_and_resumed_on_another_gateway_is_one_stream(openai_mesh: Mesh) -> None:
    """Done-when: a background response streamed, the connection dropped, the stream resumed from another
    gateway with starting_after, and the events joined are exactly the events of one uninterrupted stream (a
    reader that stayed on through the live turn, and a replay of the stored one). The chat service cuts the
    turn's deltas differently for each reader (live engine flushes, stored progress); the events do not."""
    key = await make_key(data_dir(openai_mesh), f"bg-{uuid.uuid4().hex[:8]}")
    auth = {"authorization": f"Bearer {key}"}
    async with another_gateway(openai_mesh) as other, \
            httpx.AsyncClient(base_url=openai_mesh.gateway_url, headers=auth, timeout=60) as a, \
            httpx.AsyncClient(base_url=other, headers=auth, timeout=60) as b:
        body = {"model": MODEL, "input": "Tell me a long story about a lighthouse", "background": True,
                "stream": True}
        head = check_stream(await _stream_text(a, "POST", "/openai/v1/responses", json=body, stop_after=7),
                            done=False)
        rid, last = head[0]["response"]["id"], head[-1]["sequence_number"]
        assert head[-1]["type"] == "response.output_text.delta"
        live = asyncio.create_task(_stream_text(b, "GET", f"/openai/v1/responses/{rid}?stream=true"))
        tail = check_stream(await _stream_text(
            b, "GET", f"/openai/v1/responses/{rid}?stream=true&starting_after={last}"), first_sequence=last + 1)
        uninterrupted = check_stream(await live)
        replayed = check_stream(await _stream_text(a, "GET", f"/openai/v1/responses/{rid}?stream=true"))
        assert head + tail == uninterrupted == replayed
        final = replayed[-1]["response"]
        assert final["status"] == "incomplete" and final["output"][0]["content"][0]["text"]  # the 24-token cap
        got = (await b.get(f"/openai/v1/responses/{rid}")).json()
        check_response(got)
        assert got == final
    # the SDK picks the stream up the same way
    client = sdk(openai_mesh.gateway_url, key)
    resumed = [e async for e in await client.responses.retrieve(rid, stream=True, starting_after=last)]
    assert [e.sequence_number for e in resumed] == [e["sequence_number"] for e in tail]


async def test_compaction_stores_a_summary_the_next_turn_is_built_from(openai_mesh: Mesh) -> None:
    """POST /responses/compact on the real mesh: chat summarises the conversation with the engine and stores it;
    the compaction item sent back continues the conversation, whose next prompt is the summary, not the turns."""
    client = await client_of(openai_mesh, f"c-{uuid.uuid4().hex[:8]}")
    notes = " ".join(f"note {n}: the lighthouse keeper logs the tide." for n in range(40))  # ~400 tokens
    first = await client.responses.create(model=MODEL, input=f"Remember: the code word is heron. {notes}")
    second = await client.responses.create(model=MODEL, input=f"Also remember the number 42. {notes}",
                                           previous_response_id=first.id)
    before = await client.responses.create(model=MODEL, input="What was the code word?",
                                           previous_response_id=second.id, store=False)
    compacted = await client.responses.compact(model=MODEL, previous_response_id=second.id)
    item = compacted.output[-1]
    assert item.type == "compaction" and compacted.usage.input_tokens > 0
    summary = item.model_dump()["summary"]
    assert summary and compacted.usage.output_tokens > 0
    sent_back: Any = [*[i.model_dump(warnings=False) for i in compacted.output],
                      {"role": "user", "content": "What was the code word?"}]
    after = await client.responses.create(model=MODEL, input=sent_back)
    assert after.conversation is not None and second.conversation is not None
    assert after.conversation.id == second.conversation.id
    assert before.usage is not None and after.usage is not None
    # the same question, its prompt built from the summary (at most 200 tokens) instead of the two turns before it
    assert after.usage.input_tokens < before.usage.input_tokens - 400
