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

Two versions of the same math, out = softmax(q·Kᵀ · scale) · V per (sequence, query head):

- decode_reference: plain torch, sequence by sequence. Obviously right; the kernels are tested against it.
- flash_decode:     step17's, below: step16's paged_decode_v2 (one program per (sequence, KV head) computing all
                    GROUP query heads of that KV head at once, a single pass with the online softmax) cut into
                    parts of the context, and a merge. The engine runs it for a step of decodes that splits; every
                    other step goes through kernels/attention.py's mixed kernel, so v2 itself is gone (step18).
                    Given counters (decode_counters), the split and the merge are one launch: the last
                    program of each (sequence, KV head) to finish merges its heads (MERGE_LAST).

All accumulation is in fp32; the output has q's dtype. On the CPU, Triton's interpreter (TRITON_INTERPRET=1) runs
the kernels for fp32 and fp16; they refuse bf16 there (the interpreter's tl.dot gets bf16 wrong).

Flash decoding: split each sequence's context across several programs, then merge the parts.

Step16's paged_decode_v2 ran one program per (sequence, KV head). At batch 64 with 8 KV heads that is 512 programs,
plenty for a GPU with 132 multiprocessors (SMs). At batch 1 it is 8 programs: 8 SMs stream the whole context
while the other 124 idle, and the kernel reaches a few percent of the memory bandwidth. Flash decoding adds a
third grid dimension: the context of each sequence is cut into num_splits contiguous ranges, each handled by
its own program. A program computes, for its range only, the online-softmax state of each query head:

    m   = max of the scores in the range            (base 2: scores are scaled by scale * log2(e))
    l   = sum of exp2(s - m) over the range
    acc = sum of exp2(s - m) * v over the range      (a head_dim vector)

and writes it to fp32 scratch buffers. A second, tiny kernel merges the parts of each (sequence, query head)
with the log-sum-exp rule, rescaling every part to the common maximum M:

    M   = max_p m_p
    L   = sum_p l_p * exp2(m_p - M)
    out = sum_p acc_p * exp2(m_p - M) / L

This is exact (the same rescaling the online softmax does between two tiles, done between two parts), so the
result equals the unsplit kernel's up to rounding.

flash_decode also reads an int8 cache. Given k_scale and v_scale ([num_blocks, block_size, kv_heads] fp32, one
scale per token and KV head), the split kernel loads each K/V tile as int8 and converts it to q's dtype (exact: the
values are -127..127); a token's scale is one number for its whole row, so it multiplies the token's column of
scores (after q . k) and of probabilities (before p @ v) instead of its head_dim elements, then goes on as before
(QUANTIZED, a constexpr: without scales it compiles to step17's kernel). The merge kernel never sees K/V and is
unchanged.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference still works
    triton = None

from .gemv import gdc_launch_dependents, gdc_wait
from .attention import FP8, check_scales  # an int8 cache's scales, checked as mixed_attention checks them

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)


# --------------------------------------------------------------------------------------------------------------
# Input checks, shared by the wrappers
# --------------------------------------------------------------------------------------------------------------

