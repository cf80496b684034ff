"""Fused elementwise kernels, in Triton, next to the torch code they replace (model.py's TorchLayerOps).

Between its matmuls and its attention, a layer runs small operators: RMSNorm alone is six (square, mean, add eps,
rsqrt, two multiplies, plus dtype casts), RoPE five per tensor (neg, cat, two multiplies, add), the MLP's SiLU and
its multiply two. Each reads its input from the GPU's memory and writes its output back, and each is one kernel
launch. On a decode step a launch does almost no work, so the layer's time is the launches: the host is what the GPU
waits for. Each kernel here does one of those groups in one pass: read the inputs once, do every operator in
registers, write the outputs once.

    add_rms_norm   residual add + RMSNorm: x + residual -> the new residual and its normalised copy, one pass
    silu_mul       SiLU(gate) * up over the [N, 2 * intermediate] output of the gate/up matmul
    quantize_write_kv  an int8 cache's write, K and V of every new token quantised (a scale per token and KV
                   head) and stored at their slots with their scales, one launch for both (model.py's write_kv is the
                   torch path: about ten operators for each of K and V)
    qk_norm_rope   Qwen3's per-head RMSNorm of q and k (Llama has none), then RoPE, on the q and k heads of the qkv
                   matmul's output viewed as [N, heads + kv_heads, head_dim]: one program per token, every head.
                   With the cache given, it also stores the token's rotated K and its V at the token's slot
                   (what model.py's write_kv does in two scatters), and returns q only

TritonLayerOps.linear, a projection with its norm, activation and residual, runs kernels/gemv.py's kernel
for a step of one row on CUDA (gemv_max_rows); a larger step runs cuBLAS beside the kernels here.

Each rounds where the torch code rounds (to the model's dtype after every operator that torch runs in it), so the
fused path gives the same numbers as the unfused one, up to the order of a sum.
"""
from __future__ import annotations

import torch

