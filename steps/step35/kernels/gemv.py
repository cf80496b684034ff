"""The projections of a step with few rows (a decode at batch 1, a small verify), in one Triton kernel
each, with the elementwise work around them folded in.

At batch 1 every weight is read once per token and used for one row: a matrix-vector product (GEMV), bound by the
bytes it reads. cuBLAS's GEMM, built for many rows, reaches a fraction of the copy bandwidth there, and each
projection also brings its neighbours as kernels of their own: the RMSNorm before it, the residual add or the
SiLU * up after it. This kernel reads each weight row once, for every row of x at once (up to MAX_ROWS), and does
that work in the same pass:

    norm_weight   x is the residual stream: w . rms_norm(x) = (w . (g * x)) / rms(x), so each program sums the
                  weight times g * x and, in the same pass, each row's sum of squares, and divides by the RMS at the
                  end (no normalised copy of x is written or read, and no second pass over x). The normalised x is
                  never rounded to the dtype, as rms_norm rounds it: the result differs from norm-then-matmul by
                  that rounding (the GPU's outputs are compared under the near-tie rule)
    silu_mul      epilogue: the weight is [gate; up] (2 * N rows); a program reads gate row n and up row N + n and
                  writes silu(gate) * up, rounded as kernels/fused.py's silu_mul (the [M, 2N] product never exists)
    residual      epilogue: out = x @ w.T + residual, the product rounded to the dtype first, as torch adds it

Each program owns BLOCK_N output columns and loops over K in tiles of BLOCK_K: a [BLOCK_N, BLOCK_K] tile of the
weight is multiplied with the [BLOCK_M, BLOCK_K] tile of x and summed over K in fp32. No split-K: every sum has one
owner, so the result does not depend on the timing (no atomics) and there is no reduce kernel; the grid is filled by
narrow column tiles instead (choose_config). The next weight tile is asked for before this one is used, and the
first before anything else: the weight depends on no earlier kernel.

Programmatic dependent launch (PDL, Hopper): a kernel launched with it may start before the kernel ahead of it in
the stream has finished, once every program of that one has said so (gdc_launch_dependents, first thing here); it
must wait (gdc_wait) before it reads what that kernel writes. So the next projection's programs are already on the
multiprocessors, their weights' bytes in flight, while this one finishes: at one row the time between two kernels
is much of a kernel's time. x and the residual are read after the wait; the weight before it.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: model.py's TorchLayerOps is the path
    triton = None

gdc_launch_dependents = gdc_wait = None  # programmatic dependent launch, where Triton has it (below)
MAX_ROWS = 8  # the most rows of x the kernel takes; a step with more runs cuBLAS


if triton is not None:
    try:  # programmatic dependent launch (Hopper and newer): Triton's names for griddepcontrol
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # an older Triton: the kernels are launched without it (pdl_supported says so)
        pass

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, M, N, K, eps,
                     stride_xm, stride_wn, stride_om, stride_rm,
                     HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                     scale_ptr=None, W_SCALED: tl.constexpr = False):
        """Program p: out[:, p * BLOCK_N : (p + 1) * BLOCK_N] for every row of x. W_SCALED: the weight is
        float8 with a scale per row (scale_ptr): converted like any tile, each output's sum times its row's scale."""
        if PDL:  # the next kernel may start now: its programs read their weights while this one finishes
            gdc_launch_dependents()
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        dtype = out_ptr.dtype.element_ty
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
        # The first weight tile is asked for before anything else: it depends on no earlier kernel, so its bytes
        # are on their way while this program waits for x (PDL: while the kernel before it finishes).
        ks = tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
        if SILU_MUL:
            u = tl.load(w_rows + N * stride_wn + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
        if PDL:  # x (and the residual) are written by the kernels before this one: wait for them to be done
            gdc_wait()
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if SILU_MUL:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)  # HAS_NORM: each row's sum of squares, over the same pass
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w32 = w.to(tl.float32)
            if SILU_MUL:
                u32 = u.to(tl.float32)
            # the next tile, asked for now, used in the next trip (past K: a mask of nothing, no bytes read)
            nks = ks + BLOCK_K
            w = tl.load(w_rows + nks[None, :], mask=col_ok[:, None] & (nks < K)[None, :], other=0.0)
            if SILU_MUL:
                u = tl.load(w_rows + N * stride_wn + nks[None, :], mask=col_ok[:, None] & (nks < K)[None, :],
                            other=0.0)
            if HAS_NORM:
                g = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            for m in tl.static_range(BLOCK_M):  # row by row: 2-D tiles only, each row's sum lands in its acc row
                xm = tl.load(x_ptr + m * stride_xm + ks, mask=k_ok & (ks * 0 + m < M), other=0.0).to(tl.float32)
                here = rows == m
                if HAS_NORM:  # the norm's weight now, 1 / rms at the end: weight . (g * x) / rms(x)
                    sq = tl.where(here, sq + tl.sum(xm * xm, axis=0), sq)
                    xm = g * xm
                xm = xm[None, :]
                acc = tl.where(here[:, None], acc + tl.sum(w32 * xm, axis=1)[None, :], acc)
                if SILU_MUL:
                    acc_up = tl.where(here[:, None], acc_up + tl.sum(u32 * xm, axis=1)[None, :], acc_up)
        if W_SCALED:  # sum_k (w8 * s_n) x_k = s_n * sum_k w8 x_k, one multiply per output
            acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
            if SILU_MUL:
                acc_up = acc_up * tl.load(scale_ptr + N + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_NORM:
            rstd = (1.0 / tl.sqrt(sq / K + eps))[:, None]
            acc = acc * rstd
            if SILU_MUL:
                acc_up = acc_up * rstd
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


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: a CUDA device of compute capability 9 or more (Hopper), and a Triton that
    has it. The interpreter and older GPUs launch the kernels one after the other, as every step before did."""
    return (triton is not None and gdc_wait is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def choose_config(m: int, n: int, k: int, silu_mul: bool = False) -> dict:
    """The tile for m rows, n output columns and k inputs, chosen from sweeps on the H200 at one row, each launch a
    programmatic dependent of the one before as in the engine (docs/data/bench_step28.py): BLOCK_M the rows rounded
    up to a power of two; long K tiles (1024, or 2048 where K is that long: o and down), so a program has many bytes in
    flight; narrow column tiles, so even a 1024-column projection has hundreds of programs streaming its weight
    (2 columns where K is long, 4 with SiLU * up's two weight tiles, 8 otherwise); few warps (2) where the tile
    is small, more (8) for the long K tiles."""
    bm, bk = triton.next_power_of_2(max(m, 1)), min(1024, triton.next_power_of_2(k))
    if n >= 16384:  # a vocabulary-wide matrix (lm_head): programs enough whatever the tile
        return {"BLOCK_M": bm, "BLOCK_N": 8, "BLOCK_K": bk, "num_warps": 2}
    if silu_mul:
        return {"BLOCK_M": bm, "BLOCK_N": 4, "BLOCK_K": bk, "num_warps": 2}
    if k >= 2048:
        return {"BLOCK_M": bm, "BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 8}
    return {"BLOCK_M": bm, "BLOCK_N": 8, "BLOCK_K": bk, "num_warps": 2}


def gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
         residual: torch.Tensor | None = None, silu_mul: bool = False, config: dict | None = None,
         pdl: bool = False, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] -> x @ weight.T [M, N], one launch; weight float8 e4m3 with
    weight_scale [N] fp32, one per row (quant.py's Fp8Weight), meaning weight * weight_scale[:, None]; with norm_weight, x is first
    RMS-normalised with it (rms_norm(x, norm_weight, eps)); with silu_mul, weight is [gate; up] and the result is
    silu(x @ gate.T) * (x @ up.T) [M, N / 2]; with residual [M, N], it is added to the result. pdl (where
    pdl_supported): launched as a programmatic dependent of the kernel before it, so its weight reads start before
    that kernel ends."""
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
    if (weight.dtype == torch.float8_e4m3fn) != (weight_scale is not None) or (
            weight_scale is not None and (weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32)):
        raise ValueError(f"gemv: a float8 weight needs weight_scale, float32 [{weight.shape[0]}] (and only it does)")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = dict(config or choose_config(m, n, k, silu_mul))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    _gemv_kernel[grid](x, weight, out, residual if residual is not None else out,
                       norm_weight if norm_weight is not None else x, m, n, k, eps,
                       x.stride(0), weight.stride(0), out.stride(0),
                       residual.stride(0) if residual is not None else 0,
                       HAS_NORM=norm_weight is not None, SILU_MUL=silu_mul, HAS_RESIDUAL=residual is not None,
                       PDL=pdl, **cfg, **({"launch_pdl": True} if pdl else {}),
                       **({"scale_ptr": weight_scale, "W_SCALED": True} if weight_scale is not None else {}))
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
