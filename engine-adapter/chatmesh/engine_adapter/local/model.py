"""SmolLM2 (a Llama) on the CPU in fp32 PyTorch, its attention reading K/V from a paged block pool.

Weights: the GGUF's tensors are dequantised with gguf-py (Q4_1, Q8_0 and F32 here) into fp32 torch tensors.
The shape comes from the GGUF metadata (`llama.*`: layers, hidden size, heads, KV heads, RoPE base, norm eps);
the output projection is tied to the token embedding when the file has no `output.weight`.

RoPE layout: llama.cpp's converter permutes the rows of Q and K so that each head's rotated pairs are ADJACENT
dimensions (2i, 2i+1) rather than Hugging Face's halves (i, i + d/2). We keep the GGUF rows and rotate adjacent
pairs ("interleaved" RoPE, llama.cpp's normal mode); pair i turns by position * base^(-2i/d). The dense
reference in the tests un-permutes instead and rotates halves, so the two agree only if this reading is right.

Paged KV (`KVPool`): per layer, K and V live in `[blocks, block_size, kv_heads, head_dim]` tensors. A sequence
owns an ordered list of physical blocks (its block table, from the engine's block manager); position p of the
sequence is slot `table[p // block_size] * block_size + p % block_size`. Each forward writes the K/V of the
tokens it runs into their slots first, then attends over the slots of positions [0, start + n): tokens
already in the pool (a cached prefix, earlier decode steps) are never recomputed.

A step (`PagedLlama.forward`) runs every sequence's new tokens as rows of one matrix through the dense layers
(a prefill chunk contributes many rows, a decode one). Attention differs by kind: a sequence with several new
tokens attends on its own with a causal mask offset by its start position; all single-token (decode) rows are
batched into one call, their gathered K/V padded to the longest context and masked. Logits are computed only
for the rows the caller asks for (the last token of each sequence that samples).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from chatmesh.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelConfig:
    """The architecture, as the GGUF's `llama.*` metadata states it."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_base: float
    norm_eps: float
    context_length: int

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 K and V of one token over every layer."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 4


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, hidden], Q/K rows in the GGUF's interleaved order
    wo: torch.Tensor  # [hidden, heads * head_dim]
    ffn_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * ffn, hidden]: gate rows, then up rows
    w_down: torch.Tensor  # [hidden, ffn]


@dataclass(frozen=True)
class Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    out_norm: torch.Tensor  # [hidden]
    output: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


def _meta(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"GGUF has no {key}")
    return field.contents()


