"""Capacity arithmetic for a chat fleet: the reference design's Part 1 as a pure function.

What. Given a model shape, a precision, a GPU, tensor parallelism and a workload, `plan()` returns a frozen
`CapacityPlan` with the KV bytes per token, the KV tokens a node holds, a roofline decode step and prefill
rate, the node count, the sequences in flight and the idle history to keep warm. `render()` prints it.

Why tokens, split in two. Prefill (the uncached prompt) is compute-bound; decode (one token per sequence per
step) is bandwidth-bound. A chat prompt outnumbers its reply several times over, and the prefix cache changes
the prompt side by a large factor, so the fleet is sized by both separately.

The model (all per replica of `tp` GPUs; a node of `gpus_per_node` GPUs holds gpus_per_node / tp replicas):
- KV per token = 2 (K and V) x layers x kv_heads x head_dim x bytes; each GPU holds 1/tp of it.
- KV room per GPU = HBM - weights / tp - reserved (activations, CUDA graphs, runtime).
- Decode step at batch B with mean context c = prompt + reply / 2: read the weight shard once and every
  sequence's KV shard, at `decode_eff` of peak bandwidth: (weights/tp + B c kv/tp) / (bw x decode_eff).
- Prefill: 2 x params FLOP per token (attention ignored), tp GPUs at `prefill_mfu` of dense peak.
- Busy node-equivalents = output tok/s / decode per node + uncached prompt tok/s / prefill per node;
  nodes = ceil(busy / target_util) + spare.
- Little's law: sequences decoding at once = turns/s x reply tokens x step time.
- Idle history = (open conversations - in flight) x c; free KV = nodes x KV per node - in flight x c.

Defaults are the reference's: Llama 3.1 70B shape (70.6 B parameters, 80 layers, 8 KV heads, head dim 128),
FP8, H100 SXM (80 GB, 3.35 TB/s, 1,979 dense FP8 TFLOP/s), TP 8 on 8-GPU nodes, 8 GB reserved, 60% of peak
bandwidth, 40% of peak FLOP/s, batch 256; 20,000 open conversations, a turn a minute, 3,000-token prompts,
400-token replies, 80% cached, 60% target utilisation plus one spare node. They print 160 KiB per token,
3.08 M tokens per node, a 12.7 ms step (79 tok/s per stream), 20,098 and 44,850 tok/s per node, 11.1 busy
node-equivalents, 20 nodes, ~1,698 sequences in flight, 58.6 M idle tokens against 56.3 M free.
The efficiencies are assumptions, not measurements: this is a roofline, not a benchmark.
"""

from __future__ import annotations

import enum
import math
import typing
from dataclasses import dataclass, field

from chatmesh.mesh.errors import InvalidArgument


class Precision(enum.Enum):
    """Weights and KV cache precision."""

    FP8 = "fp8"
    BF16 = "bf16"

    @property
    def bytes(self) -> int:
        match self:
            case Precision.FP8:
                return 1
            case Precision.BF16:
                return 2
            case _:
                typing.assert_never(self)


@dataclass(frozen=True)
class Gpu:
    """One accelerator: memory, bandwidth and dense FLOP/s per precision."""

    name: str
    hbm_bytes: float
    bandwidth_bytes_s: float
    fp8_flops: float
    bf16_flops: float

    def flops(self, precision: Precision) -> float:
        match precision:
            case Precision.FP8:
                return self.fp8_flops
            case Precision.BF16:
                return self.bf16_flops
            case _:
                typing.assert_never(precision)


# NVIDIA datasheets, SXM parts, dense (no sparsity).
GPUS: dict[str, Gpu] = {
    "h100": Gpu("H100 SXM", 80e9, 3.35e12, 1979e12, 989.5e12),
    "h200": Gpu("H200 SXM", 141e9, 4.8e12, 1979e12, 989.5e12),
}


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder: parameter count and the attention shape that sets the KV cache."""

    params: float = 70.6e9
    layers: int = 80
    kv_heads: int = 8
    head_dim: int = 128


@dataclass(frozen=True)
class Hardware:
    """GPU, precision, parallelism and the assumed achieved fractions of peak."""

    gpu: Gpu = GPUS["h100"]
    precision: Precision = Precision.FP8
    tp: int = 8
    gpus_per_node: int = 8
    reserved_bytes: float = 8e9
    decode_eff: float = 0.6
    prefill_mfu: float = 0.4
    max_batch: int = 256


@dataclass(frozen=True)
class Workload:
    """Peak traffic: open conversations, the user's pause, prompt and reply sizes, cached share."""

    conversations: int = 20_000
    turn_gap_s: float = 60.0
    prompt_tokens: int = 3_000
    output_tokens: int = 400
    cached_share: float = 0.8
    target_util: float = 0.6
    spare_nodes: int = 1


