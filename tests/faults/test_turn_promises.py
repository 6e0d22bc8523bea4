"""A turn keeps its word through takeovers, drains and long conversations (issue 33), on one real mesh for the
module (bench/fault_mesh.py: two `sim` engines, two chat processes, the store on SQLite, the gateway, each its own
process; sim replies run to their max_tokens, 10 ms a token):

- a takeover of an OpenAI-surface turn (seed, temperature > 0, max_tokens) after its chat process is killed: the
  stored reply is the one the turn would have had without the fault, begins with what the client was shown and
  keeps to max_tokens;
- a SIGSTOPped lease holder, resumed after its lease lapsed: the successor continues the reply, the paused
  holder's engine sequence is cancelled before the successor's starts (never two at once), nothing is stored
  twice and each output token is billed once;
- SIGTERM of the gateway while clients send turns on kept-alive connections: each new turn is refused 503
  (Retry-After, Connection: close) and succeeds on retry, none is stored stopped;
- a conversation driven past SmolLM2's 8,192-token context: summaries are made and every turn answers; a summary
  threshold above the context refuses to start;
- a stream cut at its response headers (a proxy), then retried: the retry streams a whole reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.fault_mesh import FaultMesh
from chatmesh.gateway.cli import accounts_for
from chatmesh.gateway.openai.turns import derived_id
from chatmesh.mesh import identity as ident
from chatmesh.mesh import settings
from chatmesh.mesh.config import Config
from chatmesh.mesh.up import MeshError
from chatmesh.v1 import chat_pb2, chat_pb2_grpc, generate_pb2, generate_pb2_grpc, store_pb2, store_pb2_grpc
from tests.conftest import free_port
from tests.e2e.conftest import bind_failed, channel
from tests.gateway.openai_client import make_key

pytestmark = [pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the default model profile's id (CHATMESH_MODEL=smollm2)
LOCAL = "local"  # the development identity chatmesh's own routes act for (CHATMESH_AUTH=local)
ENV = {"CHATMESH_SIM_REPLY_TOKENS": "0",  # replies run to their max_tokens: lengths known to the test
       "CHATMESH_SHUTDOWN_GRACE_S": "3"}


@pytest.fixture(scope="module")
def fm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultMesh]:
    root = tmp_path_factory.mktemp("promises")
    mesh = FaultMesh(root / "mesh", engines=2, chats=2, step_ms=10, reply_tokens=400, env=ENV)
    try:
        mesh.start()
    except MeshError:
        if not bind_failed(mesh.root / "logs"):
            raise
        mesh.stop()
        mesh = FaultMesh(root / "again", engines=2, chats=2, step_ms=10, reply_tokens=400, env=ENV)
        mesh.start()
    try:
        yield mesh
    finally:
        mesh.stop()
    assert mesh.log_problems() == []


def data_dir(fm: FaultMesh) -> Path:
    return Path(fm.mesh.cfg[settings.DATA_DIR])


async def owner_of(fm: FaultMesh, name: str) -> str:
    accounts = accounts_for(Config(env={"CHATMESH_DATA_DIR": str(data_dir(fm))}))
    try:
        owner = await accounts.user_named(name)
        assert owner is not None
        return owner
    finally:
        await accounts.close()


async def read_turn(fm: FaultMesh, owner: str, conv: str, turn: str) -> store_pb2.ReadTurnResponse:
    async with channel(fm.mesh, "store", ident.CHAT, owner_tokens=True) as ch:
        return await store_pb2_grpc.StoreServiceStub(ch).ReadTurn(store_pb2.ReadTurnRequest(
            owner_id=owner, conversation_id=conv, turn_id=turn))


async def running_sequences(fm: FaultMesh) -> int:
    total = 0
    for name in fm.names("engine"):
        async with channel(fm.mesh, "engine", address=fm.procs[name].address) as ch:
            total += (await generate_pb2_grpc.GenerateServiceStub(ch).GetStats(
                generate_pb2.GetStatsRequest())).stats.running_sequences
    return total


@contextlib.contextmanager
def engines_held(fm: FaultMesh) -> Iterator[None]:
    """Holds every engine still (SIGSTOP) for the block: a reply cannot run on (or finish) while the test finds
    its lease holder, however slow the machine; the sim engines draw each token by seed and position, so the
    reply is the same."""
    engines = [fm.pid(name) for name in fm.names("engine")]
    for pid in engines:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in engines:
            os.kill(pid, signal.SIGCONT)


async def eventually(check: Any, what: str, tries: int = 300) -> None:
    """Polls `check()` (an awaitable factory) every 50 ms until it is true, at most `tries` times."""
    for _ in range(tries):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


# ---- the two surfaces as a client sees them ---------------------------------------------------------------------


async def sse_lines(response: httpx.Response) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(event, data) of a text/event-stream, chatmesh's `event:` frames or OpenAI's bare `data:` ones."""
    event = ""
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            event = line.partition(":")[2].strip()
        elif line.startswith("data:"):
            raw = line.partition(":")[2].strip()
            if raw != "[DONE]":
                yield event, json.loads(raw)
            event = ""


