"""The attention backends: one object per way of running attention, picked once by the engine (engine.py).

    TorchAttention   step14_7's loop: each sequence gathers its context's K/V and attends on its own
    TritonAttention  the kernels (kernels/), no Python loop: every decode of a step in one flash-decoding pass
                     per layer (kernels/decode.py), every prefill chunk in one launch (kernels/attention.py)

Each object does two things, and is the only code that knows how its attention runs:

    metadata(work, slots, block_size)   once per step, called by the model runner: the scheduled work
                                        [(sequence, new tokens)] -> one AttentionMetadata, for every layer
    forward(q, k_cache, v_cache, attn)  once per layer, called by the model once it has written the new tokens'
                                        K/V into the cache: q [N, heads, head_dim] -> [N, heads * head_dim]
"""
from __future__ import annotations

from itertools import chain

import torch

from .model import (AttentionMetadata, DecodeMetadata, PrefillMetadata, causal_mask, context_slots, gather_kv,
                    grouped_attention)
from .model_runner import to_device


def cumulative(query_lens) -> list[int]:
    """Each sequence's new-token count -> where its tokens start in the flat batch: [S + 1], (0, ..., N)."""
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    return cu


def num_decodes(work) -> int:
    """How many sequences of the work are decodes (one new token, the newest); the scheduler puts them first."""
    return sum(n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens for seq, n in work)


