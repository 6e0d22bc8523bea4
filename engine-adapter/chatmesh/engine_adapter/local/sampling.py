"""Choosing the next token from logits: greedy, temperature, nucleus (top-p), reproducible by seed.

temperature 0 is greedy (argmax; ties go to the lowest id). Otherwise the logits are divided by the temperature,
softmaxed, and, when top_p < 1, cut to the smallest set of most likely tokens whose mass reaches top_p (the most
likely token is always kept) before drawing. Each sequence draws from its own `torch.Generator` seeded with the
request's seed, so a seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import torch

from chatmesh.engine_adapter.executor import SamplingParams


def new_generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


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
