"""OpenTelemetry traces of a turn across the mesh: one trace per turn, W3C `traceparent` from the edge through
gRPC metadata to every hop, exported by OTLP over gRPC.

On or off. Tracing is on exactly when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set and `OTEL_SDK_DISABLED` is not true. Off, nothing is installed: no
propagation, no exporter thread, and every helper here returns at once (`span()` hands back one shared no-op
context manager), so a turn pays a boolean test per call site.

Spans are recorded here, not by the OpenTelemetry Python SDK. The SDK's span path (start, attributes, sampling,
end, the batch processor's queue, then `encode_spans`) cost ~45 us of CPU per span, and a traced RPC ~120 us more
on the server than an untraced one: with ~18 spans per turn over six processes that was +15% server CPU and
+4.7 ms p50 TTFT (BENCHMARKS.md, issue 20). Here a span is one small object (ids as integers, the start and end
`time.time_ns()`, a dict of attributes) and the current span one `contextvars` variable; ended spans go on a
deque that one background thread turns into OTLP protobuf (written as protobuf's wire format here, parsed once
into opentelemetry-proto's `ExportTraceServiceRequest`) and sends with the SDK's own OTLP/gRPC exporter, so
the export reads the exporter's usual settings (`OTEL_EXPORTER_OTLP_HEADERS`, `_INSECURE`, `_CERTIFICATE`,
`_TIMEOUT`, `_COMPRESSION`, their `_TRACES_` forms) and retries as it does. What is kept from the OpenTelemetry
specification:
- W3C Trace Context: `traceparent` (version 00; a malformed one is ignored, as the SDK's propagator does) and
  `tracestate` passed on unchanged; a child's span id is new at every hop;
- the standard samplers by `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (`always_on`, `always_off`,
  `traceidratio`, `parentbased_always_on` (the default), `parentbased_always_off`, `parentbased_traceidratio`;
  the ratio test is the SDK's, on the trace id's low 64 bits), decided where a trace enters a process;
- the batch processor's settings: `OTEL_BSP_SCHEDULE_DELAY` (ms, 5000), `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` (512),
  `OTEL_BSP_MAX_QUEUE_SIZE` (2048; spans beyond it are dropped, and counted), a last flush at exit;
- the resource of the SDK's `Resource.create` (`OTEL_RESOURCE_ATTRIBUTES`, `telemetry.sdk.*`), with
  `service.name` = `chatmesh-<service>` (every process of one `chatmesh up` shares one environment, so a shared
  `OTEL_SERVICE_NAME` would merge them), `service.namespace` = `chatmesh`; scope `chatmesh`.
A span that ends by an exception has status ERROR with the exception's type only (its message may hold text).
There is no OpenTelemetry API tracer here: a library instrumented with `opentelemetry.trace` would not join these
traces (chatmesh has none).

Who starts what:
- the gateway starts a turn's root span (or continues the caller's trace from its `traceparent` header);
- `serving` (entered by the bootstrap's `unary_errors` / `stream_errors`, the wrapper every servicer method
  already has) gives every RPC that arrives WITH a `traceparent` a SERVER span named after the method
  (`chatmesh.v1.StoreService/BeginTurn`) and makes it current while the handler runs; no gRPC interceptor. An RPC
  without one (the router's stats watch, a shared moderation stream, health, an operator's grpcurl) is not
  traced: roots start at the edge only, so no long-lived stream becomes a trace;
- `traced_channel()` (around every channel `chatmesh.mesh.channels` opens) puts the current span's context into
  each outgoing call's metadata (no grpc.aio client interceptor: see `_Traced`);
- services add their own spans for a turn's phases (`span("claim")`, ...) and record ones they only know the
  times of afterwards (`record`: the engine's queue wait and prefill).

Attributes carry ids and counts only (`gen_ai.conversation.id`, `chatmesh.turn.id`, replica, token counts),
never message text or an owner id; the audit test checks every attribute of a real turn's spans.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import os
import random
import re
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from chatmesh.mesh import logs
from chatmesh.mesh.config import parse_bool

if TYPE_CHECKING:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

log = logs.get("chatmesh.tracing")

Value = str | int | float | bool
Attributes = Mapping[str, Value]


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OpenTelemetry environment asks for traces to be exported."""
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    try:
        disabled = parse_bool(env.get("OTEL_SDK_DISABLED", ""))
    except ValueError:
        disabled = False
    return bool(endpoint) and not disabled


