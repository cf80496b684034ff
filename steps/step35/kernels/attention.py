"""Varlen flash attention over the paged KV cache, in Triton, next to a plain torch reference of the same math.

The batch is step14_7's flat batch: the new tokens of S sequences side by side, q [N, heads, head_dim], sequence
i's tokens at rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1]; they are the last of its seq_lens_k[i] tokens, whose
K/V are already in the cache (one layer: [num_blocks, block_size, kv_heads, head_dim]) at the blocks listed in
block_tables[i]. Query j of a sequence attends to the keys at positions <= its own (causal).

The kernel: one program per (tile of BLOCK_M queries of one sequence, query head). It walks the sequence's keys
in tiles of BLOCK_N, finds each key's slot through the block table (a tile may span several cache blocks), and
keeps a running softmax (online softmax) per query row: the largest score seen m, the sum l of exp(score - m),
and the weighted sum acc of V rows, all three rescaled by exp(m_old - m_new) whenever m grows. The [queries,
context] score matrix is never stored: each tile's scores live in registers and are gone after the tile.
Key tiles wholly below the tile's first query need no mask (phase 1); the tiles that cross the diagonal are
masked (phase 2); tiles above the tile's last query are never read.

An int8 cache. Given k_scale and v_scale ([num_blocks, block_size, kv_heads] fp32, one scale per token
and KV head), the kernel loads each K/V tile as int8 (a quarter of fp32's bytes, half of bf16's) and converts it to
q's dtype, exactly (the values are -127..127). A key's scale is one number for its whole row, so it multiplies the
key's column of scores after q . k, and the value's scale the column of probabilities before p @ v: BLOCK_N
multiplies a row of the tile instead of BLOCK_N x head_dim.
QUANTIZED is a constexpr: without scales the dequantising lines are not compiled at all, and the kernel is
step18's.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference still works
    triton = None

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the kernel uses exp2, the GPU's native exponential


FP8 = torch.float8_e4m3fn  # a float8 cache, one scale per layer for K and one for V


def attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k, scale, k_scale=None,
                        v_scale=None):
    """The same math in plain torch, sequence by sequence: gather the context, causal mask, softmax in fp32.
    An int8 cache (k_scale, v_scale given) is dequantised to q's dtype first, the whole of it; a float8
    cache with its two per-layer floats, likewise."""
    if k_cache.dtype == FP8:
        k_cache = (k_cache.float() * k_scale).to(q.dtype)
        v_cache = (v_cache.float() * v_scale).to(q.dtype)
    elif k_scale is not None:
        k_cache = (k_cache.float() * k_scale[..., None]).to(q.dtype)
        v_cache = (v_cache.float() * v_scale[..., None]).to(q.dtype)
    num_heads, kv_heads, head_dim = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(len(seq_lens_k)):
        start, end, ctx = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seq_lens_k[i])
        blocks = block_tables[i, :-(-ctx // block_size)].long()
        keys = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:ctx]  # [ctx, kv_heads, D]
        values = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:ctx]
        keys = keys.repeat_interleave(num_heads // kv_heads, dim=1).float()  # query head h reads KV head h // group
        values = values.repeat_interleave(num_heads // kv_heads, dim=1).float()
        qi = q[start:end].float()  # [T, heads, D]
        scores = torch.einsum("qhd,khd->hqk", qi, keys) * scale  # [heads, T, ctx]
        query_pos = torch.arange(ctx - (end - start), ctx, device=q.device)  # the new tokens are the last T
        allowed = torch.arange(ctx, device=q.device)[None, :] <= query_pos[:, None]
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


if triton is not None:
    @triton.jit
    def _attend_tile(q, m, l, acc, k_ptr, v_ptr, table_row_ptr, key_start, ctx, query_pos, qk_scale,
                     stride_kb, stride_ks, stride_kh, kv_head, dims, k_scale_ptr, v_scale_ptr, stride_sb, stride_ss,
                     stride_sh, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                     QUANTIZED: tl.constexpr):
        """One tile of BLOCK_N keys: read K and V through the block table (int8 + scales: dequantise them),
        update the running (m, l, acc)."""
        keys_pos = key_start + tl.arange(0, BLOCK_N)  # positions of this tile's keys in the sequence
        if MASKED:  # a tile crossing the diagonal or the context's end: keys past the context are not read
            in_ctx = keys_pos < ctx
            block = tl.load(table_row_ptr + keys_pos // BLOCK_SIZE, mask=in_ctx, other=0)  # logical -> physical
            slot = block.to(tl.int64) * stride_kb + (keys_pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            k = tl.load(k_ptr + slot[:, None] + dims[None, :], mask=in_ctx[:, None], other=0.0)  # [BLOCK_N, D]
            v = tl.load(v_ptr + slot[:, None] + dims[None, :], mask=in_ctx[:, None], other=0.0)
            if QUANTIZED:  # one scale per key of the tile; a key past the context reads 0 (its row is 0 too)
                scale_slot = block.to(tl.int64) * stride_sb + (keys_pos % BLOCK_SIZE) * stride_ss + kv_head * stride_sh
                k_s = tl.load(k_scale_ptr + scale_slot, mask=in_ctx, other=0.0)  # [BLOCK_N] fp32
                v_s = tl.load(v_scale_ptr + scale_slot, mask=in_ctx, other=0.0)
        else:  # a tile wholly inside the context and below the diagonal: no masks at all
            block = tl.load(table_row_ptr + keys_pos // BLOCK_SIZE)
            slot = block.to(tl.int64) * stride_kb + (keys_pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            k = tl.load(k_ptr + slot[:, None] + dims[None, :])
            v = tl.load(v_ptr + slot[:, None] + dims[None, :])
            if QUANTIZED:
                scale_slot = block.to(tl.int64) * stride_sb + (keys_pos % BLOCK_SIZE) * stride_ss + kv_head * stride_sh
                k_s = tl.load(k_scale_ptr + scale_slot)
                v_s = tl.load(v_scale_ptr + scale_slot)
        # int8 -> q's dtype, exact (-127..127), the scales applied to scores and probabilities below; float8
        # -> q's dtype (float16 for a bf16 model), exact too, in registers; q's dtype itself: no instruction at all
        k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale  # [BLOCK_M, BLOCK_N], in log2 units
        if QUANTIZED:  # q . (k_int * k_s) = (q . k_int) * k_s: one multiply per score, not per key element
            s = s * k_s[None, :]
        if MASKED:  # only the tiles that cross the diagonal (or the context's end) pay for the mask
            allowed = (keys_pos[None, :] <= query_pos[:, None]) & in_ctx[None, :]
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = m_new
        if MASKED:  # a row may have seen no allowed key yet (m_new = -inf): subtract 0 instead, p is 0 anyway
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        correction = tl.exp2(m - m_safe)  # how much the old sums shrink now that the maximum grew
        l = l * correction + tl.sum(p, 1)
        if QUANTIZED:  # p @ (v_int * v_s) = (p * v_s) @ v_int: each key's scale on its column of probabilities
            p = p * v_s[None, :]
        acc = tl.dot(p.to(v.dtype), v, acc * correction[:, None])  # rescale, then add p @ V in the same matmul
        return m_new, l, acc

    @triton.jit
    def _mixed_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, block_tables_ptr, cu_q_ptr, lens_k_ptr, tile_seq_ptr,
                                tile_first_ptr, qk_scale, stride_qn, stride_qh, stride_kb, stride_ks, stride_kh,
                                stride_on, stride_oh, stride_bt, k_scale_ptr, v_scale_ptr, stride_sb, stride_ss,
                                stride_sh, out_scale, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr, FP8: tl.constexpr = False):
        # One program per (tile, KV head). A tile is BLOCK_Q consecutive new tokens of one sequence (a decode is a
        # tile of one token); its rows are those tokens x the GROUP query heads that share this KV head, so every
        # K/V tile is read once for the whole group. The tile map (tile -> sequence, first token) is the metadata.
        tile, kv_head = tl.program_id(0), tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile)
        first = tl.load(tile_first_ptr + tile)  # the tile's first token, 0-based within the sequence's new tokens
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        ctx = tl.load(lens_k_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        token = first + rows // GROUP  # row r: token r // GROUP of the tile, query head r % GROUP of the group
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qn + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        if FP8 and q.dtype == tl.bfloat16:  # products in float16, which e4m3 converts to in one step (bf16
            q = q.to(tl.float16)           # would take a second); exact for q's values, finer for the probabilities
        query_pos = ctx - q_len + token  # each row's position in its sequence: causal within the chunk
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        table_row = block_tables_ptr + seq * stride_bt
        # Phase 1: key tiles every row of the tile may see whole (all keys <= the first token's position).
        first_pos = ctx - q_len + first
        full_tiles = (first_pos + 1) // BLOCK_N
        for t in range(0, full_tiles):
            m, l, acc = _attend_tile(q, m, l, acc, k_ptr, v_ptr, table_row, t * BLOCK_N, ctx, query_pos, qk_scale,
                                     stride_kb, stride_ks, stride_kh, kv_head, dims, k_scale_ptr, v_scale_ptr,
                                     stride_sb, stride_ss, stride_sh, BLOCK_N, BLOCK_SIZE, False, QUANTIZED)
        # Phase 2: the tiles crossing the diagonal, masked. Keys after the tile's last token are never read.
        last_key = tl.minimum(ctx, first_pos + BLOCK_Q)
        for t in range(full_tiles, tl.cdiv(last_key, BLOCK_N)):
            m, l, acc = _attend_tile(q, m, l, acc, k_ptr, v_ptr, table_row, t * BLOCK_N, ctx, query_pos, qk_scale,
                                     stride_kb, stride_ks, stride_kh, kv_head, dims, k_scale_ptr, v_scale_ptr,
                                     stride_sb, stride_ss, stride_sh, BLOCK_N, BLOCK_SIZE, True, QUANTIZED)
        out = acc / tl.where(row_ok, l, 1.0)[:, None]  # padding rows saw no key: keep them finite, never stored
        if FP8:  # p @ (v8 * v_scale) = (p @ v8) * v_scale, one multiply per output element
            out = out * out_scale
        tl.store(o_ptr + (q_start + token)[:, None] * stride_on + head[:, None] * stride_oh + dims[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def tile_config(max_query_len: int, group: int) -> dict:
    """Rows per program and tile sizes. A tile's rows are its tokens x the query heads of one KV head (`group`).
    Steps whose longest row fills 64 rows (chunks): 64 rows and key tiles of 64; steps of decodes and short chunks:
    16 rows, the smallest tile tl.dot takes, so few rows idle. Other sizes are the callers' overrides."""
    if max_query_len * group >= 64:
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=2)
    return dict(block_m=16, block_n=64, num_warps=4, num_stages=2)


