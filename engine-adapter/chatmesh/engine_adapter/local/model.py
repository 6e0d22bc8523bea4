"""SmolLM2 (a Llama) on the CPU in PyTorch, its attention reading K/V from a paged block pool.

Weights: the GGUF's tensors are dequantised with gguf-py (Q4_1, Q8_0 and F32 here) into fp32, then kept either
as fp32 (`weights="float32"`, exact: the serving default, CHATMESH_LOCAL_WEIGHTS, and the correctness tests'
configuration) or as fp16 packed for fbgemm's `linear_dynamic_fp16` (`"float16"`, an option): 59% of the
memory, the same fp32 arithmetic, about 2e-4 relative rounding of each weight, and 1.6-3.9x faster decode on
this CPU (a step reads the matrices once; the LM head 57 MB, not 113). The token embedding stays fp32 either way
(looked up, never multiplied: 57 MB more than fp16): rounding every input vector to fp16 as well, with int8 KV,
flipped the greedy answer behind the mesh's system prompt ("La femme de France" instead of Paris: the model's
first-token logits "The" / "La" are 0.06 apart even in exact fp32; fp16 lookups put "La" 0.012 ahead, fp32
lookups keep "The" 0.08 ahead).
The shape comes from the GGUF metadata (`llama.*`: layers, hidden size, heads, KV heads, RoPE base, norm eps);
the output projection is tied to the token embedding when the file has no `output.weight`.

RoPE layout: llama.cpp's converter permutes the rows of Q and K so that each head's rotated pairs are ADJACENT
dimensions (2i, 2i+1) rather than Hugging Face's halves (i, i + d/2). We keep the GGUF rows and rotate adjacent
pairs ("interleaved" RoPE, llama.cpp's normal mode) as one complex multiplication; pair i turns by
position * base^(-2i/d). The dense reference in the tests un-permutes instead and rotates halves, so the two
agree only if this reading is right.

Paged KV (`KVPool`): per layer, K and V live in `[kv_heads, blocks * block_size, head_dim]` tensors (head-major,
so gathering a list of blocks yields each head's keys contiguous, ready for a batched matmul). A sequence owns
an ordered list of physical blocks (its block table, from the engine's block manager); position p is slot
`table[p // block_size] * block_size + p % block_size`. Element types: int8 with one fp32 scale per token and
head (absmax / 127, the serving default: half of bfloat16's memory, about 0.4% rounding), bfloat16, float16 or
float32 (exact). Each forward writes the K/V of the tokens it runs into their slots first, then attends over
the slots of positions [0, start + n): tokens already in the pool (a cached prefix, earlier decode steps) are
never recomputed. int8 scales never touch the gathered K/V: a key's scale multiplies its score, a value's its
probability.

A step (`PagedLlama.forward`) runs every sequence's new tokens as rows of one matrix through the dense layers
(a prefill chunk contributes many rows, a decode one). Attention is spelled out as batched matmuls with grouped
queries (the 3 query heads of a KV head share one matrix: K and V are never repeated). A sequence with several
new tokens attends on its own with a causal mask offset by its start position. Single-token (decode) rows go
to the native kernel when one was built (native_attention.py, decode_attention.cpp): for each (sequence, KV head)
it walks the block table and reads the K/V (and int8 scales) in place, with the same arithmetic as below.
Otherwise (no compiler, or CHATMESH_LOCAL_NATIVE_ATTENTION=false) all decode rows attend together in PyTorch in
two parts (cascade attention): the blocks at the head of EVERY decoding sequence's table (the shared
system prompt) are gathered once and scored against all the batch's queries in one matmul, each sequence's
remaining blocks are gathered padded and masked, and one softmax runs over both parts. Logits are computed only
for the rows the caller asks for (the last token of each sequence that samples).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from chatmesh.model.profile import ModelProfile, from_gguf_reader
from chatmesh.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from chatmesh.engine_adapter.local.native_attention import DecodeKernel


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


WEIGHT_DTYPES = ("float16", "float32")
KV_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "bfloat16": torch.bfloat16, "float16": torch.float16,
                                     "float32": torch.float32}


class Linear:
    """A weight matrix W [out, in] applied as x @ W.T, stored as fp32 or as fp16 packed for fbgemm."""

    __slots__ = ("out_features", "in_features", "dtype", "_w", "_packed")

    def __init__(self, w: torch.Tensor, dtype: str = "float32"):
        if w.dim() != 2:
            raise ValueError(f"a weight matrix is 2-D, got {tuple(w.shape)}")
        self.out_features, self.in_features = int(w.shape[0]), int(w.shape[1])
        self.dtype = dtype
        self._w: torch.Tensor | None = None
        self._packed: Any = None
        if dtype == "float32":
            self._w = w.float().contiguous()
        elif dtype == "float16":
            self._packed = torch.ops.quantized.linear_prepack_fp16(w.float().contiguous(), None)
        else:
            raise ValueError(f"weight dtype {dtype!r} is not one of {WEIGHT_DTYPES}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._w is not None:
            return F.linear(x, self._w)
        out: torch.Tensor = torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self._packed)
        return out

    def dense(self) -> torch.Tensor:
        """W as an fp32 tensor (the fp16-rounded values when packed): for references and tests."""
        if self._w is not None:
            return self._w
        w: torch.Tensor = torch.ops.quantized.linear_unpack_fp16(self._packed)[0]
        return w

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * (4 if self._w is not None else 2)


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: Linear  # [(heads + 2 kv_heads) * head_dim, hidden], Q/K rows in the GGUF's interleaved order
    wo: Linear  # [hidden, heads * head_dim]
    ffn_norm: torch.Tensor  # [hidden]
    w_gate_up: Linear  # [2 * ffn, hidden]: gate rows, then up rows
    w_down: Linear  # [hidden, ffn]


@dataclass(frozen=True)
class Weights:
    embed: torch.Tensor  # [vocab, hidden], fp32 (see the header): looked up by token id
    layers: tuple[LayerWeights, ...]
    out_norm: torch.Tensor  # [hidden]
    output: Linear  # [vocab, hidden]; the embedding itself when tied
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        """Bytes of the matrices (norm vectors aside)."""
        total = self.embed.numel() * self.embed.element_size() + self.output.nbytes
        return total + sum(lw.wqkv.nbytes + lw.wo.nbytes + lw.w_gate_up.nbytes + lw.w_down.nbytes
                           for lw in self.layers)


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


def read_weights(reader: Any, cfg: ModelConfig, dtype: str = "float32") -> Weights:
    """The weights, dequantised one tensor at a time and converted to `dtype` at once (so loading never holds
    the whole model in fp32 when `dtype` is float16)."""
    from gguf.quants import dequantize

    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {dtype!r} is not one of {WEIGHT_DTYPES}")
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"GGUF has no tensor {name}")
        array = dequantize(t.data, t.tensor_type)
        if array.dtype != np.float32 or not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, dtype=np.float32, order="C")  # F32 tensors are read-only views of the file
        return torch.from_numpy(array)

    # the embedding first: the largest tensor (113 MB in fp32), read while little else is held
    embed = get("token_embd.weight")  # kept fp32 whatever the matrices are stored as (see the header)
    if tuple(embed.shape) != (cfg.vocab, cfg.hidden):
        raise ValueError(f"token embedding {tuple(embed.shape)} does not match the metadata {cfg}")
    output = Linear(get("output.weight") if "output.weight" in tensors else embed, dtype)
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        wqkv = torch.cat([get(p + "attn_q.weight"), get(p + "attn_k.weight"), get(p + "attn_v.weight")])
        if tuple(wqkv.shape) != ((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.hidden):
            raise ValueError(f"tensor shapes do not match the metadata {cfg}")
        layers.append(LayerWeights(
            attn_norm=get(p + "attn_norm.weight"),
            wqkv=Linear(wqkv, dtype),
            wo=Linear(get(p + "attn_output.weight"), dtype),
            ffn_norm=get(p + "ffn_norm.weight"),
            w_gate_up=Linear(torch.cat([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")]), dtype),
            w_down=Linear(get(p + "ffn_down.weight"), dtype),
        ))
    return Weights(embed=embed, layers=tuple(layers), out_norm=get("output_norm.weight"), output=output,
                   dtype=dtype)


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: Weights
    profile: ModelProfile  # the GGUF's tokenizer, chat template, stop tokens and context (chatmesh.model.profile)

    @property
    def tokenizer(self) -> Tokenizer:
        tok = self.profile.tokenizer
        assert isinstance(tok, Tokenizer)  # a GGUF profile's tokenizer is always chatmesh's BPE
        return tok


def load_gguf(path: str | Path, weights: str = "float32") -> LoadedModel:
    """Reads the architecture, the weights (kept as `weights`: float32 or float16) and the profile."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    cfg = read_config(reader)
    return LoadedModel(cfg, read_weights(reader, cfg, weights), from_gguf_reader(reader, Path(path)))


