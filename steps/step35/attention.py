"""The attention backends: one object per way of running attention, picked once by the engine (engine.py).

    TorchAttention   step14_7's loop: each sequence gathers its context's K/V and attends on its own
    TritonAttention  the kernels (kernels/), no Python loop: every row of a step, decodes and prefill chunks
                     alike, in one launch per layer (kernels/attention.py's mixed_attention); a step of decodes
                     only whose contexts are long enough to split, in flash decoding's two (kernels/decode.py)

Each object does two things, and is the only code that knows how its attention runs:

    metadata(plan, slots, block_size,   once per step, called by the model runner: the step's plan (the
             tables, rows)              scheduler's SchedulerOutput) -> one AttentionMetadata, for every layer
                                        (tables: the runner's BlockTables; rows: the plan's rows in it)
    forward(q, k_cache, v_cache, attn,  once per layer, called by the model once it has written the new tokens'
            k_scale, v_scale)           K/V into the cache: q [N, heads, head_dim] -> [N, heads * head_dim]

With an int8 KV cache the model also passes the scales (k_scale, v_scale [num_blocks, block_size,
kv_heads] fp32; None for a cache in the model's dtype). TorchAttention dequantises after its gather; the kernels
dequantise each tile they load.

TritonAttention.graph_metadata builds a decode step's metadata from static buffers (cuda_graphs.py), so
the step can be captured in a CUDA graph and replayed.
"""
from __future__ import annotations

import torch

from .model import (AttentionMetadata, DecodeMetadata, MixedMetadata, causal_mask, context_slots, gather_kv,
                    grouped_attention)
from .model_runner import to_device


def cumulative(query_lens) -> list[int]:
    """Each sequence's new-token count -> where its tokens start in the flat batch: [S + 1], (0, ..., N)."""
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    return cu


class TorchAttention:
    """step14_7's loop, in plain PyTorch: every sequence attends on its own, to the K/V gathered from its
    context's slots, with its causal mask (none for a decode). The kernels' reference math."""

    name = "torch"

    def __init__(self, config, device: torch.device):
        self.config, self.device = config, device

    def metadata(self, plan, slots: torch.Tensor, block_size: int, tables=None, rows=None) -> AttentionMetadata:
        """Every row loops: its context slots and causal mask, computed once here for every layer (from its block
        table, read whole from the runner's rows: the loop reads each context whole anyway)."""
        return self.loop_metadata(plan, slots, block_size, tables, rows, looped=plan.num_rows)

    def loop_metadata(self, plan, slots: torch.Tensor, block_size: int, tables, rows, looped: int) -> AttentionMetadata:
        """The metadata of the flat batch (cumulative query lengths, the slot mapping [N], on the device), with the
        context slots and causal masks of the plan's first `looped` rows: those that attend in the loop."""
        looping = list(zip(rows, plan.starts, plan.query_lens))[:looped]
        context = [context_slots(tables.table(row), start + n, block_size, self.device) for row, start, n in looping]
        masks = [causal_mask(start, n, self.device) for _, start, n in looping]  # None: decodes
        return AttentionMetadata(cumulative(plan.query_lens), slots, context, masks)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        return torch.cat(self.loop(q, k_cache, v_cache, attn, k_scale, v_scale))  # [N, heads * head_dim]

    def loop(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> list:
        """The looped sequences one by one -> their outputs, each [T_i, heads * head_dim]. An int8 cache (scales
        given) is dequantised to q's dtype right after the gather; the attention after it is unchanged."""
        outputs = []
        for i in range(len(attn.context_slots)):
            keys = gather_kv(k_cache, attn.context_slots[i], k_scale, q.dtype)  # [context, kv_heads, head_dim]
            values = gather_kv(v_cache, attn.context_slots[i], v_scale, q.dtype)
            q_i = q[attn.cu_seqlens_q[i]:attn.cu_seqlens_q[i + 1]]  # this sequence's new tokens: [T_i, heads, head_dim]
            outputs.append(grouped_attention(q_i, keys, values, attn.masks[i]))
        return outputs


    def latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, attn: AttentionMetadata,
               m, scale: float) -> torch.Tensor:
        """Latent attention over the paged cache of latents (cache [num_blocks, block_size, 1, kv_lora_rank + rope]),
        the looped sequences one by one -> [N, heads * v_head_dim]. q_nope [N, heads, nope], q_rope [N, heads, rope].
        m: the layer's kv_b_proj, whole and cut per head (model.py's latent_matrices). A row of one query token (a
        decode) absorbs: its query meets the latents themselves (latent_absorbed); a row of several (a prefill
        chunk) turns its context's latents into keys and values first, its cached context and its own tokens apart,
        merged by log-sum-exp (latent_chunk)."""
        outputs = []
        for i in range(len(attn.context_slots)):
            entries = gather_kv(cache, attn.context_slots[i])[:, 0]  # [context, kv_lora_rank + rope]
            rows = slice(attn.cu_seqlens_q[i], attn.cu_seqlens_q[i + 1])
            if rows.stop - rows.start == 1:
                outputs.append(latent_absorbed(q_nope[rows], q_rope[rows], entries, m, scale))
            else:
                outputs.append(latent_chunk(q_nope[rows], q_rope[rows], entries, m, scale))
        return torch.cat(outputs)


