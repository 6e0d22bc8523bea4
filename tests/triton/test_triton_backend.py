"""The `triton` backend against a real tritonserver serving chatmesh_llm (sim engine behind the same tensors).

Skipped with the reason where tritonserver cannot start (no nvidia-pytriton); failing in CI
(CHATMESH_REQUIRE_SERVICES=1).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from tests.conftest import free_port, need

from chatmesh.engine_adapter.backend import (
    Backend,
    Delta,
    Finished,
    FinishReason,
    GenerateEvent,
    GenerateParams,
    KvLayout,
    PullOutcome,
    PullSource,
    ServeRequest,
    Started,
    TransferStats,
)
from chatmesh.engine_adapter.service import build_backend
from chatmesh.engine_adapter.triton.backend import TritonBackend, TritonOptions
from chatmesh.engine_adapter.triton.launcher import TritonMissing, TritonServer
from chatmesh.engine_adapter.triton.render import Deployment, local_server
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from chatmesh.mesh.ids import ConversationId

# The engine inside Triton, and the same engine in-process for comparison.
ENGINE_ENV = {"CHATMESH_SIM_STEP_MS": "10", "CHATMESH_BLOCK_SIZE": "16", "CHATMESH_DEVICE_BLOCKS": "512",
              "CHATMESH_HOST_BLOCKS": "0", "CHATMESH_FLUSH_INTERVAL_MS": "0", "CHATMESH_SIM_TEXT": "words"}
SYSTEM = tuple(range(100, 164))  # 64 platform-prefix tokens: 4 blocks of 16
PRIVATE = tuple(range(200, 264))  # 64 tokens of one owner's history


def start_server(tmp: Path, engine_env: dict[str, str] = ENGINE_ENV) -> TritonServer:
    try:
        server = local_server(Deployment(engine="sim", engine_env=engine_env), tmp / "repository",
                              work_dir=tmp / "work")
        return server.start()
    except TritonMissing as err:
        need(False, f"tritonserver ({err})")
        raise


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    server = start_server(tmp_path_factory.mktemp("triton"))
    yield server
    server.stop()


@pytest.fixture
async def backend(server: TritonServer) -> AsyncIterator[TritonBackend]:
    b = TritonBackend(TritonOptions(address=server.address, replica_id="r-triton", stats_interval_s=0.2))
    await b.start()
    yield b
    await b.close()


def prompt(owner: bytes = b"owner-a", max_tokens: int = 12, seed: int = 1) -> GenerateParams:
    from chatmesh.engine_adapter.executor import SamplingParams

    return GenerateParams(prompt_token_ids=SYSTEM + PRIVATE, max_tokens=max_tokens, cache_salt=owner,
                          platform_prefix_tokens=len(SYSTEM), sampling=SamplingParams(seed=seed))


async def collect(backend: Backend, params: GenerateParams) -> list[GenerateEvent]:
    return [event async for event in backend.generate(params)]


def tokens(events: list[GenerateEvent]) -> list[int]:
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


async def test_stream_is_started_deltas_finished(backend: TritonBackend) -> None:
    assert backend.ready()
    assert backend.model.model_id == "sim-words"  # what the engine inside Triton reports, not a configured name
    events = await collect(backend, prompt(max_tokens=6))
    assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
    assert all(isinstance(e, Delta) for e in events[1:-1])
    finished = events[-1]
    assert finished.usage.prompt_tokens == len(SYSTEM + PRIVATE)
    assert finished.usage.output_tokens >= len(tokens(events)) >= 1
    assert finished.reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert backend.stats().backend == "triton" and backend.stats().replica_id == "r-triton"
    # a request naming a source to pull from: served by prefill, the pull reported as unsupported (docs/triton.md)
    moved = await collect(backend, dataclasses.replace(prompt(max_tokens=2), source=PullSource("r-0", "x:1")))
    assert isinstance(moved[0], Started) and moved[0].pull is not None
    assert moved[0].pull.outcome is PullOutcome.UNSUPPORTED and moved[0].pulled_tokens == 0
    assert backend.stats().transfer == TransferStats()  # the engine inside Triton serves pulls; this replica cannot


async def test_same_tokens_as_the_same_engine_in_process(backend: TritonBackend) -> None:
    local = build_backend(Config(env={**ENGINE_ENV, "CHATMESH_ENGINE": "sim"}))
    await local.start()
    try:
        expected = await collect(local, prompt(owner=b"cmp", seed=7))
    finally:
        await local.close()
    got = await collect(backend, prompt(owner=b"cmp", seed=7))
    assert tokens(got) == tokens(expected)
    assert isinstance(got[-1], Finished) and isinstance(expected[-1], Finished)
    assert got[-1].reason == expected[-1].reason


async def test_cancel_mid_reply_stops_the_sequence_in_the_model(backend: TritonBackend) -> None:
    before = await backend.refresh_stats()
    stream = backend.generate(prompt(owner=b"cancel", max_tokens=2000))
    assert isinstance(await anext(stream), Started)
    assert isinstance(await anext(stream), Delta)
    during = await backend.refresh_stats()
    assert during.running_sequences == before.running_sequences + 1
    await stream.aclose()  # type: ignore[attr-defined]  # the caller went away
    for _ in range(100):
        after = await backend.refresh_stats()
        if after.running_sequences == before.running_sequences:
            break
        await asyncio.sleep(0.05)
    assert after.running_sequences == before.running_sequences, "the model kept generating after the cancel"
    assert after.device.used <= during.device.used
    if during.device.total:  # an engine with a KV cache: the cancelled sequence's blocks are no longer held
        assert after.device.free >= during.device.free


async def has_a_kv_cache(backend: TritonBackend) -> None:
    """The served engine reports its KV cache: 0 device blocks is what a broken stats path reports, not a reason
    to skip the owner-isolation checks."""
    stats = await backend.refresh_stats()
    assert stats.device.total > 0, f"the engine inside Triton reports no device blocks: {stats.device}"


async def test_two_owners_share_only_the_platform_prefix(backend: TritonBackend) -> None:
    await has_a_kv_cache(backend)
    first = await collect(backend, prompt(owner=b"alice", max_tokens=2))
    again = await collect(backend, prompt(owner=b"alice", max_tokens=2))
    other = await collect(backend, prompt(owner=b"bob", max_tokens=2))
    assert isinstance(first[0], Started) and isinstance(again[0], Started) and isinstance(other[0], Started)
    assert again[0].cached_tokens >= len(SYSTEM + PRIVATE) - 16  # the owner's own history is reused
    assert other[0].cached_tokens == len(SYSTEM)  # another owner reuses the system prompt and nothing else


async def test_residency_crosses_triton_to_the_adapter(backend: TritonBackend) -> None:
    """The router's placement input from the engine inside Triton: the conversation's private blocks, then 0
    once deleted, read with the residency command into the adapter's own journal."""
    from dataclasses import replace

    from chatmesh.engine_adapter.residency import FROM_START

    conversation = ConversationId("0b6ee0a4-1f43-4a5e-9d1e-b0a0f5f0a001")
    await collect(backend, replace(prompt(owner=b"dave", max_tokens=2), conversation_id=conversation))
    await backend.refresh_residency()
    first = backend.residency(FROM_START)
    assert first is not None and first.full
    assert dict(first.conversations)[conversation] == len(PRIVATE)  # 64 private tokens: 4 full blocks
    assert await backend.evict_conversation(conversation) == 4
    await backend.refresh_residency()
    changed = backend.residency(first.version)
    assert changed is not None and not changed.full and dict(changed.conversations) == {conversation: 0}


