"""The link a prefix crosses between replicas, and what a turn's prompt tokens cost by where they come from.

What. A replica can take a conversation's KV from a peer instead of recomputing it (issue 29). One model of
that, shared by everything that needs it: the `sim` engine times a pull with it, the follow router prices its
candidates with it, `chatmesh simulate` counts the bytes and the link's share with it.
- bytes of a prefix = tokens x KV bytes per token (the whole replica's: 2 x layers x KV heads x head dim x
  bytes per value, 160 KiB for the reference's 70B-class model in FP8);
- `Link.transfer_s(bytes)` = latency_s + bytes / bandwidth_bytes_s: one transfer, set up once, then streamed;
- `PrefixCost`: a prompt token the replica caches costs nothing, a pulled one its share of a transfer, a
  prefilled one 1 / prefill_tokens_per_s (the capacity plan's roofline, `capacity.py`).

Defaults: the reference's node, 8 GPUs with a 400 Gb/s NIC each (a DGX H100's eight ConnectX-7 ports), one TP-8
replica per node. With tensor parallelism each GPU holds, and so sends, its own 1/8 of every token's KV over its
own NIC, so a replica's link is 8 x 50 GB/s = 400 GB/s (`DEFAULT_NICS` x `DEFAULT_NIC_GBPS`). The latency,
0.5 ms per transfer, is an assumption: a gRPC round trip on the mesh and the first chunk's turnaround (an RDMA
engine such as NIXL or Mooncake's sets up in tens of microseconds). What that gives, for the reference's
3,000-token prompt: 491.5 MB in 0.5 + 1.2 = 1.7 ms against 66.9 ms to prefill it (44,850 tokens/s), 39x
cheaper; on one 400 Gb/s link (`Link.from_gbps(400, 1)`) 10.3 ms, 6.5x (the issue's "~10 ms at 50 GB/s").
Below `PrefixCost.break_even_tokens()` (~23 tokens at the defaults) the latency outweighs the prefill saved,
so a pull that small is never planned.

What it leaves out: contention (two pulls from one source share its link; the simulator reports the link's
share so an operator sees when that would matter), the source's host-to-device copy when the blocks sit in its
host tier (PCIe at 50 GB/s per GPU, `roofline.NodeModel.copy_s`: the same order as the link), and the puller's
import. It is a roofline, like capacity.py: set `bandwidth_bytes_s` to what the mesh achieves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chatmesh.router.capacity import CapacityPlan, plan

DEFAULT_NIC_GBPS = 400.0  # per GPU, the reference's node
DEFAULT_NICS = 8  # NICs a TP-8 replica's GPUs send over at once
DEFAULT_LATENCY_S = 0.0005


@dataclass(frozen=True)
class Link:
    """A replica's link to its peers: bytes per second and a fixed cost per transfer."""

    bandwidth_bytes_s: float = DEFAULT_NICS * DEFAULT_NIC_GBPS * 1e9 / 8
    latency_s: float = DEFAULT_LATENCY_S

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_s > 0 or not math.isfinite(self.bandwidth_bytes_s):
            raise ValueError("link bandwidth must be a positive number of bytes per second")
        if not 0 <= self.latency_s < math.inf:
            raise ValueError("link latency must be >= 0 seconds")

    @classmethod
    def from_gbps(cls, gbps_per_nic: float, nics: int = DEFAULT_NICS, latency_s: float = DEFAULT_LATENCY_S) -> Link:
        return cls(gbps_per_nic * 1e9 / 8 * nics, latency_s)

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move `nbytes` in one transfer (0 for nothing: no transfer happens)."""
        return self.latency_s + nbytes / self.bandwidth_bytes_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class PrefixCost:
    """What a prompt token costs a replica, in seconds, by where its KV comes from."""

    link: Link
    kv_bytes_per_token: int
    prefill_tokens_per_s: float

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 1 or not self.prefill_tokens_per_s > 0:
            raise ValueError("KV bytes per token and the prefill rate must be positive")

    @classmethod
    def from_plan(cls, p: CapacityPlan, link: Link | None = None) -> PrefixCost:
        """One replica of the capacity plan (prefill rate per replica, its whole KV per token)."""
        return cls(link or Link(), p.kv_bytes_per_token, p.prefill_tokens_per_s_node / p.replicas_per_node)

    def kv_bytes(self, tokens: int) -> int:
        return max(0, tokens) * self.kv_bytes_per_token

    def pull_s(self, tokens: int) -> float:
        """Seconds to pull `tokens` of KV from a peer in one transfer."""
        return self.link.transfer_s(self.kv_bytes(tokens))

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill `tokens` (the roofline's compute time)."""
        return max(0, tokens) / self.prefill_tokens_per_s

    def worth_pulling(self, tokens: int) -> bool:
        """A pull of `tokens` costs less than prefilling them."""
        return tokens > 0 and self.pull_s(tokens) < self.prefill_s(tokens)

    def break_even_tokens(self) -> int:
        """The fewest tokens worth a pull (a pull's latency is paid whatever its size)."""
        per_token = 1 / self.prefill_tokens_per_s - self.kv_bytes_per_token / self.link.bandwidth_bytes_s
        if per_token <= 0:
            raise ValueError("the link is slower per token than prefill: no pull is ever worth it")
        n = max(1, math.floor(self.link.latency_s / per_token))
        while not self.worth_pulling(n):
            n += 1
        return n


DEFAULT_COST = PrefixCost.from_plan(plan())
