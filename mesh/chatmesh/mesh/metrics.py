"""Prometheus metrics of every chatmesh process: one mechanism, in the bootstrap.

What. Each service makes one `Registry` and declares its metrics on it (`counter`, `histogram`, `gauges`); the
bootstrap serves it on the service's metrics port (`METRIC_PORTS`, one setting per service; 0: off) as
`GET /metrics` in Prometheus's text format, on the service's own event loop (`MetricsServer`).

Why this shape. A turn's hot path touches metrics on every flushed chunk, so an update must cost next to nothing:
series are plain numbers owned by the event loop (no lock, no label lookup per update: callers keep the child
of a labelled metric they update often) and rendered only when scraped. Serving on the same loop means a scrape
never reads a half-updated series, with no lock on either side. Histograms take `observe(value, n)`: a flushed
chunk of n tokens is one call, never n.

Names: chatmesh's own metrics are `chatmesh_<service>_<what>`; a metric may be exported under further names too
(`also=`: the engine's vLLM names, which existing dashboards and llm-d's endpoint picker read), rendered from the
same numbers at scrape time, so an alias costs nothing per update.

Labels carry closed sets only (an RPC name, an outcome, a replica id, a tier), never message text, an owner id or a
conversation id: `Registry` refuses a label whose name says it would hold one (`FORBIDDEN_LABELS`), and the audit
test scrapes every service after real turns to check the values too.

"Over the last minute": the server keeps what it would have answered at 10-second intervals for the last
`SNAPSHOT_KEEP` snapshots; `GET /metrics?ago=60` answers the newest snapshot at least 60 s old (or the oldest
there is) with its age in the `x-chatmesh-age-seconds` header, so `chatmesh status` computes rates and quantiles
over the last minute from two scrapes, as Prometheus's `rate()` would from its own history.

Bucket presets (`TTFT_BUCKETS` 5 ms to 30 s, `ITL_BUCKETS` 1 ms to 1 s, `RPC_BUCKETS`, `STEP_BUCKETS`) match the
range of each quantity, so a p95 is interpolated inside a narrow bucket instead of a decade-wide one.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from chatmesh.mesh import logs

log = logs.get("chatmesh.metrics")

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 15.0, 20.0, 30.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0)
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
               10.0, 30.0, 60.0, 300.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

# Label names that would carry a user's data or an unbounded id; never allowed on any metric.
FORBIDDEN_LABELS = frozenset({"owner", "owner_id", "user", "user_id", "conversation", "conversation_id", "turn",
                              "turn_id", "text", "content", "message", "prompt", "reply", "request_id"})

SNAPSHOT_INTERVAL_S = 10.0
SNAPSHOT_KEEP = 9  # 80 s of history: a full minute ago plus a margin


def _check_labels(name: str, labels: Sequence[str]) -> tuple[str, ...]:
    bad = FORBIDDEN_LABELS.intersection(labels)
    if bad:
        raise ValueError(f"metric {name}: label {sorted(bad)[0]!r} would carry user data or an unbounded id")
    return tuple(labels)


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, n: float = 1.0) -> None:
        self.value += n


class Counter:
    """A monotonically increasing count, optionally by labels (exported with the `_total` suffix)."""

    def __init__(self, name: str, help: str, labels: Sequence[str] = (), also: Sequence[str] = ()):
        self.names = (name, *also)
        self.help = help
        self.labels_names = _check_labels(name, labels)
        self.children: dict[tuple[str, ...], CounterChild] = {}
        if not labels:
            self.children[()] = CounterChild()

    def labels(self, *values: str) -> CounterChild:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labels_names):
                raise ValueError(f"{self.names[0]} takes labels {self.labels_names}, got {values}")
            child = self.children[values] = CounterChild()
        return child

    def inc(self, n: float = 1.0) -> None:
        self.children[()].value += n

    def families(self) -> Iterator[Metric]:
        for name in self.names:
            family = CounterMetricFamily(name, self.help, labels=self.labels_names)
            for values, child in self.children.items():
                family.add_metric(values, child.value)
            yield family

    def render(self, out: list[str]) -> None:
        """Appends this metric in Prometheus's text format (what `families` renders to, without the objects)."""
        for name in self.names:
            total = name + "_total"
            out.append(f"# HELP {total} {_help(self.help)}\n# TYPE {total} counter\n")
            out.extend(f"{total}{_labels(self.labels_names, values)} {_num(child.value)}\n"
                       for values, child in self.children.items())


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """`n` observations of `value` (a flushed chunk of n tokens, each `value` apart, is one call)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    @property
    def count(self) -> int:
        return sum(self.counts)


class Histogram:
    """Observations in fixed buckets (upper bounds, `le`), optionally by labels."""

    def __init__(self, name: str, help: str, buckets: Sequence[float], labels: Sequence[str] = (),
                 also: Sequence[str] = ()):
        if list(buckets) != sorted(buckets) or len(set(buckets)) != len(buckets):
            raise ValueError(f"{name}: buckets must increase")
        self.names = (name, *also)
        self.help = help
        self.bounds = tuple(float(b) for b in buckets)
        self.labels_names = _check_labels(name, labels)
        self.children: dict[tuple[str, ...], HistogramChild] = {}
        self._rendered: dict[tuple[str, tuple[str, ...]], tuple[list[str], str, str]] = {}
        if not labels:
            self.children[()] = HistogramChild(self.bounds)

    def labels(self, *values: str) -> HistogramChild:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labels_names):
                raise ValueError(f"{self.names[0]} takes labels {self.labels_names}, got {values}")
            child = self.children[values] = HistogramChild(self.bounds)
        return child

    def observe(self, value: float, n: int = 1) -> None:
        self.children[()].observe(value, n)

    def families(self) -> Iterator[Metric]:
        for name in self.names:
            family = HistogramMetricFamily(name, self.help, labels=self.labels_names)
            for values, child in self.children.items():
                cumulative, buckets = 0, []
                for bound, count in zip((*self.bounds, float("inf")), child.counts):
                    cumulative += count
                    buckets.append((_le(bound), cumulative))
                family.add_metric(list(values), buckets, child.sum)
            yield family

    def render(self, out: list[str]) -> None:
        """Appends this metric in Prometheus's text format (as `families` renders, without the objects; each
        child's label strings are made once and kept)."""
        les = [_le(b) for b in (*self.bounds, float("inf"))]
        for name in self.names:
            out.append(f"# HELP {name} {_help(self.help)}\n# TYPE {name} histogram\n")
            for values, child in self.children.items():
                key = (name, values)
                made = self._rendered.get(key)
                if made is None:
                    made = self._rendered[key] = (
                        [f"{name}_bucket{_labels((*self.labels_names, 'le'), (*values, le))} " for le in les],
                        f"{name}_count{_labels(self.labels_names, values)} ",
                        f"{name}_sum{_labels(self.labels_names, values)} ")
                buckets, count_at, sum_at = made
                cumulative = 0
                for head, n in zip(buckets, child.counts):
                    cumulative += n
                    out.append(f"{head}{_num(cumulative)}\n")
                out.append(f"{count_at}{_num(cumulative)}\n{sum_at}{_num(child.sum)}\n")


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def _num(value: float) -> str:
    """A sample's value as prometheus_client writes it (Go's float formatting: 1.0, 2.5e-05, +Inf, NaN)."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return text


def _help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    """`{a="1",b="2"}` sorted by name, as prometheus_client writes them ("" without labels)."""
    if not names:
        return ""
    pairs = sorted(zip(names, values))
    return "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in pairs) + "}"


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


GaugeRead = Callable[[], Iterable[tuple[Sequence[str], float]]]


class Gauges:
    """A value read at scrape time from the service's own state (queue depth, KV blocks in use, ...)."""

    def __init__(self, name: str, help: str, read: GaugeRead, labels: Sequence[str] = (),
                 also: Sequence[str] = ()):
        self.names = (name, *also)
        self.help = help
        self.labels_names = _check_labels(name, labels)
        self.read = read

    def families(self) -> Iterator[Metric]:
        rows = list(self.read())
        for name in self.names:
            family = GaugeMetricFamily(name, self.help, labels=self.labels_names)
            for values, value in rows:
                family.add_metric(list(values), value)
            yield family

    def render(self, out: list[str]) -> None:
        rows = [(_labels(self.labels_names, values), value) for values, value in self.read()]
        for name in self.names:
            out.append(f"# HELP {name} {_help(self.help)}\n# TYPE {name} gauge\n")
            out.extend(f"{name}{labels} {_num(value)}\n" for labels, value in rows)