def completion(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "stream": True, **body}


async def stream_completion(client: httpx.AsyncClient, key: str, idem: str, body: dict[str, Any],
                            shown: list[str] | None = None, ids: list[str] | None = None) -> str:
    """An OpenAI streamed chat completion; the text it delivered (also appended to `shown` as it arrives)."""
    text: list[str] = shown if shown is not None else []
    async with client.stream("POST", "/openai/v1/chat/completions", json=completion(body), headers={
            "authorization": f"Bearer {key}", "idempotency-key": idem}) as r:
        assert r.status_code == 200, await r.aread()
        async for _, data in sse_lines(r):
            if ids is not None and data.get("id"):
                ids.append(data["id"])
            for choice in data.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


async def rest_turn(client: httpx.AsyncClient, conv: str, turn: str, content: str, options: dict[str, Any],
                    shown: list[str] | None = None) -> tuple[int, str, str]:
    """One attempt at a turn on chatmesh's own route: (HTTP status, final event or "", text delivered)."""
    text: list[str] = shown if shown is not None else []
    async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                             json={"turn_id": turn, "content": content, "options": options}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, "", ""
        final = ""
        async for event, data in sse_lines(r):
            if event == "turn.delta":
                text.append(data["text"])
            elif event in ("turn.completed", "turn.stopped", "turn.blocked", "turn.failed"):
                final = event
                break
    return 200, final, "".join(text)


async def messages(client: httpx.AsyncClient, conv: str, key: str = "") -> list[dict[str, Any]]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    got: list[dict[str, Any]] = (await client.get(f"/v1/conversations/{conv}", headers=headers)).json()["messages"]
    return got


async def only_conversation(client: httpx.AsyncClient, key: str) -> str:
    convs = (await client.get("/v1/conversations", headers={"authorization": f"Bearer {key}"})).json()
    [conv] = convs["conversations"]
    return str(conv["id"])


# ---- the promises -----------------------------------------------------------------------------------------------


async def test_a_taken_over_openai_turn_keeps_its_seed_sampling_and_max_tokens(fm: FaultMesh) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a long story about the harbor and the lantern."}],
            "seed": 7, "temperature": 0.9, "top_p": 0.95, "max_tokens": 150}
    tag = uuid.uuid4().hex[:8]
    ref_key, key = await make_key(data_dir(fm), f"ref-{tag}"), await make_key(data_dir(fm), f"hit-{tag}")
    async with httpx.AsyncClient(base_url=fm.url, timeout=30) as client:
        reference = await stream_completion(client, ref_key, "once", body)  # the reply without a fault
        owner = await owner_of(fm, f"hit-{tag}")
        shown: list[str] = []
        ids: list[str] = []
        first = asyncio.create_task(stream_completion(client, key, "once", body, shown, ids))
        await eventually(lambda: _ready(len("".join(shown)) >= 60), "the client was shown some text")
        with engines_held(fm):  # the reply cannot finish before its holder is killed
            turn = str(uuid.UUID(ids[0].removeprefix("chatcmpl-")))
            conv = await only_conversation(client, key)
            holder = fm.chat_holding((await read_turn(fm, owner, conv, turn)).lease_holder)
            await asyncio.to_thread(fm.kill, holder, signal.SIGKILL)
        await asyncio.gather(first, return_exceptions=True)  # its stream broke with the process
        was_shown = "".join(shown)
        again = await stream_completion(client, key, "once", body)  # the SDK's retry: the same request
        stored = (await messages(client, conv, key))[-1]
    await asyncio.to_thread(fm.restart, holder)
    assert again == reference, "the taken-over reply is not the one the turn had without the fault"
    assert again.startswith(was_shown) and len(was_shown) < len(again)
    assert stored["content"] == again and stored["status"] == "complete"
    assert stored["token_count"] == 150  # max_tokens, the part shown before the takeover included


async def _ready(value: bool) -> bool:
    return value


