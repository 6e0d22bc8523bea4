"""What one engine replica exports: Prometheus metrics under chatmesh's names and vLLM's, and each generation's
spans (queue wait, prefill, first token).

vLLM-compatible names, so existing vLLM dashboards and llm-d's endpoint picker (which scores pods by
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and the prefix-cache counters) read a chatmesh replica
unchanged: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (device tier,
0..1), `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (prompt tokens looked up / found),
`vllm:num_preemptions_total`, `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
`vllm:request_success_total{finished_reason}`, and the histograms `vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`.
The first three latency histograms are also exported under OpenTelemetry's GenAI server names
(`gen_ai_server_time_to_first_token_seconds`, `gen_ai_server_time_per_output_token_seconds`,
`gen_ai_server_request_duration_seconds`). Aliases are rendered from the same numbers at scrape time.

Memory-bound admission (so `chatmesh capacity`'s KV-limited batch can be checked on a live replica):
`chatmesh_engine_waiting_by_reason{reason}` splits the waiting gauge by why the queue's head waits (kv_memory,
batch_slots, step_budget; scheduler.py) and `chatmesh_engine_admission_stalls_total{reason}` counts the steps that
ended with sequences waiting for KV room or for a batch slot. Running sequences stuck under max_batch while
kv_memory stalls climb is the planner's "KV memory binds".

Costs: gauges and since-start counters are read from `Backend.stats()` when scraped (nothing per token); the
per-generation histograms are updated once per streamed Delta, which the engine coalesces to one per flush
interval: a Delta of n tokens is one `observe(gap / n, n)` for inter-token latency. Step figures (time, prefill
and decode tokens) come from `EngineCore`'s per-step report, so the `triton` backend, whose steps run inside
Triton, has none (Triton exports its own metrics).

Prefix transfer (issue 29): `chatmesh_engine_prefix_pulled_tokens_total` (prompt tokens pulled and used, apart
from the prefix-cache hits), `chatmesh_engine_prefix_pulled_bytes_total`, `chatmesh_engine_prefix_pulls_total
{outcome}` (every pull by PullOutcome: pulled, not_held, unavailable, deadline, corrupt, ...),
`chatmesh_engine_prefix_served_blocks_total` / `_bytes_total` (as a source), `chatmesh_engine_draining`, and the
histogram `chatmesh_engine_prefix_pull_seconds` (each pull, request to import); a pull is also a `prefix_pull`
span of the generation's trace (source replica, outcome, blocks, bytes).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import assert_never

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from chatmesh.engine_adapter.backend import (
    Backend,
    Delta,
    Finished,
    GenerateEvent,
    GenerateParams,
    PullOutcome,
    Started,
)
from chatmesh.engine_adapter.engine import StepReport
from chatmesh.mesh import metrics, tracing


class _Stats(Collector):
    """Gauges and since-start counters from the backend's own statistics, read at scrape time."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def collect(self) -> Iterator[Metric]:
        s = self._backend.stats()

        def gauge(names: tuple[str, ...], help: str, value: float) -> Iterator[Metric]:
            for name in names:
                yield GaugeMetricFamily(name, help, value=value)

        def counter(names: tuple[str, ...], help: str, value: float) -> Iterator[Metric]:
            for name in names:
                yield CounterMetricFamily(name, help, value=value)

        yield from gauge(("chatmesh_engine_running_sequences", "vllm:num_requests_running"),
                         "sequences running (prefill or decode)", s.running_sequences)
        yield from gauge(("chatmesh_engine_waiting_sequences", "vllm:num_requests_waiting"),
                         "sequences waiting for admission", s.queue_depth)
        device_usage = s.device.used / s.device.total if s.device.total else 0.0
        yield from gauge(("vllm:kv_cache_usage_perc",), "device-tier KV blocks in use, 0..1", device_usage)
        blocks = GaugeMetricFamily("chatmesh_engine_kv_blocks", "KV blocks by tier and state (used: holding data, "
                                   "cached: used but held by no sequence, free: empty)", labels=["tier", "state"])
        usage = GaugeMetricFamily("chatmesh_engine_kv_usage_ratio", "KV blocks in use per tier, 0..1",
                                  labels=["tier"])
        for tier, t in (("device", s.device), ("host", s.host)):
            blocks.add_metric([tier, "used"], t.used)
            blocks.add_metric([tier, "free"], t.free)
            blocks.add_metric([tier, "cached"], t.cached)
            usage.add_metric([tier], t.used / t.total if t.total else 0.0)
        yield from (blocks, usage)
        yield from counter(("chatmesh_engine_prefix_cache_query_tokens", "vllm:prefix_cache_queries"),
                           "prompt tokens looked up in the prefix cache", s.hit_tokens + s.miss_tokens)
        yield from counter(("chatmesh_engine_prefix_cache_hit_tokens", "vllm:prefix_cache_hits"),
                           "prompt tokens found in the prefix cache (either tier)", s.hit_tokens)
        yield from counter(("chatmesh_engine_host_cache_hit_tokens",),
                           "prompt tokens found in the host tier (copied back to the device)", s.host_hit_tokens)
        evictions = CounterMetricFamily("chatmesh_engine_kv_evictions",
                                        "KV blocks evicted, by tier (device: spilled to host or dropped; host: dropped)",
                                        labels=["tier"])
        evictions.add_metric(["device"], s.device_evictions)
        evictions.add_metric(["host"], s.host_evictions)
        yield evictions
        yield from counter(("chatmesh_engine_preemptions", "vllm:num_preemptions"),
                           "running sequences preempted for memory (recomputed later)", s.preemptions)
        waiting = GaugeMetricFamily("chatmesh_engine_waiting_by_reason",
                                    "sequences waiting for admission, by why the queue's head waits (kv_memory: its "
                                    "blocks do not fit the device KV room; batch_slots: max_batch run; step_budget: "
                                    "the step's token budget is spent)", labels=["reason"])
        waiting.add_metric(["kv_memory"], s.waiting_kv)
        waiting.add_metric(["batch_slots"], s.waiting_batch)
        waiting.add_metric(["step_budget"], max(0, s.queue_depth - s.waiting_kv - s.waiting_batch))
        stalls = CounterMetricFamily("chatmesh_engine_admission_stalls",
                                     "engine steps that ended with sequences waiting, by reason (kv_memory: admission "
                                     "is memory-bound; batch_slots: bound by max_batch)", labels=["reason"])
        stalls.add_metric(["kv_memory"], s.kv_stall_steps)
        stalls.add_metric(["batch_slots"], s.batch_stall_steps)
        yield from (waiting, stalls)
        x = s.transfer
        yield from counter(("chatmesh_engine_prefix_pulled_tokens",),
                           "prompt tokens whose KV was pulled from another replica (not prefilled, not cached here)",
                           x.pulled_tokens)
        yield from counter(("chatmesh_engine_prefix_pulled_bytes",), "KV bytes pulled from other replicas",
                           x.pulled_bytes)
        pulls = CounterMetricFamily("chatmesh_engine_prefix_pulls", "prefix pulls by outcome (all but pulled "
                                    "fell back to prefill)", labels=["outcome"])
        for outcome, n in x.outcomes:
            pulls.add_metric([outcome], n)
        yield pulls
        yield from counter(("chatmesh_engine_prefix_served_blocks",), "KV blocks served to pulling replicas",
                           x.served_blocks)
        yield from counter(("chatmesh_engine_prefix_served_bytes",), "KV bytes served to pulling replicas",
                           x.served_bytes)
        yield from gauge(("chatmesh_engine_draining",), "1 while shutting down: no new generations, pulls served",
                         1 if s.draining else 0)
        info = GaugeMetricFamily("chatmesh_engine_info", "this replica: its id, backend and block size",
                                 labels=["replica", "backend", "block_size"])
        info.add_metric([s.replica_id, s.backend, str(s.block_size)], 1)
        yield info


