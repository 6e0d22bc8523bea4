"""Prefix pulls between `local` engines on the real model (SmolLM2-135M), over real gRPC with mutual TLS.

Two engine processes: a conversation's turn 1 runs on A; its turn 2, sent to B naming A as the source, pulls
the history's int8 K/V and scales from A, prefills only the new message, and answers with exactly the ids A gives
from its own cache (greedy). The same with A killed between the turns: B prefills everything, the turn completes.
In-process (the same model, two engines over gRPC): a corrupted block is detected and the turn prefills."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from chatmesh.v1 import generate_pb2, generate_pb2_grpc

from chatmesh.engine_adapter import service as engine_service
from chatmesh.engine_adapter.backend import KvBlockData
from chatmesh.engine_adapter.local.backend import build_local
from chatmesh.engine_adapter.local.model import LoadedModel
from chatmesh.mesh import identity
from chatmesh.mesh.config import Config
from chatmesh.mesh.server import start_server
from chatmesh.model.template import Role, render
from tests.conftest import free_port
from tests.trust import channel_as, trust_as

SECRET = "pull-test-secret"
BS = 16
ENV = {"CHATMESH_ENGINE": "local", "CHATMESH_BLOCK_SIZE": str(BS), "CHATMESH_DEVICE_BLOCKS": "256",
       "CHATMESH_HOST_BLOCKS": "0", "CHATMESH_LOCAL_THREADS": "1", "CHATMESH_FLUSH_INTERVAL_MS": "5",
       "CHATMESH_CACHE_SALT_SECRET": SECRET, "CHATMESH_PREFIX_PULL_TIMEOUT_MS": "30000"}


@dataclass
class Proc:
    replica: str
    address: str
    proc: subprocess.Popen[bytes]


def _spawn(certs: Path, replica: str, log: Path) -> Proc:
    port = free_port()
    env = {**os.environ, **ENV, "CHATMESH_DATA_DIR": str(certs.parent), "CHATMESH_MESH_PLAINTEXT": "false",
           "CHATMESH_LISTEN": f"127.0.0.1:{port}", "CHATMESH_REPLICA_ID": replica,
           "CHATMESH_ENGINE_METRICS_PORT": "0"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "chatmesh.mesh.cli", "serve", "engine"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    return Proc(replica, f"127.0.0.1:{port}", proc)


async def _ready(certs: Path, p: Proc, log: Path) -> None:
    for _ in range(240):  # loading the GGUF on a busy 2-core machine: up to a minute or two
        assert p.proc.poll() is None, log.read_text()[-2000:]
        try:
            async with channel_as(certs, identity.ROUTER, p.address, "engine") as channel:
                await generate_pb2_grpc.GenerateServiceStub(channel).GetStats(generate_pb2.GetStatsRequest(),
                                                                             timeout=2)
            return
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.5)
    raise AssertionError(f"engine {p.replica} did not start: {log.read_text()[-2000:]}")


@pytest.fixture
async def engines(mesh_certs: Path, gguf_file: Path, tmp_path: Path) -> AsyncIterator[tuple[Proc, Proc, Path]]:
    a, b = _spawn(mesh_certs, "a", tmp_path / "a.log"), _spawn(mesh_certs, "b", tmp_path / "b.log")
    try:
        await asyncio.wait_for(asyncio.gather(_ready(mesh_certs, a, tmp_path / "a.log"),
                                              _ready(mesh_certs, b, tmp_path / "b.log")), 200)
        yield a, b, tmp_path
    finally:
        for p in (a, b):
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in (a, b):
            try:
                p.proc.wait(30)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait(10)


def _request(prompt: tuple[int, ...], prefix: int, conversation: str, source: tuple[str, str] = ("", "")
             ) -> generate_pb2.GenerateRequest:
    """A greedy turn for alice (`source`: the replica id and address to pull from)."""
    return generate_pb2.GenerateRequest(
        request_id=str(uuid.uuid4()), conversation_id=conversation, turn_id=str(uuid.uuid4()),
        prompt_token_ids=prompt, owner_id="alice", platform_prefix_tokens=prefix, max_tokens=12,
        source_replica_id=source[0], source_address=source[1])


async def _generate(certs: Path, address: str, request: generate_pb2.GenerateRequest
                    ) -> tuple[generate_pb2.GenerateStarted, str, list[int], generate_pb2.GenerateFinished]:
    async with channel_as(certs, identity.CHAT, address, "engine", owner_tokens=True) as channel:
        events = [e async for e in generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=300)]
    assert events[0].WhichOneof("event") == "started" and events[-1].WhichOneof("event") == "finished"
    deltas = [e.delta for e in events if e.WhichOneof("event") == "delta"]
    return events[0].started, "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], \
        events[-1].finished


async def _stats(certs: Path, address: str) -> generate_pb2.EngineStats:
    async with channel_as(certs, identity.ROUTER, address, "engine") as channel:
        return (await generate_pb2_grpc.GenerateServiceStub(channel).GetStats(generate_pb2.GetStatsRequest())).stats


async def test_turn_two_on_another_engine_pulls_the_history_and_answers_the_same(
        mesh_certs: Path, loaded: LoadedModel, engines: tuple[Proc, Proc, Path]) -> None:
    a, b, _ = engines
    conversation = str(uuid.uuid4())
    one = render(loaded.tokenizer, [(Role.USER, "What is the capital of France?")])
    _, reply, _, _ = await _generate(mesh_certs, a.address, _request(one.token_ids, one.platform_prefix_len,
                                                                      conversation))
    two = render(loaded.tokenizer, [(Role.USER, "What is the capital of France?"), (Role.ASSISTANT, reply),
                                    (Role.USER, "And of Italy?")])
    assert two.token_ids[:len(one.token_ids)] == one.token_ids
    started, _, ids, finished = await _generate(
        mesh_certs, b.address, _request(two.token_ids, two.platform_prefix_len, conversation, source=(a.replica, a.address)))
    assert started.replica_id == "b" and started.pull_outcome == generate_pb2.PULL_OUTCOME_PULLED
    assert started.cached_prompt_tokens == 0  # b's own cache was empty
    assert started.pulled_prompt_tokens >= (len(one.token_ids) // BS) * BS  # at least turn 1's whole prompt
    assert finished.usage.cached_prompt_tokens == started.pulled_prompt_tokens
    stats = await _stats(mesh_certs, b.address)
    assert stats.miss_tokens == len(two.token_ids) - started.pulled_prompt_tokens  # only the new tokens ran
    assert stats.prefix_transfer.pulled_tokens == started.pulled_prompt_tokens
    assert stats.prefix_transfer.pulled_bytes == (started.pulled_prompt_tokens // BS) * \
        stats.prefix_transfer.layout.block_bytes and stats.prefix_transfer.layout.dtype == "int8"
    # A's answer from its own cache of the same prefix: the very same token ids
    home, _, home_ids, _ = await _generate(mesh_certs, a.address, _request(two.token_ids,
                                                                           two.platform_prefix_len, conversation))
    assert home.cached_prompt_tokens == started.pulled_prompt_tokens
    assert ids == home_ids and len(ids) > 0

    # a second conversation whose source is killed between its turns: b prefills, the turn completes
    conversation = str(uuid.uuid4())
    one = render(loaded.tokenizer, [(Role.USER, "Name a large animal.")])
    _, reply, _, _ = await _generate(mesh_certs, a.address, _request(one.token_ids, one.platform_prefix_len,
                                                                      conversation))
    a.proc.kill()
    a.proc.wait(30)
    two = render(loaded.tokenizer, [(Role.USER, "Name a large animal."), (Role.ASSISTANT, reply),
                                    (Role.USER, "And a small one?")])
    before = await _stats(mesh_certs, b.address)
    started, _, ids, finished = await _generate(
        mesh_certs, b.address, _request(two.token_ids, two.platform_prefix_len, conversation, source=(a.replica, a.address)))
    assert started.pull_outcome == generate_pb2.PULL_OUTCOME_UNAVAILABLE and started.pulled_prompt_tokens == 0
    assert started.cached_prompt_tokens <= two.platform_prefix_len  # the shared system prompt, nothing else
    after = await _stats(mesh_certs, b.address)
    assert after.miss_tokens - before.miss_tokens == len(two.token_ids) - started.cached_prompt_tokens
    assert finished.finish_reason in (generate_pb2.FINISH_REASON_STOP, generate_pb2.FINISH_REASON_LENGTH)
    assert ids and after.prefix_transfer.failed_pulls == 1


async def test_a_corrupted_block_is_detected_and_the_turn_prefills(mesh_certs: Path, loaded: LoadedModel) -> None:
    trust = trust_as(mesh_certs, identity.ENGINE)
    cores, services, running = [], [], []
    for replica in ("a", "b"):
        core = build_local(Config(env={**ENV, "CHATMESH_REPLICA_ID": replica}), model=loaded)
        service = engine_service.service_for(core, replica, trust, SECRET.encode())
        cores.append(core)
        services.append(service)
        running.append(await start_server(service, "127.0.0.1:0", trust=trust))
    a, b = cores
    source = ("a", f"127.0.0.1:{running[0].port}")
    try:
        conversation = str(uuid.uuid4())
        one = render(loaded.tokenizer, [(Role.USER, "What is the capital of France?")])
        await _generate(mesh_certs, source[1], _request(one.token_ids, one.platform_prefix_len, conversation))
        flipped: list[int] = []

        def flip_a_byte(block: KvBlockData) -> KvBlockData:
            if flipped:
                return block
            flipped.append(1)
            payload = bytearray(block.payload)
            payload[len(payload) // 2] ^= 0x01
            return dataclasses.replace(block, payload=bytes(payload))

        a.transfers.tamper = flip_a_byte
        two = render(loaded.tokenizer, [(Role.USER, "What is the capital of France?"), (Role.ASSISTANT, "Paris."),
                                        (Role.USER, "And of Italy?")])
        started, _, ids, _ = await _generate(mesh_certs, f"127.0.0.1:{running[1].port}",
                                             _request(two.token_ids, two.platform_prefix_len, conversation, source))
        assert flipped and started.pull_outcome == generate_pb2.PULL_OUTCOME_CORRUPT
        assert started.pulled_prompt_tokens == 0 and started.cached_prompt_tokens == 0 and ids
        assert b.stats().miss_tokens == len(two.token_ids)  # everything prefilled
        b.blocks.check()
        assert b.blocks.available_blocks == b.blocks.cfg.device_blocks  # the dropped import left nothing behind
        assert a.transfers.serving == 0
    finally:
        for service, r in zip(services, running):
            await r.stop(service, 0)