async def test_a_paused_holder_is_cancelled_and_billed_once_when_its_successor_continues(fm: FaultMesh) -> None:
    options = {"temperature": 0.7, "seed": 11, "max_tokens": 300}  # 3 s of reply
    content = "Describe the willow by the river in detail."
    async with httpx.AsyncClient(base_url=fm.url, timeout=60) as client:
        conv = str((await client.post("/v1/conversations", json={})).json()["id"])
        before = (await client.get("/v1/usage")).json()
        turn = str(uuid.uuid4())
        shown: list[str] = []
        first = asyncio.create_task(rest_turn(client, conv, turn, content, options, shown))
        await eventually(lambda: _ready(len("".join(shown)) >= 40), "the client was shown some text")
        with engines_held(fm):  # the reply cannot finish before its holder is paused
            record = await read_turn(fm, LOCAL, conv, turn)
            holder = fm.chat_holding(record.lease_holder)
            successor = next(n for n in fm.names("chat") if n != holder)
            pid = fm.pid(holder)
            os.kill(pid, signal.SIGSTOP)
        try:
            was_shown = "".join(shown)

            async def lapsed() -> bool:
                return (await read_turn(fm, LOCAL, conv, turn)).lease_expires_at_ms < time.time() * 1000

            await eventually(lapsed, "the paused holder's lease lapsed")
            # The client's retry reaches the other chat process (as the gateway sends it).
            async with channel(fm.mesh, "chat", ident.GATEWAY, owner_tokens=True,
                               address=fm.procs[successor].address) as ch:
                call = chat_pb2_grpc.ChatServiceStub(ch).SendTurn(chat_pb2.SendTurnRequest(
                    owner_id=LOCAL, conversation_id=conv, turn_id=turn, content=content,
                    options=chat_pb2.TurnOptions(temperature=0.7, seed=11, max_tokens=300)))
                text, alone = "", None
                async for resp in call:
                    kind = resp.event.WhichOneof("kind")
                    if kind == "delta":
                        if alone is None and len(text) > 0:  # generating: the paused holder's sequence is gone
                            alone = await running_sequences(fm)
                        text += resp.event.delta.text
                    elif kind != "started":
                        final = kind
                        break
        finally:
            os.kill(pid, signal.SIGCONT)
        status, ending, _ = await asyncio.wait_for(first, 30)  # the resumed holder learns it lost the lease
        stored = [m for m in await messages(client, conv) if m["turn_id"] == turn]
        after = (await client.get("/v1/usage")).json()
    assert final == "completed" and alone == 1
    assert ending != "turn.completed"  # the paused holder stored nothing: it failed, the successor stored
    assert [m["role"] for m in stored] == ["user", "assistant"]  # nothing stored twice
    reply = stored[-1]
    assert reply["content"] == text and text.startswith(was_shown) and reply["token_count"] == 300
    output = sum(d["usage"]["output_tokens"] for d in after["days"]) - \
        sum(d["usage"]["output_tokens"] for d in before["days"])
    assert output == 300  # each output token billed once, across the two holders
    assert fm.log_lines("turn_cancelled", "engine") >= 1


