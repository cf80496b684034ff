"""gemv.py's GEMV reading 4-bit blocks (quant.py's Q4Weight), dequantised in registers.

At one row a projection's time is the bytes of its weight. A 4-bit block of 32 weights is 20 bytes (16 of nibbles,
a float16 scale d and minimum m) where bfloat16 takes 64: 0.3125x. The kernel reads the blocks and never writes a
dequantised weight anywhere: each program loads its rows' bytes, splits each byte into its two 4-bit values and
applies the block's scale and minimum in float32, in registers, as it multiplies.

The nibbles are used where they lie. Byte i of a block holds value i (low nibble) and value i + 16 (high nibble),
so instead of reordering the weights, the kernel reads x twice, at the inputs the low and the high nibbles belong
to: x[32 g + i] and x[32 g + 16 + i] for block g. x is small and stays in the cache. A trip takes BLOCK_G whole
blocks of each of its rows: a [BLOCK_N, BLOCK_G, 16] tile of bytes, and the scales and minima as [BLOCK_N, BLOCK_G]
(one load per block, not one per weight).

A block's share of the sum is sum_i (d q_i + m) x_i = d * sum_i q_i x_i + m * sum_i x_i: one multiply-add per
weight, and per block its sum of x (shared by every row of the weight) and two more. Instructions matter here as
bytes do: a byte holds 3.2 times as many 4-bit weights as bfloat16 ones, so at the memory's pace a multiprocessor
must unpack, convert and multiply 3.2 times as many weights per clock (docs/data/sass_step29.py counts the loop's
instructions per weight). Converting a 4-bit value to a float is one instruction on Hopper; a bit trick
that avoids it (EXPONENT_TRICK: the value's bits under the exponent of 2^23 make the float 2^23 + q, and one
subtraction leaves q) measured no faster there, and is kept only for that comparison.

Everything else is gemv.py's kernel: one program per BLOCK_N output columns, every row of x (up to MAX_ROWS) at once,
the RMSNorm folded (the weight times g * x summed with x's sum of squares, divided by the RMS at the end), SiLU * up
or the residual in the epilogue, no split-K, programmatic dependent launch where supported (the blocks asked for
before the wait, x after it).
"""
from __future__ import annotations

import torch

from .gemv import MAX_ROWS, gdc_launch_dependents, gdc_wait

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: model.py's torch path dequantises for each matmul
    triton = None

GROUP = 32


