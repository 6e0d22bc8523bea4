"""The message size policy at the edge (chatmesh.mesh.message_size): a message over its byte or token limit is
a 400 naming the limit before anything reaches chat; one within it is accepted even when it is long in bytes."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from chatmesh.mesh.config import Config
from chatmesh.model import tokenizer as model_tokenizer
from chatmesh.model.assets import GGUF_NAME
from chatmesh.model.settings import MODEL_DIR
from tests.conftest import need
from tests.gateway.conftest import Gateway, StartGateway
from tests.gateway.fake_chat import FakeChat
from tests.gateway.sse_client import collect


@pytest.fixture
def model_dir() -> Path:
    path = Path(Config()[MODEL_DIR])
    need((path / GGUF_NAME).is_file(), f"the model file {path / GGUF_NAME} (`chatmesh model fetch`)")
    return path


async def post_turn(gw: Gateway, content: str) -> tuple[int, dict[str, object], str]:
    async with gw.client() as client:
        conv = (await client.post("/v1/conversations")).json()["id"]
        async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                 json={"turn_id": str(uuid.uuid4()), "content": content}) as r:
            if r.status_code == 200:
                await collect(r)
                return 200, {}, conv
            await r.aread()
            return r.status_code, r.json()["error"], conv


async def test_over_the_byte_limit_is_400_naming_the_setting(start_gateway: StartGateway, fake: FakeChat) -> None:
    gw = await start_gateway(CHATMESH_MAX_MESSAGE_BYTES="1000")
    status, error, conv = await post_turn(gw, "é" * 501)  # 1,002 UTF-8 bytes
    assert status == 400 and error["code"] == "message_too_long"
    assert error["message"] == "the message is 1,002 bytes; the limit is 1,000 bytes (CHATMESH_MAX_MESSAGE_BYTES)"
    assert fake.convs[conv].turns == {} and fake.allowances == []
    assert (await post_turn(gw, "é" * 500))[0] == 200


async def test_over_what_the_model_takes_is_400_and_within_it_is_counted_and_accepted(
        start_gateway: StartGateway, fake: FakeChat, model_dir: Path) -> None:
    gw = await start_gateway(CHATMESH_CONTEXT_TOKENS="600", CHATMESH_MAX_REPLY_TOKENS="100")  # 500 tokens in
    tok = model_tokenizer.load(model_dir)
    long_but_few = "hello world, " * 100
    assert len(long_but_few.encode()) > 500 and len(tok.encode(long_but_few)) < 500  # counted, then accepted
    too_many = "one two three four " * 130
    n = len(tok.encode(too_many))
    assert 500 < n < len(too_many.encode())
    status, _, _ = await post_turn(gw, long_but_few)
    assert status == 200
    status, error, conv = await post_turn(gw, too_many)
    assert status == 400 and error["code"] == "message_too_long"
    assert error["message"] == (f"the message is {n} tokens; this model takes at most 500 tokens of input (its "
                                "context minus the reply tokens): shorten the message")
    assert fake.convs[conv].turns == {}


async def test_over_the_token_limit_names_the_setting(start_gateway: StartGateway, model_dir: Path) -> None:
    gw = await start_gateway(CHATMESH_MAX_MESSAGE_TOKENS="100")
    text = "one two three four " * 30
    n = len(model_tokenizer.load(model_dir).encode(text))
    status, error, _ = await post_turn(gw, text)
    assert status == 400
    assert error["message"] == f"the message is {n} tokens; the limit is 100 tokens (CHATMESH_MAX_MESSAGE_TOKENS)"


async def test_the_edge_counts_in_the_served_models_tokens(start_gateway: StartGateway, model_dir: Path) -> None:
    # CHATMESH_MODEL=llama3: the edge counts with Llama 3's tokenizer (the profile chat renders with), not SmolLM2's.
    from chatmesh.model import assets, profile

    need(assets.LLAMA3_TOKENIZER.present(model_dir), "the Llama 3 tokenizer (`chatmesh model fetch`)")
    llama3, smollm2 = profile.load_spec("llama3", model_dir), profile.load_spec("smollm2", model_dir)
    text = "Café naïve 東京 " * 40  # 800 bytes: 163 Llama 3 tokens, 362 of SmolLM2's
    n = llama3.count(text)
    assert n < smollm2.count(text) and n < len(text.encode())
    gw = await start_gateway(CHATMESH_MODEL="llama3", CHATMESH_MAX_MESSAGE_TOKENS=str(n - 1))
    status, error, _ = await post_turn(gw, text)
    assert status == 400
    assert error["message"] == f"the message is {n} tokens; the limit is {n - 1} tokens (CHATMESH_MAX_MESSAGE_TOKENS)"
    gw = await start_gateway(CHATMESH_MODEL="llama3", CHATMESH_MAX_MESSAGE_TOKENS=str(n))
    assert (await post_turn(gw, text))[0] == 200


async def test_the_edge_takes_the_served_models_context_within_the_setting(start_gateway: StartGateway,
                                                                          model_dir: Path) -> None:
    # Llama 3.1's 131,072-token context under a larger CHATMESH_CONTEXT_TOKENS: what a message may have and what a
    # turn reserves is the model's context minus the reply, as chat computes it (chat.service.context_tokens).
    from chatmesh.model import assets

    need(assets.LLAMA3_TOKENIZER.present(model_dir), "the Llama 3 tokenizer (`chatmesh model fetch`)")
    gw = await start_gateway(CHATMESH_MODEL="llama3", CHATMESH_CONTEXT_TOKENS="200000",
                             CHATMESH_PROMPT_CAP_TOKENS="200000", CHATMESH_MAX_MESSAGE_TOKENS="200000",
                             CHATMESH_MAX_REPLY_TOKENS="256")
    assert gw.app.state.edge.message_tokens.input_tokens == 131072 - 256
    smol = await start_gateway(CHATMESH_CONTEXT_TOKENS="200000", CHATMESH_PROMPT_CAP_TOKENS="200000",
                               CHATMESH_MAX_REPLY_TOKENS="256")
    assert smol.app.state.edge.message_tokens.input_tokens == 8192 - 256