ON = enabled()
_NOOP: contextlib.nullcontext[None] = contextlib.nullcontext()

INTERNAL, SERVER = 1, 2  # OTLP's Span.SpanKind
_RECORDED = 0x01  # W3C trace-flags: sampled
# OTLP Span.flags: SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK, SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200


# ---- spans -----------------------------------------------------------------------------------------------------------

class Span:
    """One span: recorded (sampled: it is exported when it ends) or not (it only carries the trace's context on)."""

    __slots__ = ("trace_id", "span_id", "parent_id", "remote_parent", "trace_state", "recording", "name", "kind",
                 "start_ns", "end_ns", "attributes", "error", "_traceparent")

    def __init__(self, trace_id: int, span_id: int, parent_id: int, remote_parent: bool, trace_state: str,
                 recording: bool, name: str, kind: int, attributes: Attributes | None,
                 start_ns: int = 0) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_id = parent_id
        self.remote_parent = remote_parent
        self.trace_state = trace_state
        self.recording = recording
        self.name = name
        self.kind = kind
        self.start_ns = start_ns or time.time_ns()
        self.end_ns = 0
        self.attributes: dict[str, Value] = dict(attributes) if attributes else {}
        self.error = ""
        self._traceparent = ""

    def is_recording(self) -> bool:
        return self.recording

    def set_attribute(self, key: str, value: Value) -> None:
        if self.recording:
            self.attributes[key] = value

    def update_name(self, name: str) -> None:
        self.name = name

    def end(self, end_ns: int = 0) -> None:
        if self.end_ns:
            return  # ended once only, as the SDK's spans
        self.end_ns = end_ns or time.time_ns()
        if self.recording and _exporter is not None:
            _exporter.add(self)

    def child(self, name: str, attributes: Attributes | None, kind: int = INTERNAL, start_ns: int = 0) -> Span:
        return Span(self.trace_id, _new_id(), self.span_id, False, self.trace_state, self.recording, name, kind,
                    attributes, start_ns)

    def traceparent(self) -> str:
        if not self._traceparent:
            flags = "01" if self.recording else "00"
            self._traceparent = f"00-{self.trace_id:032x}-{self.span_id:016x}-{flags}"
        return self._traceparent


class _Remote:
    """A caller's trace context (W3C `traceparent` / `tracestate`), the parent of the span that continues it."""

    __slots__ = ("trace_id", "span_id", "sampled", "trace_state")

    def __init__(self, trace_id: int, span_id: int, sampled: bool, trace_state: str) -> None:
        self.trace_id, self.span_id, self.sampled, self.trace_state = trace_id, span_id, sampled, trace_state


_current: contextvars.ContextVar[Span | None] = contextvars.ContextVar("chatmesh_span", default=None)
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def _new_id(bits: int = 64) -> int:
    while True:
        if (n := random.getrandbits(bits)) != 0:
            return n


def parse_traceparent(traceparent: str, tracestate: str = "") -> _Remote | None:
    """The caller's context from W3C headers, or None when there is none or it is malformed."""
    m = _TRACEPARENT.fullmatch(traceparent.strip())
    if m is None:
        return None
    version, trace_hex, span_hex, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return _Remote(trace_id, span_id, bool(int(flags, 16) & _RECORDED), tracestate.strip())


# ---- sampling (OTEL_TRACES_SAMPLER) -----------------------------------------------------------------------------------

_LOW_64 = (1 << 64) - 1


