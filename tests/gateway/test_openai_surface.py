"""The OpenAI-compatible surface at the edge, driven by the official `openai` SDK against a real gateway in front
of the in-test ChatService (tests/gateway/fake_chat.py): what the SDK sees (objects, events, its exception classes)
and what the edge asks ChatService for (which conversation, which turn, how many generations)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from chatmesh.mesh.config import Config
from chatmesh.model import profile
from tests.gateway.conftest import Gateway, StartGateway
from tests.gateway.fake_chat import FakeChat
from tests.gateway.openai_client import MODEL, dropping_proxy, make_key, sdk


@pytest.fixture
async def client(gateway: Gateway, key: str) -> openai.AsyncOpenAI:
    return sdk(gateway.url, key)


def user(text: str) -> ChatCompletionMessageParam:
    return {"role": "user", "content": text}


def assistant(text: str) -> ChatCompletionMessageParam:
    return {"role": "assistant", "content": text}


async def test_models_list_and_retrieve(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_dump()["context_length"] == 8192
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4o")


async def test_models_follow_the_model_profile_and_an_override(start_gateway: StartGateway, key: str) -> None:
    """/models lists what CHATMESH_MODEL's profile serves (its id; its context, within CHATMESH_CONTEXT_TOKENS),
    not a separate setting; CHATMESH_OPENAI_MODEL only renames it."""
    default = profile.load(Config(env={}))
    assert default.model_id == MODEL
    llama = await start_gateway(CHATMESH_MODEL="llama3", CHATMESH_CONTEXT_TOKENS="131072")
    listed = (await sdk(llama.url, key).models.list()).data
    want = profile.load(Config(env={"CHATMESH_MODEL": "llama3"}))
    assert [(m.id, m.model_dump()["context_length"]) for m in listed] == [(want.model_id, 131072)]
    assert want.model_id != MODEL
    capped = await start_gateway(CHATMESH_MODEL="llama3")  # chat's 8,192-token default bounds what a request gets
    assert (await sdk(capped.url, key).models.retrieve(want.model_id)).model_dump()["context_length"] == 8192
    renamed = await start_gateway(CHATMESH_OPENAI_MODEL="house-model")
    client = sdk(renamed.url, key)
    assert [m.id for m in (await client.models.list()).data] == ["house-model"]
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model=MODEL, messages=[user("hi")])


async def test_completion_not_streamed(client: openai.AsyncOpenAI, fake: FakeChat) -> None:
    done = await client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "Be brief."}, user("Hi there")], temperature=0.5, top_p=0.9, seed=7,
        stop=["\n\n"], max_tokens=20)
    assert done.object == "chat.completion" and done.id.startswith("chatcmpl-")
    assert done.choices[0].message.content == "Hello, world."
    assert done.choices[0].finish_reason == "stop"
    assert done.usage is not None and done.usage.prompt_tokens == 7
    assert done.usage.prompt_tokens_details is not None and done.usage.prompt_tokens_details.cached_tokens == 2
    # the options reached ChatService, and the system message seeded the new conversation
    opts = fake.options[-1]
    assert (round(opts.temperature, 3), round(opts.top_p, 3), opts.seed, list(opts.stop), opts.max_tokens) == \
        (0.5, 0.9, 7, ["\n\n"], 20)
    (conv,) = fake.convs.values()
    assert [(m.role, m.content) for m in conv.messages][:2] == [(1, "Be brief."), (2, "Hi there")]


async def test_completion_streamed_with_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(model=MODEL, messages=[user("Hi")], stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello, world."
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 11


async def test_resent_history_continues_the_stored_conversation(client: openai.AsyncOpenAI,
                                                                fake: FakeChat) -> None:
    first = await client.chat.completions.create(model=MODEL, messages=[user("One?")])
    reply = first.choices[0].message.content or ""
    await client.chat.completions.create(model=MODEL, messages=[user("One?"), assistant(reply), user("Two?")])
    stream = await client.chat.completions.create(model=MODEL, stream=True, messages=[
        user("One?"), assistant(reply), user("Two?"), assistant(reply), user("Three?")])
    _ = [c async for c in stream]
    (conv,) = fake.convs.values()  # one conversation, each request one turn in it
    assert [m.content for m in conv.messages if m.role == 2] == ["One?", "Two?", "Three?"]
    # an edited earlier message is another history: a new conversation seeded with it
    await client.chat.completions.create(model=MODEL, messages=[user("One, edited?"), assistant(reply), user("Two?")])
    assert len(fake.convs) == 2
    forked = next(c for c in fake.convs.values() if c is not conv)
    assert [m.content for m in forked.messages] == ["One, edited?", reply, "Two?", reply]


async def test_history_never_matches_across_owners(gateway: Gateway, tmp_path: Path, fake: FakeChat) -> None:
    alice, bob = sdk(gateway.url, await make_key(tmp_path, "alice")), sdk(gateway.url, await make_key(tmp_path, "bob"))
    reply = (await alice.chat.completions.create(model=MODEL, messages=[user("Q")])).choices[0].message.content
    await bob.chat.completions.create(model=MODEL, messages=[user("Q"), assistant(reply or ""), user("Q2")])
    owners = {c.meta.owner_id for c in fake.convs.values()}
    assert len(fake.convs) == 2 and len(owners) == 2  # bob's history started a conversation of his own


async def test_idempotency_key_and_sdk_retry_generate_once(gateway: Gateway, key: str, fake: FakeChat) -> None:
    client = sdk(gateway.url, key)
    body = {"model": MODEL, "messages": [user("Once")]}
    a = await client.chat.completions.create(**body, extra_headers={"Idempotency-Key": "k-1"})  # type: ignore[call-overload]
    b = await client.chat.completions.create(**body, extra_headers={"Idempotency-Key": "k-1"})  # type: ignore[call-overload]
    assert a.id == b.id and a.choices[0].message.content == b.choices[0].message.content
    assert fake.generations == 1
    # the server side drops the first connection after the request arrived: the SDK retries on its own
    fake.delay_s = 0.1
    port = int(gateway.url.rsplit(":", 1)[1])
    async with dropping_proxy(port) as (proxy, proxy_port):
        retrying = sdk(f"http://127.0.0.1:{proxy_port}", key, max_retries=2)
        done = await retrying.chat.completions.create(model=MODEL, messages=[user("Retried")])
    assert proxy.connections == 2
    assert done.choices[0].message.content == "Hello, world."
    assert fake.generations == 2  # one for "Once", one for "Retried"


async def test_deliberate_resend_regenerates(client: openai.AsyncOpenAI, fake: FakeChat) -> None:
    await client.chat.completions.create(model=MODEL, messages=[user("Again?")])
    await client.chat.completions.create(model=MODEL, messages=[user("Again?")])
    assert fake.generations == 2 and len(fake.convs) == 1
    (conv,) = fake.convs.values()
    assert [m.superseded for m in conv.messages if m.role == 3] == [True, False]


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 5}, "temperature"),
    ({"n": 2}, "n"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),  # function tools only
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),  # not among the tools
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "tool", "content": "21", "tool_call_id": "call_1"}]}, "messages[0].tool_call_id"),
    ({"logprobs": True}, "logprobs"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [user("a"), assistant("b")]}, "messages[1].role"),
    ({"messages": [user("x" * 600_000)]}, "messages[0].content"),
])
async def test_bad_input_is_400_naming_the_parameter_and_stores_nothing(
        client: openai.AsyncOpenAI, fake: FakeChat, extra: dict[str, object], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=[user("hi")], extra_body=extra)
    assert err.value.param == param
    assert err.value.status_code == 400
    assert fake.convs == {} and fake.generations == 0


async def test_sdk_exception_classes(start_gateway: StartGateway, tmp_path: Path, fake: FakeChat) -> None:
    gw = await start_gateway(CHATMESH_AUTH="required", CHATMESH_LIMIT_TURNS_PER_MINUTE="1")
    key = await make_key(tmp_path, "alice")
    with pytest.raises(openai.AuthenticationError):
        await sdk(gw.url, "cmk_wrong").models.list()
    client = sdk(gw.url, key)
    await client.chat.completions.create(model=MODEL, messages=[user("one")])
    with pytest.raises(openai.RateLimitError) as limited:
        await client.chat.completions.create(model=MODEL, messages=[user("two")])
    assert int(limited.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_" + "0" * 64)
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve("conv_nope")


async def test_another_owners_response_and_conversation_are_not_found(gateway: Gateway, tmp_path: Path) -> None:
    alice, bob = sdk(gateway.url, await make_key(tmp_path, "alice")), sdk(gateway.url, await make_key(tmp_path, "bob"))
    made = await alice.responses.create(model=MODEL, input="secret plans")
    assert made.conversation is not None
    for call in (bob.responses.retrieve(made.id), bob.responses.delete(made.id),
                 bob.conversations.retrieve(made.conversation.id),
                 bob.conversations.items.list(made.conversation.id)):
        with pytest.raises(openai.NotFoundError) as err:
            await call
        assert "secret" not in str(err.value.body)
    assert (await alice.responses.retrieve(made.id)).output_text == "Hello, world."


async def test_trusted_frontend_names_end_users(gateway: Gateway, tmp_path: Path, fake: FakeChat) -> None:
    webui = sdk(gateway.url, await make_key(tmp_path, "webui", frontend=True))
    for end_user in ("u-ann", "u-ben"):
        await webui.chat.completions.create(model=MODEL, messages=[user("hi")],
                                            extra_headers={"X-OpenWebUI-User-Id": end_user,
                                                           "X-OpenWebUI-User-Name": end_user})
    owners = {c.meta.owner_id for c in fake.convs.values()}
    assert len(owners) == 2  # each end user an owner of their own (own history, limits, cache salt)
    plain = sdk(gateway.url, await make_key(tmp_path, "carol"))
    with pytest.raises(openai.PermissionDeniedError):
        await plain.chat.completions.create(model=MODEL, messages=[user("hi")],
                                            extra_headers={"X-OpenWebUI-User-Id": "u-ann"})
    assert len(fake.convs) == 2


async def test_background_task_leaves_no_conversation(client: openai.AsyncOpenAI, fake: FakeChat) -> None:
    done = await client.chat.completions.create(model=MODEL, messages=[user("Title for: hi")],
                                                extra_headers={"X-OpenWebUI-Task": "title_generation"})
    assert done.choices[0].message.content
    assert fake.convs == {}


async def test_responses_create_retrieve_continue_delete(client: openai.AsyncOpenAI, fake: FakeChat) -> None:
    first = await client.responses.create(model=MODEL, input="Hello", instructions="Be terse.")
    assert first.status == "completed" and first.output_text == "Hello, world."
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 2
    second = await client.responses.create(model=MODEL, input="More", previous_response_id=first.id,
                                           instructions="Be terse.")
    assert second.conversation is not None and first.conversation is not None
    assert second.conversation.id == first.conversation.id
    (conv,) = fake.convs.values()
    assert [m.content for m in conv.messages if m.role != 3] == ["Be terse.", "Hello", "More"]
    assert fake.options[-1].instructions == "Be terse."
    third = await client.responses.create(model=MODEL, input=[{"role": "user", "content": "Third"}],
                                          conversation=first.conversation.id)
    assert third.conversation is not None and third.conversation.id == first.conversation.id
    got = await client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == "Hello, world." and got.status == "completed"
    await client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(second.id)
    # branching from an earlier response forks a conversation of its own with that history
    branch = await client.responses.create(model=MODEL, input="Other", previous_response_id=first.id)
    assert branch.conversation is not None and branch.conversation.id != first.conversation.id
    assert len(fake.convs) == 2


async def test_responses_stream_events_in_order(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(model=MODEL, input="Hi", stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    sequence = [e.sequence_number for e in events]
    assert sequence == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello, world."
    terminal = [k for k in kinds if k in ("response.completed", "response.incomplete", "response.failed")]
    assert terminal == ["response.completed"]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == 4


async def test_responses_cancel_mid_stream_keeps_the_partial_reply(client: openai.AsyncOpenAI,
                                                                   fake: FakeChat) -> None:
    fake.delay_s = 0.2
    stream = await client.responses.create(model=MODEL, input="Long one", stream=True)
    events = []
    async for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta":
            cancelled = await client.responses.cancel(events[0].response.id)  # type: ignore[union-attr]
            assert cancelled.status == "cancelled"
    assert events[-1].type == "response.incomplete"
    partial = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert partial and partial != "Hello, world."
    got = await client.responses.retrieve(events[0].response.id)  # type: ignore[union-attr]
    assert got.status == "cancelled" and got.output_text == partial


async def test_responses_store_false_keeps_nothing(client: openai.AsyncOpenAI, fake: FakeChat) -> None:
    made = await client.responses.create(model=MODEL, input="ephemeral", store=False)
    assert made.output_text == "Hello, world."
    assert fake.convs == {}
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(made.id)


async def test_conversations_crud(client: openai.AsyncOpenAI, fake: FakeChat) -> None:
    conv = await client.conversations.create(items=[{"type": "message", "role": "user", "content": "Remember 42."}])
    assert conv.id.startswith("conv_")
    assert (await client.conversations.retrieve(conv.id)).id == conv.id
    await client.responses.create(model=MODEL, input="What number?", conversation=conv.id)
    items = await client.conversations.items.list(conv.id, order="asc")
    assert [(i.role, i.content[0].text) for i in items.data] == [  # type: ignore[union-attr,index]
        ("user", "Remember 42."), ("user", "What number?"), ("assistant", "Hello, world.")]
    deleted = await client.conversations.delete(conv.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(conv.id)
    assert fake.convs == {}


async def test_errors_have_openai_shape_on_unknown_routes(gateway: Gateway, key: str) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        missing = await http.get("/openai/v1/nothing", headers={"authorization": f"Bearer {key}"})
        wrong = await http.put("/openai/v1/chat/completions", headers={"authorization": f"Bearer {key}"})
    for r in (missing, wrong):
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert (missing.status_code, wrong.status_code) == (404, 405)


async def test_a_client_gone_mid_stream_stops_the_turn(client: openai.AsyncOpenAI, fake: FakeChat) -> None:
    fake.delay_s = 0.2
    stream = await client.chat.completions.create(model=MODEL, messages=[user("Stream")], stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    await stream.close()
    for _ in range(50):
        if fake.cancelled:
            break
        await asyncio.sleep(0.05)
    assert len(fake.cancelled) == 1


def test_a_point_is_held_for_the_turn_continuing_it() -> None:
    """Continuity._hold (turns.py, "Racing continuations"): while one turn continues a stored point, another turn id
    continuing it is refused (it forks), the same turn (a retry) passes, and the hold lapses."""
    from chatmesh.gateway.openai import turns as t
    from chatmesh.gateway.openai.history import Point
    from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId

    now = [0.0]
    turns = t.Continuity(edge=None, index=None, records=None, clock=lambda: now[0])  # type: ignore[arg-type]
    ask = t.Ask(owner=OwnerId("o"), chat="", history=(), content="x", options=None,  # type: ignore[arg-type]
                request_digest="d")
    point = Point(ConversationId("c"), TurnId("p"))
    assert turns._hold(ask, point, TurnId("a"))
    assert turns._hold(ask, point, TurnId("a"))  # the same turn again: a retry
    assert not turns._hold(ask, point, TurnId("b"))
    assert turns._hold(ask, Point(ConversationId("c"), TurnId("q")), TurnId("b"))  # another point
    assert turns._hold(t.Ask(**{**ask.__dict__, "owner": OwnerId("o2")}), point, TurnId("b"))  # another owner
    now[0] = t.HOLD_S + 1
    assert turns._hold(ask, point, TurnId("b"))