M = TypeVar("M", "Counter", "Histogram", "Gauges")


class Registry(Collector):
    """The metrics of one service (one per process in production; tests may hold several in one process)."""

    def __init__(self, process: bool = True) -> None:
        self._metrics: list[Counter | Histogram | Gauges] = []
        self._collectors: list[Collector] = []
        # What prometheus_client renders: the service's own collectors, metrics a library declared on it (the
        # moderation client's) and the process's. chatmesh's own series are rendered directly (`exposition`).
        self.prometheus = CollectorRegistry(auto_describe=False)
        self.prometheus.register(_Collected(self._collectors))
        if process:  # process_cpu_seconds_total, resident memory, open fds
            ProcessCollector(registry=self.prometheus)

    def counter(self, name: str, help: str, labels: Sequence[str] = (), also: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help, labels, also))

    def histogram(self, name: str, help: str, buckets: Sequence[float], labels: Sequence[str] = (),
                  also: Sequence[str] = ()) -> Histogram:
        return self._add(Histogram(name, help, buckets, labels, also))

    def gauges(self, name: str, help: str, read: GaugeRead, labels: Sequence[str] = (),
               also: Sequence[str] = ()) -> Gauges:
        return self._add(Gauges(name, help, read, labels, also))

    def collector(self, collector: Collector) -> None:
        """A collector of the service's own (read at scrape time), rendered with the rest."""
        self._collectors.append(collector)

    def _add(self, metric: M) -> M:
        self._metrics.append(metric)
        return metric

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield from metric.families()
        yield from _Collected(self._collectors).collect()
        yield from RPC.families()

    def exposition(self) -> bytes:
        """The text a scrape answers. chatmesh's own series are formatted here directly (prometheus_client's
        generate_latest took ~4 us a line, 4 ms for a typical service's 1,000 lines, on the event loop at every
        scrape); the rest through prometheus_client. tests/mesh/test_metrics.py checks both say the same."""
        out: list[str] = []
        for metric in self._metrics:
            metric.render(out)
        RPC.handled.render(out)
        RPC.seconds.render(out)
        return "".join(out).encode() + generate_latest(self.prometheus)