def sampler(env: Mapping[str, str] = os.environ) -> Callable[[_Remote | None, int], bool]:
    """`decide(parent, trace_id)`: whether a span that starts a trace in this process (no parent, or a caller's)
    is recorded, by the standard `OTEL_TRACES_SAMPLER` names and the SDK's semantics for each."""
    name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower() or "parentbased_always_on"
    ratio = 1.0
    if name.endswith("traceidratio"):
        try:
            ratio = float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
        except ValueError:
            ratio = 1.0
        ratio = min(max(ratio, 0.0), 1.0)
    bound = round(ratio * (_LOW_64 + 1))

    def by_ratio(trace_id: int) -> bool:
        return trace_id & _LOW_64 < bound

    roots: dict[str, Callable[[int], bool]] = {
        "always_on": lambda _: True, "always_off": lambda _: False, "traceidratio": by_ratio}
    base = name.removeprefix("parentbased_")
    if base not in roots:
        log.warning("unknown_sampler", sampler=name, using="parentbased_always_on")
        name, base = "parentbased_always_on", "always_on"
    root = roots[base]
    if not name.startswith("parentbased_"):
        return lambda parent, trace_id: root(trace_id)
    return lambda parent, trace_id: root(trace_id) if parent is None else parent.sampled


_decide = sampler()


def _start(name: str, parent: _Remote | None, kind: int, attributes: Attributes | None) -> Span:
    """A span that enters this process's part of a trace: continuing `parent`, or starting a new trace."""
    if parent is None:
        trace_id = _new_id(128)
        return Span(trace_id, _new_id(), 0, False, "", _decide(None, trace_id), name, kind, attributes)
    return Span(parent.trace_id, _new_id(), parent.span_id, True, parent.trace_state,
                _decide(parent, parent.trace_id), name, kind, attributes)


# ---- what services call -----------------------------------------------------------------------------------------------

class _Active:
    """`with`: makes a span current, then ends it (ERROR if the block raised; unless `ends` is False) and restores
    the span current before."""

    __slots__ = ("span", "ends", "token")

    def __init__(self, span: Span, ends: bool = True) -> None:
        self.span, self.ends = span, ends

    def __enter__(self) -> Span:
        self.token = _current.set(self.span)
        return self.span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self.ends:
            if kind is not None and kind is not GeneratorExit:  # a stream closed early is not an error
                self.span.error = kind.__name__
            self.span.end()
        _restore(self.token)


def _restore(token: contextvars.Token[Span | None]) -> None:
    try:
        _current.reset(token)
    except ValueError:  # ended in another context (a generator closed elsewhere): that context is gone anyway
        pass


def span(name: str, attributes: Attributes | None = None) -> contextlib.AbstractContextManager[Span | None]:
    """A child span of the current one for the duration of a `with` block; the no-op when tracing is off or
    nothing is being traced (a call that came in without a trace context, or one not sampled)."""
    if not ON or (parent := _current.get()) is None or not parent.recording:
        return _NOOP
    return _Active(parent.child(name, attributes))


def current() -> Span | None:
    """The span being recorded now, or None (tracing off, or this call is not traced)."""
    if not ON or (s := _current.get()) is None or not s.recording:
        return None
    return s


def annotate(attributes: Attributes) -> None:
    """Adds ids or counts to the current span, if one is being recorded."""
    if ON and (s := _current.get()) is not None and s.recording:
        s.attributes.update(attributes)


def record(name: str, start_ns: int, end_ns: int, attributes: Attributes | None = None) -> None:
    """A child span of the current one that began and ended at the given `time.time_ns()` instants (a phase
    whose times are known only once it is over, such as the engine's queue wait)."""
    if not ON or (parent := _current.get()) is None or not parent.recording:
        return
    parent.child(name, attributes, start_ns=start_ns).end(end_ns)


@contextlib.contextmanager
def detached() -> Iterator[None]:
    """Runs the block outside any trace: a call opened here (a stream shared by many turns) carries no context."""
    if not ON:
        yield
        return
    token = _current.set(None)
    try:
        yield
    finally:
        _restore(token)


def inject(carrier: dict[str, str]) -> dict[str, str]:
    """`carrier` plus the current context as W3C `traceparent` / `tracestate` (unchanged when off)."""
    if ON and (s := _current.get()) is not None:
        carrier["traceparent"] = s.traceparent()
        if s.trace_state:
            carrier["tracestate"] = s.trace_state
    return carrier


