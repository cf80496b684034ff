"""Turning logits into next tokens for a whole batch at once: temperature, min-p, top-k, top-p, seeded draws.

Each request's parameters become one entry of a tensor ([B] temperatures, [B] top-k ...), so every filter
is one tensor operation over the batch instead of one call per request. So is the draw: each row's random
number is a hash of its request's (seed, position), so a seeded request gets the same tokens alone or in any
batch, with no random stream per request to draw from one at a time.
"""
from __future__ import annotations

import torch

from shared import SamplingParams


def _per_row(value, logits: torch.Tensor, dtype=None) -> torch.Tensor:
    """A number or a [B] tensor -> [..., 1], one value per row of logits [..., vocab]."""
    value = torch.as_tensor(value, device=logits.device, dtype=dtype)
    return value.expand(logits.shape[:-1]).unsqueeze(-1)


def apply_top_k(logits: torch.Tensor, k) -> torch.Tensor:
    """Per row: keep the k largest logits (and any tied with the k-th), set the rest to -inf. k <= 0: no cut.
    logits: [..., vocab]; k: a number or one per row."""
    vocab = logits.shape[-1]
    k = _per_row(k, logits)  # [..., 1]
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    cut = k < vocab  # [..., 1]: the rows that ask for a cut
    if not bool(cut.any()):
        return logits
    # topk of the largest k asked for, not a sort of the whole vocabulary: a sort of 49,152 logits per row
    # costs far more than finding the 50 largest. Rows without a cut get -inf as their threshold.
    largest = int(k[cut].max())
    kth_largest = logits.topk(largest, dim=-1).values.gather(-1, k.clamp(max=largest) - 1)  # [..., 1]
    kth_largest = torch.where(cut, kth_largest, float("-inf"))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def apply_top_p(logits: torch.Tensor, p) -> torch.Tensor:
    """Per row, nucleus: keep the smallest set of most likely tokens whose probabilities sum to >= p."""
    p = _per_row(p, logits, logits.dtype)  # [..., 1]
    cut = (p < 1.0).squeeze(-1)  # [...]: the rows that ask for a cut (p = 1: no cut)
    if not bool(cut.any()):
        return logits
    rows, p = logits[cut], p[cut]  # sort only those rows: the sort is the cost
    sorted_logits, order = torch.sort(rows, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of all more-likely tokens
    drop_sorted = mass_before >= p  # the set already reached p without this token
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    out = logits.clone()
    out[cut] = rows.masked_fill(drop, float("-inf"))
    return out


def apply_min_p(logits: torch.Tensor, min_p) -> torch.Tensor:
    """Per row: drop tokens whose probability is below min_p x the probability of the row's most likely token."""
    min_p = _per_row(min_p, logits, logits.dtype)  # [..., 1]
    if bool((min_p <= 0.0).all()):
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))


MASK32 = 2**32 - 1


def request_seed(sp: SamplingParams) -> int:
    """A request's seed: its own, or a random one. Each of its draws is keyed by (seed, position), so the same
    seed gives the same samples whatever else runs, and there is no random state to carry between steps."""
    return sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,)))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift, multiply, twice), on int64 tensors of values in [0, 2**32): every product
    stays below 2**63, so nothing overflows."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    return x ^ (x >> 16)


def uniforms(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """One number in [0, 1) per (seed, position), as float64 [n] on the host: a hash of the key, not the next
    value of a random stream (a counter-based draw). The token at position k of a seeded request gets the same
    number alone or in any batch, and a whole batch of keys is a few tensor operations."""
    low = torch.tensor([s & MASK32 for s in seeds])  # [n] int64: the seed's two 32-bit halves
    high = torch.tensor([(s >> 32) & MASK32 for s in seeds])
    h = _mix32(_mix32(_mix32(torch.tensor(positions) & MASK32) ^ high) ^ low)  # [n], in [0, 2**32)
    return h.double() / 2**32  # at most 1 - 2**-32


DRAW_BLOCK = 128  # tokens per block of the two-level search in draw


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first token whose running sum of probabilities passes u x the total.
    probs: [..., vocab]; u: [...] float64, on probs' device -> token ids [...].

    In two levels, so the whole vocabulary is read once and no running sum of it is written: the sums of blocks of
    DRAW_BLOCK tokens, their running sum (float64) to find the block u falls in, then the running sum (float64) of
    that one block's tokens. u's offset into its block is scaled by the block's running total over its block sum
    (the two sums' rounding differ), so every token keeps its probability to float32's relative precision, the
    rarest included; a token of probability 0 is never drawn."""
    vocab = probs.shape[-1]
    rows = probs.reshape(-1, vocab)
    if vocab % DRAW_BLOCK:  # pad the vocabulary to whole blocks with tokens of probability 0
        rows = torch.nn.functional.pad(rows, (0, DRAW_BLOCK - vocab % DRAW_BLOCK))
    blocks = rows.view(rows.shape[0], -1, DRAW_BLOCK)  # [R, blocks, DRAW_BLOCK]
    sums = blocks.sum(-1).double()  # [R, blocks]
    cdf = sums.cumsum(-1)  # [R, blocks]
    target = u.reshape(-1, 1) * cdf[:, -1:]  # [R, 1], below the total since u < 1
    block = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)  # [R, 1]: cdf[block] > target
    offset = target - torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # into the block
    inner = blocks.gather(1, block[:, :, None].expand(-1, 1, DRAW_BLOCK))[:, 0].double().cumsum(-1)  # [R, DRAW_BLOCK]
    offset = offset * inner[:, -1:] / sums.gather(1, block)  # on the scale of the block's own running sum
    offset = torch.minimum(offset, torch.nextafter(inner[:, -1:], torch.zeros_like(offset)))  # inside the block
    token = block * DRAW_BLOCK + torch.searchsorted(inner, offset, right=True)  # [R, 1]
    return token.view(probs.shape[:-1])


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> list[int]:
    """logits: [B, vocab] (fp32), one row per request -> the next token id of each request. seeds, positions: each
    row's draw key (its request's seed, and how many tokens the request has generated)."""
    next_ids = torch.argmax(logits, dim=-1).tolist()  # greedy rows are done here
    rows = [i for i, sp in enumerate(params) if not sp.greedy]
    if not rows:
        return next_ids
    def column(name):
        return torch.tensor([getattr(params[i], name) for i in rows], device=logits.device)
    # The order of current vLLM: temperature, then min-p, then top-k and top-p.
    sampled = logits[rows] / column("temperature").to(logits.dtype)[:, None]  # [S, vocab]
    sampled = apply_min_p(sampled, column("min_p").to(logits.dtype))
    sampled = apply_top_k(sampled, column("top_k"))
    sampled = apply_top_p(sampled, column("top_p").to(logits.dtype))
    probs = torch.softmax(sampled, dim=-1)  # [S, vocab]
    # one draw for every sampled row, each keyed by its request's (seed, position)
    u = uniforms([seeds[i] for i in rows], [positions[i] for i in rows]).to(logits.device)  # [S] float64
    for i, token in zip(rows, draw(probs, u).tolist()):
        next_ids[i] = token
    return next_ids
