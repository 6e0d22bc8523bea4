"""Capacity arithmetic for a chat fleet: the reference design's Part 1 as a pure function, plus what memory binds.

What. Given a model shape, a precision, a GPU, tensor parallelism and a workload, `plan()` returns a frozen
`CapacityPlan` with the KV bytes per token, the KV tokens a node holds, the batch those tokens allow, a roofline
decode step and prefill rate, the node count (the larger of a time bound and a memory bound, and which binds),
the sequences in flight, the idle history to keep warm and the host tier it needs. `sweep()` plans one workload
at several context lengths. `render*()` print them. No I/O here: the CLI (cli.py) prints, capacity_plot.py
draws, and disaggregate.py splits a plan into prefill and decode pools with the KV transfer between them.

Why tokens, split in two. Prefill (the uncached prompt) is compute-bound; decode (one token per sequence per
step) is bandwidth-bound. A chat prompt outnumbers its reply several times over, and the prefix cache changes
the prompt side by a large factor, so the fleet is sized by both separately.

Why memory first. A sequence's KV grows with its context (160 KiB per token for the reference's model in FP8,
twice that in BF16), so the batch a node can hold shrinks as 1 / context: 8x longer contexts fit 8x fewer
sequences. At the reference's 3,200-token contexts 963 sequences fit per node and the batch cap (256, set by the
ITL target) binds first, so time sizes the fleet; at 32,000-token prompts only 95 fit, and a plan at batch 256
(169 GB of KV per GPU against 63.2 GB of room) would be impossible.

The model (all per replica of `tp` GPUs; a node of `gpus_per_node` GPUs holds gpus_per_node / tp replicas):
- KV per token = 2 (K and V) x layers x kv_heads x head_dim x bytes; each GPU holds 1/tp of it.
- KV room per GPU = HBM - weights / tp - reserved (activations, CUDA graphs, runtime).
- Mean context c = prompt + reply / 2 (a sequence holds its prompt, then grows by one token a step).
- Sequences that fit = floor(KV room / (c x KV per GPU)); the batch held = min(max_batch, that). Past that point
  every step reads the whole KV room, so the step time stops depending on context (35.6 ms on the reference's
  node) and decode tok/s per node falls as 1 / context.
- Decode step at the held batch B: read the weight shard once and every sequence's KV shard, at `decode_eff` of
  peak bandwidth: (weights/tp + B c kv/tp) / (bw x decode_eff).
- Prefill: 2 x params FLOP per token (attention ignored), tp GPUs at `prefill_mfu` of dense peak.
- Time bound: busy node-equivalents = output tok/s / decode per node + uncached prompt tok/s / prefill per node;
  nodes = ceil(busy / target_util) + spare.
- Little's law: sequences decoding at once L = turns/s x reply tokens x step time (at the held batch).
- Memory bound: nodes = ceil(L / (sequences that fit per node x target_util)) + spare: the KV room the
  sequences in flight need, with the same headroom as time. Nodes = max(time bound, memory bound).
  Because the step is taken at a batch memory allows, L / fit per node is at most the decode share of the busy
  time, so in an aggregated fleet the memory bound ties the time bound at best: memory binds *through the
  batch* (a smaller batch, a lower decode rate per node, more nodes by time). `binds` says KV_MEMORY when the
  batch is held under max_batch (or the memory bound is the larger), and `nodes_at_full_batch` is the count if
  the KV room held max_batch sequences: the difference is what more memory (a bigger GPU, FP8 KV, shorter
  contexts) buys.
- Idle history = (open conversations - L) x c; free KV = nodes x KV per node - L x c.
- Host tier: `host_memory_bytes` per node hold that / KV per token more tokens. The share of idle conversations
  that stay warm (equal conversations, spread perfectly: an upper bound) is (free KV + host tokens) / idle
  history, capped at 1; the host bytes per node that make the idle history fit are (idle - free KV) / nodes x
  KV per token. A returning turn whose prefix (cached_share x prompt tokens) sits in host memory reloads it over
  each GPU's host link; in time means within its own prefill of the uncached rest, so the reload adds nothing to
  TTFT: bandwidth needed per GPU = prefix x KV per GPU / (uncached tokens / prefill rate) = cached / uncached x
  prefill rate x KV per GPU (3.7 GB/s at the defaults, whatever the context), against `host_link_bytes_s`.

Defaults are the reference's: Llama 3.1 70B shape (70.6 B parameters, 80 layers, 8 KV heads, head dim 128),
FP8, H100 SXM (80 GB, 3.35 TB/s, 1,979 dense FP8 TFLOP/s), TP 8 on 8-GPU nodes, 8 GB reserved, 60% of peak
bandwidth, 40% of peak FLOP/s, batch 256; 20,000 open conversations, a turn a minute, 3,000-token prompts,
400-token replies, 80% cached, 60% target utilisation plus one spare node. They print 160 KiB per token,
3.08 M tokens per node, a 12.7 ms step (79 tok/s per stream), 20,098 and 44,850 tok/s per node, 11.1 busy
node-equivalents, 20 nodes, ~1,698 sequences in flight, 58.6 M idle tokens against 56.3 M free. Added here:
963 sequences fit per node (time binds; memory alone would need 4 nodes); a host tier of 1,536 GiB per node
(a DGX H100 has 2 TB) keeps every idle conversation warm where HBM alone keeps 96%; host links at 50 GB/s per
GPU (PCIe Gen5 x16, achieved, as roofline.py's host copies).
At 32,000-token prompts: 95 fit, a 35.6 ms step at batch 95, 164 nodes (157 if 256 fit).
The efficiencies are assumptions, not measurements: this is a roofline, not a benchmark.
"""

