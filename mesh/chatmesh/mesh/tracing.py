"""OpenTelemetry traces of a turn across the mesh: one trace per turn, W3C `traceparent` from the edge through
gRPC metadata to every hop.

On or off. Tracing is on exactly when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set and `OTEL_SDK_DISABLED` is not true; spans then go by OTLP over gRPC
(the exporter's own settings apply: `OTEL_EXPORTER_OTLP_HEADERS`, `_INSECURE`, `_CERTIFICATE`, ...), batched
on a background thread. Off, nothing is installed: no interceptor on any server or channel, no propagation,
and every helper here returns at once (`span()` hands back one shared no-op context manager), so a turn pays a
boolean test per call site. The OpenTelemetry SDK is not even imported.

Who starts what:
- the gateway starts a turn's root span (or continues the caller's trace from its `traceparent` header);
- `server_interceptors()` (installed by the bootstrap's `serve`) gives every RPC that arrives WITH a
  `traceparent` a SERVER span named after the method (`chatmesh.v1.StoreService/BeginTurn`) and makes it current
  while the handler runs. An RPC without one (the router's stats watch, a shared moderation stream, health,
  an operator's grpcurl) is not traced: roots start at the edge only, so no long-lived stream becomes a trace;
- `traced_channel()` (around every channel `chatmesh.mesh.channels` opens) puts the current span's context into
  each outgoing call's metadata (no grpc.aio client interceptor: see `_Traced`);
- services add their own spans for a turn's phases (`span("claim")`, ...) and record ones they only know the
  times of afterwards (`record`: the engine's queue wait and prefill).

Attributes carry ids and counts only (`gen_ai.conversation.id`, `chatmesh.turn.id`, replica, token counts),
never message text or an owner id; the audit test checks every attribute of a real turn's spans.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from chatmesh.mesh.config import parse_bool

Attributes = Mapping[str, str | int | float | bool]


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


class SpanLike(Protocol):
    def set_attribute(self, key: str, value: Any) -> None: ...

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None: ...

    def is_recording(self) -> bool: ...


def configure(service: str) -> None:
    """Installs the OTLP exporter for this process (a no-op when tracing is off). Called once at start-up."""
    if not ON:
        return
    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") not in ("grpc", ""):
        raise ValueError("chatmesh exports traces by OTLP over gRPC: set OTEL_EXPORTER_OTLP_PROTOCOL=grpc or unset it")
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": f"chatmesh-{service}", "service.namespace": "chatmesh"})
    provider = TracerProvider(resource=resource)  # flushes its batch at exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def _tracer() -> Any:
    from opentelemetry import trace

    return trace.get_tracer("chatmesh")


def span(name: str, attributes: Attributes | None = None) -> contextlib.AbstractContextManager[SpanLike | None]:
    """A child span of the current one for the duration of a `with` block; the no-op when tracing is off or
    nothing is being traced (a call that came in without a trace context)."""
    if not ON or not _current_recording():
        return _NOOP
    return _tracer().start_as_current_span(name, attributes=attributes)  # type: ignore[no-any-return]


def _current_recording() -> bool:
    from opentelemetry import trace

    return bool(trace.get_current_span().is_recording())


def current() -> SpanLike | None:
    """The span being recorded now, or None (tracing off, or this call is not traced)."""
    if not ON:
        return None
    from opentelemetry import trace

    s = trace.get_current_span()
    return s if s.is_recording() else None


def annotate(attributes: Attributes) -> None:
    """Adds ids or counts to the current span, if one is being recorded."""
    if ON and (s := current()) is not None:
        for key, value in attributes.items():
            s.set_attribute(key, value)


def record(name: str, start_ns: int, end_ns: int, attributes: Attributes | None = None) -> None:
    """A child span of the current one that began and ended at the given `time.time_ns()` instants (a phase
    whose times are known only once it is over, such as the engine's queue wait)."""
    if not ON or not _current_recording():
        return
    s = _tracer().start_span(name, attributes=attributes, start_time=start_ns)
    s.end(end_time=end_ns)


@contextlib.contextmanager
def detached() -> Iterator[None]:
    """Runs the block outside any trace: a call opened here (a stream shared by many turns) carries no context."""
    if not ON:
        yield
        return
    from opentelemetry import context

    token = context.attach(context.Context())
    try:
        yield
    finally:
        context.detach(token)


def inject(carrier: dict[str, str]) -> dict[str, str]:
    """`carrier` plus the current context as W3C `traceparent` / `tracestate` (unchanged when off)."""
    if ON:
        from opentelemetry.propagate import inject as _inject

        _inject(carrier)
    return carrier


def extract(headers: Mapping[str, str]) -> Any:
    """The trace context a caller sent (W3C headers), for a root span at the edge."""
    from opentelemetry.propagate import extract as _extract

    return _extract(dict(headers))


def start_root(name: str, headers: Mapping[str, str], attributes: Attributes | None = None) -> Any:
    """The edge's span for one request: a child of the caller's `traceparent` if it sent one, else a new trace.
    Not made current: the caller passes it to `use` around what belongs to it and ends it itself."""
    if not ON:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer().start_span(name, context=extract(headers), kind=SpanKind.SERVER, attributes=attributes)


def use(root: Any) -> contextlib.AbstractContextManager[Any]:
    """Makes `root` (from `start_root`) current for a block, without ending it."""
    if root is None:
        return _NOOP
    from opentelemetry import trace

    return trace.use_span(root, end_on_exit=False)


# ---- gRPC: the server interceptor and the client channel -----------------------------------------------------------------------

if TYPE_CHECKING:  # grpc's classes are generic in its stubs only, not subscriptable at run time
    Handler = grpc.RpcMethodHandler[Any, Any]
    _ServerBase = grpc.aio.ServerInterceptor[Any, Any]
else:
    Handler = grpc.RpcMethodHandler
    _ServerBase = grpc.aio.ServerInterceptor
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[Handler]]


class _ServerInterceptor(_ServerBase):
    """A SERVER span for each RPC that arrives with a trace context (see the module docstring)."""

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler:
        handler = await continuation(details)
        metadata = details.invocation_metadata or ()
        carrier = {str(k): str(v) for k, v in metadata if k in ("traceparent", "tracestate")}
        if handler is None or "traceparent" not in carrier:
            return handler
        return _traced_handler(handler, details.method.lstrip("/"), extract(carrier))


def _traced_handler(handler: Handler, name: str, parent: Any) -> Handler:
    from opentelemetry.trace import SpanKind

    service, _, method = name.partition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}

    def start() -> Any:
        return _tracer().start_as_current_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)

    def unary(behavior: Any) -> Any:
        async def run(request: Any, context: Any) -> Any:
            with start():
                return await behavior(request, context)
        return run

    def streaming(behavior: Any) -> Any:
        async def run(request: Any, context: Any) -> AsyncIterator[Any]:
            with start():
                async for item in behavior(request, context):
                    yield item
        return run

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), des, ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), des, ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), des, ser)
    assert handler.stream_stream is not None
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), des, ser)


def _with_trace(metadata: Any) -> Any:
    """`metadata` (None, a sequence of pairs or grpc.aio.Metadata) plus the current trace context, if any."""
    carrier = inject({})
    if not carrier:
        return metadata
    return (*(tuple(metadata) if metadata else ()), *carrier.items())


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


def server_interceptors() -> list[_ServerBase]:
    return [_ServerInterceptor()] if ON else []


