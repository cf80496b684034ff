"""step28: the projections of a step with few rows (a decode at batch 1, a small verify), in one Triton kernel
each, with the elementwise work around them folded in.

At batch 1 every weight is read once per token and used for one row: a matrix-vector product (GEMV), bound by the
bytes it reads. cuBLAS's GEMM, built for many rows, reaches a fraction of the copy bandwidth there, and each
projection also brings its neighbours as kernels of their own: the RMSNorm before it, the residual add or the
SiLU * up after it. This kernel reads each weight row once, for every row of x at once (up to MAX_ROWS), and does
that work in the same pass:

    norm_weight   prologue: x is the residual stream; each program computes its rows' RMS (one pass over x, which
                  is small and stays in the cache) and multiplies the weight by the normalised x, rounded as
                  model.py's rms_norm rounds (so no normalised copy of x is written or read)
    silu_mul      epilogue: the weight is [gate; up] (2 * N rows); a program reads gate row n and up row N + n and
                  writes silu(gate) * up, rounded as kernels/fused.py's silu_mul (the [M, 2N] product never exists)
    residual      epilogue: out = x @ w.T + residual, the product rounded to the dtype first, as torch adds it

Each program owns BLOCK_N output columns and loops over K in tiles of BLOCK_K: a [BLOCK_N, BLOCK_K] tile of the
weight is multiplied with the [BLOCK_M, BLOCK_K] tile of x and summed over K in fp32. No split-K: every sum has one
owner, so the result does not depend on the timing (no atomics) and there is no reduce kernel; the grid is filled by
narrow column tiles instead (choose_config).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: model.py's TorchLayerOps is the path
    triton = None

MAX_ROWS = 8  # the most rows of x the kernel takes; a step with more runs cuBLAS


if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, M, N, K, eps,
                     stride_xm, stride_wn, stride_om, stride_rm,
                     HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program p: out[:, p * BLOCK_N : (p + 1) * BLOCK_N] for every row of x."""
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        dtype = out_ptr.dtype.element_ty
        x_rows = x_ptr + rows[:, None] * stride_xm
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
        if HAS_NORM:  # the rows' RMS first: sum of squares over all of K, in fp32
            sq = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                xs = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
                xs = xs.to(tl.float32)
                sq += tl.sum(xs * xs, axis=1)
            rstd = 1.0 / tl.sqrt(sq / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if SILU_MUL:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            # the weight tile, read once for every row of x: [BLOCK_N, BLOCK_K] (and its up rows, N rows further)
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            if SILU_MUL:
                u = tl.load(w_rows + N * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                u = u.to(tl.float32)
            if HAS_NORM:
                g = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            for m in tl.static_range(BLOCK_M):  # row by row: 2-D tiles only, each row's sum lands in its acc row
                xm = tl.load(x_ptr + m * stride_xm + ks, mask=k_ok & (ks * 0 + m < M), other=0.0)
                if HAS_NORM:  # weight * (x / rms), each product rounded to the dtype as rms_norm rounds it
                    r = tl.sum(tl.where(rows == m, rstd, 0.0), axis=0)
                    xm = (g * (xm.to(tl.float32) * r).to(dtype).to(tl.float32)).to(dtype)
                xm = xm.to(tl.float32)[None, :]
                here = (rows == m)[:, None]
                acc = tl.where(here, acc + tl.sum(w * xm, axis=1)[None, :], acc)
                if SILU_MUL:
                    acc_up = tl.where(here, acc_up + tl.sum(u * xm, axis=1)[None, :], acc_up)
        y = acc.to(dtype)  # the product, rounded to the dtype as a matmul's output is
        if SILU_MUL:
            gate = y.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # silu, rounded to the dtype
            y = (act.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
        ok = row_ok[:, None] & col_ok[None, :]
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=ok, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], y, mask=ok)


def choose_config(m: int, n: int, k: int, silu_mul: bool = False) -> dict:
    """The tile for m rows, n output columns and k inputs: BLOCK_M the rows rounded up to a power of two, long
    K tiles (BLOCK_K up to 1024: few loop trips, many bytes in flight per program) and narrow column tiles (BLOCK_N
    2, or 8 with SiLU * up's two weight tiles), so that even a 1024-column projection has hundreds of programs
    streaming its weight; a vocabulary-wide matrix (lm_head, from 16,384 columns) has programs enough with tiles
    of 16 x 512. Chosen from sweeps on the H200 at one row (docs/data/bench_step28.py)."""
    if n >= 16384:
        return {"BLOCK_M": triton.next_power_of_2(max(m, 1)), "BLOCK_N": 16, "BLOCK_K": min(512, triton.next_power_of_2(k)),
                "num_warps": 4}
    return {"BLOCK_M": triton.next_power_of_2(max(m, 1)), "BLOCK_N": 8 if silu_mul else 2,
            "BLOCK_K": min(1024, triton.next_power_of_2(k)), "num_warps": 4}


def gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
         residual: torch.Tensor | None = None, silu_mul: bool = False, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] -> x @ weight.T [M, N], one launch; with norm_weight, x is first
    RMS-normalised with it (rms_norm(x, norm_weight, eps)); with silu_mul, weight is [gate; up] and the result is
    silu(x @ gate.T) * (x @ up.T) [M, N / 2]; with residual [M, N], it is added to the result."""
    if triton is None:
        raise RuntimeError("gemv needs Triton (pip install triton); model.py's TorchLayerOps is the torch path")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K], "
                         "contiguous in K")
    m, k = x.shape
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"gemv: x has {m} rows; the kernel takes 1 to {MAX_ROWS} (more: a matmul)")
    if silu_mul and weight.shape[0] % 2:
        raise ValueError(f"gemv: silu_mul needs [gate; up], an even row count, not {weight.shape[0]}")
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"gemv: norm_weight {tuple(norm_weight.shape)} must be [{k}]")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"gemv: residual {tuple(residual.shape)} must be [{m}, {n}], contiguous in its columns")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = dict(config or choose_config(m, n, k, silu_mul))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    _gemv_kernel[grid](x, weight, out, residual if residual is not None else out,
                       norm_weight if norm_weight is not None else x, m, n, k, eps,
                       x.stride(0), weight.stride(0), out.stride(0),
                       residual.stride(0) if residual is not None else 0,
                       HAS_NORM=norm_weight is not None, SILU_MUL=silu_mul, HAS_RESIDUAL=residual is not None, **cfg)
    return out


def gemv_reference(x, weight, norm_weight=None, eps=1e-6, residual=None, silu_mul=False):
    """The same in torch operators, rounding where they round: rms_norm, a matmul, silu * up, the add."""
    if norm_weight is not None:
        x32 = x.float()
        x = norm_weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = x @ weight.T
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y + residual if residual is not None else y
