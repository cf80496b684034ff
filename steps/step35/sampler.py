"""Turning logits into next tokens for a whole batch at once: temperature, min-p, top-k, top-p, seeded draws.

Each request's parameters become one entry of a tensor ([B] temperatures, [B] top-k ...), so every filter
is one tensor operation over the batch instead of one call per request. So is the draw: each row's random
number is a hash of its request's (seed, position), so a seeded request gets the same tokens alone or in any
batch, with no random stream per request to draw from one at a time.

Nothing here waits for the GPU. Which filters run is decided from the requests' parameters on the host
(Python numbers), not from device tensors (a `bool(tensor.any())` on a GPU tensor stops the host until every
queued kernel has run); the parameters travel in pinned memory without a wait; sample_batch returns the next
tokens as a tensor on the device. The model runner reads them back once per step.
"""
from __future__ import annotations

import torch

from shared import SamplingParams


def _to_device(value, device: torch.device, dtype=None) -> torch.Tensor:
    """A number or a tensor -> a tensor on `device`. A CPU tensor bound for a GPU goes through pinned memory, queued
    without a wait (a plain copy from pageable memory would make the host wait for the GPU to catch up)."""
    value = torch.as_tensor(value, dtype=dtype)
    if value.device == device or device.type != "cuda":
        return value.to(device)
    return value.pin_memory().to(device, non_blocking=True)


def _per_row(value, logits: torch.Tensor, dtype=None) -> torch.Tensor:
    """A number or a [B] tensor -> [..., 1], one value per row of logits [..., vocab]."""
    value = _to_device(value, logits.device, dtype)
    return value.expand(logits.shape[:-1]).unsqueeze(-1)


def _on_host(value) -> torch.Tensor:
    """The decision of whether a filter runs is made here, on the host: a CPU tensor costs no wait. (A GPU tensor
    still works, at the price of a wait for the GPU.)"""
    return torch.as_tensor(value).cpu()


def apply_top_k(logits: torch.Tensor, k) -> torch.Tensor:
    """Per row: keep the k largest logits (and any tied with the k-th), set the rest to -inf. k <= 0: no cut.
    logits: [..., vocab]; k: a number or one per row."""
    vocab = logits.shape[-1]
    k = _on_host(k)
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    if not bool((k < vocab).any()):  # on the host: no wait
        return logits
    # topk of the largest k asked for, not a sort of the whole vocabulary: a sort of 49,152 logits per row
    # costs far more than finding the 50 largest. Rows without a cut get -inf as their threshold.
    largest = int(k[k < vocab].max())
    k = _per_row(k, logits)  # [..., 1], on the logits' device
    cut = k < vocab  # [..., 1]: the rows that ask for a cut
    kth_largest = logits.topk(largest, dim=-1).values.gather(-1, k.clamp(max=largest) - 1)  # [..., 1]
    kth_largest = torch.where(cut, kth_largest, float("-inf"))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def apply_top_p(logits: torch.Tensor, p) -> torch.Tensor:
    """Per row, nucleus: keep the smallest set of most likely tokens whose probabilities sum to >= p."""
    vocab = logits.shape[-1]
    p_host = _on_host(p).to(logits.dtype).expand(logits.shape[:-1]).reshape(-1)  # [rows], on the host
    cut = (p_host < 1.0).nonzero()[:, 0]  # the rows that ask for a cut (p = 1: no cut), found on the host
    if len(cut) == 0:
        return logits
    flat = logits.reshape(-1, vocab)
    index = _to_device(cut, logits.device)
    rows, p = flat[index], _to_device(p_host[cut], logits.device)[:, None]  # sort only those rows: the sort is the cost
    sorted_logits, order = torch.sort(rows, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of all more-likely tokens
    drop_sorted = mass_before >= p  # the set already reached p without this token
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    out = flat.clone()
    out[index] = rows.masked_fill(drop, float("-inf"))
    return out.view_as(logits)


def apply_min_p(logits: torch.Tensor, min_p) -> torch.Tensor:
    """Per row: drop tokens whose probability is below min_p x the probability of the row's most likely token."""
    min_p_host = _on_host(min_p)
    if bool((min_p_host <= 0.0).all()):  # on the host: no wait
        return logits
    min_p = _per_row(min_p_host, logits, logits.dtype)  # [..., 1]
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


def wants_filters(params: list[SamplingParams], vocab: int) -> bool:
    """Does any row ask for min-p, top-k (a cut below the vocabulary) or top-p? Decided on the host."""
    return any(sp.min_p > 0 or 0 < sp.top_k < vocab or sp.top_p < 1 for sp in params)


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a sampled row draws from: logits [S, vocab] (one row per sampled request, none greedy) ->
    probabilities [S, vocab] after temperature, then min-p, then top-k and top-p (the order of current vLLM).
    A verify step draws each of its places through sample_batch too (model_runner.launch_draw), as a plain
    step does."""
    def column(name):  # the requests' parameters: host numbers, decided on the host
        return torch.tensor([getattr(sp, name) for sp in params])
    sampled = logits / _per_row(column("temperature"), logits, logits.dtype)  # [S, vocab]
    sampled = apply_min_p(sampled, column("min_p").to(logits.dtype))
    sampled = apply_top_k(sampled, column("top_k"))
    sampled = apply_top_p(sampled, column("top_p").to(logits.dtype))
    return torch.softmax(sampled, dim=-1)  # [S, vocab]


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 positions: list[int]) -> torch.Tensor:
    """logits: [B, vocab] (fp32), one row per request -> the next token id of each request: int64 [B], on the
    logits' device, computed without a wait for the GPU. seeds, positions: each row's draw key (its request's
    seed, and how many tokens the request has generated). The device work is the same few operations for 1 row
    or 256."""
    rows = [i for i, sp in enumerate(params) if not sp.greedy]
    if not rows:
        return torch.argmax(logits, dim=-1)
    every_row = len(rows) == len(params)  # no greedy row: no argmax, no gather of the sampled rows
    index = None if every_row else _to_device(torch.tensor(rows), logits.device)
    probs = processed_probs(logits if every_row else logits[index], [params[i] for i in rows])  # [S, vocab]
    # one draw for every sampled row, each keyed by its request's (seed, position); it stays on the device
    u = _to_device(uniforms([seeds[i] for i in rows], [positions[i] for i in rows]), logits.device)  # [S] float64
    drawn = draw(probs, u)  # [S]
    return drawn if every_row else torch.argmax(logits, dim=-1).index_put((index,), drawn)
