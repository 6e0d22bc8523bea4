"""Long pastes end to end (issue 17; the one size policy of chatmesh.mesh.message_size): through the real edge,
chat, moderation, store and the `sim` engine.

- With a 128k-context model (CHATMESH_MODEL=llama3: Llama 3.1's 131,072 tokens, which sim serves in its ids; the
  gateway and chat take the served model's context), a paste of about 127,000 tokens is accepted with 200, moderated, prefilled, answered (turn.completed, never turn.failed) and stored whole.
- A paste over CHATMESH_MAX_MESSAGE_TOKENS (128,000) is a 400 naming the limit, and nothing of it is stored.
- With the default 8k context, a paste of more than 32 KB (moderation's old input cap, where a 200 used to end in
  turn.failed) but within what the model takes is answered; one past what the model takes is a 400 naming that."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Protocol
from pathlib import Path

import httpx
import pytest

from chatmesh.mesh.config import Config
from chatmesh.model import assets, profile
from chatmesh.model import tokenizer as model_tokenizer
from chatmesh.model.assets import GGUF_NAME
from chatmesh.model.settings import MODEL_DIR
from chatmesh.mesh.up import Mesh
from tests.conftest import need
from tests.e2e.conftest import SseEvent, read_sse, start_mesh

pytestmark = pytest.mark.slow

WORDS = ("committee reviewed quarterly figures regional warehouses noted shipments delayed northern corridor "
         "because maintenance crews replaced signalling equipment overnight; analysts expect recovery before "
         "inventory audits conclude, although several suppliers disputed invoices").split()


@pytest.fixture(scope="module")
def tokenizer() -> model_tokenizer.Tokenizer:
    path = Path(Config()[MODEL_DIR])
    need((path / GGUF_NAME).is_file(), f"the model file {path / GGUF_NAME} (`chatmesh model fetch`)")
    return model_tokenizer.load(path)


class Codec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@pytest.fixture(scope="module")
def llama3() -> profile.ModelProfile:
    path = Path(Config()[MODEL_DIR])
    need(assets.LLAMA3_TOKENIZER.present(path), "the Llama 3 tokenizer (`chatmesh model fetch`)")
    return profile.load_spec("llama3", str(path))


def paste(tok: Codec, tokens: int) -> str:
    """A document of exactly `tokens` tokens (numbered lines of prose, so no two lines are alike)."""
    lines = [f"{i}. " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(12)) + ".\n" for i in range(tokens // 8)]
    text = "".join(lines)
    ids = tok.encode(text)
    while len(ids) < tokens:
        text += text[: len(text) // 2]
        ids = tok.encode(text)
    out = tok.decode(ids[:tokens])
    assert len(tok.encode(out)) == tokens
    return out


def send(client: httpx.Client, conv: str, content: str) -> tuple[int, list[SseEvent], dict[str, object]]:
    with client.stream("POST", f"/v1/conversations/{conv}/turns",
                       json={"turn_id": str(uuid.uuid4()), "content": content}) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [], r.json()["error"]
        return 200, list(read_sse(r)), {}


def stored(client: httpx.Client, conv: str) -> list[dict[str, str]]:
    got = client.get(f"/v1/conversations/{conv}")
    assert got.status_code == 200
    messages: list[dict[str, str]] = got.json()["messages"]
    return messages


@pytest.fixture(scope="module")
def long_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = start_mesh(tmp_path_factory.mktemp("paste128k"), CHATMESH_MODEL="llama3", CHATMESH_CONTEXT_TOKENS="131072",
                      CHATMESH_SIM_STEP_MS="5", CHATMESH_MAX_REPLY_TOKENS="32")
    try:
        yield mesh
    finally:
        mesh.stop()


def test_a_128k_token_paste_is_answered_and_stored_whole(long_mesh: Mesh, llama3: profile.ModelProfile) -> None:
    document = paste(llama3, 127_000)
    assert len(document.encode()) > 400_000
    with httpx.Client(base_url=long_mesh.gateway_url, timeout=300) as client:
        conv = client.post("/v1/conversations", json={}).json()["id"]
        status, events, error = send(client, conv, document)
        assert status == 200, error
        kinds = [e.event for e in events]
        assert kinds[0] == "turn.started" and kinds[-1] == "turn.completed", kinds[-3:]
        assert "turn.failed" not in kinds
        assert "turn.delta" in kinds
        usage = events[-1].data["usage"]
        assert 127_000 < usage["prompt_tokens"] < 131_072 - 32
        messages = stored(client, conv)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == document


def test_a_paste_over_the_token_limit_is_400_and_nothing_is_stored(long_mesh: Mesh,
                                                                    llama3: profile.ModelProfile) -> None:
    document = paste(llama3, 128_001)
    assert len(document.encode()) < 1024 * 1024  # under the byte bound: the token count refuses it
    with httpx.Client(base_url=long_mesh.gateway_url, timeout=300) as client:
        conv = client.post("/v1/conversations", json={}).json()["id"]
        status, _, error = send(client, conv, document)
        assert status == 400
        assert error == {"code": "message_too_long", "message": "the message is 128,001 tokens; the limit is "
                                                                "128,000 tokens (CHATMESH_MAX_MESSAGE_TOKENS)"}
        assert stored(client, conv) == []
        before = client.get("/v1/conversations").json()["conversations"]
        model = client.get("/openai/v1/models").json()["data"][0]["id"]
        completion = client.post("/openai/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": document}]})
        assert completion.status_code == 400 and "128,000 tokens" in completion.text
        assert client.get("/v1/conversations").json()["conversations"] == before  # none created for it


def test_on_the_default_context_a_long_paste_is_answered_or_refused_up_front(
        tmp_path: Path, tokenizer: model_tokenizer.Tokenizer) -> None:
    mesh = start_mesh(tmp_path)  # CHATMESH_CONTEXT_TOKENS 8192, 48 reply tokens: 8,144 tokens of input
    try:
        within, over = paste(tokenizer, 7_800), paste(tokenizer, 9_000)
        assert len(within.encode()) > 32 * 1024  # over moderation's old cap
        with httpx.Client(base_url=mesh.gateway_url, timeout=120) as client:
            conv = client.post("/v1/conversations", json={}).json()["id"]
            status, events, error = send(client, conv, within)
            assert status == 200, error
            assert events[-1].event == "turn.completed", [e.event for e in events][-3:]
            other = client.post("/v1/conversations", json={}).json()["id"]
            status, _, error = send(client, other, over)
            assert status == 400 and error["code"] == "message_too_long"
            assert error["message"] == ("the message is 9,000 tokens; this model takes at most 8,144 tokens of "
                                        "input (its context minus the reply tokens): shorten the message")
            assert stored(client, other) == []
    finally:
        mesh.stop()
