"""The shared metrics mechanism: series, bucket placement, aliases, the label rule, and the /metrics endpoint of a
real service started by the bootstrap (with the RPC counts its error decorators keep)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from chatmesh.mesh import errors, metrics
from chatmesh.mesh.trust import Trust
from chatmesh.mesh.server import Service, serve, unary_errors
from chatmesh.v1 import route_pb2, route_pb2_grpc
from tests.conftest import free_port


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def test_histogram_places_each_value_in_its_le_bucket_and_counts_batches() -> None:
    reg = metrics.Registry(process=False)
    h = reg.histogram("chatmesh_test_seconds", "test", (0.01, 0.1, 1.0), also=("vllm:test_seconds",))
    h.observe(0.01)        # exactly on a bound: counted in that bucket (le)
    h.observe(0.05, n=3)   # a flushed chunk of three tokens is one call
    h.observe(7.0)
    got = samples(reg.exposition())
    for name in ("chatmesh_test_seconds", "vllm:test_seconds"):
        assert got[name + "_bucket", (("le", "0.01"),)] == 1
        assert got[name + "_bucket", (("le", "0.1"),)] == 4
        assert got[name + "_bucket", (("le", "1.0"),)] == 4
        assert got[name + "_bucket", (("le", "+Inf"),)] == 5
        assert got[name + "_count", ()] == 5
        assert got[name + "_sum", ()] == pytest.approx(0.01 + 0.15 + 7.0)


def test_counters_and_gauges_render_by_label() -> None:
    reg = metrics.Registry(process=False)
    c = reg.counter("chatmesh_test_turns", "test", ["outcome"])
    c.labels("stored").inc()
    c.labels("stored").inc(2)
    c.labels("failed").inc()
    reg.gauges("chatmesh_test_blocks", "test", lambda: [(("device",), 5.0), (("host",), 2.0)], ["tier"])
    got = samples(reg.exposition())
    assert got["chatmesh_test_turns_total", (("outcome", "stored"),)] == 3
    assert got["chatmesh_test_turns_total", (("outcome", "failed"),)] == 1
    assert got["chatmesh_test_blocks", (("tier", "host"),)] == 2


@pytest.mark.parametrize("label", ["owner_id", "conversation_id", "text", "user"])
def test_a_label_that_would_carry_user_data_is_refused(label: str) -> None:
    reg = metrics.Registry(process=False)
    with pytest.raises(ValueError, match=label):
        reg.counter("chatmesh_test_x", "test", [label])


def test_buckets_span_the_quantities_they_measure() -> None:
    assert metrics.TTFT_BUCKETS[0] == 0.005 and metrics.TTFT_BUCKETS[-1] == 30.0
    assert metrics.ITL_BUCKETS[0] == 0.001 and metrics.ITL_BUCKETS[-1] == 1.0


class _Router(route_pb2_grpc.RouteServiceServicer):
    @unary_errors
    async def ListReplicas(self, request: route_pb2.ListReplicasRequest,
                           context: grpc.aio.ServicerContext[object, object]) -> route_pb2.ListReplicasResponse:
        return route_pb2.ListReplicasResponse()

    @unary_errors
    async def ReleaseLease(self, request: route_pb2.ReleaseLeaseRequest,
                           context: grpc.aio.ServicerContext[object, object]) -> route_pb2.ReleaseLeaseResponse:
        raise errors.NotFound("no such lease")


async def test_the_bootstrap_serves_a_services_metrics_and_counts_its_rpcs_by_code() -> None:
    registry = metrics.Registry()
    registry.counter("chatmesh_test_things", "test").inc(4)

    def register(server: grpc.aio.Server) -> Sequence[str]:
        route_pb2_grpc.add_RouteServiceServicer_to_server(_Router(), server)  # type: ignore[abstract]
        return ["chatmesh.v1.RouteService"]

    address, port = f"127.0.0.1:{free_port()}", free_port()
    ready, stop = asyncio.Event(), asyncio.Event()
    before = samples(metrics.Registry(process=False).exposition())
    task = asyncio.create_task(serve(Service("test", register, metrics=registry), address, 0.1, ready, stop,
                                     metrics_port=port, trust=Trust.insecure()))
    await ready.wait()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = route_pb2_grpc.RouteServiceStub(channel)
            await stub.ListReplicas(route_pb2.ListReplicasRequest())
            await stub.ListReplicas(route_pb2.ListReplicasRequest())
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.ReleaseLease(route_pb2.ReleaseLeaseRequest(lease_id="x"))
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        async with httpx.AsyncClient() as http:
            resp = await http.get(f"http://127.0.0.1:{port}/metrics")
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
            got = samples(resp.content)
            old = await http.get(f"http://127.0.0.1:{port}/metrics?ago=60")
            assert old.status_code == 200 and float(old.headers["x-chatmesh-age-seconds"]) >= 0
            assert (await http.get(f"http://127.0.0.1:{port}/other")).status_code == 404
    finally:
        stop.set()
        await task

    def delta(name: str, labels: tuple[tuple[str, str], ...]) -> float:
        return got.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert got["chatmesh_test_things_total", ()] == 4
    assert delta("chatmesh_rpc_server_handled_total", (("code", "OK"), ("method", "ListReplicas"))) == 2
    assert delta("chatmesh_rpc_server_handled_total", (("code", "NOT_FOUND"), ("method", "ReleaseLease"))) == 1
    assert delta("chatmesh_rpc_server_handling_seconds_count", (("method", "ListReplicas"),)) == 2
    assert ("process_cpu_seconds_total", ()) in got


def test_the_direct_exposition_is_byte_for_byte_what_prometheus_client_writes() -> None:
    """Registry.exposition formats chatmesh's own series itself (no metric objects per scrape); the text must be
    exactly prometheus_client's for the same families: escaping, label order, aliases, +Inf, tiny values."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    r = metrics.Registry(process=False)
    c = r.counter("chatmesh_t_turns", 'turns\nby "outcome" \\', ["outcome"], also=("vllm:t_turns",))
    c.labels("ok").inc()
    c.labels('a"b\\c\nd').inc(2.5e-7)
    r.counter("chatmesh_t_plain", "plain")
    h = r.histogram("chatmesh_t_seconds", "h", (0.005, 0.5), ["replica", "b"], also=("vllm:t_seconds",))
    h.labels("engine-0", "x").observe(0.01, 3)
    h.labels("engine-1", "y").observe(7.0)
    r.histogram("chatmesh_t2_seconds", "h2", (1, 2))
    r.gauges("chatmesh_t_g", "g", lambda: [(("a",), 1.5), (("b",), float("inf"))], ["replica"])
    metrics.RPC.done("chatmesh.v1.TestService/Exposition", "OK", 0.001)

    class Families(Collector):
        def collect(self) -> Iterator[Metric]:
            return r.collect()

    reference = CollectorRegistry(auto_describe=False)
    reference.register(Families())
    assert r.exposition() == generate_latest(reference)
    h.labels("engine-0", "x").observe(0.2)  # kept label strings, new counts
    assert r.exposition() == generate_latest(reference)