class _Collected(Collector):
    """A service's own collectors (read at scrape time), each family's labels checked like a declared metric's."""

    def __init__(self, collectors: list[Collector]) -> None:
        self._collectors = collectors

    def collect(self) -> Iterator[Metric]:
        for collector in self._collectors:
            for family in collector.collect():
                _check_labels(family.name, sorted({k for s in family.samples for k in s.labels} - {"le"}))
                yield family


class RpcStats:
    """Every servicer method's calls by status code and their duration, kept by the bootstrap's error decorators
    (`chatmesh.mesh.server.unary_errors` / `stream_errors`), so each service has them without code of its own.

    Process-wide: decorators are applied when a servicer class is defined, before any service exists. A
    production process serves one service; a test process holding several sees their RPCs together, each under
    its own method name."""

    def __init__(self) -> None:
        self.handled = Counter("chatmesh_rpc_server_handled", "RPCs answered, by method and gRPC status code",
                               ["method", "code"])
        self.seconds = Histogram("chatmesh_rpc_server_handling_seconds",
                                 "time from an RPC's start to its answer (streams: to their end), by method",
                                 RPC_BUCKETS, ["method"])

    def done(self, method: str, code: str, seconds: float) -> None:
        self.handled.labels(method, code).inc()
        self.seconds.labels(method).observe(seconds)

    def families(self) -> Iterator[Metric]:
        yield from self.handled.families()
        yield from self.seconds.families()


RPC = RpcStats()


class MetricsServer:
    """`GET /metrics` (and `/metrics?ago=SECONDS`) over HTTP/1.1 on the event loop that owns the registry."""

    def __init__(self, registry: Registry, host: str, port: int):
        self.registry = registry
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._snapshots: collections.deque[tuple[float, bytes]] = collections.deque(maxlen=SNAPSHOT_KEEP)
        self._snapshotter: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        except OSError as err:
            raise OSError(f"cannot serve metrics on {self.host}:{self.port}: {err.strerror}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        self._snapshotter = asyncio.create_task(self._snapshot_loop(), name="metrics-snapshots")

    async def close(self) -> None:
        if self._snapshotter is not None:
            self._snapshotter.cancel()
            await asyncio.gather(self._snapshotter, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _snapshot_loop(self) -> None:
        while True:
            self._snapshots.append((time.monotonic(), self.registry.exposition()))
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)

    def snapshot(self, ago_s: float) -> tuple[float, bytes]:
        """The newest snapshot at least `ago_s` old, else the oldest one; with its age in seconds."""
        now = time.monotonic()
        if not self._snapshots:
            return 0.0, self.registry.exposition()
        chosen = self._snapshots[0]
        for at, body in self._snapshots:
            if now - at >= ago_s:
                chosen = (at, body)
        return now - chosen[0], chosen[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            status, headers, body = self._answer(head.split(b"\r\n", 1)[0].decode("latin-1"))
            lines = [f"HTTP/1.1 {status}", f"content-length: {len(body)}", "connection: close", *headers]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def _answer(self, request_line: str) -> tuple[str, list[str], bytes]:
        parts = request_line.split(" ")
        if len(parts) != 3 or parts[0] not in ("GET", "HEAD"):
            return "405 Method Not Allowed", ["allow: GET"], b"GET /metrics\n"
        url = urllib.parse.urlsplit(parts[1])
        if url.path != "/metrics":
            return "404 Not Found", ["content-type: text/plain"], b"metrics are at /metrics\n"
        query = urllib.parse.parse_qs(url.query)
        if "ago" not in query:
            body = self.registry.exposition()
            return "200 OK", [f"content-type: {CONTENT_TYPE_LATEST}"], b"" if parts[0] == "HEAD" else body
        try:
            ago = float(query["ago"][0])
        except ValueError:
            return "400 Bad Request", ["content-type: text/plain"], b"ago must be a number of seconds\n"
        age, body = self.snapshot(ago)
        return "200 OK", [f"content-type: {CONTENT_TYPE_LATEST}", f"x-chatmesh-age-seconds: {age:.3f}"], body


def bind_host(listen: str) -> str:
    """The interface a service's metrics are served on: the one its gRPC port listens on."""
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    host = host.strip("[]")
    return host or "0.0.0.0"
