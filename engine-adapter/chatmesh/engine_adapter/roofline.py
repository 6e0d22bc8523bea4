"""The roofline step model `sim` times its steps with (the reference's capacity arithmetic, per engine step).

What. One engine step on a tensor-parallel node costs
    memory:  read the weights once, plus the KV of every token each sequence attends over, from HBM at
             `decode_eff` (60%) of peak bandwidth (per GPU: each holds 1/TP of weights and KV);
    compute: 2 x parameters FLOP per *prefill* token at `prefill_mfu` (40%) of dense peak, over the node;
and the two add: a decode token's FLOPs hide under the memory time, a prefill chunk's do not. This reproduces
the reference's figures for a 70B-class model (80 layers, 8 KV heads of dim 128) in FP8 on 8 x H100 SXM:
    a decode step at batch 256 x 3,200 tokens: (8.8 GB + 256 x 3,200 x 20 KiB) / (3.35 TB/s x 0.6) = 12.7 ms;
    prefill: 8 x 1,979 TFLOP/s x 0.4 / 141 GFLOP per token = 44,850 tokens/s;
    a 512-token chunk adds ~11 ms to a step; a 16,000-token prompt in one step stalls it for ~360 ms.
Host<->device block copies (spill and onboarding) move each GPU's share of a block over its own PCIe link at
`pcie_bw` (an assumed 50 GB/s achieved of Gen5 x16's 64).

Parameters live in `NodeModel`; `PRESETS` holds the reference node (h100-fp8) and variants (H200: 141 GB at
4.8 TB/s; BF16: 2-byte weights and KV, 989 dense TFLOP/s). The efficiencies are assumptions, as in the
reference: the model is a roofline, not a benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeModel:
    """A model on a tensor-parallel node."""

    name: str
    params: float = 70.6e9
    layers: int = 80
    kv_heads: int = 8
    head_dim: int = 128
    bytes_per_value: int = 1  # weights and KV: 1 for FP8, 2 for BF16
    gpus: int = 8
    hbm_bytes: float = 80e9  # per GPU
    hbm_bw: float = 3.35e12  # bytes/s per GPU
    dense_flops: float = 1979e12  # FLOP/s per GPU at this precision, dense
    decode_eff: float = 0.6  # achieved fraction of peak bandwidth
    prefill_mfu: float = 0.4  # achieved fraction of peak compute
    reserved_bytes: float = 8e9  # per GPU: activations, CUDA graphs, runtime
    pcie_bw: float = 50e9  # bytes/s per GPU, host <-> device
    host_kv_bytes: float = 1.5e12  # per node: system memory given to the spill tier (of 2 TB on a DGX)

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes of one token on one GPU (the node's share divided by TP)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_value / self.gpus

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.params * self.bytes_per_value / self.gpus

    @property
    def kv_tokens(self) -> float:
        """Tokens of KV the node's HBM holds after weights and the reserve."""
        return (self.hbm_bytes - self.weight_bytes_per_gpu - self.reserved_bytes) / self.kv_bytes_per_token

    @property
    def host_kv_tokens(self) -> float:
        return self.host_kv_bytes / self.gpus / self.kv_bytes_per_token

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.gpus * self.dense_flops * self.prefill_mfu / (2 * self.params)

    def memory_s(self, kv_tokens_read: int) -> float:
        """Seconds to read the weights once and `kv_tokens_read` tokens of KV."""
        return (self.weight_bytes_per_gpu + kv_tokens_read * self.kv_bytes_per_token) / (
            self.hbm_bw * self.decode_eff)

    def step_s(self, prefill_tokens: int, kv_tokens_read: int) -> float:
        """One step: memory time plus the prefill tokens' compute time."""
        return self.memory_s(kv_tokens_read) + prefill_tokens / self.prefill_tokens_per_s

    def copy_s(self, blocks: int, block_size: int) -> float:
        """Seconds to move `blocks` KV blocks between host and device."""
        return blocks * block_size * self.kv_bytes_per_token / self.pcie_bw


H100_FP8 = NodeModel("h100-fp8")
PRESETS: dict[str, NodeModel] = {
    "h100-fp8": H100_FP8,
    "h200-fp8": NodeModel("h200-fp8", hbm_bytes=141e9, hbm_bw=4.8e12),
    "h100-bf16": NodeModel("h100-bf16", bytes_per_value=2, dense_flops=989e12),
    "h200-bf16": NodeModel("h200-bf16", bytes_per_value=2, dense_flops=989e12, hbm_bytes=141e9, hbm_bw=4.8e12),
}
