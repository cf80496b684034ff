"""Decode attention over the paged cache of latents (DeepSeek's multi-head latent attention, the absorbed path).

A latent-attention model caches, per token and layer, one row: the normalised latent c (kv_lora_rank = C values)
and the roped key dims k_rope (qk_rope_head_dim = R values), shared by every head. A decode's query has absorbed
W_UK already (model.py, attention.py's latent_absorbed): per head, q_latent [C] meets the latents and q_rope [R]
the roped dims, and the output is a mix of latents [C] (W_UV comes after, outside the kernel):

    score_j = (q_latent . c_j + q_rope . k_rope_j) * scale        out = sum_j softmax(score)_j * c_j

Every head reads the same row j: a multi-query attention whose key is the whole row and whose value is its first C
values. The data, as the engine lays it out:

    q_latent      [S, heads, C]                             one query per sequence (strides used)
    q_rope        [S, heads, R]
    cache         [num_blocks, block_size, 1, C + R]        one layer's cache (only the last dim contiguous)
    block_tables  int32 [S, max_blocks]                     logical block j of sequence i: block_tables[i, j]
    seq_lens      int32 [S]                                 context length, the current token included (>= 1)

The kernel (latent_decode): a program per (sequence, block of BLOCK_H heads, split). Each tile of BLOCK_N tokens is
loaded once for all the program's heads (the point of the absorbed path: the bytes read are the rows, not a key and
a value per head), two tl.dot for the scores, one for the output, online softmax in base 2, fp32 state. With
num_splits > 1 the context is cut as flash decoding cuts it (kernels/decode.py: whole tiles per split, an empty
split stores m = -inf, l = 0) and decode.py's merge kernel merges the parts by log-sum-exp, unchanged: a part here
is a C-wide accumulator where there it is a head_dim-wide one. latent_decode_reference is the plain torch version the
kernel is tested against. On the CPU, Triton's interpreter (TRITON_INTERPRET=1) runs it for fp32 and fp16.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference still works
    triton = None

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)


def latent_decode_reference(q_latent, q_rope, cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """Plain torch, sequence by sequence: -> [S, heads, C] in q's dtype (fp32 inside)."""
    C = q_latent.shape[-1]
    block_size = cache.shape[1]
    out = torch.empty_like(q_latent)
    for i, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, :-(-n // block_size)].long()
        rows = cache[blocks].reshape(-1, cache.shape[-1])[:n].float()  # [n, C + R]
        scores = (q_latent[i].float() @ rows[:, :C].T + q_rope[i].float() @ rows[:, C:].T) * scale  # [heads, n]
        out[i] = (torch.softmax(scores, dim=-1) @ rows[:, :C]).to(out.dtype)
    return out


def _check(q_latent, q_rope, cache, block_tables, seq_lens):
    S, heads, C = q_latent.shape
    R = q_rope.shape[-1]
    if q_rope.shape[:2] != (S, heads):
        raise ValueError(f"q_rope is {tuple(q_rope.shape)}, q_latent {tuple(q_latent.shape)}: the same [S, heads]")
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != C + R:
        raise ValueError(f"cache must be [num_blocks, block_size, 1, {C + R}] (the latent and the roped dims), got "
                         f"{tuple(cache.shape)}")
    if cache.stride(-1) != 1 or q_latent.stride(-1) != 1 or q_rope.stride(-1) != 1:
        raise ValueError("the last dim of cache, q_latent and q_rope must be contiguous")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or len(seq_lens) != S:
        raise ValueError("block_tables and seq_lens must be int32, one row / entry per sequence")
    if cache.dtype != q_latent.dtype or q_rope.dtype != q_latent.dtype:
        raise ValueError(f"q_latent, q_rope and the cache must share a dtype, got {q_latent.dtype}, {q_rope.dtype}, "
                         f"{cache.dtype}")


if triton is not None:

    @triton.jit
    def _latent_split_kernel(ql_ptr, qr_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                             block_tables_ptr, seq_lens_ptr, qk_scale, num_splits, heads,
                             stride_qls, stride_qlh, stride_qrs, stride_qrh,
                             stride_cb, stride_ct,
                             stride_os, stride_oh,
                             stride_ms, stride_mh,                # part_m and part_l: [S, heads, splits]
                             stride_as, stride_ah, stride_ap,     # part_acc: [S, heads, splits, C]
                             stride_bt,
                             C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                             DIRECT: tl.constexpr):
        """Program (seq, head block, split): the online softmax of heads hb * BLOCK_H .. + BLOCK_H - 1 over one
        range of seq's context (whole tiles, as flash decoding cuts it). Reads q of its heads and each row of the range
        once; writes the normalised output (DIRECT: one split) or its part (m in base-2 units, l, acc [C])."""
        seq = tl.program_id(0)
        head_block = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq)
        num_tiles = tl.cdiv(seq_len, BLOCK_N)
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        first_tile = split * tiles_per_split
        end_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)

        rows = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        row_ok = rows < heads  # padding rows (for tl.dot's 16) are computed, never stored
        dims_c, dims_r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
        c_ok, r_ok = dims_c < C, dims_r < R
        offs_n = tl.arange(0, BLOCK_N)
        q_lat = tl.load(ql_ptr + seq * stride_qls + rows[:, None] * stride_qlh + dims_c[None, :],
                        mask=row_ok[:, None] & c_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_C]
        q_rope = tl.load(qr_ptr + seq * stride_qrs + rows[:, None] * stride_qrh + dims_r[None, :],
                         mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]

        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        for start in range(first_tile * BLOCK_N, end_tile * BLOCK_N, BLOCK_N):
            pos = start + offs_n
            valid = pos < seq_len
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0)
            at = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct  # each row's first element
            latents = tl.load(cache_ptr + at[:, None] + dims_c[None, :], mask=valid[:, None] & c_ok[None, :],
                              other=0.0)  # [BLOCK_N, BLOCK_C]: the keys' latent part, and the values
            k_rope = tl.load(cache_ptr + at[:, None] + C + dims_r[None, :], mask=valid[:, None] & r_ok[None, :],
                             other=0.0)  # [BLOCK_N, BLOCK_R]
            s = tl.dot(q_lat, tl.trans(latents)) + tl.dot(q_rope, tl.trans(k_rope))  # [BLOCK_H, BLOCK_N]
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(latents.dtype), latents)
            m = m_new

        if DIRECT:
            out = acc / tl.where(l > 0, l, 1.0)[:, None]
            tl.store(out_ptr + seq * stride_os + rows[:, None] * stride_oh + dims_c[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])
        else:
            tl.store(part_m_ptr + seq * stride_ms + rows * stride_mh + split, m, mask=row_ok)
            tl.store(part_l_ptr + seq * stride_ms + rows * stride_mh + split, l, mask=row_ok)
            tl.store(part_acc_ptr + seq * stride_as + rows[:, None] * stride_ah + split * stride_ap + dims_c[None, :],
                     acc, mask=row_ok[:, None] & c_ok[None, :])