def read_config(reader: Any) -> ModelConfig:
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"architecture {arch!r} is not llama")
    hidden = int(_meta(reader, "llama.embedding_length"))
    heads = int(_meta(reader, "llama.attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_meta(reader, "llama.vocab_size")) if "llama.vocab_size" in reader.fields else len(tokens.data)
    return ModelConfig(
        n_layers=int(_meta(reader, "llama.block_count")),
        hidden=hidden,
        n_heads=heads,
        n_kv_heads=int(_meta(reader, "llama.attention.head_count_kv")),
        head_dim=hidden // heads,
        ffn=int(_meta(reader, "llama.feed_forward_length")),
        vocab=vocab,
        rope_base=float(_meta(reader, "llama.rope.freq_base")),
        norm_eps=float(_meta(reader, "llama.attention.layer_norm_rms_epsilon")),
        context_length=int(_meta(reader, "llama.context_length")),
    )


def read_weights(reader: Any, cfg: ModelConfig) -> Weights:
    from gguf.quants import dequantize

    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"GGUF has no tensor {name}")
        array = dequantize(t.data, t.tensor_type)
        if array.dtype != np.float32 or not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, dtype=np.float32, order="C")  # F32 tensors are read-only views of the file
        return torch.from_numpy(array)

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=get(p + "attn_norm.weight"),
            wqkv=torch.cat([get(p + "attn_q.weight"), get(p + "attn_k.weight"), get(p + "attn_v.weight")]),
            wo=get(p + "attn_output.weight"),
            ffn_norm=get(p + "ffn_norm.weight"),
            w_gate_up=torch.cat([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")]),
            w_down=get(p + "ffn_down.weight"),
        ))
    embed = get("token_embd.weight")
    output = get("output.weight") if "output.weight" in tensors else embed
    weights = Weights(embed=embed, layers=tuple(layers), out_norm=get("output_norm.weight"), output=output)
    expect = (cfg.vocab, cfg.hidden)
    if tuple(embed.shape) != expect or tuple(layers[0].wqkv.shape) != (
            (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.hidden):
        raise ValueError(f"tensor shapes do not match the metadata {cfg}")
    return weights


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer


def load_gguf(path: str | Path) -> LoadedModel:
    """Reads the architecture, the fp32 weights and the tokenizer from one pass over the file."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    cfg = read_config(reader)
    return LoadedModel(cfg, read_weights(reader, cfg), Tokenizer.from_reader(reader))


class KVPool:
    """K and V of `n_blocks` blocks of `block_size` tokens, for every layer: `[layers, blocks, block, kv, d]`.

    Zeroed through numpy's calloc, so the OS maps zero pages lazily: memory is only touched (and counted in
    RSS) as blocks are first written, and slots never written hold zeros, never NaN, which matters because
    batched decode attention reads (masked) slots past each sequence's end."""

    def __init__(self, cfg: ModelConfig, n_blocks: int, block_size: int, dtype: torch.dtype = torch.float32):
        shape = (cfg.n_layers, n_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = _lazy_zeros(shape, dtype)
        self.v = _lazy_zeros(shape, dtype)
        self.n_blocks = n_blocks
        self.block_size = block_size

    def copy_to(self, other: KVPool, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies blocks `src[i]` of this pool into blocks `dst[i]` of `other` (every layer)."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long)
        d = torch.tensor(dst, dtype=torch.long)
        other.k[:, d] = self.k[:, s].to(other.k.dtype)
        other.v[:, d] = self.v[:, s].to(other.v.dtype)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros whose pages the OS allocates on first write (torch.zeros would write every byte up front)."""
    raw = {4: np.float32, 2: np.int16}[torch.empty((), dtype=dtype).element_size()]
    return torch.from_numpy(np.zeros(shape, dtype=raw)).view(dtype)


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a forward: tokens at positions [start_pos, start_pos + len(token_ids))."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class PagedLlama:
    """The forward pass over a KVPool (see the header)."""

    def __init__(self, cfg: ModelConfig, weights: Weights):
        self.cfg = cfg
        self.w = weights
        half = cfg.head_dim // 2
        inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.context_length, dtype=torch.float64), inv_freq)
        self._cos = angles.cos().float()  # [context, head_dim / 2]
        self._sin = angles.sin().float()
        self._scale = 1.0 / math.sqrt(cfg.head_dim)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates adjacent pairs of x [T, heads, head_dim] by the positions' angles (cos/sin [T, 1, d/2])."""
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqSlice], pool: KVPool, logit_rows: Sequence[int]) -> torch.Tensor:
        """Runs the seqs' tokens, writing their K/V into `pool`; returns fp32 logits [len(logit_rows), vocab]
        for the given rows (indices into the concatenation of every seq's tokens)."""
        cfg, bs = self.cfg, pool.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in seqs:
            end = s.start_pos + len(s.token_ids)
            if end > len(s.block_table) * bs:
                raise ValueError(f"block table of {len(s.block_table)} blocks cannot hold {end} positions")
            if end > cfg.context_length:
                raise ValueError(f"position {end} is past the model's context of {cfg.context_length}")
            ids.extend(s.token_ids)
            for p in range(s.start_pos, end):
                positions.append(p)
                slots.append(s.block_table[p // bs] * bs + p % bs)
        pos = torch.tensor(positions, dtype=torch.long)
        slot = torch.tensor(slots, dtype=torch.long)
        cos, sin = self._cos[pos].unsqueeze(1), self._sin[pos].unsqueeze(1)
        plan = _AttentionPlan(seqs, bs, cfg.n_heads // cfg.n_kv_heads)
        n_q, n_kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        x = self.w.embed[torch.tensor(ids, dtype=torch.long)]
        for li, lw in enumerate(self.w.layers):
            h = rms_norm(x, lw.attn_norm, cfg.norm_eps)
            qkv = F.linear(h, lw.wqkv)
            t = qkv.shape[0]
            q = self._rope(qkv[:, :n_q * d].reshape(t, n_q, d), cos, sin)
            k = self._rope(qkv[:, n_q * d:(n_q + n_kv) * d].reshape(t, n_kv, d), cos, sin)
            v = qkv[:, (n_q + n_kv) * d:].reshape(t, n_kv, d)
            k_layer = pool.k[li].view(-1, n_kv, d)
            v_layer = pool.v[li].view(-1, n_kv, d)
            k_layer[slot] = k.to(k_layer.dtype)
            v_layer[slot] = v.to(v_layer.dtype)
            attn = plan.attend(q, pool.k[li], pool.v[li], self._scale)
            x = x + F.linear(attn.flatten(1), lw.wo)
            h = rms_norm(x, lw.ffn_norm, cfg.norm_eps)
            gate, up = F.linear(h, lw.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lw.w_down)
        rows = x[torch.tensor(list(logit_rows), dtype=torch.long)]
        return F.linear(rms_norm(rows, self.w.out_norm, cfg.norm_eps), self.w.output)


class _AttentionPlan:
    """Which rows attend how in one step: multi-token sequences alone (causal, offset), single-token rows together."""

    def __init__(self, seqs: Sequence[SeqSlice], block_size: int, group: int):
        self.block_size = block_size
        self.group = group  # query heads per KV head
        self.prefills: list[tuple[int, int, int, torch.Tensor]] = []  # (row0, n, context, blocks)
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        row = 0
        for s in seqs:
            n = len(s.token_ids)
            ctx = s.start_pos + n
            blocks = list(s.block_table[:-(-ctx // block_size)])
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(blocks)
                decode_lens.append(ctx)
            else:
                self.prefills.append((row, n, ctx, torch.tensor(blocks, dtype=torch.long)))
            row += n
        self.n_rows = row
        self.decode_rows = torch.tensor(decode_rows, dtype=torch.long)
        self.decode_mask: torch.Tensor | None = None
        self.decode_tables: torch.Tensor | None = None
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            padded = [t + [t[0]] * (width - len(t)) for t in decode_tables]  # padding is masked out
            self.decode_tables = torch.tensor(padded, dtype=torch.long)
            lens = torch.tensor(decode_lens, dtype=torch.long)
            # [B, 1, 1, L]: True where a key position is within the sequence
            self.decode_mask = (torch.arange(width * block_size) < lens[:, None])[:, None, None, :]

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float) -> torch.Tensor:
        """q [rows, heads, d]; k_pool/v_pool [blocks, block, kv_heads, d] -> [rows, heads, d]."""
        out = torch.empty_like(q)
        for row0, n, ctx, blocks in self.prefills:
            k = k_pool.index_select(0, blocks).flatten(0, 1)[:ctx].float().transpose(0, 1)  # [kv, ctx, d]
            v = v_pool.index_select(0, blocks).flatten(0, 1)[:ctx].float().transpose(0, 1)
            qs = q[row0:row0 + n].transpose(0, 1)  # [heads, n, d]
            # query i sits at position ctx - n + i and sees keys 0 ..= ctx - n + i
            mask = torch.ones(n, ctx, dtype=torch.bool).tril(diagonal=ctx - n)
            # 4-D (a batch of one): PyTorch's CPU flash kernel takes it; 3-D inputs fall to a path ~3x slower
            o = F.scaled_dot_product_attention(qs[None], k[None], v[None], attn_mask=mask, scale=scale,
                                               enable_gqa=True)
            out[row0:row0 + n] = o[0].transpose(0, 1)
        if self.decode_tables is not None:
            b, width = self.decode_tables.shape
            flat = self.decode_tables.flatten()  # index_select on rows is ~2x faster than advanced indexing
            shape = (b, width * self.block_size, q.shape[1] // self.group, q.shape[2])
            k = k_pool.index_select(0, flat).float().view(shape).transpose(1, 2)  # [B, kv, L, d]
            v = v_pool.index_select(0, flat).float().view(shape).transpose(1, 2)
            qs = q[self.decode_rows].unsqueeze(2)  # [B, heads, 1, d]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=self.decode_mask, scale=scale, enable_gqa=True)
            out[self.decode_rows] = o.reshape(b, q.shape[1], q.shape[2])
        return out