from __future__ import annotations

import dataclasses
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


GIB = 1 << 30
DEFAULT_HOST_MEMORY_GIB = 1536.0  # of a DGX H100's 2 TB: what a node gives the KV host tier (as `triton render`)
DEFAULT_HOST_LINK_GBS = 50.0  # per GPU, host <-> device: PCIe Gen5 x16 achieved (of 64), as roofline.py
DEFAULT_CHUNK_TOKENS = 512  # the prefill chunk an aggregated step carries (Sarathi-Serve; the engine's budget)


@dataclass(frozen=True)
class Hardware:
    """GPU, precision, parallelism, the assumed achieved fractions of peak, and the host tier and its link."""

    gpu: Gpu = GPUS["h100"]
    precision: Precision = Precision.FP8
    tp: int = 8
    gpus_per_node: int = 8
    reserved_bytes: float = 8e9
    decode_eff: float = 0.6
    prefill_mfu: float = 0.4
    max_batch: int = 256
    host_memory_bytes: float = DEFAULT_HOST_MEMORY_GIB * GIB  # per node, for KV spilled from HBM
    host_link_bytes_s: float = DEFAULT_HOST_LINK_GBS * 1e9  # per GPU, host -> device
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS


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


class Binds(enum.Enum):
    """What sets the node count."""

    TIME = "time"  # the batch is max_batch: busy time at that batch sizes the fleet
    KV_MEMORY = "KV memory"  # the KV room holds the batch under max_batch (or the memory bound is the larger)


@dataclass(frozen=True)
class HostTier:
    """Idle history against HBM and host memory, and the host->GPU reload a returning turn needs."""

    host_tokens_per_node: float
    warm_share_hbm: float  # of idle conversations, kept warm by free HBM alone
    warm_share: float  # with the host tier too
    host_bytes_needed_node: float  # host memory per node that makes the whole idle history fit (0: HBM does)
    host_reload_share: float  # of returning turns, those whose prefix comes back from host memory
    reload_tokens: float  # a returning turn's cached prefix
    reload_bytes_gpu: float
    prefill_s: float  # the turn's own prefill of its uncached tokens (alone on a replica)
    reload_bytes_s_needed_gpu: float  # to reload within prefill_s (inf: nothing to prefill, nothing to hide under)
    reload_s: float  # at the host link
    recompute_s: float  # prefilling the prefix again instead
    host_traffic_bytes_s_gpu: float  # sustained, when host_reload_share of turns reload

    @property
    def idle_fits(self) -> bool:
        return self.warm_share >= 1.0


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
    fit_per_replica: int  # sequences of the mean context that fit in one replica's KV room
    batch: int  # held per replica: min(max_batch, fit_per_replica)
    time_nodes: int
    memory_nodes: int
    nodes_at_full_batch: int  # the time bound if the KV room held max_batch sequences
    binds: Binds
    host: HostTier

    @property
    def gpus(self) -> int:
        return self.nodes * self.hardware.gpus_per_node

    @property
    def prefill_share(self) -> float:
        return self.prefill_busy_nodes / self.busy_nodes if self.busy_nodes else 0.0

    @property
    def idle_history_fits(self) -> bool:
        return self.idle_history_tokens <= self.free_kv_tokens

    @property
    def fit_per_node(self) -> int:
        return self.fit_per_replica * self.replicas_per_node

    @property
    def batch_per_node(self) -> int:
        return self.batch * self.replicas_per_node

    @property
    def kv_limited(self) -> bool:
        return self.batch < self.hardware.max_batch

    @property
    def full_batch_kv_bytes_gpu(self) -> float:
        """KV per GPU that max_batch sequences of the mean context would need."""
        return self.hardware.max_batch * self.mean_context_tokens * self.kv_bytes_per_token_gpu

    @property
    def prefill_tokens_per_s_replica(self) -> float:
        return self.prefill_tokens_per_s_node / self.replicas_per_node

    @property
    def chunk_s(self) -> float:
        """What one prefill chunk adds to an aggregated step."""
        return self.hardware.chunk_tokens / self.prefill_tokens_per_s_replica

    @property
    def decode_ceiling_tokens_per_s_node(self) -> float:
        """Decode tok/s per node as the batch grows without bound: KV reads alone, at the mean context."""
        hw = self.hardware
        return (self.replicas_per_node * hw.gpu.bandwidth_bytes_s * hw.decode_eff
                / (self.mean_context_tokens * self.kv_bytes_per_token_gpu))


