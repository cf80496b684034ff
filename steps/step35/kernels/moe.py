"""A mixture of experts' MLP in two Triton kernels, whatever the number of experts the tokens chose.

model.py's TorchLayerOps.moe is the loop this replaces: for each expert that got tokens, gather them, two matmuls,
add the rows back. With E experts that is up to 2 * E small matmuls per layer (Qwen3-30B-A3B: 128 experts, 8 per
token), each reading its expert's weights for a handful of rows, and a host loop that must know which experts were
hit (a wait for the GPU, so no CUDA graph either). Here the same work is two launches, their shapes fixed by the
number of tokens alone:

    align      the N * k (token, expert) pairs sorted by expert, each expert's run padded to a whole number of
               BLOCK_M rows: sorted_pairs [P] (a pair's index token * k + slot; N * k marks padding) and
               block_expert [P / BLOCK_M] (the expert of each block of rows; -1: a block past the last run). Torch
               operators on the device, no wait for the host: P is an upper bound fixed by N.
    gate_up    one program per (block of BLOCK_M sorted pairs, BLOCK_N columns of the width): the block's token
               rows of x times its expert's gate and up rows, SiLU(gate) * up -> inter [P, width], in sorted order
    down       one program per (block, BLOCK_N columns of hidden): inter's rows times the expert's down matrix,
               each row scaled by its pair's router weight -> out [N * k, hidden] at the pair's own row

and then the k rows of each token are summed (a torch sum over [N, k, hidden]: a fixed order, no atomics, so a
token's output does not depend on what else is in the batch). Every block of rows is one expert's, so each program
reads one expert's weight tiles and reuses them for BLOCK_M tokens: the grouped GEMM. A pair routed to an expert
this rank does not hold (expert parallelism) sorts into no block and its row of out stays 0.

vLLM's fused_moe (moe_align_block_size, then one grouped GEMM per projection) is the same idea; this is a small
version of it written for reading.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: model.py's loop over the experts still works
    triton = None


if triton is not None:
    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs, top_k, hidden, width,
                        stride_x, stride_we, stride_wn, stride_o,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
        """Program (m, n): rows m * BLOCK_M .. of the sorted pairs (one expert's), columns n * BLOCK_N .. of the
        width. x [N, hidden]; w [E, 2 * width, hidden] (each expert's gate rows, then its up rows)."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:  # a block past the last expert's run: nothing to compute
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pairs_ptr + rows)
        valid = pairs < num_pairs  # padding rows (value num_pairs) read zeros and store nothing
        tokens = tl.where(valid, pairs // top_k, 0)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < width
        w_gate = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn  # [1, BLOCK_N] row starts
        w_up = w_gate + width * stride_wn
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]: the block's tokens, gathered by index
            w_mask = k_ok[:, None] & col_ok[None, :]
            g = tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]: W.T's tile
            u = tl.load(w_up + ks[:, None], mask=w_mask, other=0.0)
            acc_gate = tl.dot(a, g, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a, u, acc_up, input_precision=DOT_PRECISION)
        # SiLU(gate) * up, each product rounded to the model's dtype first, as the torch path rounds it
        gate = acc_gate.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32) * up
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(a_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, weights_ptr, num_pairs, width, hidden,
                     stride_a, stride_we, stride_wn, stride_o,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
        """Program (m, n): the block's rows of a [P, width] (sorted order) times its expert's down rows n * BLOCK_N ..
        of w [E, hidden, width], scaled by each pair's router weight, stored at the pair's row of out [N * k, hidden]."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pairs_ptr + rows)
        valid = pairs < num_pairs
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, width, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < width
            a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        weight = tl.load(weights_ptr + tl.where(valid, pairs, 0), mask=valid, other=0.0).to(tl.float32)
        # the expert's output rounded to the model's dtype, then weighted (as the torch path does), kept in fp32
        y = acc.to(a_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
        safe = tl.where(valid, pairs, 0).to(tl.int64)
        tl.store(out_ptr + safe[:, None] * stride_o + cols[None, :], y, mask=valid[:, None] & col_ok[None, :])


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: about the pairs an expert gets on average (num_pairs / num_experts), 16 to 64. A block holds
    one expert's pairs only, so a block much larger than an expert's run is mostly padding (16 is the smallest
    tile tl.dot takes); a larger one reuses each weight tile for more tokens."""
    per_expert = num_pairs / max(1, num_experts)
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """P: the sorted rows, an upper bound fixed by the pairs alone (so a CUDA graph can hold it): each expert that
    got pairs pads its run by at most block_m - 1 rows, and at most min(num_pairs, E) experts got any."""
    p = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-p // block_m) * block_m


def align(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs sorted by expert, each expert's run padded to a multiple of block_m.

    experts [N, k]: each token's chosen experts, as this rank numbers them (0 .. num_experts - 1; any other value:
    an expert held by another rank, left out). -> sorted_pairs int32 [P] (the pair index token * k + slot, runs of
    one expert; N * k in the padding) and block_expert int32 [P / block_m] (each block's expert; -1 past the runs).
    Torch operators only, on experts' device: nothing waits for the host, nothing's shape depends on the routing."""
    device, num_pairs = experts.device, experts.numel()
    flat = experts.flatten()
    mine = (flat >= 0) & (flat < num_experts)
    key = torch.where(mine, flat, torch.full_like(flat, num_experts))  # other ranks' pairs: one more bin, last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, key, torch.ones_like(key))  # pairs per expert (a scatter, not bincount: bincount's size waits for the host)
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # where each expert's padded run ends in the sorted rows
    P = padded_pairs(num_pairs, num_experts, block_m)
    order = torch.argsort(key, stable=True)  # the pairs by expert, each expert's in token order
    sorted_key = key[order]
    first = counts.cumsum(0) - counts  # each bin's first place in `order`
    starts = torch.cat([ends - padded, ends.new_full((1,), P)])  # the extra bin: to slot P, cut off below
    dest = starts[sorted_key] + torch.arange(num_pairs, device=device) - first[sorted_key]
    dest = torch.where(sorted_key < num_experts, dest, torch.full_like(dest, P))
    sorted_pairs = torch.full((P + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(0, P, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_start, right=True)  # the run each block's first row falls in
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs[:P], block_expert


def fused_moe(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, block_m: int | None = None, block_n: int = 64, block_k: int = 64,
              num_warps: int = 4) -> torch.Tensor:
    """The experts' weighted sum for every token: h [N, hidden], the router's weights [N, k] and experts [N, k]
    (route's; numbered as this rank holds them), gate_up [E, 2 * width, hidden], down [E, hidden, width] ->
    [N, hidden] in h's dtype. Equal to model.py's loop over the experts up to the order of each sum."""
    if triton is None:
        raise RuntimeError("kernels/moe.py needs Triton")
    N, hidden = h.shape
    E, two_width, _ = gate_up.shape
    width, top_k = two_width // 2, experts.shape[1]
    if gate_up.shape != (E, 2 * width, hidden) or down.shape != (E, hidden, width):
        raise ValueError(f"gate_up must be [E, 2 * width, hidden={hidden}] and down [E, hidden, width]; got "
                         f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    if not (h.dtype == gate_up.dtype == down.dtype) or h.stride(1) != 1:
        raise ValueError(f"h, gate_up and down must share a dtype and h's rows be contiguous ({h.dtype}, "
                         f"{gate_up.dtype}, {down.dtype})")
    num_pairs = N * top_k
    block_m = block_m or choose_block_m(num_pairs, E)
    sorted_pairs, block_expert = align(experts, E, block_m)
    P = sorted_pairs.numel()
    precision = "ieee" if h.dtype == torch.float32 else "tf32"  # fp32: exact products, not tf32's
    bn, bk = max(16, min(block_n, triton.next_power_of_2(width))), max(16, min(block_k, triton.next_power_of_2(hidden)))
    inter = torch.empty((P, width), dtype=h.dtype, device=h.device)
    _gate_up_kernel[(P // block_m, triton.cdiv(width, bn))](
        h, gate_up, inter, sorted_pairs, block_expert, num_pairs, top_k, hidden, width,
        h.stride(0), gate_up.stride(0), gate_up.stride(1), inter.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=precision, num_warps=num_warps)
    out = torch.zeros((num_pairs, hidden), dtype=torch.float32, device=h.device)  # rows of other ranks' pairs: 0
    bn, bk = max(16, min(block_n, triton.next_power_of_2(hidden))), max(16, min(block_k, triton.next_power_of_2(width)))
    _down_kernel[(P // block_m, triton.cdiv(hidden, bn))](
        inter, down, out, sorted_pairs, block_expert, weights.contiguous(), num_pairs, width, hidden,
        inter.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=precision, num_warps=num_warps)
    return out.view(N, top_k, hidden).sum(dim=1).to(h.dtype)
