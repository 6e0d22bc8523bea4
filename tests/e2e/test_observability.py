"""Seeing the mesh work, with real parts: Debian's Prometheus server scraping every service of a real mesh, an OTLP
receiver decoding the spans the services export over real OTLP/gRPC, and `chatmesh status`, all checked against
the turns this test sends (counts exact, cached tokens equal to the sum the SSE `turn.completed` events reported).
The label-and-text audit runs over the same mesh: no metric label or span attribute carries message text or the
owner id, and no label carries a conversation or turn id."""

from __future__ import annotations

import bisect
import json
import math
import secrets
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from chatmesh.mesh import identity as ident
from chatmesh.mesh import metrics, status
from chatmesh.mesh.up import Mesh
from chatmesh.v1 import generate_pb2, generate_pb2_grpc, route_pb2, route_pb2_grpc
from tests.conftest import free_port, need
from tests.e2e.conftest import channel, read_sse, start_mesh

pytestmark = [pytest.mark.slow, pytest.mark.services]

# Texts with words no metric or span name could hold by chance.
TEXTS = ["Zanzibar quokka: how far is the lighthouse?", "And the quokka's second lighthouse, Zanzibar?"]
OWNER = "obs-owner-7f3a9c"  # CHATMESH_AUTH=local's user id in this mesh: a string no label could hold by chance


@dataclass
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    attributes: dict[str, Any]