from ..linear import method_of
from .gemv import gdc_launch_dependents, gdc_wait, pdl_supported

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the torch path (model.py's TorchLayerOps) still works
    triton = None


if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, n_cols, eps,
                             stride_x, stride_r, stride_o, stride_n,
                             HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        """One row per program: s = x + residual (rounded to the dtype, stored as the new residual), then
        out = weight * (s / rms(s)), the rms over the row in fp32."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        s = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)  # the add, rounded as torch's
            tl.store(new_res_ptr + row * stride_n + cols, s, mask=ok)
        s32 = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(s32 * s32, axis=0) / n_cols + eps)
        normed = (s32 * rstd).to(out_ptr.dtype.element_ty)  # torch rounds the normalised row, then scales it
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=ok)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, stride_g, stride_o, BLOCK: tl.constexpr):
        """Program (row, column tile): out = silu(gate) * up, gate and up the two halves of the row."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        gate = tl.load(gu_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * stride_g + n_cols + cols, mask=ok, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)  # torch's silu, rounded to the dtype
        tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=ok)

    @triton.jit
    def _to_fp8_range(x, scale):
        """x / scale in fp32, rounded to the nearest float8 e4m3 value (ties to even) and saturated at +-448,
        still as fp32: quant.py's quantize_fp8 (torch's cast), so that the store's conversion has nothing left to
        round. e4m3 keeps 3 bits of mantissa: a normal value (|y| >= 2^-6) is rounded by adding half of the dropped
        20 bits' range (and the kept last bit, for ties to even) to its fp32 bits and clearing them, a carry moving
        into the exponent as it should; below 2^-6 e4m3's steps are 2^-9, and adding then subtracting 1.5 * 2^14
        (whose fp32 steps are 2^-9) rounds |y| to them."""
        y = x.to(tl.float32) / scale
        bits = y.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 = 0xFFF00000: sign, exponent, 3 bits
        normal = rounded.to(tl.float32, bitcast=True)
        # the sign put back by its bit, so that a negative value rounded to zero stays -0 as torch's cast keeps it
        # (a negation compiled as 0 - x would give +0)
        small = ((tl.abs(y) + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -2147483648)
        r = tl.where(tl.abs(y) < 0.015625, small.to(tl.float32, bitcast=True), normal)
        return tl.minimum(tl.maximum(r, -448.0), 448.0)

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, out_ptr, eps,
                             stride_t, stride_c, stride_o, stride_oh,
                             slot_ptr, kc_ptr, vc_ptr, stride_cs, stride_ch, k_scale, v_scale,
                             NUM_HEADS: tl.constexpr, NUM_QK: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr, WRITE_KV: tl.constexpr,
                             KV_HEADS: tl.constexpr, BLOCK_KV: tl.constexpr, PDL: tl.constexpr = False,
                             FP8_KV: tl.constexpr = False):
        """One program per token, all its heads + kv_heads q and k heads at once ([BLOCK_H, HEAD_DIM / 2] tiles of
        each half): RMSNorm of each head over head_dim with q's or k's weight (when HAS_NORM), then the rotation of
        each (first half, second half) pair by the token's angle."""
        if PDL:  # launched before the qkv projection ends: let the next kernel start, then wait for qkv
            gdc_launch_dependents()
            gdc_wait()
        token = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)[:, None]  # one row per head
        half = tl.arange(0, HEAD_DIM // 2)[None, :]
        ok = heads < NUM_QK
        src = qkv_ptr + token * stride_t + heads * HEAD_DIM + half
        x1 = tl.load(src, mask=ok, other=0.0)  # the first half of every head
        x2 = tl.load(src + HEAD_DIM // 2, mask=ok, other=0.0)  # the second half
        dtype = x1.dtype
        if HAS_NORM:
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM + eps)[:, None]
            is_q = heads < NUM_HEADS  # q's heads come first, then k's
            w1 = tl.where(is_q, tl.load(qw_ptr + half), tl.load(kw_ptr + half)).to(tl.float32)
            w2 = tl.where(is_q, tl.load(qw_ptr + HEAD_DIM // 2 + half), tl.load(kw_ptr + HEAD_DIM // 2 + half))
            x1 = (w1 * (a * rstd).to(dtype).to(tl.float32)).to(dtype)  # rounded where torch's rms_norm rounds
            x2 = (w2.to(tl.float32) * (b * rstd).to(dtype).to(tl.float32)).to(dtype)
        # cos/sin rows repeat their first half in their second (model.py's rope_cos_sin): read the first half only
        c = tl.load(cos_ptr + token * stride_c + half).to(tl.float32)
        s = tl.load(sin_ptr + token * stride_c + half).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded as torch rounds it: first half a*c - b*s, second b*c + a*s
        out1 = ((a * c).to(dtype).to(tl.float32) + (-b * s).to(dtype).to(tl.float32)).to(dtype)
        out2 = ((b * c).to(dtype).to(tl.float32) + (a * s).to(dtype).to(tl.float32)).to(dtype)
        dst = out_ptr + token * stride_o + heads * stride_oh + half
        if WRITE_KV:  # q to the output; k and v to the cache at the token's slot
            is_k = ok & (heads >= NUM_HEADS)
            tl.store(dst, out1, mask=ok & (heads < NUM_HEADS))
            tl.store(dst + HEAD_DIM // 2, out2, mask=ok & (heads < NUM_HEADS))
            slot = tl.load(slot_ptr + token).to(tl.int64)
            kdst = kc_ptr + slot * stride_cs + (heads - NUM_HEADS) * stride_ch + half
            kv = tl.arange(0, BLOCK_KV)[:, None]
            dims = tl.arange(0, HEAD_DIM)[None, :]
            v = tl.load(qkv_ptr + token * stride_t + (NUM_QK + kv) * HEAD_DIM + dims, mask=kv < KV_HEADS, other=0.0)
            if FP8_KV:  # quant.py's quantize_fp8, x / scale saturated at +-448, rounded to e4m3 by the store
                out1 = _to_fp8_range(out1, k_scale)
                out2 = _to_fp8_range(out2, k_scale)
                v = _to_fp8_range(v, v_scale)
            tl.store(kdst, out1.to(kc_ptr.dtype.element_ty), mask=is_k)
            tl.store(kdst + HEAD_DIM // 2, out2.to(kc_ptr.dtype.element_ty), mask=is_k)
            tl.store(vc_ptr + slot * stride_cs + kv * stride_ch + dims, v.to(vc_ptr.dtype.element_ty),
                     mask=kv < KV_HEADS)
        else:
            tl.store(dst, out1, mask=ok)
            tl.store(dst + HEAD_DIM // 2, out2, mask=ok)

    @triton.jit
    def _quantize_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
                               stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch, stride_ss,
                               KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
        """Program (token, 0 for K or 1 for V): the token's kv_heads rows, each quantised by its own absmax
        (scale = max|x| / 127, q = round-half-even(x / scale), as torch.round), stored at the token's slot."""
        token = tl.program_id(0).to(tl.int64)
        is_v = tl.program_id(1)
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, HEAD_DIM)[None, :]
        ok = heads < KV_HEADS
        slot = tl.load(slot_ptr + token).to(tl.int64)
        src = tl.where(is_v == 1, v_ptr + token * stride_vt + heads * stride_vh,
                       k_ptr + token * stride_kt + heads * stride_kh)
        x = tl.load(src + dims, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_H, HEAD_DIM]
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)  # [BLOCK_H]
        y = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])  # a zero row: 0 / 1 = 0
        f = tl.floor(y)
        odd = f - 2.0 * tl.floor(f * 0.5)  # 1.0 where f is odd: a tie (d == 0.5) goes to the even neighbour
        d = y - f
        q = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + odd))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)
        dst = tl.where(is_v == 1, vc_ptr, kc_ptr) + slot * stride_cs + heads * stride_ch + dims
        tl.store(dst, q, mask=ok)
        scales = tl.where(is_v == 1, vs_ptr, ks_ptr) + slot * stride_ss + tl.arange(0, BLOCK_H)
        tl.store(scales, scale, mask=tl.arange(0, BLOCK_H) < KV_HEADS)