def nodes_for(node_equivalents: float, target_util: float, spare: int) -> int:
    """Nodes for that much busy time (or in-flight KV) at the target utilisation, plus the spares."""
    return math.ceil(node_equivalents / target_util - 1e-9) + spare


def plan(model: ModelShape = ModelShape(), hardware: Hardware = Hardware(),
         workload: Workload = Workload()) -> CapacityPlan:
    """The arithmetic. Raises InvalidArgument when the inputs cannot describe a fleet."""
    hw, wl = hardware, workload
    if hw.tp < 1 or hw.gpus_per_node % hw.tp:
        raise InvalidArgument(f"tp ({hw.tp}) must divide the GPUs per node ({hw.gpus_per_node})")
    if not 0 <= wl.cached_share <= 1 or not 0 < wl.target_util <= 1:
        raise InvalidArgument("cached share must be in [0, 1] and target utilisation in (0, 1]")
    if min(model.params, model.layers, model.kv_heads, model.head_dim, wl.turn_gap_s, wl.output_tokens,
           hw.max_batch, hw.decode_eff, hw.prefill_mfu, hw.gpu.bandwidth_bytes_s, hw.host_link_bytes_s,
           hw.chunk_tokens) <= 0 or wl.prompt_tokens < 0 or wl.conversations < 0:
        raise InvalidArgument("model shape, turn gap, reply tokens, batch, efficiencies and links must be positive")
    if hw.host_memory_bytes < 0 or wl.spare_nodes < 0:
        raise InvalidArgument("host memory and spare nodes must not be negative")
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
    fit = math.floor(tokens_replica / ctx + 1e-9)
    if fit < 1:
        raise InvalidArgument(
            f"one sequence of {ctx:,.0f} tokens needs {ctx * kv_token_gpu / 1e9:.1f} GB of KV per GPU, more than "
            f"the {kv_room_gpu / 1e9:.1f} GB of room: shorten the context, or add GPUs per replica (--tp)")
    batch = min(hw.max_batch, fit)
    bandwidth = hw.gpu.bandwidth_bytes_s * hw.decode_eff
    prefill_node = per_node * hw.tp * hw.gpu.flops(hw.precision) * hw.prefill_mfu / (2 * model.params)
    prefill_busy = uncached_s / prefill_node

    def step_at(b: int) -> float:
        return (weights_gpu + b * ctx * kv_token_gpu) / bandwidth

    step_s = step_at(batch)
    decode_node = per_node * batch / step_s
    decode_busy = out_s / decode_node
    busy = decode_busy + prefill_busy
    time_nodes = nodes_for(busy, wl.target_util, wl.spare_nodes)
    in_flight = turns_s * wl.output_tokens * step_s
    memory_nodes = nodes_for(in_flight / (per_node * fit), wl.target_util, wl.spare_nodes)
    nodes = max(time_nodes, memory_nodes)
    full_step = step_at(hw.max_batch)
    full_nodes = nodes_for(out_s * full_step / (per_node * hw.max_batch) + prefill_busy, wl.target_util,
                             wl.spare_nodes)
    binds = Binds.KV_MEMORY if batch < hw.max_batch or memory_nodes > time_nodes else Binds.TIME
    idle = (wl.conversations - in_flight) * ctx
    free = nodes * per_node * tokens_replica - in_flight * ctx
    return CapacityPlan(
        model=model, hardware=hw, workload=wl,
        kv_bytes_per_token=kv_token, kv_bytes_per_token_gpu=kv_token_gpu, weights_bytes_gpu=weights_gpu,
        kv_room_bytes_gpu=kv_room_gpu, kv_tokens_per_replica=tokens_replica,
        kv_tokens_per_node=per_node * tokens_replica, replicas_per_node=per_node,
        turns_per_s=turns_s, output_tokens_per_s=out_s, prompt_tokens_per_s=in_s, uncached_tokens_per_s=uncached_s,
        mean_context_tokens=ctx, decode_step_s=step_s, stream_tokens_per_s=1 / step_s,
        decode_tokens_per_s_node=decode_node, prefill_tokens_per_s_node=prefill_node,
        decode_busy_nodes=decode_busy, prefill_busy_nodes=prefill_busy, busy_nodes=busy, nodes=nodes,
        in_flight=in_flight, batch_slots=(nodes - wl.spare_nodes) * per_node * batch,
        idle_history_tokens=idle, free_kv_tokens=free,
        fit_per_replica=fit, batch=batch, time_nodes=time_nodes, memory_nodes=memory_nodes,
        nodes_at_full_batch=full_nodes, binds=binds,
        host=_host_tier(hw, wl, kv_token, kv_token_gpu, nodes, idle, free, turns_s, prefill_node / per_node,
                        nodes * per_node),
    )


