"""A capacity plan split into prefill and decode pools, and the KV transfer between them (pure: no I/O).

What. `disaggregate(plan, link)` sizes a prefill pool and a decode pool for the workload of a `CapacityPlan`
(capacity.py) and says what moving each turn's KV from one to the other costs, with the aggregated plan beside
it so the trade is visible (`chatmesh capacity --disaggregate`).

The model:
- Prefill pool: uncached prompt tok/s / prefill tok/s per node (the prefill MFU's roofline) busy nodes,
  ceil(busy / target utilisation) + spare.
- Decode pool: output tok/s / decode tok/s per node at the KV-limited batch (capacity.py: the smaller of
  max_batch and what fits in KV room at the mean context), and the memory bound (Little's sequences in flight
  over what fits per node); the larger of the two, + spare.
- Transfer: every uncached prompt token's KV crosses from prefill to decode once, so the fleet moves uncached
  prompt tok/s x KV bytes per token (32.8 GB/s at the reference's defaults). That assumes the decode node keeps
  the conversation's earlier KV (affinity routing brings the next turn back to it) and the prefill node finds
  the cached prefix in its own cache; if every prompt token's KV crossed, it would be prompt tok/s x KV bytes
  (5x at 80% cached), printed beside it. A prefill node at full speed sends prefill tok/s x KV bytes (7.3 GB/s
  at the defaults), a decode node at full speed takes in its turns' uncached KV; both are compared with the
  node's links. One turn's KV crosses in link.py's `Link.transfer_s` (latency + bytes / bandwidth) over its
  replica's share of the node's links.
- What it saves: by this roofline busy time adds up the same (prefill time plus decode time), so
  `saved_nodes` is 0: splitting costs a second rounding up and a second spare. What it buys is latency and
  independent scaling: a decode step carries no prefill chunk (ITL = the decode step, not step + a chunk's
  prefill time, capacity.py's `chunk_s`), long prompts stop stalling decode, and each pool scales on its own
  signal (the reference's "What changes at 10x"; DistServe, OSDI 2024).
Defaults: link.py's link, 8 NICs of 400 Gb/s per TP-8 replica (a DGX H100's ConnectX-7 ports), 0.5 ms a
transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chatmesh.router.capacity import Binds, CapacityPlan, ms_text, nodes_for, rate_text
from chatmesh.router.link import Link


@dataclass(frozen=True)
class DisaggregatedPlan:
    """Prefill and decode pools sized separately, the KV transfer between them, and the aggregated plan beside."""

    aggregated: CapacityPlan
    link: Link  # one replica's
    prefill_nodes: int
    decode_time_nodes: int
    decode_memory_nodes: int
    decode_nodes: int
    decode_binds: Binds
    saved_nodes: int  # busy time disaggregation saves by this model, in nodes at the target: 0 (module doc)
    transfer_bytes_s: float  # prefill -> decode, fleet-wide: uncached prompt tok/s x KV per token
    whole_prompt_transfer_bytes_s: float  # if decode nodes kept no prefix and every prompt token's KV crossed
    transfer_bytes_s_prefill_node: float  # average out of a serving prefill node
    transfer_bytes_s_decode_node: float  # average into a serving decode node
    peak_bytes_s_prefill_node: float  # a prefill node at full speed
    peak_bytes_s_decode_node: float  # a decode node at full speed (its finished turns replaced by new ones)
    turn_transfer_bytes: float  # one turn's uncached KV
    turn_transfer_s: float  # over its replica's link

    @property
    def nodes(self) -> int:
        return self.prefill_nodes + self.decode_nodes

    @property
    def node_link_bytes_s(self) -> float:
        return self.link.bandwidth_bytes_s * self.aggregated.replicas_per_node

    @property
    def link_share_prefill_node(self) -> float:
        """A prefill node at full speed, as a share of its links."""
        return self.peak_bytes_s_prefill_node / self.node_link_bytes_s

    @property
    def link_share_decode_node(self) -> float:
        return self.peak_bytes_s_decode_node / self.node_link_bytes_s

    @property
    def aggregated_itl_s(self) -> float:
        """An aggregated step carries a prefill chunk beside the decodes."""
        return self.aggregated.decode_step_s + self.aggregated.chunk_s

    @property
    def decode_itl_s(self) -> float:
        return self.aggregated.decode_step_s


def disaggregate(p: CapacityPlan, link: Link | None = None) -> DisaggregatedPlan:
    """Splits `p` into a prefill pool and a decode pool (module doc: what is and is not modelled)."""
    link = link or Link()
    wl, kv = p.workload, p.kv_bytes_per_token
    prefill_nodes = nodes_for(p.prefill_busy_nodes, wl.target_util, wl.spare_nodes)
    decode_time = nodes_for(p.decode_busy_nodes, wl.target_util, wl.spare_nodes)
    decode_memory = p.memory_nodes
    decode_nodes = max(decode_time, decode_memory)
    pooled_busy = p.prefill_busy_nodes + p.decode_busy_nodes
    saved = math.floor((p.busy_nodes - pooled_busy) / wl.target_util + 1e-9)
    transfer = p.uncached_tokens_per_s * kv
    turn_bytes = wl.prompt_tokens * (1 - wl.cached_share) * kv
    binds = Binds.KV_MEMORY if p.kv_limited or decode_memory > decode_time else Binds.TIME
    return DisaggregatedPlan(
        aggregated=p, link=link, prefill_nodes=prefill_nodes, decode_time_nodes=decode_time,
        decode_memory_nodes=decode_memory, decode_nodes=decode_nodes, decode_binds=binds, saved_nodes=saved,
        transfer_bytes_s=transfer, whole_prompt_transfer_bytes_s=p.prompt_tokens_per_s * kv,
        transfer_bytes_s_prefill_node=transfer / max(1, prefill_nodes - wl.spare_nodes),
        transfer_bytes_s_decode_node=transfer / max(1, decode_nodes - wl.spare_nodes),
        peak_bytes_s_prefill_node=p.prefill_tokens_per_s_node * kv,
        peak_bytes_s_decode_node=p.decode_tokens_per_s_node / wl.output_tokens * turn_bytes,
        turn_transfer_bytes=turn_bytes, turn_transfer_s=link.transfer_s(turn_bytes),
    )


def render(d: DisaggregatedPlan) -> str:
    """The two pools, the transfer between them, and the aggregated plan beside them."""
    p = d.aggregated
    hw, wl = p.hardware, p.workload
    lines = [
        f"disaggregated: prefill and decode pools, each at {wl.target_util:.0%} target + {wl.spare_nodes} spare",
        f"  prefill pool              {d.prefill_nodes:,} nodes: {p.uncached_tokens_per_s:,.0f} uncached tok/s / "
        f"{p.prefill_tokens_per_s_node:,.0f} per node = {p.prefill_busy_nodes:.1f} busy",
        f"  decode pool               {d.decode_nodes:,} nodes: {p.output_tokens_per_s:,.0f} tok/s / "
        f"{p.decode_tokens_per_s_node:,.0f} per node at batch {p.batch} = {p.decode_busy_nodes:.1f} busy "
        f"(time {d.decode_time_nodes:,}, memory {d.decode_memory_nodes:,}: {d.decode_binds.value} binds)",
        f"  against aggregated        {d.nodes:,} nodes vs {p.nodes:,} ({d.nodes - p.nodes:+,d}); busy time saved: "
        f"{d.saved_nodes} (time adds up the same; each pool rounds up and keeps its own spare)",
        f"  KV transfer               {p.uncached_tokens_per_s:,.0f} tok/s x {p.kv_bytes_per_token / 1024:,.0f} KiB = "
        f"{rate_text(d.transfer_bytes_s)} ({d.transfer_bytes_s * 8 / 1e9:,.0f} Gb/s) in total; whole prompts would "
        f"be {rate_text(d.whole_prompt_transfer_bytes_s)}",
        f"  per node                  prefill out {rate_text(d.transfer_bytes_s_prefill_node)} average, "
        f"{rate_text(d.peak_bytes_s_prefill_node)} at full speed = {d.link_share_prefill_node:.0%} of "
        f"{d.node_link_bytes_s * 8 / 1e9:,.0f} Gb/s; decode in {rate_text(d.transfer_bytes_s_decode_node)} "
        f"average, {rate_text(d.peak_bytes_s_decode_node)} at full speed = {d.link_share_decode_node:.0%}",
        f"  per turn                  {d.turn_transfer_bytes / 1e6:,.0f} MB of KV: {ms_text(d.turn_transfer_s)} on the "
        f"links (with {ms_text(d.link.latency_s)} to set up), added to TTFT unless sent layer by layer during "
        f"the prefill",
        f"  ITL                       aggregated {ms_text(p.decode_step_s)} step + {ms_text(p.chunk_s)} per "
        f"{hw.chunk_tokens}-token chunk = {ms_text(d.aggregated_itl_s)}; decode pool {ms_text(d.decode_itl_s)}",
    ]
    return "\n".join(lines)