def _check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, quantized=False):
    """Raise ValueError with a clear message if the inputs do not have the layout the kernels assume.
    quantized: the caches are int8 (their scales are checked by check_scales), else they have q's dtype.

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
    if not quantized and k_cache.dtype != FP8 and (k_cache.dtype != q.dtype or v_cache.dtype != q.dtype):
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

def decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None):
    """The same math in plain torch, sequence by sequence: gather the context through the block table, repeat
    each KV head for the GROUP query heads that share it, softmax in fp32. Returns [S, num_heads, head_dim].
    An int8 cache (k_scale, v_scale given) is dequantised to q's dtype first, the whole of it; a float8
    cache with its two per-layer floats, likewise."""
    if k_cache.dtype == FP8:
        k_cache = (k_cache.float() * k_scale).to(q.dtype)
        v_cache = (v_cache.float() * v_scale).to(q.dtype)
    elif k_scale is not None:
        k_cache = (k_cache.float() * k_scale[..., None]).to(q.dtype)
        v_cache = (v_cache.float() * v_scale[..., None]).to(q.dtype)
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


# ---- flash decoding -----------------------------------------------------------------------------------------

def choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms=132, min_tokens_per_split=256):
    """How many parts to cut each context into.

    Without splitting the grid has num_seqs * num_kv_heads programs. We want about 2 programs per SM
    (2 * num_sms), so: if the unsplit grid already has that many, return 1 (splitting would only add the merge);
    otherwise cdiv(2 * num_sms, num_seqs * num_kv_heads) splits, but never so many that a split of the longest
    context gets fewer than min_tokens_per_split tokens (a short split spends more on writing and merging its
    partial result than on reading K/V). Always >= 1.

    Examples (132 SMs): batch 64, 8 KV heads -> 512 programs -> 1. Batch 1, 8 KV heads, context 32768 ->
    cdiv(264, 8) = 33 splits of ~1000 tokens. Batch 1, 8 KV heads, context 1024 -> at most 1024 // 256 = 4.
    """
    programs = num_seqs * num_kv_heads
    target = 2 * num_sms
    if programs >= target:
        return 1
    wanted = -(-target // max(programs, 1))
    longest_allowed = max(1, max_seq_len // min_tokens_per_split)
    return max(1, min(wanted, longest_allowed))


if triton is not None:

    @triton.jit
    def _flash_decode_split_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                                   block_tables_ptr, seq_lens_ptr, qk_scale, num_splits,
                                   stride_qs, stride_qh,
                                   stride_kb, stride_kt, stride_kh,
                                   stride_vb, stride_vt, stride_vh,
                                   stride_os, stride_oh,
                                   stride_ms, stride_mh,              # part_m and part_l: [S, heads, splits]
                                   stride_as, stride_ah, stride_ap,   # part_acc: [S, heads, splits, D]
                                   stride_bt,
                                   k_scale_ptr, v_scale_ptr, stride_sb, stride_st, stride_sh,  # int8: the scales
                                   counter_ptr, num_kv_heads,         # MERGE_LAST's arrival counters
                                   out_scale,                         # a float8 cache's v_scale
                                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                                   DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr, QUANTIZED: tl.constexpr,
                                   MERGE_LAST: tl.constexpr = False, BLOCK_P: tl.constexpr = 1,
                                   GROUP_P: tl.constexpr = 1, PDL: tl.constexpr = False, FP8: tl.constexpr = False):
        """Program (seq, kv_head, split): the online softmax of query heads kv_head*GROUP .. +GROUP-1 over one
        contiguous range of seq's context.

        The range: the context has num_tiles = cdiv(seq_len, BLOCK_N) tiles of BLOCK_N tokens; each split gets
        tiles_per_split = cdiv(num_tiles, num_splits) whole tiles, split p the tiles
        [p * tiles_per_split, min((p + 1) * tiles_per_split, num_tiles)). The cut depends on each sequence's own
        length, so short and long sequences of one batch are all spread over the same number of programs. When
        num_splits exceeds num_tiles the last splits get no tile at all: their loop runs zero times and they
        write the empty state m = -inf, l = 0, acc = 0, which the merge weighs by exp2(-inf - M) = 0.

        Reads:  q of the GROUP heads; K/V of kv_head for the range's tokens, through the block table (QUANTIZED:
                int8 K/V and each token's two scales, dequantised right after the load).
        Writes: DIRECT (num_splits == 1, the range is the whole context): the normalised output rows, as
                step16's paged_decode_v2 wrote them; the merge kernel is not launched.
                Otherwise: part_m[seq, h, split], part_l[seq, h, split], part_acc[seq, h, split, :] for the
                GROUP heads h, all fp32, m in base-2 units.
        MERGE_LAST: the merge in the same launch. After storing its part, each program adds 1 to its
                (seq, kv_head)'s counter; the program that finds num_splits - 1 there is the last of its group: every
                other part is stored (each program's stores come before its add, the add releases them and the last
                add acquires them), so it merges the GROUP heads' parts as the merge kernel would, in the same
                order, and sets the counter back to 0 for the next launch (a captured graph replays the same
                counters). Which program comes last depends on the timing; what it computes does not.
        """
        if PDL:  # launched before the K/V write ends: let the o projection start, then wait for q, K, V
            gdc_launch_dependents()
            gdc_wait()
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq)

        num_tiles = tl.cdiv(seq_len, BLOCK_N)
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        first_tile = split * tiles_per_split
        end_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)  # may be < first_tile: an empty split

        rows = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kv_head * GROUP + rows
        row_ok = rows < GROUP  # rows padded up to BLOCK_G (>= 16, for tl.dot) are computed, never stored
        q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)  # [BLOCK_G, HEAD_DIM]
        if FP8 and q.dtype == tl.bfloat16:  # products in float16, which e4m3 converts to in one step (bf16
            q = q.to(tl.float16)           # would take a second); exact for q's values, finer for the probabilities

        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)

        # The loop body is step16's paged_decode_v2's: one tile of BLOCK_N tokens per iteration, online softmax.
        for start in range(first_tile * BLOCK_N, end_tile * BLOCK_N, BLOCK_N):
            pos = start + offs_n
            valid = pos < seq_len  # only the context's last tile is partial; a tile's first token is valid
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0)
            k_rows = block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
            v_rows = block.to(tl.int64) * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
            k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
            if QUANTIZED:  # int8 rows as q's dtype (exact: -127..127) and each token's two scales (0 past the end)
                s_rows = block.to(tl.int64) * stride_sb + (pos % BLOCK_SIZE) * stride_st + kv_head * stride_sh
                k_s = tl.load(k_scale_ptr + s_rows, mask=valid, other=0.0)  # [BLOCK_N] fp32
                v_s = tl.load(v_scale_ptr + s_rows, mask=valid, other=0.0)
            # int8 or float8 rows as q's dtype, in registers, exact; q's dtype itself: no instruction
            k, v = k.to(q.dtype), v.to(q.dtype)

            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
            if QUANTIZED:  # q . (k_int * k_s) = (q . k_int) * k_s: a token's scale multiplies its column of scores
                s = s * k_s[None, :]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)  # rescales the old state to the new maximum; 0 on the first tile
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if QUANTIZED:  # p @ (v_int * v_s) = (p * v_s) @ v_int: the scale goes on the column of probabilities
                p = p * v_s[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new

        if FP8:  # p @ (v8 * v_scale) = (p @ v8) * v_scale, once per output element of the range
            acc = acc * out_scale
        if DIRECT:
            out = acc / tl.where(l > 0, l, 1.0)[:, None]
            tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            # An empty split stores m = -inf, l = 0, acc = 0 exactly as initialised: no arithmetic touched them,
            # so nothing here can be NaN.
            tl.store(part_m_ptr + seq * stride_ms + heads * stride_mh + split, m, mask=row_ok)
            tl.store(part_l_ptr + seq * stride_ms + heads * stride_mh + split, l, mask=row_ok)
            tl.store(part_acc_ptr + seq * stride_as + heads[:, None] * stride_ah + split * stride_ap
                     + dims[None, :], acc, mask=row_ok[:, None])
            if MERGE_LAST:
                tl.debug_barrier()  # every thread's stores of this part, before the add that publishes them
                counter = counter_ptr + seq * num_kv_heads + kv_head
                arrived = tl.atomic_add(counter, 1, sem="acq_rel")
                if arrived == num_splits - 1:  # the last: all GROUP heads' parts at once, [GROUP_P, BLOCK_P, D]
                    tl.debug_barrier()
                    g_rows = tl.arange(0, GROUP_P)
                    parts = tl.arange(0, BLOCK_P)
                    g_heads = kv_head * GROUP + g_rows
                    ok = (g_rows < GROUP)[:, None] & (parts < num_splits)[None, :]
                    at = seq * stride_ms + g_heads[:, None] * stride_mh + parts[None, :]
                    # other programs wrote these: read them from L2 (.cg), past this SM's own cache
                    pm = tl.load(part_m_ptr + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
                    pl = tl.load(part_l_ptr + at, mask=ok, other=0.0, cache_modifier=".cg")
                    pa = tl.load(part_acc_ptr + seq * stride_as + g_heads[:, None, None] * stride_ah
                                 + parts[None, :, None] * stride_ap + dims[None, None, :], mask=ok[:, :, None],
                                 other=0.0, cache_modifier=".cg")
                    m_max = tl.max(pm, axis=1)  # the merge kernel's arithmetic, a head per row (see it below)
                    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
                    weight = tl.exp2(pm - m_max[:, None])
                    total = tl.sum(pl * weight, axis=1)
                    merged = tl.sum(pa * weight[:, :, None], axis=1) / tl.where(total > 0, total, 1.0)[:, None]
                    tl.store(out_ptr + seq * stride_os + g_heads[:, None] * stride_oh + dims[None, :],
                             merged.to(out_ptr.dtype.element_ty), mask=(g_rows < GROUP)[:, None])
                    tl.atomic_xchg(counter, 0)

    @triton.jit
    def _flash_decode_merge_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, num_splits,
                                   stride_ms, stride_mh, stride_as, stride_ah, stride_ap, stride_os, stride_oh,
                                   HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr):
        """Program (seq, head): merge the num_splits parts of one query head by log-sum-exp.

        Reads:  part_m[seq, head, :], part_l[seq, head, :], part_acc[seq, head, :, :] (num_splits entries,
                loaded as one BLOCK_P-long tile, BLOCK_P = next power of two; the padding lanes read as
                empty parts: m = -inf, l = 0, acc = 0).
        Writes: out[seq, head, :].
        """
        seq = tl.program_id(0)
        head = tl.program_id(1)
        parts = tl.arange(0, BLOCK_P)
        dims = tl.arange(0, HEAD_DIM)
        part_ok = parts < num_splits
        m = tl.load(part_m_ptr + seq * stride_ms + head * stride_mh + parts, mask=part_ok, other=float("-inf"))
        l = tl.load(part_l_ptr + seq * stride_ms + head * stride_mh + parts, mask=part_ok, other=0.0)
        acc = tl.load(part_acc_ptr + seq * stride_as + head * stride_ah + parts[:, None] * stride_ap
                      + dims[None, :], mask=part_ok[:, None], other=0.0)  # [BLOCK_P, HEAD_DIM]

        m_max = tl.max(m, axis=0)  # M: finite as soon as one part saw a token (seq_len >= 1)
        # If every part were empty (seq_len == 0), M = -inf and m - M = -inf - (-inf) = NaN: use 0 instead, so
        # the weights are exp2(-inf) = 0 and the output 0.
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        weight = tl.exp2(m - m_max)  # each part's rescale factor to the common maximum; 0 for empty parts
        total = tl.sum(l * weight, axis=0)                       # L
        out = tl.sum(acc * weight[:, None], axis=0)              # [HEAD_DIM]
        out = out / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def _check_tiling(num_splits, block_n):
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")


def _launch_split_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, out, parts,
                         block_n, num_warps, num_stages, k_scale=None, v_scale=None, counters=None, pdl=False):
    """Grid (num_seqs, kv_heads, num_splits). parts = (part_m, part_l, part_acc), or None: then num_splits must
    be 1 and the kernel writes the normalised output to out directly (DIRECT). k_scale, v_scale: an int8 cache's
    scales (QUANTIZED), or None. counters: int32 zeros, one per (seq, kv_head): the last program of each
    merges into out (MERGE_LAST) and leaves its counter at 0 again."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    direct, quantized = parts is None, k_cache.dtype == torch.int8
    fp8 = k_cache.dtype == FP8  # k_scale goes into the scores' scale, v_scale onto the output
    if direct:  # the scratch pointers are never used: pass out in their place
        parts, m_strides, acc_strides = (out, out, out), (0, 0), (0, 0, 0)
    else:
        m_strides, acc_strides = parts[0].stride()[:2], parts[2].stride()[:3]
    _flash_decode_split_kernel[(num_seqs, kv_heads, num_splits)](
        q, k_cache, v_cache, out, *parts, block_tables, seq_lens,
        float(scale) * LOG2E * (k_scale if fp8 else 1.0), num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        *m_strides, *acc_strides,
        block_tables.stride(0),
        *((k_scale, v_scale, *k_scale.stride()) if quantized else (k_cache, v_cache, 0, 0, 0)),  # unused if not
        counters if counters is not None else seq_lens, kv_heads,  # unused without MERGE_LAST
        float(v_scale) if fp8 else 1.0,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        # fp32 inputs: exact fp32 products (the default would round them to tf32 on the tensor cores).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DIRECT=direct, QUANTIZED=quantized,
        MERGE_LAST=counters is not None, BLOCK_P=triton.next_power_of_2(num_splits), GROUP_P=triton.next_power_of_2(group),
        PDL=pdl, FP8=fp8, **({"launch_pdl": True} if pdl else {}),
        num_warps=num_warps, num_stages=num_stages)