class EngineMetrics:
    """A replica's metrics on its service's registry."""

    def __init__(self, registry: metrics.Registry, backend: Backend) -> None:
        registry.collector(_Stats(backend))
        self.ttft = registry.histogram(
            "chatmesh_engine_time_to_first_token_seconds", "time from a Generate request to its first token",
            metrics.TTFT_BUCKETS,
            also=("vllm:time_to_first_token_seconds", "gen_ai_server_time_to_first_token_seconds"))
        self.itl = registry.histogram(
            "chatmesh_engine_inter_token_latency_seconds", "time between output tokens (per streamed chunk)",
            metrics.ITL_BUCKETS,
            also=("vllm:inter_token_latency_seconds", "gen_ai_server_time_per_output_token_seconds"))
        self.e2e = registry.histogram(
            "chatmesh_engine_request_seconds", "time from a Generate request to its end", metrics.TTFT_BUCKETS,
            also=("vllm:e2e_request_latency_seconds", "gen_ai_server_request_duration_seconds"))
        self.queue = registry.histogram(
            "chatmesh_engine_queue_seconds", "time from a Generate request to its admission", metrics.TTFT_BUCKETS,
            also=("vllm:request_queue_time_seconds",))
        self.prompt_tokens = registry.counter("chatmesh_engine_prompt_tokens", "prompt tokens of finished requests",
                                              also=("vllm:prompt_tokens",))
        self.output_tokens = registry.counter("chatmesh_engine_output_tokens", "tokens generated",
                                              also=("vllm:generation_tokens",))
        self.finished = registry.counter("chatmesh_engine_requests", "finished requests by reason",
                                         ["finished_reason"], also=("vllm:request_success",))
        self.step_seconds = registry.histogram("chatmesh_engine_step_seconds", "duration of one engine step",
                                               metrics.STEP_BUCKETS)
        self.step_tokens = registry.counter("chatmesh_engine_step_tokens", "tokens computed by steps, by phase",
                                            ["phase"])
        self.pull_seconds = registry.histogram("chatmesh_engine_prefix_pull_seconds",
                                               "time of one prefix pull, request to import (failed ones included)",
                                               metrics.TTFT_BUCKETS)
        self._prefill = self.step_tokens.labels("prefill")
        self._decode = self.step_tokens.labels("decode")

    def on_step(self, report: StepReport) -> None:
        self.step_seconds.observe(report.duration_s)
        self._prefill.inc(report.prefill_tokens)
        self._decode.inc(report.decode_seqs)

    def generation(self, params: GenerateParams, replica_id: str) -> Generation:
        return Generation(self, params, replica_id)