def padded_block_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables of different lengths -> int32 [S, widest] on the CPU, each row padded with 0 (entries past a
    sequence's context, never read): one tensor of all the ids, written into the rows by one boolean mask."""
    lengths = torch.tensor([len(t) for t in tables])  # [S]
    padded = torch.zeros(len(tables), int(lengths.max()), dtype=torch.int32)
    padded[torch.arange(padded.shape[1]) < lengths[:, None]] = torch.tensor(list(chain.from_iterable(tables)),
                                                                              dtype=torch.int32)
    return padded


class TorchAttention:
    """step14_7's loop, in plain PyTorch: every sequence attends on its own, to the K/V gathered from its
    context's slots, with its causal mask (none for a decode). The kernels' reference math."""

    name = "torch"

    def __init__(self, config, device: torch.device):
        self.config, self.device = config, device

    def metadata(self, work, slots: torch.Tensor, block_size: int) -> AttentionMetadata:
        """Every sequence loops: its context slots and causal mask, computed once here for every layer."""
        return self.loop_metadata(work, slots, block_size, looped=len(work))

    def loop_metadata(self, work, slots: torch.Tensor, block_size: int, looped: int) -> AttentionMetadata:
        """The metadata of the flat batch (cumulative query lengths, the slot mapping [N], on the device), with the
        context slots and causal masks of its first `looped` sequences: those that attend in the loop."""
        context = [context_slots(seq.block_table, seq.num_computed_tokens + n, block_size, self.device)
                   for seq, n in work[:looped]]
        masks = [causal_mask(seq.num_computed_tokens, n, self.device) for seq, n in work[:looped]]  # None: decodes
        return AttentionMetadata(cumulative(n for _, n in work), slots, context, masks)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        return torch.cat(self.loop(q, k_cache, v_cache, attn))  # [N, heads * head_dim]

    def loop(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata) -> list:
        """The looped sequences one by one -> their outputs, each [T_i, heads * head_dim]."""
        outputs = []
        for i in range(len(attn.context_slots)):
            keys = gather_kv(k_cache, attn.context_slots[i])  # [context, kv_heads, head_dim]
            values = gather_kv(v_cache, attn.context_slots[i])
            q_i = q[attn.cu_seqlens_q[i]:attn.cu_seqlens_q[i + 1]]  # this sequence's new tokens: [T_i, heads, head_dim]
            outputs.append(grouped_attention(q_i, keys, values, attn.masks[i]))
        return outputs


class TritonAttention(TorchAttention):
    """The kernels, no Python loop: every decode of a step (first in the batch) in one flash-decoding pass per
    layer (kernels/decode.py: split + merge, or v2 where one part suffices), every prefill chunk in one launch
    (kernels/attention.py)."""

    name = "triton"

    def __init__(self, config, device: torch.device):
        super().__init__(config, device)
        if config.head_dim & (config.head_dim - 1) or config.head_dim < 16:  # the kernels' tiles: tl.arange, tl.dot
            raise ValueError(f"attention_backend='triton' (the default on CUDA): the kernels need head_dim to be a "
                             f"power of two >= 16, and this model's is {config.head_dim}; attention_backend='torch' "
                             "runs it")
        # Flash decoding's split rule (kernels/decode.py's choose_num_splits): the GPU's multiprocessor count, and
        # the shortest part worth a program of its own. On a CPU the count only changes how the work is cut.
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        self.split_rule = {"num_sms": sms, "min_tokens_per_split": 256}

    def metadata(self, work, slots: torch.Tensor, block_size: int) -> AttentionMetadata:
        """Nothing loops, so no sequence needs the loop's context slots or masks: the decodes get their block
        tables and lengths, the chunks theirs."""
        first = num_decodes(work)
        attn = self.loop_metadata(work, slots, block_size, looped=0)
        if first > 0:  # flash decoding: enough parts per context to fill the GPU, none too short
            from .kernels.decode import choose_num_splits  # imported with the kernels, only when they run

            tables, _, lens = self.kernel_tensors(work[:first])
            longest = max(seq.num_tokens for seq, _ in work[:first])
            splits = choose_num_splits(first, self.config.num_kv_heads, longest, **self.split_rule)
            attn.decode = DecodeMetadata(first, tables, lens, splits)
        if first < len(work):
            attn.prefill = self.prefill_metadata(work[first:], attn.cu_seqlens_q[first])
        return attn

    def kernel_tensors(self, work):
        """(sequence, new tokens) pairs -> the int32 device tensors the kernels read: block tables padded to the
        widest [S, max_blocks], cumulative query lengths [S + 1], context lengths after this step [S]."""
        tables = padded_block_tables([seq.block_table for seq, _ in work])  # [S, widest]
        lens = [seq.num_computed_tokens + n for seq, n in work]
        as_tensor = lambda x: to_device(torch.tensor(x, dtype=torch.int32), self.device)  # noqa: E731
        return to_device(tables, self.device), as_tensor(cumulative(n for _, n in work)), as_tensor(lens)

    def prefill_metadata(self, work, token_start: int) -> PrefillMetadata:
        """The prefill chunks as the flash-attention kernel reads them."""
        return PrefillMetadata(token_start, *self.kernel_tensors(work), max(n for _, n in work))

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        from .kernels.attention import paged_attention  # imported with the kernels, only when they run
        from .kernels.decode import flash_decode, paged_decode_v2

        c = self.config
        outputs = []
        if attn.decode is not None:  # flash decoding: a split kernel and a merge kernel
            d = attn.decode
            if d.num_splits == 1:  # the batch fills the GPU without splitting: step16's kernel, no merge
                out = paged_decode_v2(q[:d.num], k_cache, v_cache, d.block_tables, d.seq_lens, c.head_dim ** -0.5)
            else:
                out = flash_decode(q[:d.num], k_cache, v_cache, d.block_tables, d.seq_lens, c.head_dim ** -0.5,
                                   d.num_splits)
            outputs.append(out.reshape(d.num, c.num_heads * c.head_dim))
        if attn.prefill is not None:  # every prefill chunk of the step in one launch
            f = attn.prefill
            out = paged_attention(q[f.token_start:], k_cache, v_cache, f.block_tables, f.cu_seqlens_q, f.seq_lens_k,
                                  c.head_dim ** -0.5, f.max_query_len)
            outputs.append(out.reshape(-1, c.num_heads * c.head_dim))
        return torch.cat(outputs)  # [N, heads * head_dim]


BACKENDS = {"torch": TorchAttention, "triton": TritonAttention}  # engine.py's choose_attention_backend -> class