@dataclass
class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: decodes each ExportTraceServiceRequest as the collector would."""

    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(Span(str(resource.get("service.name")), s.trace_id.hex(), s.span_id.hex(),
                                               s.parent_span_id.hex(), s.name,
                                               {a.key: _value(a.value) for a in s.attributes}))
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class Observed:
    mesh: Mesh
    receiver: Receiver
    prometheus: str
    turns: list[dict[str, Any]]  # each turn.completed event's data
    trace_id: str
    edge_parent: str
    conversations: list[str]
    turn_ids: list[str]


def _start_prometheus(tmp: Path, mesh: Mesh) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("prometheus")
    need(binary is not None, "Debian's prometheus (apt-get install prometheus)")
    assert binary is not None
    config = tmp / "prometheus.yml"
    config.write_text(status.scrape_config(mesh.cfg, interval_s=0.5))
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=(tmp / "prometheus.log").open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("prometheus did not become ready")


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("observe")
    receiver = Receiver()
    otlp = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, otlp)  # type: ignore[no-untyped-call]
    otlp_port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    mesh = start_mesh(tmp, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp_port}",
                      OTEL_BSP_SCHEDULE_DELAY="100", CHATMESH_MAX_REPLY_TOKENS="24", CHATMESH_LOCAL_USER=OWNER)
    prometheus: subprocess.Popen[bytes] | None = None
    try:
        prometheus, prom_url = _start_prometheus(tmp, mesh)
        trace_id, edge_parent = secrets.token_hex(16), secrets.token_hex(8)
        turns: list[dict[str, Any]] = []
        conversations, turn_ids = [], []
        with httpx.Client(base_url=mesh.gateway_url, timeout=60) as client:
            for c in range(2):
                conv = client.post("/v1/conversations", json={}).json()["id"]
                conversations.append(conv)
                for t, text in enumerate(TEXTS):
                    turn_id = str(uuid.uuid4())
                    turn_ids.append(turn_id)
                    headers = {"traceparent": f"00-{trace_id}-{edge_parent}-01"} if (c, t) == (0, 0) else {}
                    with client.stream("POST", f"/v1/conversations/{conv}/turns", headers=headers,
                                       json={"turn_id": turn_id, "content": text}) as resp:
                        assert resp.status_code == 200
                        done = [e.data for e in read_sse(resp) if e.event == "turn.completed"]
                    assert len(done) == 1
                    turns.append(done[0])
        yield Observed(mesh, receiver, prom_url, turns, trace_id, edge_parent, conversations, turn_ids)
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(10)
        mesh.stop()
        otlp.stop(0)


def query(prometheus: str, expr: str) -> dict[str, float]:
    """An instant query: {'label=value,...': value} per series."""
    resp = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=5).json()
    assert resp["status"] == "success", resp
    return {",".join(f"{k}={v}" for k, v in sorted(r["metric"].items()) if k != "__name__"): float(r["value"][1])
            for r in resp["data"]["result"]}


def wait_for(prometheus: str, expr: str, want: float, timeout_s: float = 30) -> None:
    deadline, got = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        got = query(prometheus, expr)
        if list(got.values()) == [want]:
            return
        time.sleep(0.3)
    raise AssertionError(f"{expr}: got {got}, wanted {want}")


def test_prometheus_reads_the_turns_sent(observed: Observed) -> None:
    prom, turns = observed.prometheus, observed.turns
    prompt = sum(t["usage"]["prompt_tokens"] for t in turns)
    cached = sum(t["usage"]["cached_prompt_tokens"] for t in turns)
    assert cached > 0  # the second turn of each conversation hit the cache
    wait_for(prom, 'sum(chatmesh_gateway_turns_total{outcome="completed"})', len(turns))
    wait_for(prom, "sum(vllm:prefix_cache_hits_total)", cached)
    # each target is scraped on its own schedule: wait until chat's and the store's latest scrapes hold every turn too
    wait_for(prom, 'sum(chatmesh_chat_turns_total{outcome="stored"})', len(turns))
    wait_for(prom, 'sum(chatmesh_store_claims_total{answer="claimed"})', len(turns))
    assert query(prom, "sum by (outcome) (chatmesh_gateway_turns_total)") == {"outcome=completed": len(turns)}
    assert query(prom, "sum(vllm:prefix_cache_queries_total)") == {"": prompt}
    hit_rate = query(prom, "sum(vllm:prefix_cache_hits_total) / sum(vllm:prefix_cache_queries_total)")
    assert hit_rate[""] == pytest.approx(cached / prompt)
    assert query(prom, "sum(chatmesh_engine_prefix_cache_hit_tokens_total)") == {"": cached}
    # TTFT p95 as Prometheus interpolates it equals the same quantile of the TTFTs the edge reported per turn
    ttfts = [t["ttft_ms"] / 1000 for t in turns]
    counts = [0] * (len(metrics.TTFT_BUCKETS) + 1)
    for v in ttfts:
        counts[bisect.bisect_left(metrics.TTFT_BUCKETS, v)] += 1
    cumulative = {le: float(sum(counts[:i + 1])) for i, le in enumerate((*metrics.TTFT_BUCKETS, math.inf))}
    p95 = query(prom, "histogram_quantile(0.95, sum by (le) (chatmesh_gateway_time_to_first_token_seconds_bucket))")
    assert p95[""] == pytest.approx(status.quantile(0.95, cumulative), rel=1e-6)
    assert query(prom, "sum(chatmesh_gateway_time_to_first_token_seconds_count)") == {"": len(turns)}
    # the store's claims by answer and its RPCs by code; the router's picks per replica
    assert query(prom, "sum by (answer) (chatmesh_store_claims_total)") == {
        "answer=claimed": len(turns), "answer=in_progress": 0, "answer=done": 0, "answer=conflict": 0}
    begin = query(prom, 'sum(chatmesh_rpc_server_handled_total{job="chatmesh-store",method="BeginTurn",code="OK"})')
    assert begin == {"": len(turns)}
    picks = query(prom, "sum by (replica) (chatmesh_router_picks_total)")
    assert picks == {"replica=engine-0": len(turns)}
    # chat's own view: turns by the state machine's outcome, prompt tokens cached vs prefilled
    assert query(prom, "sum by (outcome) (chatmesh_chat_turns_total) > 0") == {"outcome=stored": len(turns)}
    assert query(prom, "sum by (source) (chatmesh_chat_prompt_tokens_total)") == {
        "source=cached": cached, "source=prefilled": prompt - cached}
    assert query(prom, "sum(chatmesh_chat_time_to_first_token_seconds_count)") == {"": len(turns)}
    assert query(prom, "sum(vllm:num_requests_running)") == {"": 0}
    assert 0 < query(prom, "sum(vllm:kv_cache_usage_perc)")[""] <= 1


def test_chatmesh_status_shows_the_same_figures(observed: Observed) -> None:
    turns = observed.turns
    report = status.report(observed.mesh.cfg)
    assert all(report.health.values()), report.health
    assert report.turns == {"completed": len(turns)}
    prompt = sum(t["usage"]["prompt_tokens"] for t in turns)
    cached = sum(t["usage"]["cached_prompt_tokens"] for t in turns)
    assert report.hit_rate == pytest.approx(cached / prompt)
    assert report.replicas["engine-0"]["serving"] == 1
    assert min(t["ttft_ms"] for t in turns) / 1000 <= report.ttft_p95_s
    text = report.render()
    assert "engine-0" in text and f"{cached / prompt * 100:.1f}%" in text


def _wait_spans(receiver: Receiver, trace_id: str, names: set[str], timeout_s: float = 20) -> list[Span]:
    deadline = time.monotonic() + timeout_s
    spans: list[Span] = []
    while time.monotonic() < deadline:
        spans = receiver.trace(trace_id)
        if names <= {s.name for s in spans}:
            return spans
        time.sleep(0.2)
    raise AssertionError(f"spans of trace {trace_id}: {sorted({(s.service, s.name) for s in spans})}")


def test_one_turn_is_one_trace_from_the_edge(observed: Observed) -> None:
    edge_name, chat_name = "POST /v1/conversations/{conversation_id}/turns", "chatmesh.v1.ChatService/SendTurn"
    # (child span, its parent span, the child's service)
    chain = [
        ("claim", chat_name, "chatmesh-chat"), ("chatmesh.v1.StoreService/BeginTurn", "claim", "chatmesh-store"),
        ("route", chat_name, "chatmesh-chat"), ("chatmesh.v1.RouteService/PickReplica", "route", "chatmesh-router"),
        ("input_check", chat_name, "chatmesh-chat"),
        ("chatmesh.v1.ModerateService/CheckInput", "input_check", "chatmesh-moderation"),
        ("generate", chat_name, "chatmesh-chat"),
        ("chatmesh.v1.GenerateService/Generate", "generate", "chatmesh-engine"),
        ("queue", "chatmesh.v1.GenerateService/Generate", "chatmesh-engine"),
        ("prefill", "chatmesh.v1.GenerateService/Generate", "chatmesh-engine"),
        ("first_token", "generate", "chatmesh-chat"), ("output_checks", chat_name, "chatmesh-chat"),
        ("finish", chat_name, "chatmesh-chat"), ("chatmesh.v1.StoreService/FinishTurn", "finish", "chatmesh-store"),
    ]
    spans = _wait_spans(observed.receiver, observed.trace_id, {edge_name, chat_name} | {c for c, _, _ in chain})
    by_name = {s.name: s for s in spans}
    edge, chat = by_name[edge_name], by_name[chat_name]
    assert edge.service == "chatmesh-gateway" and edge.parent_id == observed.edge_parent  # the caller's traceparent
    assert edge.attributes["gen_ai.conversation.id"] == observed.conversations[0]
    assert edge.attributes["chatmesh.turn.id"] == observed.turn_ids[0]
    assert edge.attributes["http.response.status_code"] == 200
    assert chat.service == "chatmesh-chat" and chat.parent_id == edge.span_id
    chat_ids = {s.span_id for s in spans if s.service == "chatmesh-chat"}
    for child, parent, service in chain:
        span = by_name[child]
        assert span.service == service, (child, span.service)
        if parent == chat_name:  # a phase of the turn: under chat's span (or a chat span that began it)
            assert span.parent_id in chat_ids, child
        else:
            assert span.parent_id == by_name[parent].span_id, (child, parent)
    first = observed.turns[0]["usage"]
    generate = by_name["chatmesh.v1.GenerateService/Generate"]
    assert generate.attributes["gen_ai.usage.input_tokens"] == first["prompt_tokens"]
    assert generate.attributes["chatmesh.prompt.cached_tokens"] == first["cached_prompt_tokens"]
    assert generate.attributes["chatmesh.replica.id"] == "engine-0"
    assert by_name["chatmesh.v1.StoreService/BeginTurn"].attributes["chatmesh.claim"] == "claimed"
    assert by_name["output_checks"].attributes["chatmesh.output.chunks"] >= 1
    # every other turn is a trace of its own: only the first carried this trace id
    assert [s for s in spans if s.name == edge.name] == [edge]


async def test_store_router_and_engine_continue_a_callers_trace(observed: Observed) -> None:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    metadata = (("traceparent", f"00-{trace_id}-{parent}-01"),)
    # as chat calls them: chat's certificate, and for Generate an owner token for the owner it names
    async with channel(observed.mesh, "router", ident.CHAT) as ch:
        pick = await route_pb2_grpc.RouteServiceStub(ch).PickReplica(
            route_pb2.PickReplicaRequest(conversation_id=observed.conversations[0]), metadata=metadata)
        await route_pb2_grpc.RouteServiceStub(ch).ReleaseLease(
            route_pb2.ReleaseLeaseRequest(lease_id=pick.lease_id), metadata=metadata)
    async with channel(observed.mesh, "engine", ident.CHAT, owner_tokens=True) as ch:
        async for _ in generate_pb2_grpc.GenerateServiceStub(ch).Generate(generate_pb2.GenerateRequest(
                prompt_token_ids=list(range(1, 90)), max_tokens=4, request_id="trace-test", owner_id="trace-test"),
                metadata=metadata):
            pass
    spans = _wait_spans(observed.receiver, trace_id, {
        "chatmesh.v1.RouteService/PickReplica", "chatmesh.v1.GenerateService/Generate", "queue", "prefill"})
    by_name = {s.name: s for s in spans}
    assert by_name["chatmesh.v1.RouteService/PickReplica"].parent_id == parent
    assert by_name["chatmesh.v1.RouteService/PickReplica"].service == "chatmesh-router"
    generate = by_name["chatmesh.v1.GenerateService/Generate"]
    assert generate.service == "chatmesh-engine" and generate.parent_id == parent
    assert generate.attributes["chatmesh.replica.id"] == "engine-0"
    assert generate.attributes["gen_ai.usage.input_tokens"] == 89
    assert generate.attributes["gen_ai.usage.output_tokens"] == 4
    assert by_name["queue"].parent_id == generate.span_id and by_name["prefill"].parent_id == generate.span_id


def test_no_label_or_attribute_carries_text_or_owner(observed: Observed) -> None:
    ids = set(observed.conversations) | set(observed.turn_ids)
    words = {w.strip("?,:'s").lower() for text in TEXTS for w in text.split() if len(w) > 5}
    for service, url in observed.mesh.metrics_urls.items():
        text = httpx.get(url, timeout=5).text
        for (name, labels), _ in status.parse(text).items():
            for key, value in labels:
                where = f"{service}: {name}{{{key}={value!r}}}"
                assert OWNER not in value and value not in ids, where
                assert not any(w in value.lower() for w in words), where
    spans = list(observed.receiver.spans)
    assert {s.service for s in spans} >= {"chatmesh-gateway", "chatmesh-chat", "chatmesh-moderation",
                                         "chatmesh-store", "chatmesh-router", "chatmesh-engine"}
    for s in spans:
        for key, value in s.attributes.items():
            shown = json.dumps(value).lower()
            assert not any(w in shown for w in words), (s.service, s.name, key)
            assert OWNER not in shown, (s.service, s.name, key)
            if isinstance(value, str) and value in ids:
                assert key in ("gen_ai.conversation.id", "chatmesh.turn.id"), (s.name, key)


def test_the_dashboards_queries_run_on_prometheus_over_scraped_names(observed: Observed) -> None:
    import re

    dashboard = json.loads((Path(__file__).parents[2] / "docs/observability/grafana-dashboard.json").read_text())
    names = set(httpx.get(observed.prometheus + "/api/v1/label/__name__/values", timeout=5).json()["data"])
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            query(observed.prometheus, target["expr"])  # valid PromQL (asserts status success)
            for name in re.findall(r"\b(?:chatmesh_|vllm:)[a-z_:]+", target["expr"]):
                assert name in names, (panel["title"], name)