if triton is not None:
    _GROUP = tl.constexpr(GROUP)  # the kernels' name for it (a global a kernel reads must be a constexpr)

    @triton.jit
    def _nibbles(byte, HIGH: tl.constexpr, EXPONENT_TRICK: tl.constexpr):
        """A byte's low or high 4-bit values as float32: converted, or (EXPONENT_TRICK, the benchmark's comparison)
        put under the exponent of 2^23, which makes the float 2^23 + q exactly, then 2^23 subtracted."""
        q = (byte >> 4) if HIGH else (byte & 0x0F)
        if EXPONENT_TRICK:
            return (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return q.to(tl.float32)

    @triton.jit
    def _gemv4_kernel(x_ptr, packed_ptr, scale_ptr, min_ptr, out_ptr, res_ptr, nw_ptr, M, N, K, eps,
                      stride_xm, stride_pn, stride_sn, stride_om, stride_rm,
                      HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr = False,
                      EXPONENT_TRICK: tl.constexpr = False):
        """Program p: out[:, p * BLOCK_N : (p + 1) * BLOCK_N] for every row of x; BLOCK_G blocks (32 inputs each)
        of each weight row a trip, as a [BLOCK_N, BLOCK_G, 16] tile of bytes and [BLOCK_N, BLOCK_G] scales and
        minima."""
        if PDL:
            gdc_launch_dependents()
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        dtype = out_ptr.dtype.element_ty
        n_groups = K // _GROUP
        gs = tl.arange(0, BLOCK_G)
        bs = tl.arange(0, _GROUP // 2)
        p_rows = packed_ptr + cols[:, None, None].to(tl.int64) * stride_pn + bs[None, None, :]
        s_rows = cols[:, None].to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if SILU_MUL:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            up_off = N * stride_pn
            up_soff = N * stride_sn
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        # the first trip's bytes, scales and minima asked for before the wait (they depend on no earlier kernel)
        g_ok = col_ok[:, None] & (gs < n_groups)[None, :]
        byte = tl.load(p_rows + gs[None, :, None] * (_GROUP // 2), mask=g_ok[:, :, None], other=0)
        d = tl.load(scale_ptr + s_rows + gs[None, :], mask=g_ok, other=0.0)
        mn = tl.load(min_ptr + s_rows + gs[None, :], mask=g_ok, other=0.0)
        if SILU_MUL:
            ubyte = tl.load(p_rows + up_off + gs[None, :, None] * (_GROUP // 2), mask=g_ok[:, :, None], other=0)
            ud = tl.load(scale_ptr + up_soff + s_rows + gs[None, :], mask=g_ok, other=0.0)
            um = tl.load(min_ptr + up_soff + s_rows + gs[None, :], mask=g_ok, other=0.0)
        if PDL:  # x (and the residual) are the kernel before's outputs: wait for it once, here
            gdc_wait()
        for g0 in range(0, n_groups, BLOCK_G):
            groups = g0 + gs
            in_row = groups < n_groups
            # x's inputs of this trip: the low nibbles' (32 g + i) and the high ones' (32 g + 16 + i), [BLOCK_G, 16]
            k_low = groups[:, None] * _GROUP + bs[None, :]
            k_high = k_low + _GROUP // 2
            q_low, q_high = _nibbles(byte, False, EXPONENT_TRICK), _nibbles(byte, True, EXPONENT_TRICK)
            d32, mn32 = d.to(tl.float32), mn.to(tl.float32)
            if SILU_MUL:
                u_low, u_high = _nibbles(ubyte, False, EXPONENT_TRICK), _nibbles(ubyte, True, EXPONENT_TRICK)
                ud32, um32 = ud.to(tl.float32), um.to(tl.float32)
            # the next trip's blocks, asked for now (past the row: a mask of nothing, no bytes read)
            n_ok = col_ok[:, None] & (groups + BLOCK_G < n_groups)[None, :]
            byte = tl.load(p_rows + (groups + BLOCK_G)[None, :, None] * (_GROUP // 2), mask=n_ok[:, :, None], other=0)
            d = tl.load(scale_ptr + s_rows + (groups + BLOCK_G)[None, :], mask=n_ok, other=0.0)
            mn = tl.load(min_ptr + s_rows + (groups + BLOCK_G)[None, :], mask=n_ok, other=0.0)
            if SILU_MUL:
                ubyte = tl.load(p_rows + up_off + (groups + BLOCK_G)[None, :, None] * (_GROUP // 2),
                                mask=n_ok[:, :, None], other=0)
                ud = tl.load(scale_ptr + up_soff + s_rows + (groups + BLOCK_G)[None, :], mask=n_ok, other=0.0)
                um = tl.load(min_ptr + up_soff + s_rows + (groups + BLOCK_G)[None, :], mask=n_ok, other=0.0)
            if HAS_NORM:
                g_low = tl.load(nw_ptr + k_low, mask=in_row[:, None], other=0.0).to(tl.float32)
                g_high = tl.load(nw_ptr + k_high, mask=in_row[:, None], other=0.0).to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                x_ok = in_row[:, None] & (k_low * 0 + m < M)
                x_low = tl.load(x_ptr + m * stride_xm + k_low, mask=x_ok, other=0.0).to(tl.float32)
                x_high = tl.load(x_ptr + m * stride_xm + k_high, mask=x_ok, other=0.0).to(tl.float32)
                here = rows == m
                if HAS_NORM:
                    sq = tl.where(here, sq + tl.sum(tl.sum(x_low * x_low + x_high * x_high, axis=1), axis=0), sq)
                    x_low = g_low * x_low
                    x_high = g_high * x_high
                # a block's part of the sum: sum_i (d q_i + m) x_i = d * sum_i q_i x_i + m * sum_i x_i
                x_sum = tl.sum(x_low + x_high, axis=1)  # [BLOCK_G]
                dot = tl.sum(q_low * x_low[None, :, :] + q_high * x_high[None, :, :], axis=2)  # [BLOCK_N, BLOCK_G]
                part = tl.sum(d32 * dot + mn32 * x_sum[None, :], axis=1)
                acc = tl.where(here[:, None], acc + part[None, :], acc)
                if SILU_MUL:
                    dot_up = tl.sum(u_low * x_low[None, :, :] + u_high * x_high[None, :, :], axis=2)
                    part_up = tl.sum(ud32 * dot_up + um32 * x_sum[None, :], axis=1)
                    acc_up = tl.where(here[:, None], acc_up + part_up[None, :], acc_up)
        if HAS_NORM:
            rstd = (1.0 / tl.sqrt(sq / K + eps))[:, None]
            acc = acc * rstd
            if SILU_MUL:
                acc_up = acc_up * rstd
        y = acc.to(dtype)
        if SILU_MUL:
            gate = y.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
            y = (act.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
        ok = row_ok[:, None] & col_ok[None, :]
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=ok, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], y, mask=ok)


def choose_config4(m: int, n: int, k: int, silu_mul: bool = False) -> dict:
    """The tile: at one row, the fastest of a sweep on the H200 at Qwen3-0.6B's shapes (docs/data/bench_step29.py,
    h200_step29_gemv.txt): 16 columns a program for the wide projections (qkv, gate_up, lm_head), 4 for the narrow
    ones (o, down, 1,024 columns: 256 programs), whole rows of 1,024 inputs a trip, fewer for gate_up (two weights
    a program) and lm_head."""
    bm = triton.next_power_of_2(max(m, 1))
    bg = 8 if n >= 16384 else 16 if silu_mul else 32
    bg = min(bg, triton.next_power_of_2(max(k // GROUP, 1)))
    return {"BLOCK_M": bm, "BLOCK_N": 16 if n >= 3072 else 4, "BLOCK_G": bg, "num_warps": 4}


def gemv4(x: torch.Tensor, weight, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
          residual: torch.Tensor | None = None, silu_mul: bool = False, config: dict | None = None,
          pdl: bool = False) -> torch.Tensor:
    """gemv.py's gemv for a Q4Weight (quant.py): x [M, K] (M <= MAX_ROWS) -> x @ weight.T [M, N], the weight's
    blocks dequantised in registers; norm_weight, silu_mul, residual and pdl as gemv's."""
    if triton is None:
        raise RuntimeError("gemv4 needs Triton (pip install triton); model.py's TorchLayerOps is the torch path")
    n_rows, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"gemv4: x {tuple(x.shape)} must be [M, {k}], contiguous in K")
    if k % GROUP:
        raise ValueError(f"gemv4: K = {k} is not a whole number of {GROUP}-weight blocks")
    m = x.shape[0]
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"gemv4: x has {m} rows; the kernel takes 1 to {MAX_ROWS} (more: a matmul)")
    if silu_mul and n_rows % 2:
        raise ValueError(f"gemv4: silu_mul needs [gate; up], an even row count, not {n_rows}")
    n = n_rows // 2 if silu_mul else n_rows
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"gemv4: norm_weight {tuple(norm_weight.shape)} must be [{k}]")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"gemv4: residual {tuple(residual.shape)} must be [{m}, {n}], contiguous in its columns")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = dict(config or choose_config4(m, n, k, silu_mul))
    _gemv4_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight.packed, weight.scale, weight.minimum, out, residual if residual is not None else out,
        norm_weight if norm_weight is not None else x, m, n, k, eps,
        x.stride(0), weight.packed.stride(0), weight.scale.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0,
        HAS_NORM=norm_weight is not None, SILU_MUL=silu_mul, HAS_RESIDUAL=residual is not None,
        PDL=pdl, **cfg, **({"launch_pdl": True} if pdl else {}))
    return out


if triton is not None:
    @triton.jit
    def _dequantize4_kernel(packed_ptr, scale_ptr, min_ptr, out_ptr, N, K, stride_pn, stride_sn, stride_on,
                            BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
        """Program (row tile, byte tile): d * q + m for BLOCK_N rows and 2 * BLOCK_B inputs, in one pass over the
        blocks, written in the checkpoint's order (low nibbles to 32 g + i, high ones to 32 g + 16 + i)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        bs = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        ok = (rows < N)[:, None] & (bs < K // 2)[None, :]
        group = bs // (_GROUP // 2)
        k_low = group * _GROUP + bs % (_GROUP // 2)
        r64 = rows[:, None].to(tl.int64)
        byte = tl.load(packed_ptr + r64 * stride_pn + bs[None, :], mask=ok, other=0)
        d = tl.load(scale_ptr + r64 * stride_sn + group[None, :], mask=ok, other=0.0).to(tl.float32)
        mn = tl.load(min_ptr + r64 * stride_sn + group[None, :], mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + r64 * stride_on + k_low[None, :], (d * (byte & 0x0F).to(tl.float32) + mn).to(dtype), mask=ok)
        tl.store(out_ptr + r64 * stride_on + (k_low + _GROUP // 2)[None, :], (d * (byte >> 4).to(tl.float32) + mn).to(dtype),
                 mask=ok)


def dequantize4(weight, dtype: torch.dtype) -> torch.Tensor:
    """A Q4Weight as a [N, K] tensor of dtype in one launch (quant.py's Q4Weight.dequantize, the torch reference, is
    several passes over the matrix): the path of a step with more rows than the GEMV takes, before cuBLAS."""
    if triton is None:
        raise RuntimeError("dequantize4 needs Triton; quant.py's Q4Weight.dequantize is the torch path")
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.packed.device)
    block_n, block_b = 16, 64
    _dequantize4_kernel[(triton.cdiv(n, block_n), triton.cdiv(k // 2, block_b))](
        weight.packed, weight.scale, weight.minimum, out, n, k, weight.packed.stride(0), weight.scale.stride(0),
        out.stride(0), BLOCK_N=block_n, BLOCK_B=block_b, num_warps=4)
    return out
