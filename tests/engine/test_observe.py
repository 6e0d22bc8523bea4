"""The engine's metrics over a real served sim replica: vLLM's names beside chatmesh's, the prefix-cache counters
in tokens equal to what the streams reported, per-chunk (not per-token) latency observations."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import httpx

from chatmesh.engine_adapter import service as engine_service
from chatmesh.mesh import status
from chatmesh.mesh.config import Config
from chatmesh.mesh.server import serve
from chatmesh.mesh.trust import Trust
from chatmesh.v1 import generate_pb2, generate_pb2_grpc
from tests.conftest import free_port


async def test_a_replica_exports_vllm_and_chatmesh_names_that_agree_with_its_streams() -> None:
    cfg = Config(env={"CHATMESH_ENGINE": "sim", "CHATMESH_SIM_STEP_MS": "2", "CHATMESH_SIM_TEXT": "words",
                      "CHATMESH_DEVICE_BLOCKS": "64", "CHATMESH_HOST_BLOCKS": "64"})
    port, metrics_port = free_port(), free_port()
    ready, stop = asyncio.Event(), asyncio.Event()
    service = engine_service.build(cfg, Trust.insecure())
    task = asyncio.create_task(serve(service, f"127.0.0.1:{port}", 0.5, ready, stop, trust=Trust.insecure(),
                                     metrics_port=metrics_port))
    await asyncio.wait_for(ready.wait(), 10)
    prompt = list(range(1, 101))
    usages, deltas, tokens = [], 0, 0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            for _ in range(2):  # the same prompt twice: the second finds its full blocks in the cache
                async for r in stub.Generate(generate_pb2.GenerateRequest(
                        request_id=str(uuid.uuid4()), prompt_token_ids=prompt, cache_salt=b"owner-a",
                        max_tokens=12)):
                    if r.WhichOneof("event") == "delta" and r.delta.token_ids:
                        deltas += 1
                        tokens += len(r.delta.token_ids)
                    if r.WhichOneof("event") == "finished":
                        usages.append(r.finished.usage)
        async with httpx.AsyncClient() as http:
            got = status.parse((await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    cached = sum(u.cached_prompt_tokens for u in usages)
    assert usages[1].cached_prompt_tokens == 96  # three full blocks of 32
    for name in ("vllm:prefix_cache_hits_total", "chatmesh_engine_prefix_cache_hit_tokens_total"):
        assert got[name, ()] == cached
    assert got["vllm:prefix_cache_queries_total", ()] == 2 * len(prompt)
    assert got["vllm:num_requests_running", ()] == 0 and got["vllm:num_requests_waiting", ()] == 0
    assert got["vllm:generation_tokens_total", ()] == tokens == 24
    assert got["vllm:time_to_first_token_seconds_count", ()] == 2
    assert got["gen_ai_server_time_to_first_token_seconds_count", ()] == 2
    # one inter-token observation per token after each stream's first chunk, made once per chunk
    first_chunk_tokens = tokens - got["vllm:inter_token_latency_seconds_count", ()]
    assert 2 <= first_chunk_tokens <= tokens and deltas < tokens
    assert got["vllm:request_success_total", (("finished_reason", "length"),)] == 2
    assert 0 < got["vllm:kv_cache_usage_perc", ()] <= 1
    assert got["chatmesh_engine_kv_blocks", (("state", "used"), ("tier", "device"))] > 0
    assert got["chatmesh_engine_step_tokens_total", (("phase", "prefill"),)] == 2 * len(prompt) - cached
    assert got["chatmesh_engine_step_seconds_count", ()] > 0