@dataclass(frozen=True)
class CapacityPlan:
    """Every derived figure; units in the names. Per-node figures include every replica on the node."""

    model: ModelShape
    hardware: Hardware
    workload: Workload = field(repr=False)
    kv_bytes_per_token: int
    kv_bytes_per_token_gpu: float
    weights_bytes_gpu: float
    kv_room_bytes_gpu: float
    kv_tokens_per_replica: float
    kv_tokens_per_node: float
    replicas_per_node: int
    turns_per_s: float
    output_tokens_per_s: float
    prompt_tokens_per_s: float
    uncached_tokens_per_s: float
    mean_context_tokens: float
    decode_step_s: float
    stream_tokens_per_s: float
    decode_tokens_per_s_node: float
    prefill_tokens_per_s_node: float
    decode_busy_nodes: float
    prefill_busy_nodes: float
    busy_nodes: float
    nodes: int
    in_flight: float
    batch_slots: int
    idle_history_tokens: float
    free_kv_tokens: float

    @property
    def gpus(self) -> int:
        return self.nodes * self.hardware.gpus_per_node

    @property
    def prefill_share(self) -> float:
        return self.prefill_busy_nodes / self.busy_nodes if self.busy_nodes else 0.0

    @property
    def idle_history_fits(self) -> bool:
        return self.idle_history_tokens <= self.free_kv_tokens


def plan(model: ModelShape = ModelShape(), hardware: Hardware = Hardware(),
         workload: Workload = Workload()) -> CapacityPlan:
    """The arithmetic. Raises InvalidArgument when the inputs cannot describe a fleet."""
    hw, wl = hardware, workload
    if hw.tp < 1 or hw.gpus_per_node % hw.tp:
        raise InvalidArgument(f"tp ({hw.tp}) must divide the GPUs per node ({hw.gpus_per_node})")
    if not 0 <= wl.cached_share <= 1 or not 0 < wl.target_util <= 1:
        raise InvalidArgument("cached share must be in [0, 1] and target utilisation in (0, 1]")
    if min(model.params, model.layers, model.kv_heads, model.head_dim, wl.turn_gap_s, wl.output_tokens,
           hw.max_batch, hw.decode_eff, hw.prefill_mfu, hw.gpu.bandwidth_bytes_s) <= 0:
        raise InvalidArgument("model shape, turn gap, reply tokens, batch and efficiencies must be positive")
    nbytes = hw.precision.bytes
    kv_token = 2 * model.layers * model.kv_heads * model.head_dim * nbytes
    kv_token_gpu = kv_token / hw.tp
    weights_gpu = model.params * nbytes / hw.tp
    kv_room_gpu = hw.gpu.hbm_bytes - weights_gpu - hw.reserved_bytes
    if kv_room_gpu <= 0:
        raise InvalidArgument(
            f"the weights ({weights_gpu / 1e9:.1f} GB per GPU at TP={hw.tp}) and reserve do not fit in "
            f"{hw.gpu.hbm_bytes / 1e9:.0f} GB")
    per_node = hw.gpus_per_node // hw.tp
    tokens_replica = kv_room_gpu / kv_token_gpu

    turns_s = wl.conversations / wl.turn_gap_s
    out_s = turns_s * wl.output_tokens
    in_s = turns_s * wl.prompt_tokens
    uncached_s = in_s * (1 - wl.cached_share)
    ctx = wl.prompt_tokens + wl.output_tokens / 2

    step_s = (weights_gpu + hw.max_batch * ctx * kv_token_gpu) / (hw.gpu.bandwidth_bytes_s * hw.decode_eff)
    decode_node = per_node * hw.max_batch / step_s
    prefill_node = per_node * hw.tp * hw.gpu.flops(hw.precision) * hw.prefill_mfu / (2 * model.params)
    decode_busy, prefill_busy = out_s / decode_node, uncached_s / prefill_node
    busy = decode_busy + prefill_busy
    nodes = math.ceil(busy / wl.target_util - 1e-9) + wl.spare_nodes
    in_flight = turns_s * wl.output_tokens * step_s
    return CapacityPlan(
        model=model, hardware=hw, workload=wl,
        kv_bytes_per_token=kv_token, kv_bytes_per_token_gpu=kv_token_gpu, weights_bytes_gpu=weights_gpu,
        kv_room_bytes_gpu=kv_room_gpu, kv_tokens_per_replica=tokens_replica,
        kv_tokens_per_node=per_node * tokens_replica, replicas_per_node=per_node,
        turns_per_s=turns_s, output_tokens_per_s=out_s, prompt_tokens_per_s=in_s, uncached_tokens_per_s=uncached_s,
        mean_context_tokens=ctx, decode_step_s=step_s, stream_tokens_per_s=1 / step_s,
        decode_tokens_per_s_node=decode_node, prefill_tokens_per_s_node=prefill_node,
        decode_busy_nodes=decode_busy, prefill_busy_nodes=prefill_busy, busy_nodes=busy, nodes=nodes,
        in_flight=in_flight, batch_slots=(nodes - wl.spare_nodes) * per_node * hw.max_batch,
        idle_history_tokens=(wl.conversations - in_flight) * ctx,
        free_kv_tokens=nodes * per_node * tokens_replica - in_flight * ctx,
    )