async def test_evict_salt_drops_that_owners_blocks(backend: TritonBackend) -> None:
    await has_a_kv_cache(backend)
    await collect(backend, prompt(owner=b"carol", max_tokens=2))
    assert await backend.evict_salt(b"carol") > 0
    again = await collect(backend, prompt(owner=b"carol", max_tokens=2))
    assert isinstance(again[0], Started) and again[0].cached_tokens == len(SYSTEM)


async def test_model_config_rpc_returns_the_rendered_config(server: TritonServer, backend: TritonBackend) -> None:
    import tritonclient.grpc.aio as grpcclient

    from chatmesh.engine_adapter.triton.render import parse_model_config

    rendered = parse_model_config((server.repository / "chatmesh_llm" / "config.pbtxt").read_text())
    async with grpcclient.InferenceServerClient(server.address) as client:
        served = (await client.get_model_config("chatmesh_llm")).config
    assert served.name == "chatmesh_llm" and served.backend == "python"
    assert served.model_transaction_policy.decoupled
    assert [i.name for i in served.input] == [i.name for i in rendered.input]  # type: ignore[attr-defined]
    assert [o.name for o in served.output] == [o.name for o in rendered.output]  # type: ignore[attr-defined]
    assert served.parameters["engine"].string_value == "sim"


