"""The roofline step model `sim` times its steps with: the reference's capacity arithmetic, applied per step.

What. One engine step on a tensor-parallel replica costs
    memory:  read the weights once, plus the KV of every token each sequence attends over, from HBM at
             `decode_eff` (60%) of peak bandwidth (per GPU: each holds 1/TP of weights and KV);
    compute: 2 x parameters FLOP per *prefill* token at `prefill_mfu` (40%) of dense peak, over the replica;
and the two add: a decode token's FLOPs hide under the memory time, a prefill chunk's do not. This reproduces
the reference's figures for a 70B-class model (80 layers, 8 KV heads of dim 128) in FP8 on 8 x H100 SXM:
    a decode step at batch 256 x 3,200 tokens: (8.8 GB + 256 x 3,200 x 20 KiB) / (3.35 TB/s x 0.6) = 12.7 ms;
    prefill: 8 x 1,979 TFLOP/s x 0.4 / 141 GFLOP per token = 44,850 tokens/s;
    a 512-token chunk adds ~11 ms to a step; a 16,000-token prompt in one step stalls it for ~360 ms.
Host<->device block copies (spill and onboarding) move each GPU's share of a block over its own PCIe link at
`pcie_bw` (an assumed 50 GB/s achieved of Gen5 x16's 64).

The per-token constants (weight and KV bytes per GPU, effective bandwidth, prefill rate, KV room) are not
recomputed here: they come from the capacity planner (`chatmesh.router.capacity.plan`, `chatmesh capacity`),
so the planned fleet and the simulated replica share one arithmetic; this module only applies it to the shape
of each step. `PRESETS` holds the reference replica (h100-fp8) and variants (H200: 141 GB at 4.8 TB/s; BF16:
2-byte weights and KV at half the FLOP/s). The efficiencies are the reference's assumptions: a roofline, not a
benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatmesh.router.capacity import GPUS, CapacityPlan, Hardware, Precision, plan


@dataclass(frozen=True)
class NodeModel:
    """One replica's step model: the planner's figures plus the host link and host tier size."""

    name: str
    plan: CapacityPlan
    pcie_bw: float = 50e9  # bytes/s per GPU, host <-> device
    host_kv_bytes: float = 1.5e12  # per node: system memory given to the spill tier (of 2 TB on a DGX)

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes of one token on one GPU (the replica's share divided by TP)."""
        return self.plan.kv_bytes_per_token_gpu

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.plan.weights_bytes_gpu

    @property
    def kv_tokens(self) -> float:
        """Tokens of KV the replica's HBM holds after weights and the reserve."""
        return self.plan.kv_tokens_per_replica

    @property
    def host_kv_tokens(self) -> float:
        return self.host_kv_bytes / self.plan.replicas_per_node / self.plan.kv_bytes_per_token

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.plan.prefill_tokens_per_s_node / self.plan.replicas_per_node

    @property
    def bandwidth(self) -> float:
        """Achieved HBM bandwidth per GPU, bytes/s."""
        hw = self.plan.hardware
        return hw.gpu.bandwidth_bytes_s * hw.decode_eff

    def memory_s(self, kv_tokens_read: int) -> float:
        """Seconds to read the weights once and `kv_tokens_read` tokens of KV."""
        return (self.weight_bytes_per_gpu + kv_tokens_read * self.kv_bytes_per_token) / self.bandwidth

    def step_s(self, prefill_tokens: int, kv_tokens_read: int) -> float:
        """One step: memory time plus the prefill tokens' compute time."""
        return self.memory_s(kv_tokens_read) + prefill_tokens / self.prefill_tokens_per_s

    def copy_s(self, blocks: int, block_size: int) -> float:
        """Seconds to move `blocks` KV blocks between host and device."""
        return blocks * block_size * self.kv_bytes_per_token / self.pcie_bw


def _node(name: str, gpu: str, precision: Precision) -> NodeModel:
    return NodeModel(name, plan(hardware=Hardware(gpu=GPUS[gpu], precision=precision)))


H100_FP8 = _node("h100-fp8", "h100", Precision.FP8)
PRESETS: dict[str, NodeModel] = {
    "h100-fp8": H100_FP8,
    "h200-fp8": _node("h200-fp8", "h200", Precision.FP8),
    "h100-bf16": _node("h100-bf16", "h100", Precision.BF16),
    "h200-bf16": _node("h200-bf16", "h200", Precision.BF16),
}