class KVPool:
    """K and V of `n_blocks` blocks of `block_size` tokens for every layer, `[layers, kv_heads, slots, head_dim]`
    (slot = block * block_size + offset); int8 pools add one fp32 scale per token and head, `[layers, kv_heads,
    slots]`.

    Zeroed through numpy's calloc, so the OS maps zero pages lazily: memory is only touched (and counted in
    RSS) as blocks are first written (`touch()` writes it all, to measure a full pool), and slots never written
    hold zeros, never NaN, which matters because batched decode attention reads (masked) padding slots."""

    def __init__(self, cfg: ModelConfig, n_blocks: int, block_size: int, dtype: torch.dtype = torch.float32):
        if dtype not in KV_DTYPES.values():
            raise ValueError(f"KV dtype {dtype} is not one of {sorted(KV_DTYPES)}")
        shape = (cfg.n_layers, cfg.n_kv_heads, n_blocks * block_size, cfg.head_dim)
        self.dtype = dtype
        self.k = _lazy_zeros(shape, dtype)
        self.v = _lazy_zeros(shape, dtype)
        self.quantized = dtype == torch.int8
        self.k_scale = _lazy_zeros(shape[:3], torch.float32) if self.quantized else None
        self.v_scale = _lazy_zeros(shape[:3], torch.float32) if self.quantized else None
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim

    @property
    def nbytes(self) -> int:
        total = 2 * self.k.numel() * self.k.element_size()
        if self.k_scale is not None:
            total += 2 * self.k_scale.numel() * 4
        return total

    def touch(self) -> None:
        """Writes every page (zeros), so the whole pool is resident (memory measurements)."""
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t.zero_()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores fp32 k, v [tokens, kv_heads, head_dim] at `slots` of `layer`."""
        for data, store, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            if scales is None:
                store[layer].index_copy_(1, slots, data.transpose(0, 1).to(self.dtype))
            else:
                absmax = data.abs().amax(dim=-1, keepdim=True)  # [T, kv, 1]
                scale = absmax / 127.0
                q = torch.round(data / scale.clamp_min(1e-30)).to(torch.int8)
                store[layer].index_copy_(1, slots, q.transpose(0, 1))
                scales[layer].index_copy_(1, slots, scale.squeeze(-1).t())

    def gather(self, layer: int, blocks: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """K and V of `blocks` (in order) as fp32 [kv_heads, len(blocks) * block_size, head_dim], and for int8
        pools their scales [kv_heads, len(blocks) * block_size] (else None): the true K is K * scale[..., None]."""
        kv, bs, d = self.kv_heads, self.block_size, self.head_dim
        k = self.k[layer].view(kv, self.n_blocks, bs * d).index_select(1, blocks).view(kv, -1, d).float()
        v = self.v[layer].view(kv, self.n_blocks, bs * d).index_select(1, blocks).view(kv, -1, d).float()
        if self.k_scale is None or self.v_scale is None:
            return k, v, None, None
        ks = self.k_scale[layer].view(kv, self.n_blocks, bs).index_select(1, blocks).view(kv, -1)
        vs = self.v_scale[layer].view(kv, self.n_blocks, bs).index_select(1, blocks).view(kv, -1)
        return k, v, ks, vs

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K, V (and int8 scales) over every layer: a transfer payload (`export`)."""
        per_token_head = self.head_dim * self.k.element_size() + (4 if self.quantized else 0)
        return 2 * self.k.shape[0] * self.kv_heads * self.block_size * per_token_head

    def _parts(self) -> list[tuple[torch.Tensor, int]]:
        """Each stored tensor viewed [layers, kv_heads, blocks, per-block values], with its per-block width."""
        n, bs, d = self.n_blocks, self.block_size, self.head_dim
        out = [(t.view(*t.shape[:2], n, bs * d), bs * d) for t in (self.k, self.v)]
        if self.k_scale is not None and self.v_scale is not None:
            out += [(t.view(*t.shape[:2], n, bs), bs) for t in (self.k_scale, self.v_scale)]
        return out

    def export(self, blocks: Sequence[int]) -> list[bytes]:
        """The payloads of `blocks`: per block, K then V then (int8) K and V scales, each [layers, kv_heads,
        block_size, head_dim] (scales without head_dim) in native byte order."""
        if not blocks:
            return []
        idx = torch.tensor(blocks, dtype=torch.long)
        rows = [t.index_select(2, idx).permute(2, 0, 1, 3).contiguous().view(torch.uint8).reshape(len(blocks), -1)
                for t, _ in self._parts()]
        packed = torch.cat(rows, dim=1).numpy()
        return [packed[i].tobytes() for i in range(len(blocks))]

    def load(self, blocks: Sequence[int], payloads: Sequence[bytes]) -> None:
        """Writes `export` payloads into `blocks` (same layout and element type)."""
        if not blocks:
            return
        m = len(blocks)
        raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(m, -1)
        if raw.shape[1] != self.block_bytes:
            raise ValueError(f"payloads of {raw.shape[1]} bytes, blocks of {self.block_bytes}")
        idx = torch.tensor(blocks, dtype=torch.long)
        at = 0
        for t, width in self._parts():
            size = t.shape[0] * t.shape[1] * width * t.element_size()
            part = raw[:, at:at + size].contiguous().view(t.dtype).view(m, t.shape[0], t.shape[1], width)
            t.index_copy_(2, idx, part.permute(1, 2, 0, 3))
            at += size

    def copy_to(self, other: KVPool, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies blocks `src[i]` of this pool into blocks `dst[i]` of `other` (every layer)."""
        if not src:
            return
        if other.dtype != self.dtype or other.block_size != self.block_size:
            raise ValueError("KV pools of different element types or block sizes")
        s = torch.tensor(src, dtype=torch.long)
        d = torch.tensor(dst, dtype=torch.long)
        for mine, theirs in ((self.k, other.k), (self.v, other.v), (self.k_scale, other.k_scale),
                             (self.v_scale, other.v_scale)):
            if mine is None or theirs is None:
                continue
            a = mine.view(*mine.shape[:2], self.n_blocks, -1)
            b = theirs.view(*theirs.shape[:2], other.n_blocks, -1)
            b[:, :, d] = a[:, :, s]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros whose pages the OS allocates on first write (torch.zeros would write every byte up front)."""
    raw = {4: np.float32, 2: np.int16, 1: np.int8}[torch.empty((), dtype=dtype).element_size()]
    return torch.from_numpy(np.zeros(shape, dtype=raw)).view(dtype)


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a forward: tokens at positions [start_pos, start_pos + len(token_ids))."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


class PagedLlama:
    """The forward pass over a KVPool (see the header). `decode_kernel`: the native decode attention
    (native_attention.load()); None keeps every step on the PyTorch path."""

    def __init__(self, cfg: ModelConfig, weights: Weights, decode_kernel: DecodeKernel | None = None):
        self.cfg = cfg
        self.w = weights
        group = cfg.n_heads // cfg.n_kv_heads
        if decode_kernel is not None and not decode_kernel.supports(cfg.n_kv_heads, group, cfg.head_dim):
            decode_kernel = None
        self.decode_kernel = decode_kernel
        half = cfg.head_dim // 2
        inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.context_length, dtype=torch.float64), inv_freq)
        self._rot = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)  # [context, head_dim / 2]
        self._scale = 1.0 / math.sqrt(cfg.head_dim)
        self.shared_prefix_steps = 0  # forwards whose decode rows shared a head of blocks (PyTorch path: cascade)
        self.native_decode_steps = 0  # forwards whose decode rows ran in the native kernel

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
            table = s.block_table
            for p in range(s.start_pos, end):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
        t = len(ids)
        slot = torch.tensor(slots, dtype=torch.long)
        rot = self._rot[torch.tensor(positions, dtype=torch.long)].unsqueeze(1)  # [T, 1, d/2]
        plan = _AttentionPlan(seqs, bs, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim,
                              self.decode_kernel)
        if plan.shared_blocks:
            self.shared_prefix_steps += 1
        if plan.kernel is not None:
            self.native_decode_steps += 1
        n_q, n_kv, d, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        hidden, ffn = (cfg.hidden,), cfg.ffn
        x = self.w.embed[torch.tensor(ids, dtype=torch.long)].float()
        for li, lw in enumerate(self.w.layers):
            h = F.rms_norm(x, hidden, lw.attn_norm, eps)
            qkv = lw.wqkv(h)
            # Q and K heads rotated together: adjacent pairs as complex numbers times e^(i * angle)
            qk = torch.view_as_complex(qkv[:, :(n_q + n_kv) * d].reshape(t, n_q + n_kv, d // 2, 2))
            qk_r = torch.view_as_real(qk * rot).reshape(t, n_q + n_kv, d)
            v = qkv[:, (n_q + n_kv) * d:].reshape(t, n_kv, d)
            pool.write(li, slot, qk_r[:, n_q:], v)
            attn = plan.attend(qk_r[:, :n_q], pool, li, self._scale)
            x = x + lw.wo(attn.reshape(t, n_q * d))
            h = F.rms_norm(x, hidden, lw.ffn_norm, eps)
            gate_up = lw.w_gate_up(h)
            x = x + lw.w_down(F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:])
        rows = x[torch.tensor(list(logit_rows), dtype=torch.long)]
        return self.w.output(F.rms_norm(rows, hidden, self.w.out_norm, eps))


_NEG_INF = float("-inf")
_DECODE_CHUNK = 8  # decoding sequences whose own blocks are gathered and attended at once


class _AttentionPlan:
    """Which rows attend how in one step (built once per forward, used by every layer): multi-token sequences
    alone (causal, offset), single-token rows together: in the native kernel over their block tables, or in
    PyTorch over a shared head of blocks plus their own blocks."""

    def __init__(self, seqs: Sequence[SeqSlice], block_size: int, kv_heads: int, group: int, head_dim: int,
                 kernel: DecodeKernel | None = None):
        self.kv, self.group, self.d, self.block_size = kv_heads, group, head_dim, block_size
        self.prefills: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []  # row0, n, ctx, blocks, masked
        dec_rows: list[int] = []
        dec_tables: list[Sequence[int]] = []
        dec_lens: list[int] = []
        row = 0
        for s in seqs:
            n = len(s.token_ids)
            ctx = s.start_pos + n
            n_blocks = -(-ctx // block_size)
            if n == 1:
                dec_rows.append(row)
                dec_tables.append(s.block_table[:n_blocks])
                dec_lens.append(ctx)
            else:
                # query i sits at position ctx - n + i and sees keys 0 ..= ctx - n + i
                q_pos = torch.arange(ctx - n, ctx)
                masked = torch.arange(ctx)[None, :] > q_pos[:, None]  # [n, ctx]: True where hidden
                self.prefills.append((row, n, ctx, torch.tensor(list(s.block_table[:n_blocks]), dtype=torch.long),
                                      masked))
            row += n
        self.all_decode = not self.prefills
        self.n_dec = len(dec_rows)
        self.dec_rows = torch.tensor(dec_rows, dtype=torch.long)
        self.prefix_blocks: torch.Tensor | None = None
        self.prefix_len = 0
        self.shared_blocks = 0
        self.kernel = kernel if self.n_dec else None
        if self.n_dec == 0:
            return
        shared = 0
        if self.n_dec > 1:  # the blocks every decoding sequence starts with (wholly inside every context)
            limit = min(dec_lens) // block_size
            first = dec_tables[0]
            while shared < limit and all(t[shared] == first[shared] for t in dec_tables):
                shared += 1
        self.shared_blocks = shared
        if self.kernel is not None:  # tables padded to one width (the kernel never reads past a length)
            width = max(len(t) for t in dec_tables)
            self.dec_tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in dec_tables], dtype=torch.int32)
            self.dec_lens = torch.tensor(dec_lens, dtype=torch.int32)
            return
        if shared:
            self.prefix_blocks = torch.tensor(list(dec_tables[0][:shared]), dtype=torch.long)
            self.prefix_len = shared * block_size
        width = max(1, max(len(t) - shared for t in dec_tables))
        padded: list[int] = []
        for tbl in dec_tables:
            own = list(tbl[shared:])
            padded.extend(own + [tbl[0]] * (width - len(own)))  # padding is masked out
        self.suffix_blocks = torch.tensor(padded, dtype=torch.long)
        self.suffix_width = width
        self.suffix_len = width * block_size
        own_len = torch.tensor(dec_lens, dtype=torch.long) - self.prefix_len
        self.suffix_masked = torch.arange(self.suffix_len)[None, :] >= own_len[:, None]  # [B, Ls]

    def attend(self, q: torch.Tensor, pool: KVPool, layer: int, scale: float) -> torch.Tensor:
        """q [rows, heads, d] (any strides) -> attention output [rows, heads, d]."""
        rows, heads, d = q.shape
        if self.all_decode:
            return self._decode(q, pool, layer, scale)
        out = torch.empty(rows, heads, d)
        for row0, n, ctx, blocks, masked in self.prefills:
            out[row0:row0 + n] = self._prefill(q[row0:row0 + n], pool, layer, scale, blocks, ctx, masked)
        if self.n_dec:
            out.index_copy_(0, self.dec_rows, self._decode(q.index_select(0, self.dec_rows), pool, layer, scale))
        return out

    def _prefill(self, q: torch.Tensor, pool: KVPool, layer: int, scale: float, blocks: torch.Tensor, ctx: int,
                 masked: torch.Tensor) -> torch.Tensor:
        n, heads, d = q.shape
        k, v, ks, vs = pool.gather(layer, blocks)
        k, v = k[:, :ctx], v[:, :ctx]
        if ks is not None and vs is not None:  # n queries per key: widening K and V once is cheaper than scores
            k = k * ks[:, :ctx, None]
            v = v * vs[:, :ctx, None]
        # 4-D (a batch of one): PyTorch's CPU flash kernel takes it; it reads the g query heads of a KV head
        # against that head's K/V (enable_gqa) without repeating them
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=~masked,
                                           scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, pool: KVPool, layer: int, scale: float) -> torch.Tensor:
        b, heads, d = q.shape
        if self.kernel is not None:
            ks = vs = None
            if pool.k_scale is not None and pool.v_scale is not None:
                ks, vs = pool.k_scale[layer], pool.v_scale[layer]
            out = self.kernel(q.reshape(b, self.kv, self.group, d), pool.k[layer], ks, pool.v[layer], vs,
                              self.dec_tables, self.dec_lens, self.block_size, scale)
            return out.view(b, heads, d)
        kv, g, ls, lp = self.kv, self.group, self.suffix_len, self.prefix_len
        qh = (q.reshape(b, kv, g, d).transpose(0, 1) * scale).contiguous()  # [kv, B, g, d]
        out = torch.empty(kv, b, g, d)
        pre_max = pre_sum = None
        if self.prefix_blocks is not None:
            # the shared head of blocks: gathered once, every query of the batch against it in one matmul per KV
            # head; kept as (max, sum of exp, exp-weighted values) to merge with each sequence's own part
            pk, pv, pks, pvs = pool.gather(layer, self.prefix_blocks)  # [kv, Lp, d]
            s_pre = torch.bmm(qh.view(kv, b * g, d), pk.transpose(1, 2))  # [kv, B*g, Lp]
            if pks is not None:
                s_pre.mul_(pks.view(kv, 1, lp))
            pre_max = s_pre.amax(dim=-1, keepdim=True)
            e_pre = torch.exp(s_pre.sub_(pre_max))
            pre_sum = e_pre.sum(dim=-1, keepdim=True)
            if pvs is not None:
                e_pre.mul_(pvs.view(kv, 1, lp))
            torch.bmm(e_pre, pv, out=out.view(kv, b * g, d))
            pre_max, pre_sum = pre_max.view(kv, b, g, 1), pre_sum.view(kv, b, g, 1)
        # then each sequence's own blocks, a few sequences at a time, so their widened K/V stay in cache
        # between the gather and the matmuls
        for i in range(0, b, _DECODE_CHUNK):
            j = min(b, i + _DECODE_CHUNK)
            c = j - i
            k, v, ks, vs = pool.gather(layer, self.suffix_blocks[i * self.suffix_width:j * self.suffix_width])
            s_own = torch.matmul(qh[:, i:j], k.view(kv, c, ls, d).transpose(2, 3))  # [kv, c, g, Ls]
            if ks is not None:
                s_own.mul_(ks.view(kv, c, 1, ls))
            s_own.masked_fill_(self.suffix_masked[None, i:j, None, :], _NEG_INF)
            own_max = s_own.amax(dim=-1, keepdim=True)
            if pre_max is not None and pre_sum is not None:
                own_max = torch.maximum(own_max, pre_max[:, i:j])
            e_own = torch.exp(s_own.sub_(own_max))
            total = e_own.sum(dim=-1, keepdim=True)
            if vs is not None:
                e_own.mul_(vs.view(kv, c, 1, ls))
            o = torch.matmul(e_own, v.view(kv, c, ls, d))  # [kv, c, g, d]
            if pre_max is not None and pre_sum is not None:
                w = torch.exp(pre_max[:, i:j] - own_max)  # rescales the shared part to this chunk's maximum
                total.addcmul_(pre_sum[:, i:j], w)
                o.addcmul_(out[:, i:j], w)
            out[:, i:j] = o.div_(total)
        return out.transpose(0, 1).reshape(b, heads, d)