async def test_nothing_listening_is_not_ready_and_generate_is_unavailable_naming_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    b = TritonBackend(TritonOptions(address=address, retries=1, ready_timeout_s=0.3))
    await b.start()  # a Triton still loading its model must not fail the engine's start
    assert not b.ready()
    with pytest.raises(Unavailable, match=address):
        await collect(b, prompt(max_tokens=2))
    assert not b.stats().transfer.serves and not b.stats().transfer.receives
    with pytest.raises(FailedPrecondition, match="cannot serve or import KV blocks"):
        b.serve_prefix(ServeRequest(b"", (bytes(16),), KvLayout("local", b.model, 32, "int8", 1), 1 << 20))
    await b.close()


async def test_triton_stopped_generate_is_unavailable_naming_the_address(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        b = TritonBackend(TritonOptions(address=server.address, retries=1, stats_interval_s=0.1))
        await b.start()
        assert (await collect(b, prompt(max_tokens=2)))[-1].reason in (FinishReason.LENGTH, FinishReason.STOP)  # type: ignore[union-attr]
    finally:
        server.stop()
    with pytest.raises(Unavailable, match=server.address):
        await collect(b, prompt(max_tokens=2))
    for _ in range(50):
        if not b.ready():
            break
        await asyncio.sleep(0.05)
    assert not b.ready()
    await b.close()


async def test_deadline_mid_reply_ends_in_error_and_the_model_stops(server: TritonServer) -> None:
    b = TritonBackend(TritonOptions(address=server.address, timeout_s=0.5, stats_interval_s=0.2))
    await b.start()
    try:
        before = await b.refresh_stats()
        events = await collect(b, prompt(owner=b"slow", max_tokens=5000))  # 10 ms a token: far past 0.5 s
        last = events[-1]
        assert isinstance(last, Finished) and last.reason is FinishReason.ERROR
        assert "DEADLINE_EXCEEDED" in last.error and server.address in last.error
        assert last.usage.output_tokens == len(tokens(events)) > 0
        for _ in range(100):
            after = await b.refresh_stats()
            if after.running_sequences == before.running_sequences:
                break
            await asyncio.sleep(0.05)
        assert after.running_sequences == before.running_sequences, "the model kept generating past the deadline"
    finally:
        await b.close()


async def test_model_refusals_come_back_as_typed_errors(backend: TritonBackend, tmp_path: Path) -> None:
    bad = GenerateParams(prompt_token_ids=(1, 2), max_tokens=2, conversation_id=ConversationId("not-a-uuid"))
    with pytest.raises(InvalidArgument, match="conversation_id"):  # validated in the model, typed on the wire
        await collect(backend, bad)
    server = start_server(tmp_path, engine_env={**ENGINE_ENV, "CHATMESH_MAX_BATCH": "1", "CHATMESH_QUEUE_LIMIT": "1"})
    b = TritonBackend(TritonOptions(address=server.address))
    try:
        await b.start()
        running = b.generate(prompt(owner=b"q1", max_tokens=5000))
        assert isinstance(await anext(running), Started)
        waiting = asyncio.create_task(collect(b, prompt(owner=b"q2", max_tokens=2)))
        for _ in range(400):
            if (await b.refresh_stats()).queue_depth == 1:
                break
            await asyncio.sleep(0.05)
        assert b.stats().queue_depth == 1, "the second generation never queued"
        with pytest.raises(ResourceExhausted, match="queue is full"):
            await collect(b, prompt(owner=b"q3", max_tokens=2))
        await running.aclose()  # type: ignore[attr-defined]
        done = await asyncio.wait_for(waiting, 30)  # the queued one runs once the first is cancelled
        assert isinstance(done[-1], Finished)
    finally:
        await b.close()
        server.stop()
