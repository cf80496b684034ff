"""Decode attention over the paged KV cache: one query per sequence against its whole context.

A decode step has, for each of S sequences, one new query token per head. Its K/V are already written to the
cache, so the query attends to all seq_lens[i] tokens of its context (no causal mask: every key is in the past
or is the token itself). The data, as the engine lays it out:

    q             [S, num_heads, head_dim]                   one query per sequence (a view: use its strides)
    k/v_cache     [num_blocks, block_size, kv_heads, head_dim]  one layer's cache (views: only the last dim is
                                                              contiguous)
    block_tables  int32 [S, max_blocks_per_seq]              logical block j of sequence i is the physical
                                                              block block_tables[i, j]
    seq_lens      int32 [S]                                  context length, the current token included (>= 1)

Grouped-query attention (GQA): num_heads = GROUP * kv_heads, and query heads h*GROUP .. h*GROUP + GROUP - 1
all read KV head h.

Three versions of the same math, out = softmax(q·Kᵀ · scale) · V per (sequence, query head):

- decode_reference: plain torch, sequence by sequence. Obviously right; the other two are tested against it.
- paged_decode_v1:  one Triton program per (sequence, query head). The exact softmax in two passes over the
                    context: pass 1 computes every score, writes it to a scratch buffer in global memory and
                    tracks the maximum; pass 2 reads the scores back, exponentiates and accumulates p·V.
                    Easy to follow, but it reads each K/V byte GROUP times (once per query head sharing it) and
                    writes and re-reads a [S, heads, context] buffer of scores.
- paged_decode_v2:  one program per (sequence, KV head) computing all GROUP query heads of that KV head at once,
                    so each K/V byte leaves memory once; a single pass with the online softmax, so no scores are
                    stored. This is the one the engine uses.

All accumulation is in fp32; the output has q's dtype. On the CPU, Triton's interpreter (TRITON_INTERPRET=1) runs
the kernels for fp32 and fp16; v2 refuses bf16 there (the interpreter's tl.dot gets bf16 wrong).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference still works
    triton = None

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)


# --------------------------------------------------------------------------------------------------------------
# Input checks, shared by the wrappers
# --------------------------------------------------------------------------------------------------------------

def _check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens):
    """Raise ValueError with a clear message if the inputs do not have the layout the kernels assume.

    seq_lens' values are not checked (1 <= seq_lens[i] <= max_blocks_per_seq * block_size): that would need a
    GPU -> CPU copy every step.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q's head_dim {head_dim} differs from the cache's {k_cache.shape[3]}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 (tl.arange and tl.dot need it), got {head_dim}")
    if num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of kv_heads ({kv_heads})")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the last dimension (head_dim) of q, k_cache and v_cache must be contiguous")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be int32 [num_seqs={num_seqs}, max_blocks], "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables' rows must be contiguous")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be int32 [num_seqs={num_seqs}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")


def _check_not_interpreted_bf16(dtype):
    """Triton's CPU interpreter (TRITON_INTERPRET=1) stores bfloat16 as raw uint16 and its tl.dot multiplies those
    bit patterns (results ~1e10; triton-lang/triton#11584, "not supported yet"). Refuse rather than return
    garbage; on a GPU bfloat16 is the normal case."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise ValueError("bfloat16 is not supported under TRITON_INTERPRET=1 (the interpreter's tl.dot is wrong "
                         "for it): use float16 or float32 on the CPU")


# --------------------------------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------------------------------

def decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """The same math in plain torch, sequence by sequence: gather the context through the block table, repeat
    each KV head for the GROUP query heads that share it, softmax in fp32. Returns [S, num_heads, head_dim]."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for i in range(num_seqs):
        ctx = int(seq_lens[i])
        blocks = block_tables[i, :-(-ctx // block_size)].long()              # the physical blocks, in order
        keys = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:ctx].float()  # [ctx, kv_heads, D]
        values = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:ctx].float()
        keys = keys.repeat_interleave(group, dim=1)                           # [ctx, num_heads, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i].float(), keys) * scale       # [num_heads, ctx]
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hk,khd->hd", probs, values).to(q.dtype)
    return out


if triton is not None:

    # ----------------------------------------------------------------------------------------------------------
    # v1: one program per (sequence, query head); exact softmax over scores materialised in global memory
    # ----------------------------------------------------------------------------------------------------------

    @triton.jit
    def _decode_v1_kernel(q_ptr, k_ptr, v_ptr, out_ptr, scores_ptr, block_tables_ptr, seq_lens_ptr, scale,
                          stride_qs, stride_qh,
                          stride_kb, stride_kt, stride_kh,
                          stride_vb, stride_vt, stride_vh,
                          stride_os, stride_oh,
                          stride_ss, stride_sh,
                          stride_bt,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """Program (seq, head) computes out[seq, head, :].

        Reads:  q[seq, head, :]; for each logical block b < cdiv(seq_len, BLOCK_SIZE), the physical block
                block_tables[seq, b], and in it K and V of KV head head // GROUP (BLOCK_SIZE x HEAD_DIM each).
        Writes: scores[seq, head, 0:seq_len] (its own row of the scratch buffer), then out[seq, head, :].
        """
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        seq_len = tl.load(seq_lens_ptr + seq)
        num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)

        dims = tl.arange(0, HEAD_DIM)
        slots = tl.arange(0, BLOCK_SIZE)  # the token slots of one cache block
        q = tl.load(q_ptr + seq * stride_qs + head * stride_qh + dims).to(tl.float32)  # [HEAD_DIM]
        scores_row = scores_ptr + seq * stride_ss + head * stride_sh

        # Pass 1: s_j = scale * q·k_j for every context token j, stored to scores_row[j]. We also need
        # max_j s_j. Each of the BLOCK_SIZE lanes keeps the maximum of the scores it has seen (m_lanes);
        # one reduction at the end gives the maximum over all of them.
        m_lanes = tl.full([BLOCK_SIZE], float("-inf"), tl.float32)
        for b in range(0, num_blocks):
            block = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)  # logical -> physical
            pos = b * BLOCK_SIZE + slots  # the tokens' positions in the sequence
            valid = pos < seq_len         # the last block may be partly filled
            k = tl.load(k_ptr + block * stride_kb + slots[:, None] * stride_kt + kv_head * stride_kh
                        + dims[None, :], mask=valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_SIZE, HEAD_DIM]
            s = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_SIZE]: one dot product per key
            s = tl.where(valid, s, float("-inf"))
            tl.store(scores_row + pos, s, mask=valid)
            m_lanes = tl.maximum(m_lanes, s)
        m = tl.max(m_lanes, axis=0)  # the maximum score

        # Pass 2 reads what pass 1 wrote. The threads that read scores_row[j] need not be the ones that wrote
        # it, so all of the program's threads must finish their stores first: a barrier (__syncthreads).
        tl.debug_barrier()

        # Pass 2: p_j = exp(s_j - m) (<= 1, so no overflow), l = sum_j p_j, acc = sum_j p_j * v_j.
        l_lanes = tl.zeros([BLOCK_SIZE], tl.float32)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for b in range(0, num_blocks):
            block = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)
            pos = b * BLOCK_SIZE + slots
            valid = pos < seq_len
            s = tl.load(scores_row + pos, mask=valid, other=float("-inf"))
            p = tl.exp(s - m)  # exp(-inf) = 0 for the empty slots
            l_lanes += p
            v = tl.load(v_ptr + block * stride_vb + slots[:, None] * stride_vt + kv_head * stride_vh
                        + dims[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            acc += tl.sum(p[:, None] * v, axis=0)  # [HEAD_DIM]
        l = tl.sum(l_lanes, axis=0)
        out = acc / tl.where(l > 0, l, 1.0)  # l > 0 whenever seq_len >= 1; an empty sequence gives 0, not NaN
        tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))

    # ----------------------------------------------------------------------------------------------------------
    # v2: one program per (sequence, KV head), all GROUP query heads at once, online softmax in one pass
    # ----------------------------------------------------------------------------------------------------------

    @triton.jit
    def _decode_v2_kernel(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, qk_scale,
                          stride_qs, stride_qh,
                          stride_kb, stride_kt, stride_kh,
                          stride_vb, stride_vt, stride_vh,
                          stride_os, stride_oh,
                          stride_bt,
                          GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Program (seq, kv_head) computes out[seq, kv_head*GROUP + g, :] for g in 0..GROUP-1.

        Reads:  q of those GROUP heads; then the context in tiles of BLOCK_N tokens: for each token its physical
                slot via block_tables[seq, pos // BLOCK_SIZE], and there K and V of kv_head. Each K/V byte of
                (seq, kv_head) is read by this program only, once.
        Writes: the GROUP output rows.

        The GROUP query rows form the M side of two small matrix products per tile, S = Q·Kᵀ and P·V. tl.dot
        needs M >= 16, so the rows are padded to BLOCK_G (a power of two >= 16); the padded rows load q = 0,
        compute harmless finite values, and are never stored. qk_scale = scale * log2(e): the softmax runs in
        base 2 (exp2 is one hardware instruction; exp(x) = exp2(x * log2 e)), so m below is in base-2 units.
        """
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + seq)

        rows = tl.arange(0, BLOCK_G)      # query heads of this KV head (padded)
        dims = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)    # the tokens of one tile
        heads = kv_head * GROUP + rows
        row_ok = rows < GROUP
        q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)  # [BLOCK_G, HEAD_DIM]

        # Online softmax state, per query row: m = max score so far, l = sum of exp2(s - m) so far,
        # acc = sum of exp2(s - m) * v so far. All three describe the keys seen so far relative to the current m.
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)

        for start in range(0, seq_len, BLOCK_N):
            pos = start + offs_n
            valid = pos < seq_len  # only the last tile has invalid tokens; its first token is always valid
            # A tile may span several cache blocks (BLOCK_N > BLOCK_SIZE) or part of one (BLOCK_N < BLOCK_SIZE):
            # look up each token's own physical block.
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0)
            k_rows = block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
            v_rows = block.to(tl.int64) * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
            k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
            v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]

            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N], base 2
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every tile holds at least one valid token
            # The old l and acc are relative to the old maximum: rescale them to the new one.
            # exp2(m - m_new) <= 1; on the first tile m = -inf and it is 0 (l and acc are 0 anyway).
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_G, BLOCK_N], 0 for the invalid tokens
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new

        out = acc / tl.where(l > 0, l, 1.0)[:, None]  # seq_len == 0 would give l == 0: write 0, not NaN
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _require_triton():
    if triton is None:
        raise RuntimeError("Triton is not installed: only decode_reference is available")


def paged_decode_v1(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Decode attention, v1: grid (num_seqs, num_heads), exact two-pass softmax through a scratch buffer.

    The scratch buffer is fp32 [num_seqs, num_heads, max_blocks_per_seq * block_size]: room for every score of
    the longest context the block table can describe (no GPU -> CPU copy of seq_lens needed to size it).
    block_size must be a power of two (one tl.arange over a block's slots). Returns [num_seqs, num_heads, D].
    """
    _require_triton()
    _check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if block_size & (block_size - 1):
        raise ValueError(f"paged_decode_v1 needs a power-of-two block_size, got {block_size}")
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    max_context = block_tables.shape[1] * block_size
    scores = torch.empty(num_seqs, num_heads, max_context, dtype=torch.float32, device=q.device)
    _decode_v1_kernel[(num_seqs, num_heads)](
        q, k_cache, v_cache, out, scores, block_tables, seq_lens, float(scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        scores.stride(0), scores.stride(1),
        block_tables.stride(0),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        num_warps=4)
    return out


def paged_decode_v2(q, k_cache, v_cache, block_tables, seq_lens, scale, block_n=64, num_warps=4, num_stages=3):
    """Decode attention, v2: grid (num_seqs, kv_heads), all GROUP query heads of a KV head in one program,
    single pass with the online softmax. Returns [num_seqs, num_heads, head_dim] in q's dtype.

    block_n (keys per loop iteration, a power of two >= 16), num_warps and num_stages default to 64 / 4 / 3:
    a [64, head_dim] K tile and V tile (16 KB each in bf16 at head_dim 128) per iteration; with num_stages=3
    Triton's software pipeline copies the next tile's K/V into shared memory while this one is computed, and
    the block-table entries two tiles ahead (about 39 KB of shared memory and ~100 registers per thread on
    sm_90, so 4+ programs fit on one SM: batch 64 x 8 KV heads = 512 programs is one wave on 132 SMs).
    A benchmark may pass others.
    """
    _require_triton()
    _check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    _check_not_interpreted_bf16(q.dtype)
    num_seqs, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    _decode_v2_kernel[(num_seqs, kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, float(scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        # fp32 inputs: exact fp32 products (the default would round them to tf32 on the tensor cores).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    return out