def latent_absorbed(q_nope, q_rope, entries, m, scale, mask=None) -> torch.Tensor:
    """One sequence's queries [T, heads, nope] and [T, heads, rope] over its entries [S, kv_lora_rank + rope],
    without a key or value per head: W_UK goes into the query (q_nope @ W_UK: [T, heads, kv_lora_rank]), which then
    meets the latents as a multi-query attention whose one key is the whole entry; the output, a mix of latents, goes
    through W_UV after. -> [T, heads * v]. The scores are q_nope . (W_UK c) + q_rope . k_rope, as decompressed."""
    latents, k_rope = entries[:, :m.kv_lora_rank], entries[:, m.kv_lora_rank:]
    q_latent = torch.einsum("thn,hnc->thc", q_nope, m.w_uk)
    scores = (torch.einsum("thc,sc->hts", q_latent, latents) + torch.einsum("thr,sr->hts", q_rope, k_rope)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(latents.dtype)
    out = torch.einsum("hts,sc->thc", probs, latents)  # [T, heads, kv_lora_rank]
    return torch.einsum("thc,hvc->thv", out, m.w_uv).flatten(1)


def latent_chunk(q_nope, q_rope, entries, m, scale) -> torch.Tensor:
    """A prefill chunk of T queries, the last T of its S entries: its cached context (the first S - T entries, which
    every query sees: no mask) and its own tokens (causal among themselves), each through the decompressed path on its
    own, then merged by log-sum-exp: each part's output weighed by its share exp(lse_part - lse) of the softmax's
    total. The same as one attention over all S (latent_decompressed with the causal mask), in two pieces: the
    context's keys and values never meet a mask, and a long context could be taken piece by piece. -> [T, heads * v]."""
    T, start = q_nope.shape[0], entries.shape[0] - q_nope.shape[0]
    own = torch.ones(T, T, dtype=torch.bool, device=entries.device).tril()
    parts = [latent_part(q_nope, q_rope, entries[start:], m, scale, own)]
    if start:
        parts.append(latent_part(q_nope, q_rope, entries[:start], m, scale, None))
    lse = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)  # [heads, T]
    out = sum(part * torch.exp(part_lse - lse).transpose(0, 1)[..., None] for part, part_lse in parts)
    return out.to(entries.dtype).flatten(1)


def latent_part(q_nope, q_rope, entries, m, scale, mask):
    """The decompressed attention of the queries over some of their entries -> (its output [T, heads, v] in fp32,
    normalised over these entries alone, and the log of its softmax's sum [heads, T]): what latent_chunk merges."""
    keys, values = decompress(entries, m, q_nope.shape[1])
    scores = (torch.einsum("thd,shd->hts", torch.cat([q_nope, q_rope], dim=-1), keys) * scale).float()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [heads, T]
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("hts,shv->thv", probs, values.float()), lse


