"""Turning logits into the next token: temperature, min-p, top-k, top-p, a seeded random draw."""
from __future__ import annotations

import torch

from shared import SamplingParams


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (and any tied with the k-th), set the rest to -inf. k <= 0: no cut."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probabilities sum to >= p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of all more-likely tokens
    drop_sorted = mass_before >= p  # the set already reached p without this token
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the probability of the most likely token."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def make_generator(sp: SamplingParams, device: torch.device) -> torch.Generator:
    """A per-request random stream: the same seed gives the same samples, whatever else runs."""
    generator = torch.Generator(device=device)
    seed = sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,)))
    generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, sp: SamplingParams, generator: torch.Generator) -> int:
    """logits: [vocab] (fp32) -> the next token id."""
    if sp.greedy:
        return int(torch.argmax(logits))
    # The order of current vLLM: temperature, then min-p, then top-k and top-p.
    logits = logits / sp.temperature
    logits = apply_min_p(logits, sp.min_p)
    logits = apply_top_k(logits, sp.top_k)
    logits = apply_top_p(logits, sp.top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator))
