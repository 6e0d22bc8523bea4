"""The paged SmolLM2 forward against an independent dense one, prefix reuse, batching and sampling."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from chatmesh.engine_adapter.executor import BlockCopy, SamplingParams, SeqWork, Tier
from chatmesh.engine_adapter.local.executor import LocalExecutor
from chatmesh.engine_adapter.local.model import LoadedModel
from chatmesh.model.template import Role, render

from .reference import dense_logits

BS = 16  # small blocks so short prompts span several
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model(loaded: object) -> LoadedModel:
    assert isinstance(loaded, LoadedModel)
    return loaded


def _executor(model: LoadedModel, device_blocks: int = 64, host_blocks: int = 16,
              kv_dtype: torch.dtype = torch.float32, native: bool = True) -> LocalExecutor:
    ex = LocalExecutor(model, device_blocks, host_blocks, BS, kv_dtype, native)
    ex.keep_logits = True
    return ex


def _prompt(model: LoadedModel, text: str) -> list[int]:
    return list(render(model.tokenizer, [(Role.USER, text)]).token_ids)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _run(ex: LocalExecutor, seq_id: int, tokens: Sequence[int], start: int, table: Sequence[int],
         chunk: int = 1 << 30) -> torch.Tensor:
    """Prefills tokens[start:] in chunks; returns the logits after the last one."""
    pos = start
    while pos < len(tokens):
        end = min(pos + chunk, len(tokens))
        ex.execute([SeqWork(seq_id, tokens[pos:end], pos, table, end == len(tokens), GREEDY)])
        pos = end
    return ex.last_logits[seq_id]


def _greedy(ex: LocalExecutor, seq_id: int, prompt: list[int], table: Sequence[int], n: int) -> list[int]:
    _run(ex, seq_id, prompt, 0, table)
    out = [int(ex.last_logits[seq_id].argmax())]
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        r = ex.execute([SeqWork(seq_id, [out[-1]], pos, table, True, GREEDY)])
        out.append(r.next_tokens[seq_id])
    return out


def test_logits_match_the_dense_reference(model: LoadedModel) -> None:
    ex = _executor(model)
    prompt = _prompt(model, "Name three colours of the rainbow.")
    table = [5, 2, 9, 7, 11]  # scattered physical blocks
    paged = _run(ex, 1, prompt, 0, table, chunk=13)  # chunked prefill: later chunks read earlier ones' blocks
    ref = dense_logits(model, prompt)
    assert _rel_err(paged, ref[-1]) < 1e-3
    assert int(paged.argmax()) == int(ref[-1].argmax())
    # The serving default keeps K/V in bfloat16: about 2e-3 off, the same top token.
    half = _run(_executor(model, kv_dtype=torch.bfloat16), 1, prompt, 0, table, chunk=13)
    assert _rel_err(half, ref[-1]) < 1e-2
    assert int(half.argmax()) == int(ref[-1].argmax())


def test_greedy_32_tokens_match_the_dense_reference(model: LoadedModel) -> None:
    ex = _executor(model)
    prompt = _prompt(model, "What is the capital of France?")
    out = _greedy(ex, 1, prompt, list(range(10, 20)), 32)
    # Teacher forcing: the reference's argmax at every position of prompt + output[:-1] is the next output token.
    ref = dense_logits(model, prompt + out[:-1])
    ref_next = ref[len(prompt) - 1:].argmax(dim=-1).tolist()
    assert out == ref_next
    assert "Paris" in model.tokenizer.decode(out)
    # decode-step logits too, not just their argmax
    assert _rel_err(ex.last_logits[1], ref[-1]) < 1e-3


def test_prefix_reuse_is_exact_and_prefills_only_new_tokens(model: LoadedModel) -> None:
    tok = model.tokenizer
    turn1 = render(tok, [(Role.SYSTEM, "You are terse."), (Role.USER, "Say hello in French.")]).token_ids
    cached = _executor(model)
    table = [3, 4, 5, 6, 7, 8, 9]
    reply = _greedy(cached, 1, list(turn1), table, 8)
    turn2 = render(tok, [(Role.SYSTEM, "You are terse."), (Role.USER, "Say hello in French."),
                         (Role.ASSISTANT, tok.decode(reply)), (Role.USER, "And in Spanish?")]).token_ids
    reused = (len(turn1) // BS) * BS  # the engine reuses full blocks only
    assert list(turn2[:reused]) == list(turn1[:reused])
    before = cached.prefill_tokens
    second = _run(cached, 2, list(turn2), reused, table)
    assert cached.prefill_tokens - before == len(turn2) - reused

    fresh = _executor(model)
    full = _run(fresh, 1, list(turn2), 0, [20, 21, 22, 23, 24, 25, 26])
    assert fresh.prefill_tokens == len(turn2)
    assert _rel_err(second, full) < 1e-4


def test_blocks_spilled_to_host_and_onboarded_elsewhere_give_the_same_logits(model: LoadedModel) -> None:
    ex = _executor(model)
    prompt = _prompt(model, "Count from one to five.")
    first = _run(ex, 1, prompt, 0, [0, 1, 2])
    full_blocks = len(prompt) // BS
    assert ex.copy_blocks([BlockCopy(Tier.DEVICE, b, Tier.HOST, 10 + b) for b in range(full_blocks)]) >= 0.0
    ex.pools[Tier.DEVICE].k.zero_()  # forget the device copies
    ex.pools[Tier.DEVICE].v.zero_()
    ex.copy_blocks([BlockCopy(Tier.HOST, 10 + b, Tier.DEVICE, 30 + b) for b in range(full_blocks)])
    table = [30 + b for b in range(full_blocks)] + [40]
    again = _run(ex, 2, prompt, full_blocks * BS, table)
    assert _rel_err(again, first) < 1e-4


def test_batched_decode_gives_the_same_greedy_tokens(model: LoadedModel) -> None:
    prompts = [_prompt(model, "What is the capital of France?"),
               _prompt(model, "Write a haiku about the sea, please, with a title."),
               _prompt(model, "Hi")]
    tables = [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14, 15], [20, 21, 22, 23]]
    n = 12
    alone = [_greedy(_executor(model), 7, p, t, n) for p, t in zip(prompts, tables)]

    ex = _executor(model)
    outs: list[list[int]] = [[], [], []]
    # seq 0 and 1 prefill together in one step; seq 2 joins later, prefilling in chunks while the others decode
    r = ex.execute([SeqWork(i, prompts[i], 0, tables[i], True, GREEDY) for i in (0, 1)])
    for i in (0, 1):
        outs[i].append(r.next_tokens[i])
    p2 = 0
    while any(len(o) < n for o in outs):
        work = [SeqWork(i, [outs[i][-1]], len(prompts[i]) + len(outs[i]) - 1, tables[i], True, GREEDY)
                for i in range(3) if outs[i] and len(outs[i]) < n]
        if p2 < len(prompts[2]) and len(outs[0]) >= 3:
            end = min(p2 + 10, len(prompts[2]))
            work.append(SeqWork(2, prompts[2][p2:end], p2, tables[2], end == len(prompts[2]), GREEDY))
            p2 = end
        r = ex.execute(work)
        for i, t in r.next_tokens.items():
            outs[i].append(t)
    assert outs == alone


def test_sampling_is_reproducible_by_seed_and_top_p_near_zero_is_greedy(model: LoadedModel) -> None:
    prompt = _prompt(model, "Tell me a story.")

    def draw(params: SamplingParams) -> list[int]:
        ex = _executor(model)
        out = [ex.execute([SeqWork(1, prompt, 0, [0, 1, 2, 3], True, params)]).next_tokens[1]]
        for i in range(5):
            out.append(ex.execute([SeqWork(1, [out[-1]], len(prompt) + i, [0, 1, 2, 3], True, params)])
                       .next_tokens[1])
        return out

    hot = SamplingParams(temperature=1.5, top_p=1.0, seed=42)
    assert draw(hot) == draw(hot)
    assert draw(hot) != draw(SamplingParams(temperature=1.5, top_p=1.0, seed=43))
    assert draw(SamplingParams(temperature=1.0, top_p=1e-6, seed=1)) == draw(GREEDY)


def test_a_continuation_draws_what_the_reply_it_continues_drew(model: LoadedModel) -> None:
    """Draws are keyed by seed and position (sampling.py): a turn continued elsewhere (the prompt plus the reply
    shown so far, prefilled) samples the rest of that reply, not another one."""
    prompt = _prompt(model, "Tell me a story")
    hot = SamplingParams(temperature=1.2, top_p=0.95, seed=7)
    ex = _executor(model)
    out = [ex.execute([SeqWork(1, prompt, 0, [0, 1, 2, 3], True, hot)]).next_tokens[1]]
    for i in range(5):
        out.append(ex.execute([SeqWork(1, [out[-1]], len(prompt) + i, [0, 1, 2, 3], True, hot)]).next_tokens[1])
    again = _executor(model)  # another replica: the prompt and the first three tokens, then on from there
    rest = [again.execute([SeqWork(2, [*prompt, *out[:3]], 0, [0, 1, 2, 3], True, hot)]).next_tokens[2]]
    for i in range(2):
        rest.append(again.execute([SeqWork(2, [rest[-1]], len(prompt) + 3 + i, [0, 1, 2, 3], True, hot)])
                    .next_tokens[2])
    assert rest == out[3:]
    again.release(2)
    assert 2 not in again.last_logits


@pytest.fixture(scope="module")
def serving(gguf_file: object) -> LoadedModel:
    """The low-memory weights option (CHATMESH_LOCAL_WEIGHTS=float16): fp16 matrices (fbgemm-packed)."""
    from chatmesh.engine_adapter.local.model import load_gguf

    assert isinstance(gguf_file, Path)
    return load_gguf(gguf_file, "float16")


def test_serving_precision_fp16_weights_int8_kv_stays_close_to_the_dense_reference(
        model: LoadedModel, serving: LoadedModel) -> None:
    # The low-memory option trades exactness for memory: fp16 weight matrices (~2e-4 rounding of each weight)
    # with int8 K/V (one scale per token and head). Measured: ~3% max-relative logit error for the first token,
    # the same greedy reply for this bare prompt. The embedding table stays fp32 (fp16 lookups as well flipped
    # the answer behind the mesh's system prompt: tests/e2e/test_local_model.py), so 365 of 621 MiB.
    assert serving.weights.dtype == "float16"
    assert serving.weights.embed.dtype == torch.float32
    assert serving.weights.nbytes < model.weights.nbytes * 0.6
    prompt = _prompt(model, "What is the capital of France?")
    exact = _greedy(_executor(model), 1, prompt, list(range(10, 20)), 32)
    ex = _executor(serving, kv_dtype=torch.int8)
    first = _run(ex, 1, prompt, 0, list(range(10, 20)))
    ref = dense_logits(model, prompt)
    assert _rel_err(first, ref[-1]) < 6e-2
    assert int(first.argmax()) == int(ref[-1].argmax())
    assert _greedy(_executor(serving, kv_dtype=torch.int8), 1, prompt, list(range(10, 20)), 32) == exact


def test_int8_kv_round_trip_is_within_half_a_step_of_each_scale(model: LoadedModel) -> None:
    from chatmesh.engine_adapter.local.model import KVPool

    pool = KVPool(model.config, 8, BS, torch.int8)
    kv, d = model.config.n_kv_heads, model.config.head_dim
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(5, kv, d, generator=gen) * torch.tensor([0.01, 1.0, 30.0])[:, None]
    v = torch.randn(5, kv, d, generator=gen)
    slots = torch.tensor([BS * 3 + 1, BS * 3 + 2, BS * 5, BS * 5 + 7, BS * 6 + 15])
    pool.write(2, slots, k, v)
    gk, gv, ks, vs = pool.gather(2, torch.tensor([3, 5, 6]))
    assert ks is not None and vs is not None
    at = torch.tensor([1, 2, BS, BS + 7, 2 * BS + 15])  # where the slots land in the gathered blocks
    for got, scale, want in ((gk, ks, k), (gv, vs, v)):
        back = (got[:, at] * scale[:, at, None]).transpose(0, 1)
        step = want.abs().amax(-1, keepdim=True) / 127
        assert bool(((back - want).abs() <= step / 2 + 1e-7).all())
    untouched = torch.ones(3 * BS, dtype=torch.bool)
    untouched[at] = False
    assert bool((gk[:, untouched] == 0).all()) and bool((ks[:, untouched] == 0).all())


@pytest.mark.parametrize(("kv_dtype", "chunk", "native"),
                         [(torch.float32, 0, False), (torch.float32, 2, False), (torch.int8, 2, False),
                          (torch.int8, 0, True)])
def test_batched_decode_over_a_shared_prefix_matches_decoding_alone(model: LoadedModel, kv_dtype: torch.dtype,
                                                                    chunk: int, native: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Three conversations under one system prompt share its blocks (as the engine's prefix cache hands them
    # out); decoding them in one batch takes the cascade path (shared blocks scored once for all queries, each
    # sequence's own blocks in chunks of `chunk` sequences, merged by log-sum-exp), or with int8 KV the native
    # kernel, which walks each sequence's whole table (shared blocks included).
    from chatmesh.engine_adapter.local import model as model_module

    if chunk:
        monkeypatch.setattr(model_module, "_DECODE_CHUNK", chunk)
    tok = model.tokenizer
    system = ("You are a helpful assistant who answers in one short sentence, without lists or preambles, "
              "in plain English, politely, and never mentions these instructions or that you are a model.")
    prompts = [list(render(tok, [(Role.SYSTEM, system), (Role.USER, u)]).token_ids)
               for u in ("What is the capital of France?", "Name a large animal.", "Hi")]
    common = 0
    while all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    shared = common // BS  # full blocks of the system prompt
    assert shared >= 2
    n = 10
    alone: list[list[int]] = []
    alone_logits: list[torch.Tensor] = []
    for p in prompts:
        ex = _executor(model, kv_dtype=kv_dtype, native=native)
        alone.append(_greedy(ex, 1, p, list(range(20, 30)), n))
        alone_logits.append(ex.last_logits[1])

    ex = _executor(model, kv_dtype=kv_dtype, native=native)
    head = list(range(shared))  # the system prompt's blocks, computed once by the first sequence
    tables = [head + [10 + 8 * i + j for j in range(8)] for i in range(3)]
    outs: list[list[int]] = []
    for i, p in enumerate(prompts):
        start = 0 if i == 0 else shared * BS
        outs.append([int(_run(ex, i, p, start, tables[i]).argmax())])
    while len(outs[0]) < n:
        r = ex.execute([SeqWork(i, [outs[i][-1]], len(prompts[i]) + len(outs[i]) - 1, tables[i], True, GREEDY)
                        for i in range(3)])
        for i in range(3):
            outs[i].append(r.next_tokens[i])
    assert ex.net.shared_prefix_steps == n - 1  # every batched decode step shared a head of blocks
    assert ex.net.native_decode_steps == (n - 1 if native else 0)
    assert outs == alone
    if kv_dtype == torch.float32:
        for i in range(3):
            assert _rel_err(ex.last_logits[i], alone_logits[i]) < 1e-4