def tile_rows(max_query_len: int, group: int, block_m: int | None = None) -> int:
    """The rows of one program's tile (BLOCK_M): tile_config's, or the caller's block_m, raised to hold at least
    one token's query heads (`group`, rounded up to a power of two). A tile then holds block_m // group tokens.
    The one place this rule lives: mixed_attention and the backends' metadata (attention.py) both ask it."""
    rows = tile_config(max_query_len, group)["block_m"] if block_m is None else block_m
    return max(rows, 1 << (group - 1).bit_length())


def tile_map(query_lens: torch.Tensor, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's new tokens cut into tiles of block_q -> (tile -> its sequence, tile -> its first token),
    int32, on the device of query_lens. Built with tensor operations, no Python loop over the sequences."""
    tiles = (query_lens + block_q - 1) // block_q  # [S]
    seq = torch.repeat_interleave(torch.arange(len(query_lens), device=query_lens.device), tiles)  # [T]
    starts = torch.cumsum(tiles, 0) - tiles  # the first tile of each sequence
    first = (torch.arange(len(seq), device=query_lens.device) - starts[seq]) * block_q
    return seq.to(torch.int32), first.to(torch.int32)


def mixed_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k, scale, max_query_len,
                    tiles=None, block_m=None, block_n=None, num_warps=None, num_stages=None, k_scale=None,
                    v_scale=None):
    """Attention of a flat batch that mixes decodes and prefill chunks, over the paged cache, in one launch.

    q [N, heads, D]; k_cache, v_cache [num_blocks, block_size, kv_heads, D] (views allowed: only the last dim
    must be contiguous); block_tables [S, max_blocks] int32; cu_seqlens_q [S + 1] int32; seq_lens_k [S] int32
    (each sequence's context including its new tokens); max_query_len: the longest row (1 for a step of decodes);
    tiles: tile_map(...) for this call's block size, if the caller built it already. k_scale, v_scale: an int8
    cache's scales, [num_blocks, block_size, kv_heads] fp32 (None: the cache has q's dtype); a float8 e4m3
    cache's, one float each (its layer's). -> [N, heads, D]."""
    if triton is None:
        raise RuntimeError("mixed_attention needs Triton (pip install triton); attention_reference is the torch path")
    num_heads, head_dim = q.shape[1], q.shape[2]
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"shapes: q {tuple(q.shape)} must be [N, heads, D] and the caches "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)} [blocks, block_size, kv_heads, D]")
    kv_heads = k_cache.shape[2]
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {kv_heads} KV heads")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim}: the kernel needs a power of two >= 16")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q and the caches must be contiguous in head_dim, and K and V must share strides")
    quantized = check_scales(k_cache, v_cache, k_scale, v_scale)
    fp8 = k_cache.dtype == FP8  # k_scale goes into the scores' scale, v_scale onto the output
    group = num_heads // kv_heads
    config = tile_config(max_query_len, group)
    if (quantized or fp8) and config["block_m"] == 16:  # short rows on int8 or fp8: key tiles twice as long
        config.update(block_n=128, num_stages=3)  # keep as many bytes in flight per load as bf16's
        # (docs/data/tune_int8_decode.py), and spread each tile's fixed work over twice the keys (sass_step30.py)
    for name, value in dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages).items():
        if value is not None:
            config[name] = value
    block_m = tile_rows(max_query_len, group, config["block_m"])
    block_q = block_m // group
    if tiles is None:
        tiles = tile_map(cu_seqlens_q[1:] - cu_seqlens_q[:-1], block_q)
    tile_seq, tile_first = tiles
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _mixed_attention_kernel[(len(tile_seq), kv_heads)](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens_k, tile_seq, tile_first,
        scale * LOG2E * (k_scale if fp8 else 1.0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        *((k_scale, v_scale, *k_scale.stride()) if quantized else (k_cache, v_cache, 0, 0, 0)),  # unused if not
        float(v_scale) if fp8 else 1.0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=config["block_n"],
        BLOCK_SIZE=k_cache.shape[1], QUANTIZED=quantized, FP8=fp8, num_warps=config["num_warps"],
        num_stages=config["num_stages"])
    return out


def check_scales(k_cache, v_cache, k_scale, v_scale) -> bool:
    """-> whether the cache is int8 with its scales (True) or in the model's dtype (False); a ValueError for
    anything in between: an int8 cache needs both scale tensors, fp32 [num_blocks, block_size, kv_heads], with
    the same strides (the kernels take one set). A float8 e4m3 cache (False) needs one positive float
    scale each for K and V."""
    if k_cache.dtype == FP8 or v_cache.dtype == FP8:
        if k_cache.dtype != v_cache.dtype:
            raise ValueError(f"K and V caches must share their dtype, got {k_cache.dtype} and {v_cache.dtype}")
        if not all(isinstance(s, (int, float)) and s > 0 for s in (k_scale, v_scale)):
            raise ValueError(f"a float8 KV cache needs k_scale and v_scale as positive floats (one per layer), got "
                             f"{k_scale!r} and {v_scale!r}")
        return False
    if k_scale is None and v_scale is None:
        if k_cache.dtype == torch.int8 or v_cache.dtype == torch.int8:
            raise ValueError("an int8 KV cache needs its scales: pass k_scale and v_scale")
        return False
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale and v_scale go together: pass both or neither")
    if k_cache.dtype != torch.int8 or v_cache.dtype != torch.int8:
        raise ValueError(f"k_scale/v_scale are for an int8 cache, got {k_cache.dtype} and {v_cache.dtype}")
    if (k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32 or k_scale.shape != k_cache.shape[:3]
            or v_scale.shape != k_scale.shape or v_scale.stride() != k_scale.stride()):
        raise ValueError(f"k_scale and v_scale must be float32 {tuple(k_cache.shape[:3])} = [num_blocks, block_size, "
                         f"kv_heads] with equal strides, got {k_scale.dtype} {tuple(k_scale.shape)}, "
                         f"{v_scale.dtype} {tuple(v_scale.shape)}")
    if k_scale.device != k_cache.device or v_scale.device != k_cache.device:
        raise ValueError("the scales must be on the cache's device")
    return True
