"""chatmesh's span recorder (chatmesh.mesh.tracing) without a mesh: W3C trace context in and out, the standard
samplers, parenting, and the OTLP protobuf it encodes, decoded by the real protobuf classes. The wire to a
receiver and a turn across six processes are tests/e2e/test_observability.py's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from grpc_health.v1 import health_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1 import trace_pb2

from chatmesh.mesh import tracing
from chatmesh.v1 import moderate_pb2  # noqa: F401  (its service in the descriptor pool)

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class Collected:
    def __init__(self) -> None:
        self.spans: list[tracing.Span] = []

    def add(self, span: tracing.Span) -> None:
        self.spans.append(span)


@pytest.fixture
def on(monkeypatch: pytest.MonkeyPatch) -> Iterator[Collected]:
    """Tracing on in this process, ended spans collected instead of exported."""
    collected = Collected()
    monkeypatch.setattr(tracing, "ON", True)
    monkeypatch.setattr(tracing, "_exporter", collected)
    monkeypatch.setattr(tracing, "_decide", tracing.sampler({}))
    yield collected


def decoded(spans: list[tracing.Span]) -> list[trace_pb2.Span]:
    wire = tracing.encode(spans, Resource(), InstrumentationScope(name="chatmesh")).SerializeToString()
    request = ExportTraceServiceRequest.FromString(wire)
    assert request.resource_spans[0].scope_spans[0].scope.name == "chatmesh"
    return list(request.resource_spans[0].scope_spans[0].spans)


def attributes(span: trace_pb2.Span) -> dict[str, Any]:
    return {a.key: getattr(a.value, str(a.value.WhichOneof("value"))) for a in span.attributes}


@pytest.mark.parametrize("header, expected", [
    (f"00-{TRACE}-{PARENT}-01", (int(TRACE, 16), int(PARENT, 16), True)),
    (f"00-{TRACE}-{PARENT}-00", (int(TRACE, 16), int(PARENT, 16), False)),
    (f"01-{TRACE}-{PARENT}-09-future", (int(TRACE, 16), int(PARENT, 16), True)),  # a later version may add fields
    (f"00-{TRACE}-{PARENT}-01-extra", None),  # version 00 may not
    (f"ff-{TRACE}-{PARENT}-01", None),
    (f"00-{'0' * 32}-{PARENT}-01", None),
    (f"00-{TRACE}-{'0' * 16}-01", None),
    (f"00-{TRACE.upper()}-{PARENT}-01", None),
    (f"00-{TRACE}-{PARENT}", None),
    ("", None),
])
def test_traceparent_is_read_as_w3c_defines_it(header: str, expected: tuple[int, int, bool] | None) -> None:
    parent = tracing.parse_traceparent(header, "vendor=x")
    got = None if parent is None else (parent.trace_id, parent.span_id, parent.sampled)
    assert got == expected


def test_samplers_by_their_standard_names() -> None:
    sampled = tracing.parse_traceparent(f"00-{TRACE}-{PARENT}-01")
    unsampled = tracing.parse_traceparent(f"00-{TRACE}-{PARENT}-00")
    low, high = 5, (1 << 64) - 5  # a trace id's low 64 bits against the ratio's bound
    default = tracing.sampler({})
    assert default(None, high) and default(sampled, high) and not default(unsampled, high)
    ratio = tracing.sampler({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"})
    assert ratio(None, low) and not ratio(None, high)
    assert ratio(sampled, high) and not ratio(unsampled, low)  # a caller's decision stands
    plain = tracing.sampler({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"})
    assert plain(unsampled, low) and not plain(sampled, high)  # not parent-based: the trace id decides
    assert not tracing.sampler({"OTEL_TRACES_SAMPLER": "always_off"})(sampled, low)
    assert tracing.sampler({"OTEL_TRACES_SAMPLER": "parentbased_always_off"})(sampled, low)
    assert not tracing.sampler({"OTEL_TRACES_SAMPLER": "parentbased_always_off"})(None, low)


def test_a_turns_spans_nest_and_encode_as_otlp(on: Collected) -> None:
    root = tracing.start_root("POST", {"traceparent": f"00-{TRACE}-{PARENT}-01", "tracestate": "vendor=x"},
                              {"http.request.method": "POST"})
    assert root is not None
    with tracing.use(root):
        with tracing.span("claim", {"n": 3}) as claim:
            assert claim is not None and tracing.current() is claim
            carrier = tracing.inject({})
            tracing.annotate({"ok": True, "ratio": 0.5})
        with pytest.raises(KeyError), tracing.span("route"):
            raise KeyError("a message that is not recorded")
        tracing.record("queue", 1_000, 2_000)
        with tracing.detached():
            assert tracing.current() is None and tracing.inject({}) == {}
    assert root.end_ns == 0 and len(on.spans) == 3  # `use` does not end the root: its owner does
    root.update_name("POST /v1/turns")
    root.end()
    root.end()  # once only
    assert tracing.current() is None
    assert carrier == {"traceparent": f"00-{TRACE}-{claim.span_id:016x}-01", "tracestate": "vendor=x"}

    by_name = {s.name: s for s in decoded(on.spans)}
    assert sorted(by_name) == ["POST /v1/turns", "claim", "queue", "route"]
    edge = by_name["POST /v1/turns"]
    assert edge.trace_id.hex() == TRACE and edge.parent_span_id.hex() == PARENT
    assert edge.kind == trace_pb2.Span.SPAN_KIND_SERVER and edge.trace_state == "vendor=x"
    assert edge.flags == 0x301  # the parent is remote; sampled
    for name in ("claim", "route", "queue"):
        child = by_name[name]
        assert child.trace_id.hex() == TRACE and child.parent_span_id == edge.span_id, name
        assert child.kind == trace_pb2.Span.SPAN_KIND_INTERNAL and child.flags == 0x101, name
        assert child.span_id not in (edge.span_id, bytes.fromhex(PARENT)), name
    assert attributes(by_name["claim"]) == {"n": 3, "ok": True, "ratio": 0.5}
    assert attributes(edge) == {"http.request.method": "POST"}
    assert by_name["route"].status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert by_name["route"].status.message == "KeyError"  # the type only: a message may hold text
    assert (by_name["queue"].start_time_unix_nano, by_name["queue"].end_time_unix_nano) == (1_000, 2_000)
    assert edge.start_time_unix_nano <= by_name["claim"].start_time_unix_nano <= edge.end_time_unix_nano


def test_the_wire_encoding_is_the_protobuf_classes_own() -> None:
    """`encode` writes protobuf's wire format by hand: it must be byte for byte what building the messages with
    opentelemetry-proto's classes gives, for every field and attribute type it writes (and a seen attribute,
    encoded from the memo, the same as a new one)."""
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    values: dict[str, tracing.Value] = {"s": "é" * 200, "empty": "", "t": True, "f": False, "zero": 0, "n": -5,
                                        "big": 2**63 - 1, "least": -(2**63), "x": 2.5, "nx": -0.0}
    remote = tracing.Span(int(TRACE, 16), 7, int(PARENT, 16), True, "vendor=x", True, "chatmesh.v1.S/M",
                          tracing.SERVER, values, start_ns=1_700_000_000_123_456_789)
    remote.error, remote.end_ns = "ValueError", remote.start_ns + 300
    child = remote.child("claim", {"s": "é" * 200, "t": True}, start_ns=5)
    child.end_ns = 2**64 - 1
    root = tracing.Span(1, 2**64 - 1, 0, False, "", True, "", tracing.INTERNAL, None, start_ns=1)
    root.end_ns = 2

    def any_value(v: tracing.Value) -> AnyValue:
        if isinstance(v, bool):
            return AnyValue(bool_value=v)
        return AnyValue(int_value=v) if isinstance(v, int) else \
            AnyValue(double_value=v) if isinstance(v, float) else AnyValue(string_value=v)

    def built(s: tracing.Span) -> trace_pb2.Span:
        pb = trace_pb2.Span(trace_id=s.trace_id.to_bytes(16, "big"), span_id=s.span_id.to_bytes(8, "big"),
                            name=s.name, kind=s.kind, start_time_unix_nano=s.start_ns,  # type: ignore[arg-type]
                            end_time_unix_nano=s.end_ns, flags=0x301 if s.remote_parent else 0x101,
                            trace_state=s.trace_state,
                            attributes=[KeyValue(key=k, value=any_value(v)) for k, v in s.attributes.items()])
        if s.parent_id:
            pb.parent_span_id = s.parent_id.to_bytes(8, "big")
        if s.error:
            pb.status.code, pb.status.message = trace_pb2.Status.STATUS_CODE_ERROR, s.error
        return pb

    resource = Resource(attributes=[KeyValue(key="service.name", value=AnyValue(string_value="chatmesh-chat"))])
    scope = InstrumentationScope(name="chatmesh")
    spans = [remote, child, root]
    expected = ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
        resource=resource, scope_spans=[trace_pb2.ScopeSpans(scope=scope, spans=[built(s) for s in spans])])])
    for _ in range(2):  # the second time from the memo
        assert tracing.encode(spans, resource, scope).SerializeToString() == expected.SerializeToString()
        assert tracing.encode(spans, resource.SerializeToString(), scope.SerializeToString()) == expected


def test_an_unsampled_caller_is_followed_not_recorded(on: Collected) -> None:
    root = tracing.start_root("POST", {"traceparent": f"00-{TRACE}-{PARENT}-00"})
    assert root is not None and not root.is_recording()
    with tracing.use(root):
        assert tracing.span("claim") is tracing._NOOP and tracing.current() is None
        assert tracing.inject({})["traceparent"] == f"00-{TRACE}-{root.span_id:016x}-00"  # still propagated
    root.end()
    assert on.spans == []


class Context:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


class Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    pass


class Plain:
    pass


def test_a_server_span_only_for_a_call_that_carries_a_trace(on: Collected) -> None:
    tracing.served(["chatmesh.v1.ModerateService"])
    with tracing.serving(Health(), "Check", Context((("x", "y"),))):
        assert tracing.current() is None
    with tracing.serving(Health(), "Check", Context((("traceparent", f"00-{TRACE}-{PARENT}-01"),))) as s:
        assert s is tracing.current() and s is not None
    with tracing.serving(Plain(), "CheckInput", Context((("traceparent", f"00-{TRACE}-{PARENT}-01"),))):
        pass
    health, moderate = decoded(on.spans)
    assert health.name == "grpc.health.v1.Health/Check"  # from the generated servicer it subclasses
    assert moderate.name == "chatmesh.v1.ModerateService/CheckInput"  # from the services this process serves
    assert attributes(moderate) == {"rpc.system": "grpc", "rpc.service": "chatmesh.v1.ModerateService",
                                    "rpc.method": "CheckInput"}
    assert health.kind == trace_pb2.Span.SPAN_KIND_SERVER and health.parent_span_id.hex() == PARENT