def _host_tier(hw: Hardware, wl: Workload, kv_token: int, kv_token_gpu: float, nodes: int, idle: float,
               free: float, turns_s: float, prefill_replica: float, replicas: int) -> HostTier:
    """The host tier's share of the idle history and the reload it implies (module doc)."""
    host_node = hw.host_memory_bytes / kv_token
    free_hbm = max(0.0, free)
    beyond_hbm = max(0.0, idle - free_hbm)
    from_host = min(beyond_hbm, nodes * host_node)
    reload_tokens = wl.cached_share * wl.prompt_tokens
    reload_bytes = reload_tokens * kv_token_gpu
    prefill_s = wl.prompt_tokens * (1 - wl.cached_share) / prefill_replica
    reload_share = from_host / idle if idle > 0 else 0.0
    return HostTier(
        host_tokens_per_node=host_node,
        warm_share_hbm=min(1.0, free_hbm / idle) if idle > 0 else 1.0,
        warm_share=min(1.0, (free_hbm + nodes * host_node) / idle) if idle > 0 else 1.0,
        host_bytes_needed_node=beyond_hbm / nodes * kv_token,
        host_reload_share=reload_share,
        reload_tokens=reload_tokens, reload_bytes_gpu=reload_bytes, prefill_s=prefill_s,
        reload_bytes_s_needed_gpu=reload_bytes / prefill_s if prefill_s > 0 else math.inf,
        reload_s=reload_bytes / hw.host_link_bytes_s, recompute_s=reload_tokens / prefill_replica,
        host_traffic_bytes_s_gpu=turns_s * reload_share * reload_bytes / replicas,
    )


# ---- a context sweep ---------------------------------------------------------------------------------------

def parse_tokens(text: str) -> int:
    """'32k' -> 32,000 (k = 1,000 tokens, as the reference counts: 16,000, 128,000); '32000' -> 32,000."""
    t = text.strip().lower().replace(",", "").replace("_", "")
    scale = 1000 if t.endswith("k") else 1
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise InvalidArgument(f"{text!r} is not a token count (write 4k, 32k, 128000)") from None
    if not value >= 1 or value != value or value == math.inf:
        raise InvalidArgument(f"{text!r}: a context is at least one token")
    return round(value)


def sweep(contexts: typing.Sequence[int], model: ModelShape = ModelShape(), hardware: Hardware = Hardware(),
          workload: Workload = Workload()) -> list[CapacityPlan]:
    """One plan per prompt length, everything else as given."""
    if not contexts:
        raise InvalidArgument("a sweep needs at least one context length")
    return [plan(model, hardware, dataclasses.replace(workload, prompt_tokens=c)) for c in contexts]