def decode_counters(max_seqs: int, kv_heads: int, device) -> torch.Tensor:
    """The arrival counters flash_decode's one-launch merge needs, one per (sequence, KV head), zeros."""
    return torch.zeros(max_seqs * kv_heads, dtype=torch.int32, device=device)


def flash_decode_partials(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, block_n=64,
                          num_warps=4, num_stages=3, k_scale=None, v_scale=None):
    """The split kernel alone: returns the fp32 partial results (part_m, part_l, part_acc), shapes
    [S, heads, num_splits], [S, heads, num_splits], [S, heads, num_splits, head_dim]; m in base-2 units
    (scores scaled by scale * log2 e). An empty split's entries are m = -inf, l = 0, acc = 0.
    flash_decode merges them; tests look at them directly."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    quantized = check_scales(k_cache, v_cache, k_scale, v_scale)
    _check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, quantized)
    _check_not_interpreted_bf16(q.dtype)
    _check_tiling(num_splits, block_n)
    return _partials(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, block_n, num_warps, num_stages,
                     k_scale, v_scale)


def _scratch(q, num_splits):
    """The split kernel's fp32 parts: part_m, part_l [S, heads, num_splits] and part_acc [S, heads, num_splits, D]."""
    num_seqs, num_heads, head_dim = q.shape
    part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    return part_m, torch.empty_like(part_m), torch.empty(num_seqs, num_heads, num_splits, head_dim,
                                                         dtype=torch.float32, device=q.device)