class Generation:
    """One Generate request's timings, fed each event the backend yields."""

    __slots__ = ("m", "start", "start_ns", "admitted_ns", "last", "first", "cached", "pulled", "replica_id")

    def __init__(self, m: EngineMetrics, params: GenerateParams, replica_id: str) -> None:
        self.m = m
        self.start = time.perf_counter()
        self.start_ns = time.time_ns()
        self.admitted_ns = self.start_ns
        self.last = 0.0
        self.first = True
        self.cached = 0
        self.pulled = 0
        self.replica_id = replica_id
        if tracing.ON:
            attributes: dict[str, str | int] = {"chatmesh.replica.id": replica_id,
                                                "gen_ai.usage.input_tokens": len(params.prompt_token_ids)}
            if params.conversation_id:
                attributes["gen_ai.conversation.id"] = params.conversation_id
            if params.turn_id:
                attributes["chatmesh.turn.id"] = params.turn_id
            tracing.annotate(attributes)

    def event(self, event: GenerateEvent) -> None:
        now = time.perf_counter()
        match event:
            case Started():
                self.m.queue.observe(now - self.start)
                self.cached = event.cached_tokens
                self.pulled = event.pulled_tokens
                pull = event.pull
                if pull is not None and pull.outcome is not PullOutcome.NOT_NEEDED:
                    self.m.pull_seconds.observe(pull.seconds)
                if tracing.ON:
                    self.admitted_ns = time.time_ns()
                    if pull is not None:
                        pulled_ns = self.start_ns + int(pull.seconds * 1e9)
                        tracing.record("prefix_pull", self.start_ns, pulled_ns, {
                            "chatmesh.pull.source": pull.source_replica_id, "chatmesh.pull.outcome": pull.outcome.value,
                            "chatmesh.pull.blocks": pull.blocks, "chatmesh.pull.bytes": pull.bytes})
                        tracing.record("queue", pulled_ns, self.admitted_ns)
                    else:
                        tracing.record("queue", self.start_ns, self.admitted_ns)
            case Delta():
                n = len(event.token_ids)
                if n == 0:
                    return
                if self.first:
                    self.first = False
                    self.m.ttft.observe(now - self.start)
                    if tracing.ON:
                        tracing.record("prefill", self.admitted_ns, time.time_ns(),
                                       {"chatmesh.prompt.cached_tokens": self.cached,
                                        "chatmesh.prompt.pulled_tokens": self.pulled})
                else:
                    self.m.itl.observe((now - self.last) / n, n)
                self.last = now
            case Finished():
                u = event.usage
                self.m.e2e.observe(now - self.start)
                self.m.prompt_tokens.inc(u.prompt_tokens)
                self.m.output_tokens.inc(u.output_tokens)
                self.m.finished.labels(event.reason.value).inc()
                tracing.annotate({"gen_ai.usage.output_tokens": u.output_tokens,
                                  "chatmesh.prompt.cached_tokens": u.cached_prompt_tokens,
                                  "gen_ai.response.finish_reasons": event.reason.value})
            case _:
                assert_never(event)
