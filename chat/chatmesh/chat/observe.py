"""What the chat service exports: its Prometheus metrics (`ChatMetrics`) and the spans of a turn's phases.

Metrics, on the service's registry (served by the bootstrap on CHATMESH_CHAT_METRICS_PORT):
- `chatmesh_chat_turns_total{outcome}`: every attempt's terminal state in the turn state machine
  (`chatmesh.mesh.turn`: stored, stopped, blocked, failed, replayed, attached, rejected), counted by the machine's
  observe hook, so no path can end a turn uncounted;
- `chatmesh_chat_moderation_blocks_total{stage}`: turns moderation stopped, input (RECEIVED -> BLOCKED) or output
  (DECODE -> BLOCKED);
- `chatmesh_chat_time_to_first_token_seconds`: SendTurn/RegenerateTurn received -> first text sent on;
- `chatmesh_chat_inter_token_latency_seconds`: per engine chunk, its gap divided over its tokens (one
  `observe(gap / n, n)` per chunk, never per token);
- `chatmesh_chat_prompt_tokens_total{source}`: prompt tokens of finished generations, `cached` (the engine found
  them in its prefix cache) or `prefilled` (computed): the hit rate as chat sees it;
- `chatmesh_chat_summaries_total`: summaries made and saved at a turn boundary;
- the moderation client's `chatmesh_moderation_client_failures_total{direction,reason}`.

Spans (with tracing on; `chatmesh.mesh.tracing`), children of the turn's ChatService span and parents of the
RPCs they make: `claim` (store BeginTurn), `route` (router PickReplica), `input_check` (moderation CheckInput),
`generate` (the engine stream; the engine adds `queue` and `prefill` under it) with `first_token` (request ->
first chunk), `output_checks` (the reply's screening, with its chunk count; the checks share one stream with
other turns, so they are timed here), `finish` (store FinishTurn). They are opened at the gRPC edge
(`clients.py`), so the core stays free of transport and telemetry.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from chatmesh.mesh import metrics
from chatmesh.mesh.turn import Move, TurnState, TERMINAL


class ChatMetrics:
    def __init__(self, registry: metrics.Registry) -> None:
        turns = registry.counter("chatmesh_chat_turns", "turn attempts by outcome (the state machine's end state)",
                                 ["outcome"])
        self._turns = {state: turns.labels(state.value) for state in TERMINAL}
        blocks = registry.counter("chatmesh_chat_moderation_blocks", "turns moderation stopped, by stage", ["stage"])
        self._input_blocks, self._output_blocks = blocks.labels("input"), blocks.labels("output")
        self.ttft = registry.histogram("chatmesh_chat_time_to_first_token_seconds",
                                       "a turn's request received -> its first text sent on", metrics.TTFT_BUCKETS)
        self.itl = registry.histogram("chatmesh_chat_inter_token_latency_seconds",
                                      "time between output tokens as chat receives them (per chunk)",
                                      metrics.ITL_BUCKETS)
        prompt = registry.counter("chatmesh_chat_prompt_tokens", "prompt tokens of finished generations, by source "
                                  "(cached: found in the engine's prefix cache; prefilled: computed)", ["source"])
        self.cached_tokens, self.prefilled_tokens = prompt.labels("cached"), prompt.labels("prefilled")
        self.summaries = registry.counter("chatmesh_chat_summaries", "summaries made at a turn boundary")

    def on_move(self, move: Move) -> None:
        """The turn state machine's observe hook."""
        counter = self._turns.get(move.target)
        if counter is not None:
            counter.inc()
        if move.target is TurnState.BLOCKED:
            (self._input_blocks if move.source is TurnState.RECEIVED else self._output_blocks).inc()

    def first_text_timer(self) -> Callable[[], None]:
        """Started when a turn's request arrives; call it once, when its first text goes out."""
        start = time.perf_counter()
        return lambda: self.ttft.observe(time.perf_counter() - start)
