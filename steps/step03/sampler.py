"""Turning logits into the next token: temperature, min-p, top-k, top-p, a seeded random draw.

The draw is keyed: its random number is a hash of the request's seed and the position of the token
(uniforms), turned into a token by the inverse of the cumulative distribution (draw)."""
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


def sample(logits: torch.Tensor, sp: SamplingParams, seed: int, position: int) -> int:
    """logits: [vocab] (fp32) -> the next token id. (seed, position) keys the draw: the request's seed
    (request_seed) and how many tokens it has generated so far."""
    if sp.greedy:
        return int(torch.argmax(logits))
    # The order of current vLLM: temperature, then min-p, then top-k and top-p.
    logits = logits / sp.temperature
    logits = apply_min_p(logits, sp.min_p)
    logits = apply_top_k(logits, sp.top_k)
    logits = apply_top_p(logits, sp.top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(draw(probs, uniforms([seed], [position])[0].to(probs.device)))