def latent_decode(q_latent, q_rope, cache, block_tables, seq_lens, scale, num_splits: int = 1, block_n: int = 32,
                  block_h: int = 16, num_warps: int = 4) -> torch.Tensor:
    """The kernel: -> [S, heads, C] in q's dtype. num_splits > 1: flash decoding's parts, merged by
    kernels/decode.py's merge kernel (its head_dim: C, a power of two)."""
    from .decode import _check_not_interpreted_bf16, _flash_decode_merge_kernel

    _check(q_latent, q_rope, cache, block_tables, seq_lens)
    _check_not_interpreted_bf16(q_latent.dtype)
    S, heads, C = q_latent.shape
    R = q_rope.shape[-1]
    if C & (C - 1):
        raise ValueError(f"latent_decode: kv_lora_rank must be a power of two (the merge's tile), got {C}")
    block_c, block_r = triton.next_power_of_2(C), max(16, triton.next_power_of_2(R))
    out = torch.empty_like(q_latent)
    direct = num_splits == 1
    if direct:  # no parts: the output written by the split kernel itself
        part_m = part_l = part_acc = out
        sm = sa = (0, 0, 0)
    else:
        part_m = torch.empty(S, heads, num_splits, device=q_latent.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(S, heads, num_splits, C, device=q_latent.device, dtype=torch.float32)
        sm, sa = part_m.stride(), part_acc.stride()
    grid = (S, triton.cdiv(heads, block_h), num_splits)
    _latent_split_kernel[grid](
        q_latent, q_rope, cache, out, part_m, part_l, part_acc, block_tables, seq_lens, scale * LOG2E, num_splits,
        heads, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        cache.stride(0), cache.stride(1), out.stride(0), out.stride(1), sm[0], sm[1], sa[0], sa[1], sa[2],
        block_tables.stride(0), C=C, R=R, BLOCK_C=block_c, BLOCK_R=block_r, BLOCK_H=block_h,
        BLOCK_SIZE=cache.shape[1], BLOCK_N=block_n, DIRECT=direct, num_warps=num_warps)
    if not direct:
        _flash_decode_merge_kernel[(S, heads)](
            part_m, part_l, part_acc, out, num_splits, sm[0], sm[1], sa[0], sa[1], sa[2], out.stride(0),
            out.stride(1), HEAD_DIM=C, BLOCK_P=triton.next_power_of_2(num_splits))
    return out