# ---- what `chatmesh capacity` prints -----------------------------------------------------------------------

def gb_text(nbytes: float) -> str:
    """Bytes as the renderers print them (here and in disaggregate.py)."""
    return f"{nbytes / 1e9:,.1f} GB"


def rate_text(nbytes_s: float) -> str:
    return f"{nbytes_s / 1e9:,.1f} GB/s" if nbytes_s >= 1e9 else f"{nbytes_s / 1e6:,.0f} MB/s"


def ms_text(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def share_text(share: float) -> str:
    """A share as a whole percent, except that one short of all (or above none) never reads as 100% (or 0%)."""
    text = f"{share:.0%}"
    if 0 < share < 1 and text in ("100%", "0%"):
        return f"{math.floor(share * 1000) / 10:.1f}%" if share > 0.5 else f"{math.ceil(share * 1000) / 10:.1f}%"
    return text


_MORE = " " * 28  # a continued line, under the figures


def _binding(p: CapacityPlan) -> list[str]:
    """Which resource runs out, by how much, and what more of it would change."""
    hw, wl = p.hardware, p.workload
    mem = (f"{p.memory_nodes:,} by KV memory ({p.in_flight:,.0f} in flight / {p.fit_per_node:,} per node at "
           f"{wl.target_util:.0%}, + {wl.spare_nodes})")
    match p.binds:
        case Binds.TIME:
            return [f"  binds                     time: {p.time_nodes:,} nodes by busy time at batch {p.batch} "
                    f"(--max-batch); {mem}"]
        case Binds.KV_MEMORY:
            return [
                f"  binds                     KV memory: {hw.max_batch} sequences of {p.mean_context_tokens:,.0f} "
                f"tokens need {gb_text(p.full_batch_kv_bytes_gpu)} of KV per GPU, room {gb_text(p.kv_room_bytes_gpu)}: "
                f"batch {p.batch}",
                f"{_MORE}{p.time_nodes:,} nodes by busy time at batch {p.batch}; {mem}",
                f"{_MORE}{p.nodes_at_full_batch:,} if the full batch fit ({p.nodes - p.nodes_at_full_batch:+,d} for memory); "
                f"decode per node {p.decode_tokens_per_s_node:,.0f} tok/s, at most "
                f"{p.decode_ceiling_tokens_per_s_node:,.0f} at any batch at this context",
            ]
        case _:
            typing.assert_never(p.binds)


def _host_lines(p: CapacityPlan) -> list[str]:
    hw, h = p.hardware, p.host
    lines = [
        f"  host tier                 {hw.host_memory_bytes / GIB:,.0f} GiB per node = "
        f"{h.host_tokens_per_node / 1e6:.2f} M tokens; idle conversations warm: {share_text(h.warm_share_hbm)} in "
        f"HBM alone, {share_text(h.warm_share)} with the host tier",
        f"{_MORE}{math.ceil(h.host_bytes_needed_node / GIB):,} GiB per node would make the idle history fit; with this "
        f"tier {h.host_reload_share:.0%} of returning turns reload from host, {rate_text(h.host_traffic_bytes_s_gpu)} "
        f"per GPU",
    ]
    if h.reload_tokens > 0:
        within = (f"to arrive within its {ms_text(h.prefill_s)} prefill of the rest needs "
                  f"{rate_text(h.reload_bytes_s_needed_gpu)} per GPU" if math.isfinite(h.reload_bytes_s_needed_gpu)
                  else "with nothing left to prefill to hide it under")
        lines += [
            f"  reload from host          a returning turn's {h.reload_tokens:,.0f} cached tokens, "
            f"{h.reload_bytes_gpu / 1e6:,.0f} MB per GPU, {within}",
            f"{_MORE}at {rate_text(hw.host_link_bytes_s)} per GPU it takes {ms_text(h.reload_s)}; recomputing it "
            f"{ms_text(h.recompute_s)}",
        ]
    return lines


def render(p: CapacityPlan) -> str:
    """The plan as the text `chatmesh capacity` prints."""
    m, hw, wl = p.model, p.hardware, p.workload
    prec = hw.precision.value.upper()
    batch_note = (f"KV memory holds the batch under --max-batch {hw.max_batch}" if p.kv_limited
                  else f"batch {p.batch} (--max-batch)")
    lines = [
        f"capacity plan: {m.params / 1e9:.1f} B parameters ({m.layers} layers, {m.kv_heads} KV heads, head dim "
        f"{m.head_dim}), {prec}, {hw.gpu.name}, TP={hw.tp}, {hw.gpus_per_node} GPUs per node",
        f"  KV cache per token        {p.kv_bytes_per_token / 1024:,.0f} KiB "
        f"({p.kv_bytes_per_token_gpu / 1024:,.0f} KiB per GPU)",
        f"  weights per GPU           {p.weights_bytes_gpu / 1e9:.1f} GB; KV room {p.kv_room_bytes_gpu / 1e9:.1f} GB",
        f"  KV tokens per node        {p.kv_tokens_per_node / 1e6:.2f} M",
        f"  sequences per node        {p.fit_per_node:,} fit at {p.mean_context_tokens:,.0f} tokens "
        f"(prompt + reply / 2); {batch_note}",
        f"  turns per second          {p.turns_per_s:,.0f}",
        f"  output tokens/s           {p.output_tokens_per_s:,.0f}",
        f"  prompt tokens/s           {p.prompt_tokens_per_s:,.0f}; uncached {p.uncached_tokens_per_s:,.0f} "
        f"at {wl.cached_share:.0%} cached",
        f"  decode step at batch {p.batch:<4} {p.decode_step_s * 1e3:.1f} ms = "
        f"{p.stream_tokens_per_s:.0f} tok/s per stream",
        f"  per node                  decode {p.decode_tokens_per_s_node:,.0f} tok/s, "
        f"prefill {p.prefill_tokens_per_s_node:,.0f} tok/s",
        f"  busy node-equivalents     {p.busy_nodes:.1f} (decode {p.decode_busy_nodes:.1f}, prefill "
        f"{p.prefill_busy_nodes:.1f} = {p.prefill_share:.0%})",
        f"  nodes                     {p.nodes:,} ({p.gpus:,} GPUs) at {wl.target_util:.0%} target "
        f"+ {wl.spare_nodes} spare",
        f"  in flight (Little)        {p.in_flight:,.0f} sequences = {p.turns_per_s:,.0f}/s x "
        f"{wl.output_tokens * p.decode_step_s:.1f} s, against {p.batch_slots:,} batch slots",
        *_binding(p),
        f"  idle history              {p.idle_history_tokens / 1e6:.1f} M tokens vs "
        f"{p.free_kv_tokens / 1e6:.1f} M free KV fleet-wide ({'fits' if p.idle_history_fits else 'does not fit'})",
        *_host_lines(p),
    ]
    return "\n".join(lines)


def _context_label(tokens: int) -> str:
    return f"{tokens / 1000:g}k" if tokens >= 1000 and tokens % 100 == 0 else f"{tokens:,}"


def render_sweep(plans: typing.Sequence[CapacityPlan]) -> str:
    """One row per context: concurrency, decode rates, nodes and what binds."""
    wl = plans[0].workload
    head = (f"context sweep: {wl.output_tokens:,}-token replies, {wl.cached_share:.0%} cached, "
            f"--max-batch {plans[0].hardware.max_batch}; per node")
    cols = (f"  {'prompt':>7} {'context':>8} {'fit':>6} {'batch':>5} {'step':>8} {'tok/s':>6} {'tok/s':>8} "
            f"{'nodes':>6} {'time':>6} {'memory':>6} {'full':>6}  binds")
    sub = (f"  {'':>7} {'mean':>8} {'/node':>6} {'/node':>5} {'ms':>8} {'/strm':>6} {'/node':>8} "
           f"{'':>6} {'bound':>6} {'bound':>6} {'batch':>6}")
    rows = [head, cols, sub]
    for p in plans:
        rows.append(
            f"  {_context_label(p.workload.prompt_tokens):>7} {p.mean_context_tokens:>8,.0f} {p.fit_per_node:>6,} "
            f"{p.batch_per_node:>5,} {p.decode_step_s * 1e3:>8.1f} {p.stream_tokens_per_s:>6.0f} "
            f"{p.decode_tokens_per_s_node:>8,.0f} {p.nodes:>6,} {p.time_nodes:>6,} {p.memory_nodes:>6,} "
            f"{p.nodes_at_full_batch:>6,}  {p.binds.value}")
    rows.append("  (full batch: the nodes if the KV room held --max-batch sequences; the gap is what memory costs)")
    return "\n".join(rows)
