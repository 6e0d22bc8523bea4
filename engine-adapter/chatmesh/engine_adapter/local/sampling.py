"""Choosing the next token from logits: greedy, temperature, nucleus (top-p), reproducible by seed.

temperature 0 is greedy (argmax; ties go to the lowest id). Otherwise the logits are divided by the temperature,
softmaxed, and, when top_p < 1, cut to the smallest set of most likely tokens whose mass reaches top_p (the most
likely token is always kept) before drawing. Each draw uses a generator seeded by the request's seed and the
sampled token's position in the sequence (`position_seed`), so a seed gives the same tokens whatever else shares
the batch, and a continuation (the prompt plus reply already shown, `resumed_tokens`) draws at each position what
the first attempt drew there: it continues the reply rather than start another one. (The logits of a prefilled
continuation can differ from the decoded original in the last float bits; a draw that close to a boundary may
then differ, as a greedy pick with a near-tie may.)
"""

from __future__ import annotations

import torch

from chatmesh.engine_adapter.executor import SamplingParams


def new_generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def position_seed(seed: int, position: int) -> int:
    """The generator seed of the draw at `position` (splitmix64 of the two, so neighbouring positions and seeds
    give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return z ^ (z >> 31)


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token id from fp32 logits [vocab]."""
    if params.temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs[mass_before >= params.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen))