async def test_a_gateway_stopped_under_kept_alive_load_refuses_new_turns_and_stores_none_stopped(
        fm: FaultMesh) -> None:
    clients, turns_each = 4, 5
    refused: list[httpx.Headers] = []
    acked: dict[tuple[str, str], str] = {}
    answered = [0] * clients  # each client's turns acknowledged so far

    async def user(n: int) -> None:
        async with httpx.AsyncClient(base_url=fm.url, timeout=30,
                                     limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as client:
            conv = ""
            while not conv:
                try:
                    conv = str((await client.post("/v1/conversations", json={})).json()["id"])
                except (httpx.HTTPError, KeyError):
                    await asyncio.sleep(0.2)
            for k in range(turns_each):
                turn = str(uuid.uuid4())
                for _ in range(200):
                    try:
                        async with client.stream("POST", f"/v1/conversations/{conv}/turns", json={
                                "turn_id": turn, "content": f"user {n} turn {k}: the ember and the summit",
                                "options": {"max_tokens": 30}}) as r:
                            if r.status_code == 503:
                                refused.append(r.headers)
                                await r.aread()
                            else:  # read to the end of the body, so the connection is kept alive for the next
                                text = ""
                                async for event, data in sse_lines(r):
                                    if event == "turn.delta":
                                        text += data["text"]
                                    elif event == "turn.completed":
                                        acked[(conv, turn)] = text
                                        answered[n] += 1
                    except httpx.HTTPError:
                        pass  # the gateway is gone for a moment: retry the same turn id
                    if (conv, turn) in acked:
                        break
                    await asyncio.sleep(0.1)

    load = [asyncio.create_task(user(n)) for n in range(clients)]
    # every client has a kept-alive connection (a turn answered on it) and turns still to send
    await eventually(lambda: _ready(all(answered)), "every client had a turn answered")
    code = await asyncio.to_thread(fm.kill, "gateway", signal.SIGTERM)
    await asyncio.to_thread(fm.restart, "gateway")
    await asyncio.wait_for(asyncio.gather(*load), 120)
    assert code == 0
    assert len(acked) == clients * turns_each  # every turn answered in the end, by retrying it
    assert refused and all(h["retry-after"] == "1" and h["connection"] == "close" for h in refused)
    async with httpx.AsyncClient(base_url=fm.url, timeout=30) as client:
        for conv in {c for c, _ in acked}:
            for m in await messages(client, conv):
                if m["role"] == "assistant":
                    assert m["status"] == "complete", m  # none cut short by the drain
                    assert acked[(conv, m["turn_id"])] == m["content"]


async def test_a_conversation_past_the_models_context_is_summarised_and_every_turn_answers(fm: FaultMesh) -> None:
    words = "river lantern orbit meadow cipher harbor quartz willow ember summit".split()
    summaries = fm.log_lines("summary_stored", "chat")
    async with httpx.AsyncClient(base_url=fm.url, timeout=60) as client:
        conv = str((await client.post("/v1/conversations", json={})).json()["id"])
        for k in range(8):  # ~1,500 tokens a turn: 8 turns are half again SmolLM2's 8,192-token context
            content = f"Turn {k}: " + " ".join(words[(i * 7 + k) % len(words)] for i in range(1200))
            status, final, text = await rest_turn(client, conv, str(uuid.uuid4()), content, {"max_tokens": 24})
            assert (status, final) == (200, "turn.completed") and text, (k, status, final)
        held = sum(m["token_count"] for m in await messages(client, conv))
    assert held > 8192  # the conversation outgrew the context ...
    assert fm.log_lines("summary_stored", "chat") - summaries >= 2  # ... and was summarised before its turns


def test_a_summary_threshold_above_the_context_refuses_to_start(fm: FaultMesh) -> None:
    name = "chat-refused"
    proc = fm.mesh._spawn("chat", name, {"CHATMESH_SUMMARY_THRESHOLD_TOKENS": "9000",
                                         "CHATMESH_LISTEN": f"127.0.0.1:{free_port()}",
                                         settings.METRIC_PORTS["chat"].env: "0"})
    code = proc.wait(60)
    log = (fm.root / "logs" / f"{name}.log").read_text()
    assert code == 2 and "startup_refused" in log and "above the prompt room of 7792 tokens" in log  # 8192 - 400
    assert "Traceback" not in log


class HeaderCut:
    """A TCP proxy to the gateway that forwards each request, then the response's headers, and closes both ends:
    the client's stream is cut at its response headers (a proxy dropping, a connection reset)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        up_writer.write(head + await reader.readexactly(length))
        await up_writer.drain()
        writer.write(await up_reader.readuntil(b"\r\n\r\n"))  # the response's headers, nothing after them
        await writer.drain()
        writer.close()
        up_writer.close()


async def test_a_stream_cut_at_its_response_headers_is_released_and_its_retry_streams_a_whole_reply(
        fm: FaultMesh) -> None:
    tag = uuid.uuid4().hex[:8]
    key = await make_key(data_dir(fm), f"cut-{tag}")
    body = {"messages": [{"role": "user", "content": "Name three things about the orbit."}], "max_tokens": 40}
    port = int(fm.url.rsplit(":", 1)[1])
    # The engines are held still (SIGSTOP) while the stream is cut: chat sends the turn's start (the response
    # headers) before any engine work, so no token can exist before the cut. Without this the cut races the
    # first token, and a token the gateway wrote to the socket before it saw the close counts as shown (the
    # gateway cannot know the proxy dropped it): on a loaded runner that turned the turn into a stopped one.
    with engines_held(fm):
        async with HeaderCut(port) as proxy_port, httpx.AsyncClient(base_url=f"http://127.0.0.1:{proxy_port}",
                                                                     timeout=30) as cut:
            with pytest.raises(httpx.HTTPError):
                await stream_completion(cut, key, "cut", body)
    owner = await owner_of(fm, f"cut-{tag}")
    turn = derived_id("key", owner, "cut")  # the turn an Idempotency-Key names (gateway/openai/turns.py)
    async with httpx.AsyncClient(base_url=fm.url, timeout=30) as client:
        conv = await only_conversation(client, key)

        async def released() -> bool:
            return (await read_turn(fm, owner, conv, turn)).state == store_pb2.TURN_STATE_FAILED

        await eventually(released, "the cut turn was released (not stored stopped)")
        again = await stream_completion(client, key, "cut", body)  # the SDK's retry
        stored = (await messages(client, conv, key))[-1]
    assert again and stored["content"] == again and stored["status"] == "complete" and stored["token_count"] == 40