def _partials(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, block_n, num_warps, num_stages,
              k_scale=None, v_scale=None):
    """flash_decode_partials without the input checks (flash_decode has made them)."""
    num_seqs = q.shape[0]
    part_m, part_l, part_acc = _scratch(q, num_splits)
    if num_seqs > 0:
        out_unused = torch.empty(1, 1, dtype=q.dtype, device=q.device)
        _launch_split_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, out_unused,
                             (part_m, part_l, part_acc), block_n, num_warps, num_stages, k_scale, v_scale)
    return part_m, part_l, part_acc


def flash_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, block_n=64, num_warps=4,
                 num_stages=3, k_scale=None, v_scale=None, counters=None, pdl=False):
    """Decode attention with each context split num_splits ways (any positive integer). Returns
    [num_seqs, num_heads, head_dim] in q's dtype.

    num_splits > 1: the split kernel, grid (num_seqs, kv_heads, num_splits), all GROUP query heads of a KV head
    per program (as in step16's paged_decode_v2), writes fp32 partial results (flash_decode_partials); the merge kernel,
    grid (num_seqs, num_heads), combines them.
    num_splits == 1: the split kernel normalises and writes the output itself; no scratch, no merge launch
    (exactly step16's paged_decode_v2's work).
    block_n / num_warps / num_stages: 64 / 4 / 3, step16's v2's defaults (a [64, head_dim] K tile and V tile per
    iteration; with 3 stages Triton copies the next tile into shared memory while this one is computed); a
    benchmark may try others.
    k_scale, v_scale: an int8 cache's scales, [num_blocks, block_size, kv_heads] fp32 (None: q's dtype); a
    float8 e4m3 cache's, one float each.
    counters: an int32 tensor of at least num_seqs * kv_heads zeros (decode_counters): the split and the
    merge in one launch, the last program of each (seq, kv_head) merging its heads' parts; the counters are 0 again
    when it returns, so the same tensor serves every launch (and a captured graph). None: the two launches.
    pdl (with counters): launched as a programmatic dependent (gemv.py's pdl_supported).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed")
    quantized = check_scales(k_cache, v_cache, k_scale, v_scale)
    _check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, quantized)
    _check_not_interpreted_bf16(q.dtype)
    _check_tiling(num_splits, block_n)
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if num_splits == 1:
        _launch_split_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, 1, out, None,
                             block_n, num_warps, num_stages, k_scale, v_scale)
        return out
    if counters is not None:
        kv_heads = k_cache.shape[2]
        if counters.dtype != torch.int32 or counters.device != q.device or counters.numel() < num_seqs * kv_heads:
            raise ValueError(f"counters must be int32 on {q.device} with at least {num_seqs * kv_heads} entries, got "
                             f"{counters.dtype} on {counters.device} with {counters.numel()}")
        _launch_split_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, out,
                             _scratch(q, num_splits), block_n, num_warps, num_stages, k_scale, v_scale, counters, pdl)
        return out
    part_m, part_l, part_acc = _partials(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, block_n,
                                         num_warps, num_stages, k_scale, v_scale)
    _flash_decode_merge_kernel[(num_seqs, num_heads)](
        part_m, part_l, part_acc, out, num_splits,
        part_m.stride(0), part_m.stride(1), part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_P=triton.next_power_of_2(num_splits), num_warps=4)
    return out