def extract(headers: Mapping[str, str]) -> _Remote | None:
    """The trace context a caller sent (W3C headers), or None."""
    traceparent = headers.get("traceparent")
    return parse_traceparent(traceparent, headers.get("tracestate", "")) if traceparent else None


def start_root(name: str, headers: Mapping[str, str], attributes: Attributes | None = None) -> Span | None:
    """The edge's span for one request: a child of the caller's `traceparent` if it sent one, else a new trace.
    Not made current: the caller passes it to `use` around what belongs to it and ends it itself."""
    if not ON:
        return None
    return _start(name, extract(headers), SERVER, attributes)


def use(root: Span | None) -> contextlib.AbstractContextManager[Any]:
    """Makes `root` (from `start_root`) current for a block, without ending it."""
    if root is None:
        return _NOOP
    return _Active(root, ends=False)


# ---- gRPC: server spans from the servicer wrappers, the client channel ------------------------------------------------

_paths: dict[tuple[type, str], tuple[str, dict[str, Value]]] = {}
_served: list[str] = []


def served(names: Sequence[str]) -> None:
    """The gRPC services this process registered (`chatmesh.v1.ModerateService`, ...): where `serving` looks up
    a method's full name when its servicer does not subclass a generated `*Servicer`."""
    _served.extend(n for n in names if n not in _served)


def _path_of(servicer: type, method: str) -> tuple[str, dict[str, Value]]:
    """`chatmesh.v1.StoreService/BeginTurn` for a method of a servicer (from the generated `*Servicer` base class
    it implements, else the registered service that has the method), and the span's rpc.* attributes; worked
    out once per method."""
    key = (servicer, method)
    if (known := _paths.get(key)) is not None:
        return known
    from google.protobuf import descriptor_pool

    service = ""
    for base in servicer.__mro__:
        module = sys.modules.get(base.__module__.removesuffix("_grpc"))
        descriptor = getattr(module, "DESCRIPTOR", None) if base.__module__.endswith("_pb2_grpc") else None
        found = descriptor.services_by_name.get(base.__name__.removesuffix("Servicer")) if descriptor else None
        if found is not None:
            service = found.full_name
            break
    for name in _served if not service else ():
        try:
            if method in descriptor_pool.Default().FindServiceByName(name).methods_by_name:  # type: ignore[no-untyped-call]
                service = name
                break
        except KeyError:
            continue
    service = service or servicer.__name__
    known = _paths[key] = (f"{service}/{method}",
                           {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method})
    return known


def serving(servicer: object, method: str, context: Any) -> contextlib.AbstractContextManager[Any]:
    """Around one RPC's handler: a SERVER span, current while it runs, when the call carries a `traceparent`
    (else the no-op). Entered by `chatmesh.mesh.server.unary_errors` / `stream_errors` when tracing is on."""
    traceparent = tracestate = ""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            traceparent = value
        elif key == "tracestate":
            tracestate = value
    if not traceparent or (parent := parse_traceparent(traceparent, tracestate)) is None:
        return _NOOP
    name, attributes = _path_of(type(servicer), method)
    return _Active(_start(name, parent, SERVER, attributes))


def _with_trace(metadata: Any) -> Any:
    """`metadata` (None, a sequence of pairs or grpc.aio.Metadata) plus the current trace context, if any."""
    if (s := _current.get()) is None:
        return metadata
    added: tuple[tuple[str, str], ...] = (("traceparent", s.traceparent()),)
    if s.trace_state:
        added += (("tracestate", s.trace_state),)
    return (*(tuple(metadata) if metadata else ()), *added)


class _Traced:
    """A multi-callable that adds the current trace context to each call's metadata, then makes the call as it is.
    This, not a grpc.aio client interceptor: with any interceptor, grpc.aio starts a task per call and passes
    every streamed message through extra async generators and queues (bench/mesh_overhead --observability
    measured it: ~30 us of CPU per streamed message on each side); this costs one dictionary per call."""

    __slots__ = ("_call",)

    def __init__(self, call: Any) -> None:
        self._call = call

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._call(*args, metadata=_with_trace(metadata), **kwargs)