def render(p: CapacityPlan) -> str:
    """The plan as the text `chatmesh capacity` prints."""
    m, hw, wl = p.model, p.hardware, p.workload
    prec = hw.precision.value.upper()
    lines = [
        f"capacity plan: {m.params / 1e9:.1f} B parameters ({m.layers} layers, {m.kv_heads} KV heads, head dim "
        f"{m.head_dim}), {prec}, {hw.gpu.name}, TP={hw.tp}, {hw.gpus_per_node} GPUs per node",
        f"  KV cache per token        {p.kv_bytes_per_token / 1024:,.0f} KiB "
        f"({p.kv_bytes_per_token_gpu / 1024:,.0f} KiB per GPU)",
        f"  weights per GPU           {p.weights_bytes_gpu / 1e9:.1f} GB; KV room {p.kv_room_bytes_gpu / 1e9:.1f} GB",
        f"  KV tokens per node        {p.kv_tokens_per_node / 1e6:.2f} M",
        f"  turns per second          {p.turns_per_s:,.0f}",
        f"  output tokens/s           {p.output_tokens_per_s:,.0f}",
        f"  prompt tokens/s           {p.prompt_tokens_per_s:,.0f}; uncached {p.uncached_tokens_per_s:,.0f} "
        f"at {wl.cached_share:.0%} cached",
        f"  decode step at batch {hw.max_batch:<4} {p.decode_step_s * 1e3:.1f} ms = "
        f"{p.stream_tokens_per_s:.0f} tok/s per stream",
        f"  per node                  decode {p.decode_tokens_per_s_node:,.0f} tok/s, "
        f"prefill {p.prefill_tokens_per_s_node:,.0f} tok/s",
        f"  busy node-equivalents     {p.busy_nodes:.1f} (decode {p.decode_busy_nodes:.1f}, prefill "
        f"{p.prefill_busy_nodes:.1f} = {p.prefill_share:.0%})",
        f"  nodes                     {p.nodes} ({p.gpus} GPUs) at {wl.target_util:.0%} target "
        f"+ {wl.spare_nodes} spare",
        f"  in flight (Little)        {p.in_flight:,.0f} sequences = {p.turns_per_s:,.0f}/s x "
        f"{wl.output_tokens * p.decode_step_s:.1f} s, against {p.batch_slots:,} batch slots",
        f"  idle history              {p.idle_history_tokens / 1e6:.1f} M tokens vs "
        f"{p.free_kv_tokens / 1e6:.1f} M free KV fleet-wide ({'fits' if p.idle_history_fits else 'does not fit'})",
    ]
    return "\n".join(lines)