def _need_triton(name: str):
    if triton is None:
        raise RuntimeError(f"{name} needs Triton (pip install triton); model.py's TorchLayerOps is the torch path")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """x [N, H] (+ residual [N, H]) -> (rms_norm(x + residual) [N, H], x + residual [N, H]), one launch.
    Without a residual: (rms_norm(x), x)."""
    _need_triton("add_rms_norm")
    if x.dim() != 2 or x.stride(1) != 1 or (residual is not None and (residual.shape != x.shape or residual.stride(1) != 1)):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual must be [N, H], contiguous in H")
    n, h = x.shape
    out = torch.empty_like(x)
    new_res = torch.empty_like(x) if residual is not None else x
    if n:
        _add_rms_norm_kernel[(n,)](x, residual if residual is not None else x, weight, out, new_res, h, eps,
                                   x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0),
                                   new_res.stride(0), HAS_RESIDUAL=residual is not None,
                                   BLOCK=triton.next_power_of_2(h), num_warps=4 if h <= 2048 else 8)
    return out, new_res


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2 * I] (gate, then up) -> silu(gate) * up [N, I], one launch."""
    _need_triton("silu_mul")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)} must be [N, 2 * I], contiguous in its columns")
    n, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, i), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(i))
    if n:
        _silu_mul_kernel[(n, triton.cdiv(i, block))](gate_up, out, i, gate_up.stride(0), out.stride(0), BLOCK=block,
                                                      num_warps=4)
    return out


def qk_norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, num_heads: int, num_kv_heads: int, head_dim: int,
                 k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None, pdl: bool = False, k_scale: float | None = None,
                 v_scale: float | None = None):
    """qkv [N, (heads + 2 * kv_heads) * head_dim], cos/sin [N, head_dim] -> q [N, heads, head_dim], k [N, kv_heads,
    head_dim]: normalised (when the weights are given) and rotated, one launch for both (views of one output).
    With k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim] (the model's dtype) and slot_mapping
    [N], K and V are stored at each token's slot in the same launch, and only q is returned. pdl: launched as a
    programmatic dependent (gemv.py's pdl_supported). A float8 e4m3 cache with its layer's k_scale and
    v_scale (floats): K and V stored as quant.py's quantize_fp8 stores them."""
    _need_triton("qk_norm_rope")
    n = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qk_norm_rope: qkv {tuple(qkv.shape)} must be [N, (heads + 2 * kv_heads) * head_dim]")
    if head_dim & (head_dim - 1) or cos.shape != (n, head_dim) or sin.stride() != cos.stride() or cos.stride(1) != 1:
        raise ValueError(f"qk_norm_rope: head_dim {head_dim} must be a power of two and cos/sin [N, head_dim]")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: give both norm weights (Qwen3) or neither (Llama)")
    write = k_cache is not None
    fp8 = write and k_cache.dtype == torch.float8_e4m3fn
    if fp8 and not all(isinstance(x, (int, float)) and x > 0 for x in (k_scale, v_scale)):
        raise ValueError(f"qk_norm_rope: a float8 cache needs k_scale and v_scale as positive floats, got {k_scale!r} "
                         f"and {v_scale!r}")
    if write and (v_cache is None or slot_mapping is None or k_cache.dtype not in (qkv.dtype, torch.float8_e4m3fn)
                  or v_cache.dtype != k_cache.dtype
                  or k_cache.stride() != v_cache.stride() or k_cache.shape[2:] != (num_kv_heads, head_dim)
                  or k_cache.stride(3) != 1 or slot_mapping.shape != (n,)):
        raise ValueError(f"qk_norm_rope: the caches must be [blocks, block_size, {num_kv_heads}, {head_dim}] of "
                         f"{qkv.dtype} (or float8_e4m3fn), with one stride, and slot_mapping [{n}]")
    out = torch.empty((n, num_heads + num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    has_norm = q_weight is not None
    if n:
        _qk_norm_rope_kernel[(n,)](
            qkv, cos, sin, q_weight if has_norm else qkv, k_weight if has_norm else qkv, out, eps,
            qkv.stride(0), cos.stride(0), out.stride(0), out.stride(1),
            slot_mapping if write else qkv, k_cache if write else qkv, v_cache if write else qkv,
            k_cache.stride(1) if write else 0, k_cache.stride(2) if write else 0,
            float(k_scale) if fp8 else 1.0, float(v_scale) if fp8 else 1.0,
            NUM_HEADS=num_heads, NUM_QK=num_heads + num_kv_heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads), HAS_NORM=has_norm, WRITE_KV=write,
            KV_HEADS=num_kv_heads, BLOCK_KV=triton.next_power_of_2(num_kv_heads), PDL=pdl, FP8_KV=fp8, num_warps=4,
            **({"launch_pdl": True} if pdl else {}))
    if write:
        return out[:, :num_heads]
    return out[:, :num_heads], out[:, num_heads:]


def quantize_write_kv(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    """k, v [N, kv_heads, head_dim] -> quantised into the int8 cache layers k_cache, v_cache [num_blocks, block_size,
    kv_heads, head_dim] at slot_mapping [N], their scales into k_scale, v_scale [num_blocks, block_size, kv_heads]:
    model.py's write_kv(cache, slots, new, scale) for K and for V, in one launch."""
    _need_triton("quantize_write_kv")
    n, kv_heads, head_dim = k.shape
    if v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1 or k_cache.dtype != torch.int8:
        raise ValueError(f"quantize_write_kv: k {tuple(k.shape)}, v {tuple(v.shape)} must match, contiguous in "
                         f"head_dim, into int8 caches (got {k_cache.dtype})")
    if k_cache.stride() != v_cache.stride() or k_scale.stride() != v_scale.stride() or k_cache.stride(3) != 1:
        raise ValueError("quantize_write_kv: K and V caches (and their scales) must share strides")
    if n:
        _quantize_write_kernel[(n, 2)](
            k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), k_cache.stride(1), k_cache.stride(2), k_scale.stride(1),
            KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads), num_warps=4)


class TritonLayerOps:
    """The model's elementwise groups as the kernels above, one launch each; `launches` counts them."""

    name = "triton"
    # the most rows a step may have for its projections to run the GEMV kernel. The kernel takes up to
    # gemv.MAX_ROWS, but on the H200 it beat cuBLAS only at one row (docs/data/raw/h200_step28_gemv.txt): from 2 rows
    # on, cuBLAS's tensor-core GEMM reads the weight once for all rows as the kernel does, and faster.
    gemv_max_rows = 1
    # the same for a layer of 4-bit blocks, where the path above it dequantises the layer first. On the H200
    # (docs/data/raw/h200_step29_gemv.txt) the 4-bit GEMV beat dequantise + cuBLAS on every projection at 1, 2 and 4
    # rows and lost on every one at 8: its time grows with the rows, the other path's does not.
    gemv4_max_rows = 4

    def __init__(self):
        self.launches = 0
        # the devices where a step of few rows runs the GEMV kernel (a test adds "cpu", under Triton's
        # interpreter: there it would make every token take minutes on a real model)
        self.gemv_devices = {"cuda"}
        self.pdl = None  # whether the GEMV launches as a programmatic dependent (pdl_supported), per device

    def uses_pdl(self, device) -> bool:
        """Whether this device launches the GEMV and q/k norm + RoPE kernels as programmatic dependents."""
        if self.pdl is None:
            self.pdl = pdl_supported(device)
        return self.pdl

    def add_rms_norm(self, x, residual, weight, eps):
        self.launches += 1
        return add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up):
        self.launches += 1
        return silu_mul(gate_up)

    def qk_norm_rope(self, qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim):
        self.launches += 1
        return qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)

    def qk_norm_rope_write(self, qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim,
                           k_cache, v_cache, k_scale, v_scale, slot_mapping):
        """One launch for q/k norm, RoPE and the cache write (an int8 cache: a second, quantising one; a float8
        cache is written by the same one launch)."""
        if k_cache.dtype == torch.int8:
            q, k = self.qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)
            v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(qkv.shape[0], num_kv_heads, head_dim)
            self.write_kv_int8(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
            return q
        self.launches += 1
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        return qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim,
                            k_cache, v_cache, slot_mapping, pdl=self.uses_pdl(qkv.device),
                            k_scale=k_scale if fp8 else None, v_scale=v_scale if fp8 else None)

    def linear(self, x, weight, norm_weight=None, eps=1e-6, residual=None, silu_mul=False):
        """model.py's TorchLayerOps.linear, the weight's format's way (linear.py). With at most its gemv_rows rows on
        CUDA: one GEMV kernel with the norm in its prologue and the activation or the add in its epilogue. Otherwise
        the norm kernel, the format's matmul (cuBLAS, adding the residual itself on CUDA) and the SiLU * up kernel."""
        method = method_of(weight)
        if x.device.type in self.gemv_devices and x.shape[0] <= method.gemv_rows(self):
            self.launches += 1
            return method.gemv(x, weight, norm_weight, eps, residual, silu_mul, pdl=self.uses_pdl(x.device))
        if norm_weight is not None:
            x = self.add_rms_norm(x, None, norm_weight, eps)[0]
        if residual is not None and not silu_mul:
            return method.matmul(x, weight, self, residual)
        y = method.matmul(x, weight, self)
        if silu_mul:
            y = self.silu_mul(y)
        return y + residual if residual is not None else y

    def experts(self, h, weights, chosen, gate_up, down):
        """A mixture of experts' MLP after its router (model.py's TorchLayerOps.expert_loop, the loop over the
        experts) as kernels/moe.py's two grouped GEMMs: two launches whatever the experts the tokens chose."""
        from .moe import fused_moe

        self.launches += 2
        self.moe_launches += 2
        return fused_moe(h, weights, chosen, gate_up, down)

    moe_launches = 0  # the grouped GEMMs' launches (two per mixture-of-experts layer)
    expert_matmuls = 0  # the loop's matmuls (TorchLayerOps.expert_loop): none on this path

    def write_kv_int8(self, k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        self.launches += 1
        quantize_write_kv(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