def decompress(entries, m, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache entries [S, kv_lora_rank + rope] -> every head's keys [S, heads, nope + rope] and values [S, heads, v]:
    kv_b_proj over the latents (one matmul), the shared roped dims joined to each head's key part."""
    latents, k_rope = entries[:, :m.kv_lora_rank], entries[:, m.kv_lora_rank:]
    kv = (latents @ m.kv_b.T).view(len(latents), heads, -1)  # [S, heads, nope + v]
    keys = torch.cat([kv[..., :m.nope], k_rope[:, None, :].expand(-1, heads, -1)], dim=-1)
    return keys, kv[..., m.nope:]


def latent_decompressed(q_nope, q_rope, entries, m, scale, mask=None) -> torch.Tensor:
    """One sequence's queries over all its entries as HF's modules compute it (latent_part over every entry at once):
    kv_b_proj turns each latent into every head's key part and value, the shared roped dims join each head's key,
    then ordinary attention with the scale. -> [T, heads * v]."""
    out, _ = latent_part(q_nope, q_rope, entries, m, scale, mask)
    return out.to(entries.dtype).flatten(1)


class TritonAttention(TorchAttention):
    """The kernels, no Python loop: every row of a step in one launch per layer (kernels/attention.py's
    mixed_attention: a decode is a row of one token, a prefill chunk a row of n, each causal within itself over
    its paged context). One exception: a step of decodes only, whose contexts are long enough that flash
    decoding's split rule cuts them (kernels/decode.py), runs flash decoding: its split and merge in one launch.
    `launches` counts the attention kernels launched, every layer of every step."""

    name = "triton"
    merge_in_split = True  # flash decoding's merge inside its split kernel (False: two launches, split then merge)

    def __init__(self, config, device: torch.device):
        super().__init__(config, device)
        # the kernels' tiles: tl.arange, tl.dot (a latent model's keys are no heads: kernels/latent.py tiles them)
        if not config.kv_lora_rank and (config.head_dim & (config.head_dim - 1) or config.head_dim < 16):
            raise ValueError(f"attention_backend='triton' (the default on CUDA): the kernels need head_dim to be a "
                             f"power of two >= 16, and this model's is {config.head_dim}; attention_backend='torch' "
                             "runs it")
        # Flash decoding's split rule (kernels/decode.py's choose_num_splits): the GPU's multiprocessor count, and
        # the shortest part worth a program of its own. On a CPU the count only changes how the work is cut.
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        self.split_rule = {"num_sms": sms, "min_tokens_per_split": 256}
        self.launches = 0
        # latent attention's launches: the latent kernel's (decode rows), the mixed kernel's over decompressed chunks,
        # and how many of those ran in a step that had decode rows too
        self.latent_launches = {"decodes": 0, "chunks": 0, "beside decodes": 0}
        self.counters = None  # flash decoding's arrival counters, made at the first split step
        self.retired_counters = []  # outgrown counters, kept alive: a graph captured earlier still points at them
        from .kernels.gemv import pdl_supported  # launch it as a programmatic dependent where it can
        self.pdl = pdl_supported(device)

    def decode_counters(self, num_seqs: int) -> torch.Tensor:
        """The counters of flash decoding's one-launch merge (kernels/decode.py), one per (sequence, KV
        head), kept for every step: each launch leaves them at 0. Made for 1,024 sequences (32 KiB with 8 KV heads)
        and grown if a step has more."""
        from .kernels.decode import decode_counters

        if self.counters is None or self.counters.numel() < num_seqs * self.config.num_kv_heads:
            if self.counters is not None:
                self.retired_counters.append(self.counters)
            self.counters = decode_counters(max(num_seqs, 1024), self.config.num_kv_heads, self.device)
        return self.counters

    def metadata(self, plan, slots: torch.Tensor, block_size: int, tables, rows: list[int]) -> AttentionMetadata:
        """Nothing loops, so no sequence needs the loop's context slots or masks. Every row gets its block table
        (from the runner's persistent rows) and lengths, and the tiles the kernel cuts its new tokens into, once for
        every layer."""
        from .kernels.attention import tile_map, tile_rows  # imported with the kernels, only when they run
        from .kernels.decode import choose_num_splits

        # latent attention: a step with prefill chunks loops as the torch backend does (its decompressed path)
        looped = plan.num_rows if self.config.kv_lora_rank and not plan.decodes_only else 0
        attn = self.loop_metadata(plan, slots, block_size, tables, rows, looped=looped)
        tables, cu, lens = self.kernel_tensors(plan, tables, rows)
        if plan.decodes_only:  # decodes only: split long contexts if that fills the GPU better
            longest = max(start + 1 for start in plan.starts)  # each row's context, its new token's included
            splits = choose_num_splits(plan.num_rows, self.config.num_kv_heads, longest, **self.split_rule)
            if splits > 1:
                attn.decode = DecodeMetadata(plan.num_rows, tables, lens, splits)
                return attn
        group = self.config.num_heads // self.config.num_kv_heads
        max_query_len = max(plan.query_lens)
        block_m = tile_rows(max_query_len, group)
        tile_seq, tile_first = tile_map(torch.tensor(plan.query_lens), block_m // group)  # on the CPU
        attn.mixed = MixedMetadata(tables, cu, lens, max_query_len, to_device(tile_seq, self.device),
                                   to_device(tile_first, self.device), block_m)
        return attn

    def kernel_tensors(self, plan, tables, rows: list[int]):
        """The plan's rows -> the int32 device tensors the kernels read: their block tables, the rows `rows` of the
        runner's BlockTables cut to the widest [S, widest] (one index_select, one copy), cumulative query lengths
        [S + 1], context lengths after this step [S]."""
        tables = tables.gather(rows)  # [S, widest]; past a row's length: stale entries, never read
        lens = [start + n for start, n in zip(plan.starts, plan.query_lens)]
        as_tensor = lambda x: to_device(torch.tensor(x, dtype=torch.int32), self.device)  # noqa: E731
        return to_device(tables, self.device), as_tensor(cumulative(plan.query_lens)), as_tensor(lens)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        from .kernels.attention import mixed_attention  # imported with the kernels, only when they run
        from .kernels.decode import flash_decode

        c = self.config
        if attn.decode is not None:  # flash decoding: the split and the merge in one launch
            d = attn.decode
            one = self.merge_in_split
            self.launches += 1 if one else 2
            out = flash_decode(q, k_cache, v_cache, d.block_tables, d.seq_lens, c.head_dim ** -0.5, d.num_splits,
                               k_scale=k_scale, v_scale=v_scale, counters=self.decode_counters(d.num) if one else None,
                               pdl=self.pdl and one)
            return out.reshape(d.num, c.num_heads * c.head_dim)
        x = attn.mixed  # every row of the step, one launch
        self.launches += 1
        out = mixed_attention(q, k_cache, v_cache, x.block_tables, x.cu_seqlens_q, x.seq_lens_k, c.head_dim ** -0.5,
                              x.max_query_len, tiles=(x.tile_seq, x.tile_first), block_m=x.block_m,
                              k_scale=k_scale, v_scale=v_scale)
        return out.reshape(-1, c.num_heads * c.head_dim)


    def latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, attn: AttentionMetadata,
               m, scale: float) -> torch.Tensor:
        """Latent attention: a step of decodes (every row one query token) absorbs W_UK into its queries and runs
        kernels/latent.py's kernel over the paged latents, split as flash decoding splits (the step's DecodeMetadata)
        or not; W_UV after. A step with prefill chunks: its decode rows the same way, its chunks through the mixed
        kernel over their contexts' keys and values, decompressed (latent_chunks)."""
        d = attn.decode
        if attn.context_slots:  # prefill chunks in the step
            return self.latent_chunks(q_nope, q_rope, cache, attn, m, scale)
        tables, lens, splits = ((d.block_tables, d.seq_lens, d.num_splits) if d is not None
                                else (attn.mixed.block_tables, attn.mixed.seq_lens_k, 1))
        return self.latent_decodes(q_nope, q_rope, cache, tables, lens, splits, m, scale)

    def latent_decodes(self, q_nope, q_rope, cache, tables, lens, splits: int, m, scale: float) -> torch.Tensor:
        """Rows of one query token each: W_UK into the queries, the latent kernel, W_UV after. -> [rows, heads * v]."""
        from .kernels.latent import latent_decode  # imported with the kernels, only when they run

        q_latent = torch.einsum("thn,hnc->thc", q_nope, m.w_uk)
        self.launches += 1 if splits == 1 else 2
        self.latent_launches["decodes"] += 1
        out = latent_decode(q_latent, q_rope.contiguous(), cache, tables, lens, scale, splits)
        return torch.einsum("thc,hvc->thv", out, m.w_uv).flatten(1)

    def latent_chunks(self, q_nope, q_rope, cache, attn: AttentionMetadata, m, scale: float) -> torch.Tensor:
        """A step with prefill chunks. Its decode rows: latent_decodes. Its chunks: every chunk's context (its latents,
        the chunk's own included) decompressed by kv_b_proj in one matmul into each head's key (nope + rope) and value,
        both zero-padded to one power-of-two width (zeros add nothing to q . k, and the output's padding is cut off),
        laid out as a scratch paged cache, each context in whole blocks of its own; then the mixed kernel, one launch,
        causal within each chunk as for any prefill. -> [N, heads * v]."""
        from .kernels.attention import mixed_attention

        cu, heads, v = attn.cu_seqlens_q, q_nope.shape[1], m.w_uv.shape[1]
        out = q_nope.new_empty(q_nope.shape[0], heads * v)
        decodes = [i for i in range(len(cu) - 1) if cu[i + 1] - cu[i] == 1]
        chunks = [i for i in range(len(cu) - 1) if cu[i + 1] - cu[i] > 1]
        if decodes:
            rows = to_device(torch.tensor([cu[i] for i in decodes]), q_nope.device)
            picked = to_device(torch.tensor(decodes), q_nope.device)
            out[rows] = self.latent_decodes(q_nope[rows], q_rope[rows], cache, attn.mixed.block_tables[picked],
                                            attn.mixed.seq_lens_k[picked], 1, m, scale)
        if not chunks:
            return out
        block = 16
        lengths = [len(attn.context_slots[i]) for i in chunks]
        spans = [-(-n // block) for n in lengths]  # each context's blocks in the scratch cache
        slots = torch.cat([torch.nn.functional.pad(attn.context_slots[i], (0, span * block - n), value=0)
                           for i, n, span in zip(chunks, lengths, spans)])  # padding rows: entry 0, never attended
        keys, values = decompress(gather_kv(cache, slots)[:, 0], m, heads)  # [padded tokens, heads, nope + rope / v]
        width = 1 << (max(keys.shape[-1], v, 16) - 1).bit_length()
        pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[-1]))  # noqa: E731
        keys, values = pad(keys).view(-1, block, heads, width), pad(values).view(-1, block, heads, width)
        starts = [0]
        for span in spans[:-1]:
            starts.append(starts[-1] + span)
        tables = torch.zeros(len(chunks), max(spans), dtype=torch.int32)
        for r, (first, span) in enumerate(zip(starts, spans)):
            tables[r, :span] = torch.arange(first, first + span, dtype=torch.int32)
        rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in chunks])
        rows = to_device(rows, q_nope.device)
        q = pad(torch.cat([q_nope[rows], q_rope[rows]], dim=-1)).contiguous()  # [chunk tokens, heads, width]
        query_lens = [cu[i + 1] - cu[i] for i in chunks]
        as_tensor = lambda x: to_device(torch.tensor(x, dtype=torch.int32), q_nope.device)  # noqa: E731
        self.launches += 1
        self.latent_launches["chunks"] += 1
        self.latent_launches["beside decodes"] += bool(decodes)
        o = mixed_attention(q, keys, values, to_device(tables, q_nope.device), as_tensor(cumulative(query_lens)),
                            as_tensor(lengths), scale, max(query_lens))
        out[rows] = o[..., :v].flatten(1)
        return out

    # ---- the metadata of a captured decode step ----------------------------------------------------------------
    def graph_num_splits(self, size: int, max_context: int) -> int:
        """Flash decoding's split count for a graph of `size` decode rows: fixed when the graph is captured, so
        chosen for the longest context the graph may meet (the model's length). A context shorter than that leaves
        some splits empty (m = -inf, l = 0), which the merge adds as zero."""
        from .kernels.decode import choose_num_splits

        return choose_num_splits(size, self.config.num_kv_heads, max_context, **self.split_rule)

    def graph_metadata(self, inputs, size: int, num_splits: int, query_len: int = 1) -> AttentionMetadata:
        """A step of `size` decodes as the kernels read it, from the static buffers of cuda_graphs.py's
        StaticDecodeInputs: the same tensors at the same addresses every step (a graph replays their addresses),
        only their contents change. Each decode is one tile of one token: tile i is sequence i, token 0.
        query_len tokens per row (a verify step, StaticVerifyInputs): the mixed kernel's tiles of those
        rows, cut once here, as the eager path cuts them (the tile map is a constant of the graph)."""
        from .kernels.attention import tile_map, tile_rows

        q = query_len
        attn = AttentionMetadata([i * q for i in range(size + 1)], inputs.slot_mapping[:size * q], [], [])
        tables, lens = inputs.block_tables[:size], inputs.seq_lens[:size]
        if num_splits > 1:
            attn.decode = DecodeMetadata(size, tables, lens, num_splits)
            return attn
        group = self.config.num_heads // self.config.num_kv_heads
        block_m = tile_rows(q, group)
        if q == 1:
            tile_seq, tile_first = inputs.tile_seq[:size], inputs.tile_first[:size]
        else:
            tile_seq, tile_first = (t.to(self.device) for t in tile_map(torch.full((size,), q), block_m // group))
        attn.mixed = MixedMetadata(tables, inputs.cu_seqlens_q[:size + 1], lens, q, tile_seq, tile_first, block_m)
        return attn


BACKENDS = {"torch": TorchAttention, "triton": TritonAttention}  # engine.py's choose_attention_backend -> class
