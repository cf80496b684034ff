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
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference still works
    triton = None

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the kernel uses exp2, the GPU's native exponential


def attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k, scale):
    """The same math in plain torch, sequence by sequence: gather the context, causal mask, softmax in fp32."""
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
                     stride_kb, stride_ks, stride_kh, kv_head, dims,
                     BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
        """One tile of BLOCK_N keys: read K and V through the block table, update the running (m, l, acc)."""
        keys_pos = key_start + tl.arange(0, BLOCK_N)  # positions of this tile's keys in the sequence
        if MASKED:  # a tile crossing the diagonal or the context's end: keys past the context are not read
            in_ctx = keys_pos < ctx
            block = tl.load(table_row_ptr + keys_pos // BLOCK_SIZE, mask=in_ctx, other=0)  # logical -> physical
            slot = block.to(tl.int64) * stride_kb + (keys_pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            k = tl.load(k_ptr + slot[:, None] + dims[None, :], mask=in_ctx[:, None], other=0.0)  # [BLOCK_N, D]
            v = tl.load(v_ptr + slot[:, None] + dims[None, :], mask=in_ctx[:, None], other=0.0)
        else:  # a tile wholly inside the context and below the diagonal: no masks at all
            block = tl.load(table_row_ptr + keys_pos // BLOCK_SIZE)
            slot = block.to(tl.int64) * stride_kb + (keys_pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            k = tl.load(k_ptr + slot[:, None] + dims[None, :])
            v = tl.load(v_ptr + slot[:, None] + dims[None, :])
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale  # [BLOCK_M, BLOCK_N], in log2 units
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
        acc = tl.dot(p.to(v.dtype), v, acc * correction[:, None])  # rescale, then add p @ V in the same matmul
        return m_new, l, acc

    @triton.jit
    def _flash_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, block_tables_ptr, cu_q_ptr, lens_k_ptr, qk_scale,
                                stride_qn, stride_qh, stride_kb, stride_ks, stride_kh, stride_on, stride_oh,
                                stride_bt, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        # The last query tiles of a prompt see the most keys: they are launched first (tile numbers reversed), so
        # the long programs do not all start at the end and leave the GPU half idle.
        tile, seq, head = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1), tl.program_id(2)
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        if tile * BLOCK_M >= q_len:  # the grid is sized for the longest chunk: shorter ones leave programs idle
            return
        ctx = tl.load(lens_k_ptr + seq)
        kv_head = head // GROUP  # grouped-query attention: GROUP query heads read the same KV head
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # this tile's queries, 0-based within the sequence's chunk
        dims = tl.arange(0, HEAD_DIM)
        row_ok = rows < q_len
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qn + head * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        query_pos = ctx - q_len + rows  # each query's position in its sequence
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        table_row = block_tables_ptr + seq * stride_bt
        # Phase 1: key tiles that every query of this tile may see whole (all keys <= the first query's position).
        first_query = ctx - q_len + tile * BLOCK_M
        full_tiles = (first_query + 1) // BLOCK_N
        for t in range(0, full_tiles):
            m, l, acc = _attend_tile(q, m, l, acc, k_ptr, v_ptr, table_row, t * BLOCK_N, ctx, query_pos, qk_scale,
                                     stride_kb, stride_ks, stride_kh, kv_head, dims, BLOCK_N, BLOCK_SIZE, False)
        # Phase 2: the tiles crossing the diagonal, masked. Keys after the tile's last query are never read.
        last_key = tl.minimum(ctx, first_query + BLOCK_M)
        for t in range(full_tiles, tl.cdiv(last_key, BLOCK_N)):
            m, l, acc = _attend_tile(q, m, l, acc, k_ptr, v_ptr, table_row, t * BLOCK_N, ctx, query_pos, qk_scale,
                                     stride_kb, stride_ks, stride_kh, kv_head, dims, BLOCK_N, BLOCK_SIZE, True)
        out = acc / l[:, None]
        tl.store(o_ptr + (q_start + rows)[:, None] * stride_on + head * stride_oh + dims[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (132 on an H200); 132 stands in on a CPU (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def tile_config(max_query_len: int, head_dim: int, programs_per_128_rows: int, sms: int) -> dict:
    """Tile sizes and warps, chosen by rules measured on the H200 (docs/data/raw/h200_step15_tune_*.txt).
    Long chunks: 128 queries per program, while that still gives at least two programs per multiprocessor;
    else 64 (a 1,024-token prompt of 16 heads makes 128 programs of 128 rows, too few for 132 SMs). Short chunks
    and decodes: 16 rows, so that few rows are idle. Overridable per call (the benchmarks try others)."""
    if max_query_len >= 64 and programs_per_128_rows >= 2 * sms:
        if head_dim >= 128:  # three 64 KiB stages of K and V tiles in flight: 224 of the H200's 228 KiB per SM
            return dict(block_m=128, block_n=128, num_warps=8, num_stages=3)
        return dict(block_m=128, block_n=64, num_warps=8, num_stages=3)
    if max_query_len >= 64:
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=3)
    return dict(block_m=16, block_n=64, num_warps=4, num_stages=2)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k, scale, max_query_len,
                    block_m=None, block_n=None, num_warps=None, num_stages=None):
    """Flash attention of a flat varlen batch over the paged cache.

    q [N, heads, D]; k_cache, v_cache [num_blocks, block_size, kv_heads, D] (views allowed: only the last dim
    must be contiguous); block_tables [S, max_blocks] int32; cu_seqlens_q [S + 1] int32; seq_lens_k [S] int32
    (each sequence's context including its new tokens); max_query_len: the longest chunk. -> [N, heads, D]."""
    if triton is None:
        raise RuntimeError("paged_attention needs Triton (pip install triton); attention_reference is the torch path")
    num_seqs, num_heads, head_dim = len(seq_lens_k), q.shape[1], q.shape[2]
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"shapes: q {tuple(q.shape)} must be [N, heads, D] and the caches "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)} [blocks, block_size, kv_heads, D]")
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"{num_heads} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim}: the kernel needs a power of two >= 16")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q and the caches must be contiguous in head_dim, and K and V must share strides")
    config = tile_config(max_query_len, head_dim, triton.cdiv(max_query_len, 128) * num_seqs * num_heads,
                         num_sms(q.device))
    for name, value in dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages).items():
        if value is not None:
            config[name] = value
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(max_query_len, config["block_m"]), num_seqs, num_heads)
    _flash_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens_k, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_M=config["block_m"],
        BLOCK_N=config["block_n"], BLOCK_SIZE=k_cache.shape[1],
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out
