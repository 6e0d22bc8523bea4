"""An independent dense SmolLM2 forward for checking the paged one: no KV pool, no batching, the whole
sequence recomputed each call. It un-permutes llama.cpp's Q/K rows back to Hugging Face's order and applies
RoPE the Hugging Face way (rotating the two halves of each head), repeats K/V heads explicitly for GQA and
spells out the causal softmax; it shares only the dequantised weight tensors with the code under test."""

from __future__ import annotations

import math

import torch

from chatmesh.engine_adapter.local.model import LoadedModel


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert permute: within each head, rows (pair i, member j) -> (half j, index i)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def dense_logits(model: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of every position, in float64 for a trustworthy reference."""
    cfg, w = model.config, model.weights
    dt = torch.float64
    n, d, hq, hk = len(token_ids), cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    pos = torch.arange(n, dtype=dt)
    inv = 1.0 / (cfg.rope_base ** (torch.arange(0, d, 2, dtype=dt) / d))
    ang = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)  # [n, d]: halves share frequencies
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def norm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * g.to(dt)

    causal = torch.triu(torch.full((n, n), float("-inf"), dtype=dt), diagonal=1)
    x = w.embed[torch.tensor(token_ids)].to(dt)
    for lw in w.layers:
        wqkv = lw.wqkv.dense().to(dt)
        wq, wk, wv = wqkv[:hq * d], wqkv[hq * d:(hq + hk) * d], wqkv[(hq + hk) * d:]
        wq, wk = _unpermute(wq, hq), _unpermute(wk, hk)
        h = norm(x, lw.attn_norm)
        q = (h @ wq.T).reshape(n, hq, d)
        k = (h @ wk.T).reshape(n, hk, d)
        v = (h @ wv.T).reshape(n, hk, d)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d) + causal
        att = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).reshape(n, hq * d)
        x = x + att @ lw.wo.dense().to(dt).T
        h = norm(x, lw.ffn_norm)
        gate_up = h @ lw.w_gate_up.dense().to(dt).T
        gate, up = gate_up[:, :cfg.ffn], gate_up[:, cfg.ffn:]
        x = x + (torch.nn.functional.silu(gate) * up) @ lw.w_down.dense().to(dt).T
    return norm(x, w.out_norm) @ w.output.dense().to(dt).T
