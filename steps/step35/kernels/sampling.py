"""The sampler's draw as one Triton kernel, for the rows that ask for no filter (temperature only, or greedy).

sampler.py's torch path spends its time on the host: about thirty operators a step (the temperature's division,
the softmax, the key's hash, the two-level search of the draw, the log-softmax for the chosen tokens' logprobs),
each a launch of a few microseconds of work, each paid again at batch 1. Here one kernel does all of it.

A program per block of a row (step21's kernel had one program per row, which at batch 1 is one of the GPU's
132 multiprocessors reading the whole vocabulary three times: 60 us of a 1 ms token):

    each block   its maximum (and first position), and two sums at that maximum: exp(logit - max) (the
                 log-softmax's normaliser) and exp(logit / T - max / T) (the draw's), kept in a small scratch
                 tensor (float64)
    the last     the row's last program to finish (an arrival counter per row, as kernels/decode.py's flash
                 decoding merges): the row's maximum (and its first position: the greedy token), the blocks' sums
                 moved to it, then u (the request's key hashed in the kernel, bit for bit as sampler.py's
                 `uniforms` hashes it) x the total finds the block, and the running sum of that one block the token

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
    def _draw_kernel(logits_ptr, stride, params_ptr, scratch_ptr, counter_ptr, token_ptr, logprob_ptr, vocab,
                     num_blocks, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
        """Program (row, block b), every block of every row at once; the last of a row's programs to finish
        draws the row's token (an arrival counter, as flash decoding's merge: kernels/decode.py)."""
        row = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        base = logits_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        t = tl.load(params_ptr + row * 4).to(tl.float32)  # the row's temperature (0: greedy)
        t_safe = tl.where(t > 0, t, 1.0)
        # this block: its maximum and first position, sum exp(logit - max) (the normaliser's share) and
        # sum exp(logit / T - max / T) (the draw's), both at the block's own maximum (0 if the block is all -inf)
        ok = b * BLOCK + cols < vocab
        x = tl.load(base + b * BLOCK + cols, mask=ok, other=-float("inf"))
        block_max = tl.max(x, axis=0)
        block_at = tl.min(tl.where(x == block_max, b * BLOCK + cols, vocab), axis=0)
        shift = tl.where(block_max > -float("inf"), block_max, 0.0)
        norm_part = tl.sum(tl.exp(x - shift), axis=0)
        draw_part = tl.sum(tl.where(ok, tl.exp(x / t_safe - shift / t_safe), 0.0).to(tl.float64), axis=0)
        scratch = scratch_ptr + row * 4 * num_blocks  # [4, num_blocks] float64 a row: max, position, two sums
        tl.store(scratch + b, block_max.to(tl.float64))
        tl.store(scratch + num_blocks + b, block_at.to(tl.float64))
        tl.store(scratch + 2 * num_blocks + b, norm_part.to(tl.float64))
        tl.store(scratch + 3 * num_blocks + b, draw_part)
        tl.debug_barrier()  # every thread's stores, before the add that publishes them
        arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel")
        if arrived == num_blocks - 1:  # the row's last block: every block's entries are stored
            tl.debug_barrier()
            index = tl.arange(0, BLOCKS)
            here = index < num_blocks
            maxes = tl.load(scratch + index, mask=here, other=-float("inf"), cache_modifier=".cg").to(tl.float32)
            at = tl.load(scratch + num_blocks + index, mask=here, other=0.0, cache_modifier=".cg").to(tl.int64)
            norms = tl.load(scratch + 2 * num_blocks + index, mask=here, other=0.0, cache_modifier=".cg")
            sums = tl.load(scratch + 3 * num_blocks + index, mask=here, other=0.0, cache_modifier=".cg")
            best = tl.max(maxes, axis=0)
            best_at = tl.min(tl.where(here & (maxes == best), at, vocab), axis=0)  # the first maximum: greedy
            top = best / t_safe
            shifts = tl.where(maxes > -float("inf"), maxes, 0.0)
            # each block's sums moved from its own maximum to the row's
            norm = tl.sum(tl.where(here, norms.to(tl.float32) * tl.exp(shifts - best), 0.0), axis=0)
            sums = tl.where(here, sums * tl.exp(shifts / t_safe - top).to(tl.float64), 0.0)
            low = tl.load(params_ptr + row * 4 + 1).to(tl.int64)
            high = tl.load(params_ptr + row * 4 + 2).to(tl.int64)
            position = tl.load(params_ptr + row * 4 + 3).to(tl.int64)
            # the key's number, as sampler.py's uniforms hashes (position, seed's high half, seed's low half)
            h = _mix32(_mix32(_mix32(position & 0xFFFFFFFF) ^ high) ^ low)
            # the block u falls in: the first whose running sum of block sums passes u x the total
            cdf = tl.cumsum(sums, axis=0)
            total = tl.sum(tl.where(index == num_blocks - 1, cdf, 0.0), axis=0)
            target = (h.to(tl.float64) / 4294967296.0) * total  # below the total: u < 1
            block = tl.min(tl.where((cdf > target) & here, index, num_blocks - 1), axis=0)
            offset = target - tl.sum(tl.where(index == block - 1, cdf, 0.0), axis=0)  # into the block
            block_sum = tl.sum(tl.where(index == block, sums, 0.0), axis=0)
            # the token inside it: the block's own running sum, u's offset scaled to its total (the two are
            # rounded differently) and kept inside it, so a token of probability 0 is never drawn
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
            tl.atomic_xchg(counter_ptr + row, 0)  # ready for the next draw


def draw_params(temperatures: list[float], seeds: list[int], positions: list[int]) -> torch.Tensor:
    """[S, 4] float64 on the host, one row per request: temperature, the seed's low and high 32-bit halves, the
    position (integers below 2**53 are exact in a float64), all the kernel reads, in one copy to the device."""
    return torch.tensor([[t, s & MASK32, (s >> 32) & MASK32, p] for t, s, p in zip(temperatures, seeds, positions)],
                        dtype=torch.float64).reshape(-1, 4)


_counters: dict = {}  # the draw's arrival counters, one per row, per device; zeros between draws


def draw_counters(rows: int, device: torch.device) -> torch.Tensor:
    """int32 zeros, at least `rows` of them, kept per device (each draw leaves them at 0); grown when a step has more
    rows than any before (the draw is never captured in a graph, so a new tensor is safe)."""
    have = _counters.get(device)
    if have is None or have.numel() < rows:
        have = _counters[device] = torch.zeros(max(rows, 1024), dtype=torch.int32, device=device)
    return have


def fused_draw(logits: torch.Tensor, params: torch.Tensor, block: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, vocab] fp32 and params [S, 4] float64 (draw_params), on the same device -> (token [S] int64, its
    logprob [S] fp32). One launch of S x blocks programs; the blocks' maxima and sums go through a small scratch
    tensor [S, 4, blocks], and the last program of a row draws."""
    rows, vocab = logits.shape
    logits = logits.contiguous()
    num_blocks = -(-vocab // block)
    token = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprob = torch.empty(rows, dtype=torch.float32, device=logits.device)
    scratch = torch.empty(rows, 4, num_blocks, dtype=torch.float64, device=logits.device)
    if rows:
        _draw_kernel[(rows, num_blocks)](logits, logits.stride(0), params, scratch, draw_counters(rows, logits.device),
                                         token, logprob, vocab, num_blocks, BLOCK=block,
                                         BLOCKS=triton.next_power_of_2(num_blocks), num_warps=8)
    return token, logprob
