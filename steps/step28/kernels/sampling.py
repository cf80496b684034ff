"""The sampler's draw as one Triton kernel, for the rows that ask for no filter (temperature only, or greedy).

sampler.py's torch path spends its time on the host: about thirty operators a step (the temperature's division,
the softmax, the key's hash, the two-level search of the draw, the log-softmax for the chosen tokens' logprobs),
each a launch of a few microseconds of work, each paid again at batch 1. Here one program per row does all of it:

    pass 1   the row's maximum (and its first position: the greedy token)
    pass 2   the log-softmax's normaliser, and the sum of exp(logit / T - max / T) of every block of the row,
             kept in a small scratch tensor (float64)
    search   u (the request's key hashed in the kernel, bit for bit as sampler.py's `uniforms` hashes it) x the
             total finds the block, then the running sum of that one block finds the token

This is sampler.py's two-level draw (`draw`), blocks of 8,192 tokens instead of 128: the first token whose running
sum passes u x the total, u's offset into its block scaled to the block's own running total, so a token of
probability 0 is never drawn. The probabilities differ from torch's softmax by float32 rounding only, so a token can
differ from the torch path's only when u falls within that rounding of a boundary between two tokens.
-> (token [S] int64, its logprob under the model's distribution [S] fp32), both on the device, with no wait.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: sampler.py's torch path
    triton = None

MASK32 = 2**32 - 1


if triton is not None:
    @triton.jit
    def _mix32(x):
        """sampler.py's _mix32 on an int64 in [0, 2**32): the products stay below 2**63."""
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _draw_kernel(logits_ptr, stride, params_ptr, block_sums_ptr, token_ptr, logprob_ptr, vocab, num_blocks,
                     BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        # the row's parameters, one float64 each: temperature (0: greedy), seed's low and high halves, position
        t = tl.load(params_ptr + row * 4).to(tl.float32)
        low = tl.load(params_ptr + row * 4 + 1).to(tl.int64)
        high = tl.load(params_ptr + row * 4 + 2).to(tl.int64)
        position = tl.load(params_ptr + row * 4 + 3).to(tl.int64)
        # pass 1: the maximum and its first position (the greedy token)
        best = -float("inf")
        best_at = 0
        for start in range(0, vocab, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < vocab, other=-float("inf"))
            block_max = tl.max(x, axis=0)
            at = tl.min(tl.where(x == block_max, start + cols, vocab), axis=0)  # the first maximum in the block
            better = block_max > best
            best_at = tl.where(better, at, best_at)
            best = tl.where(better, block_max, best)
        # pass 2: the normaliser of the logits, and each block's sum of exp(logit / T - max / T), kept (float64)
        t_safe = tl.where(t > 0, t, 1.0)
        top = best / t_safe
        norm = tl.zeros((), tl.float32)
        for b in range(0, num_blocks):
            ok = b * BLOCK + cols < vocab
            x = tl.load(base + b * BLOCK + cols, mask=ok, other=-float("inf"))
            norm += tl.sum(tl.exp(x - best), axis=0)
            p = tl.where(ok, tl.exp(x / t_safe - top), 0.0)
            tl.store(block_sums_ptr + row * num_blocks + b, tl.sum(p.to(tl.float64), axis=0))
        tl.debug_barrier()  # the block sums stored above are read below by other threads of the program
        # the key's number, as sampler.py's uniforms hashes (position, seed's high half, seed's low half)
        h = _mix32(_mix32(_mix32(position & 0xFFFFFFFF) ^ high) ^ low)
        # the block u falls in: the first whose running sum of block sums passes u x the total
        index = tl.arange(0, BLOCKS)
        sums = tl.load(block_sums_ptr + row * num_blocks + index, mask=index < num_blocks, other=0.0)
        cdf = tl.cumsum(sums, axis=0)
        total = tl.sum(tl.where(index == num_blocks - 1, cdf, 0.0), axis=0)
        target = (h.to(tl.float64) / 4294967296.0) * total  # below the total: u < 1
        block = tl.min(tl.where((cdf > target) & (index < num_blocks), index, num_blocks - 1), axis=0)
        offset = target - tl.sum(tl.where(index == block - 1, cdf, 0.0), axis=0)  # into the block
        block_sum = tl.sum(tl.where(index == block, sums, 0.0), axis=0)
        # the token inside it: the block's own running sum, u's offset scaled to its total (the two are rounded
        # differently) and kept inside it, so a token of probability 0 is never drawn
        ok = block * BLOCK + cols < vocab
        x = tl.load(base + block * BLOCK + cols, mask=ok, other=-float("inf"))
        running = tl.cumsum(tl.where(ok, tl.exp(x / t_safe - top), 0.0).to(tl.float64), axis=0)
        inner = tl.sum(tl.where(cols == BLOCK - 1, running, 0.0), axis=0)
        offset = tl.minimum(offset * (inner / block_sum), inner * (1.0 - 2.0**-52))
        token = block * BLOCK + tl.min(tl.where(running > offset, cols, BLOCK - 1), axis=0)
        token = tl.where(t > 0, token.to(tl.int64), best_at.to(tl.int64))
        chosen = tl.load(base + token)
        tl.store(token_ptr + row, token)
        tl.store(logprob_ptr + row, chosen - best - tl.log(norm))


def draw_params(temperatures: list[float], seeds: list[int], positions: list[int]) -> torch.Tensor:
    """[S, 4] float64 on the host, one row per request: temperature, the seed's low and high 32-bit halves, the
    position (integers below 2**53 are exact in a float64), all the kernel reads, in one copy to the device."""
    return torch.tensor([[t, s & MASK32, (s >> 32) & MASK32, p] for t, s, p in zip(temperatures, seeds, positions)],
                        dtype=torch.float64).reshape(-1, 4)


def fused_draw(logits: torch.Tensor, params: torch.Tensor, block: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, vocab] fp32 and params [S, 4] float64 (draw_params), on the same device -> (token [S] int64, its
    logprob [S] fp32). One launch; the blocks' sums go through a small scratch tensor [S, blocks]."""
    rows, vocab = logits.shape
    logits = logits.contiguous()
    num_blocks = -(-vocab // block)
    token = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprob = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block_sums = torch.empty(rows, num_blocks, dtype=torch.float64, device=logits.device)
    if rows:
        _draw_kernel[(rows,)](logits, logits.stride(0), params, block_sums, token, logprob, vocab, num_blocks,
                              BLOCK=block, BLOCKS=triton.next_power_of_2(num_blocks), num_warps=16)
    return token, logprob