class _TracedChannel(grpc.aio.Channel):
    """A channel whose calls carry the current trace context (see `_Traced`); everything else is the channel's."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _Traced(self._channel.unary_unary(*args, **kwargs))

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _Traced(self._channel.unary_stream(*args, **kwargs))

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _Traced(self._channel.stream_unary(*args, **kwargs))

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _Traced(self._channel.stream_stream(*args, **kwargs))

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    async def __aenter__(self) -> _TracedChannel:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._channel.close(None)


def traced_channel(channel: grpc.aio.Channel) -> grpc.aio.Channel:
    """`channel`, its calls carrying the current trace context when tracing is on (unchanged when off)."""
    return _TracedChannel(channel) if ON else channel


# ---- export: OTLP protobuf, batched on a thread of its own ------------------------------------------------------------

def _int_env(name: str, default: int) -> int:
    try:
        value = int(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if value > 0 else default


class _Exporter:
    """Ended spans -> `ExportTraceServiceRequest` batches -> the SDK's OTLP/gRPC exporter, on one daemon thread:
    every `OTEL_BSP_SCHEDULE_DELAY` ms, or as soon as a batch is full; the rest once more at exit. Adding a span
    is one deque append (no lock: deque's append and popleft are atomic)."""

    def __init__(self, service: str) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.proto.common.v1 import common_pb2
        from opentelemetry.proto.resource.v1 import resource_pb2
        from opentelemetry.sdk.resources import Resource

        self.delay_s = _int_env("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self.batch = _int_env("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)
        self.limit = max(_int_env("OTEL_BSP_MAX_QUEUE_SIZE", 2048), self.batch)
        self.queue: collections.deque[Span] = collections.deque()
        self.dropped = 0
        self.wake = threading.Event()
        self.lock = threading.Lock()  # one export at a time (the thread's, or the last flush at exit)
        resource = Resource.create({"service.name": f"chatmesh-{service}", "service.namespace": "chatmesh"})
        self.resource = resource_pb2.Resource(attributes=[
            common_pb2.KeyValue(key=k, value=_any(v)) for k, v in resource.attributes.items()
            if isinstance(v, str | bool | int | float)]).SerializeToString()
        self.scope = common_pb2.InstrumentationScope(name="chatmesh").SerializeToString()

        class Exporter(OTLPSpanExporter):
            """The SDK's exporter (channel, settings, retries), handed requests already encoded."""

            def _translate_data(self, data: Any) -> Any:
                return data

            def _count_data(self, data: Any) -> int:
                return sum(len(ss.spans) for rs in data.resource_spans for ss in rs.scope_spans)

        self.otlp = Exporter()
        self.thread = threading.Thread(target=self._run, name="chatmesh-span-export", daemon=True)
        self.thread.start()
        atexit.register(self.flush)

    def add(self, span: Span) -> None:
        if len(self.queue) >= self.limit:
            self.dropped += 1
            return
        self.queue.append(span)
        if len(self.queue) == self.batch:
            self.wake.set()

    def _run(self) -> None:
        while True:
            self.wake.wait(self.delay_s)
            self.wake.clear()
            self._export_all()

    def _export_all(self) -> None:
        with self.lock:
            while self.queue:
                spans = [self.queue.popleft() for _ in range(min(self.batch, len(self.queue)))]
                try:
                    self.otlp.export(encode(spans, self.resource, self.scope))  # type: ignore[arg-type]
                except Exception as err:  # an exporter failure loses that batch, never the process
                    log.warning("span_export_failed", error=type(err).__name__, spans=len(spans))
                if self.dropped:
                    log.warning("spans_dropped", spans=self.dropped, queue=self.limit)
                    self.dropped = 0

    def flush(self) -> None:
        self._export_all()



def encode(spans: Sequence[Span], resource: Any, scope: Any) -> ExportTraceServiceRequest:
    """Ended spans as one OTLP request (under one resource and instrumentation scope, protobuf messages or their
    serialized bytes). The spans are written in protobuf's wire format here, then parsed once by the protobuf
    runtime (in C): building a `trace_pb2.Span` and its `KeyValue`s from Python cost ~12-18 us a span, the bytes
    ~2-5 us (an attribute already seen is reused as bytes)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    resource_bytes = resource if isinstance(resource, bytes) else resource.SerializeToString()
    scope_bytes = scope if isinstance(scope, bytes) else scope.SerializeToString()
    scope_spans = b"".join([b"\x0a", _len(len(scope_bytes)), scope_bytes, *map(_span_bytes, spans)])
    resource_spans = b"".join([b"\x0a", _len(len(resource_bytes)), resource_bytes,
                               b"\x12", _len(len(scope_spans)), scope_spans])
    return ExportTraceServiceRequest.FromString(b"\x0a" + _len(len(resource_spans)) + resource_spans)


# Protobuf's wire format for what `encode` writes (opentelemetry/proto/trace/v1/trace.proto): each field's key is
# (number << 3) | wire type, one byte for these numbers but Span.flags (16: two bytes).
_Q = struct.Struct("<Q").pack
_D = struct.Struct("<d").pack
_SPAN_FLAGS = (b"\x85\x01" + struct.pack("<I", _HAS_IS_REMOTE | _RECORDED),
               b"\x85\x01" + struct.pack("<I", _HAS_IS_REMOTE | _IS_REMOTE | _RECORDED))
_ERROR_CODE = b"\x18\x02"  # Status.code = STATUS_CODE_ERROR
_attribute_bytes: dict[tuple[str, Value, type], bytes] = {}


def _len(n: int) -> bytes:
    """A base-128 varint (a length, or any non-negative int below 2**64)."""
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _string(key: bytes, value: str) -> bytes:
    b = value.encode()
    return key + _len(len(b)) + b


def _attribute(key: str, value: Value) -> bytes:
    """Span.attributes (9): one KeyValue (key 1, AnyValue 2: string 1, bool 2, int 3, double 4)."""
    memo = (key, value, type(value))
    if (known := _attribute_bytes.get(memo)) is not None:
        return known
    if isinstance(value, bool):
        any_value = b"\x10\x01" if value else b"\x10\x00"
    elif isinstance(value, int):
        any_value = b"\x18" + _len(value & 0xFFFFFFFFFFFFFFFF)  # int64: two's complement, as protobuf writes it
    elif isinstance(value, float):
        any_value = b"\x21" + _D(value)
    else:
        any_value = _string(b"\x0a", str(value))
    body = _string(b"\x0a", key) + b"\x12" + _len(len(any_value)) + any_value
    if len(_attribute_bytes) >= 4096:
        _attribute_bytes.clear()
    known = _attribute_bytes[memo] = b"\x4a" + _len(len(body)) + body
    return known


def _span_bytes(s: Span) -> bytes:
    """ScopeSpans.spans (2): one Span (trace_id 1, span_id 2, trace_state 3, parent_span_id 4, name 5, kind 6,
    start 7, end 8, attributes 9, status 15, flags 16)."""
    parts = [b"\x0a\x10", s.trace_id.to_bytes(16, "big"), b"\x12\x08", s.span_id.to_bytes(8, "big")]
    if s.trace_state:
        parts.append(_string(b"\x1a", s.trace_state))
    if s.parent_id:
        parts += (b"\x22\x08", s.parent_id.to_bytes(8, "big"))
    parts += (_string(b"\x2a", s.name), b"\x30", _len(s.kind), b"\x39", _Q(s.start_ns), b"\x41", _Q(s.end_ns))
    parts += [_attribute(k, v) for k, v in s.attributes.items()]
    if s.error:
        status = _string(b"\x12", s.error) + _ERROR_CODE
        parts += (b"\x7a", _len(len(status)), status)
    parts.append(_SPAN_FLAGS[s.remote_parent])
    body = b"".join(parts)
    return b"\x12" + _len(len(body)) + body


def _any(v: Value) -> Any:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    return AnyValue(string_value=str(v))


_exporter: _Exporter | None = None


def configure(service: str) -> None:
    """Starts this process's span export (a no-op when tracing is off). Called once at start-up."""
    global _exporter
    if not ON or _exporter is not None:
        return
    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") not in ("grpc", ""):
        raise ValueError("chatmesh exports traces by OTLP over gRPC: set OTEL_EXPORTER_OTLP_PROTOCOL=grpc or unset it")
    _exporter = _Exporter(service)
