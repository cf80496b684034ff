"""The model runner: the engine's one door to the model.

It owns the model and the KV cache (allocates it, sized from the device's memory), turns the scheduled
sequences into the tensors the model reads (input ids, positions, one AttentionMetadata), runs the forward,
and samples the next tokens. The scheduler and the block manager never touch a tensor; the model never
sees a sequence.
"""
from __future__ import annotations

import torch

from .model import AttentionMetadata, CausalLM, KVCache, causal_mask, context_slots, slot_mapping
from .sampler import sample_batch
from .sequence import Sequence

CPU_DEFAULT_KV_TOKENS = 32768  # on the CPU, max_kv_tokens sizes the cache (default 32768 tokens)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V of one token in every layer: 2 x layers x kv_heads x head_dim x bytes per element."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element


def kv_pool_blocks(total_bytes: int, gpu_memory_utilization: float, used_bytes: int, bytes_per_block: int) -> int:
    """The KV cache's size in blocks: the share of the device we may use, minus what the weights and the peak of
    a warm-up forward took, in whole blocks (vLLM's gpu_memory_utilization, same meaning)."""
    return max(int(total_bytes * gpu_memory_utilization) - used_bytes, 0) // bytes_per_block


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor built on the CPU -> device. On CUDA: one copy from pinned (page-locked) memory, queued without
    making the CPU wait (the GPU runs it before the kernels that read the tensor). On the CPU: no copy at all."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype, timers, stats: dict):
        self.model, self.device, self.dtype = model, device, dtype
        self.timers = timers  # the engine's phase timers: "prepare inputs", "forward" and "sample" are ours
        self.stats = stats  # the engine's counters: we count model forwards
        self.kv_cache: KVCache | None = None

    # ---- the KV cache -------------------------------------------------------------------------------------
    def allocate_kv_cache(self, max_kv_tokens: int | None, block_size: int, warmup_tokens: int,
                          gpu_memory_utilization: float) -> dict:
        """Size the cache and allocate it; bind it to the model. Given max_kv_tokens (the CPU default, or a
        choice): that many tokens. Else (CUDA): profile one forward of the largest step (warmup_tokens prompt
        tokens), then give the cache what is left of gpu_memory_utilization x the device's memory after the
        weights and that forward's peak. -> what was decided (blocks, bytes per token, why)."""
        per_token = kv_bytes_per_token(self.model.config, self.dtype)
        memory = {"bytes_per_token": per_token, "block_size": block_size}
        if max_kv_tokens is not None:
            memory.update(num_blocks=max_kv_tokens // block_size, sized_by="max_kv_tokens")
        else:
            used = self._profile_peak_bytes(warmup_tokens, block_size)
            total = torch.cuda.get_device_properties(self.device).total_memory
            num_blocks = kv_pool_blocks(total, gpu_memory_utilization, used, per_token * block_size)
            if num_blocks * block_size < warmup_tokens:
                share = total * gpu_memory_utilization / 2**30
                raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}: {share:.2f} GiB of the device's "
                                 f"{total / 2**30:.2f} GiB, minus {used / 2**30:.2f} GiB for weights and a warm-up "
                                 f"forward, leaves room for {num_blocks * block_size} KV tokens, fewer than one "
                                 f"step's {warmup_tokens}; raise gpu_memory_utilization or lower "
                                 "max_num_batched_tokens")
            memory.update(num_blocks=num_blocks, sized_by=f"gpu_memory_utilization={gpu_memory_utilization}",
                          total_bytes=total, used_bytes=used, utilization=gpu_memory_utilization)
        self.kv_cache = self.model.kv_cache = KVCache(self.model.config, memory["num_blocks"], block_size,
                                                      self.device, self.dtype)
        return memory

    def _profile_peak_bytes(self, num_tokens: int, block_size: int) -> int:
        """Run one forward of num_tokens prompt tokens through a scratch cache; return the peak bytes allocated
        (weights + the largest activations), without the scratch cache itself (the real cache replaces it)."""
        num_blocks = -(-num_tokens // block_size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model.kv_cache = KVCache(self.model.config, num_blocks, block_size, self.device, self.dtype)
        input_ids = torch.zeros(1, num_tokens, dtype=torch.long, device=self.device)  # [1, num_tokens]
        positions = torch.arange(num_tokens, device=self.device)[None]  # [1, num_tokens]
        self.model.forward(input_ids, positions,
                           self._metadata([0], num_tokens, [list(range(num_blocks))], block_size))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.model.kv_cache = None
        torch.cuda.empty_cache()
        return peak - num_blocks * block_size * kv_bytes_per_token(self.model.config, self.dtype)

    # ---- one engine step ----------------------------------------------------------------------------------
    def prepare_decode(self, seqs: list[Sequence]):
        """B sequences that decode one token each -> input ids and positions [B, 1], and their metadata."""
        input_ids = to_device(torch.tensor([[s.token_ids[-1]] for s in seqs]), self.device)
        positions = to_device(torch.tensor([[s.num_computed_tokens] for s in seqs]), self.device)
        return input_ids, positions, self._metadata([s.num_computed_tokens for s in seqs], 1,
                                                    [s.block_table for s in seqs])

    def prepare_prefill(self, seq: Sequence, n: int):
        """The next n prompt tokens of one sequence -> input ids and positions [1, n], and its metadata."""
        start = seq.num_computed_tokens
        input_ids = to_device(torch.tensor([seq.token_ids[start:start + n]]), self.device)
        positions = torch.arange(start, start + n, device=self.device)[None]
        return input_ids, positions, self._metadata([start], n, [seq.block_table])

    def _metadata(self, starts: list[int], num_new: int, block_tables: list[list[int]], block_size=None):
        """The attention metadata of B rows of num_new tokens each, with the slot mapping, each row's context slots and causal mask
        computed once here."""
        block_size = block_size or self.kv_cache.data.shape[3]
        slots = to_device(slot_mapping(starts, num_new, block_tables, block_size), self.device)
        context = [context_slots(table, start + num_new, block_size, self.device)
                   for start, table in zip(starts, block_tables)]
        masks = [causal_mask(start, num_new, self.device) for start in starts]  # None for decode rows
        return AttentionMetadata(starts, block_tables, slots, context, masks)

    def execute(self, decodes: list[Sequence], chunks: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run the scheduled work: the decode rows in one forward, then each prefill chunk in its own (prompts
        differ in length). -> the logits of each decode row, then of each chunk's last token: [B, vocab]."""
        timer, batches = self.timers.phase, []
        with timer("prepare inputs"):
            if decodes:
                batches.append(self.prepare_decode(decodes))
            batches += [self.prepare_prefill(seq, n) for seq, n in chunks]
        logits = []
        with timer("forward"):
            for input_ids, positions, attn in batches:
                self.stats["forwards"] += 1
                logits.append(self.model.forward(input_ids, positions, attn))
        return torch.cat(logits)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[float], torch.Tensor]:
        """One sampler call for the batch: logits [B, vocab] -> (next token ids, their logprobs, all logprobs)."""
        with self.timers.phase("sample"):
            token_logprobs = torch.log_softmax(logits, dim=-1)  # [B, vocab]
            next_ids = sample_batch(logits, [s.params for s in seqs], [s.seed for s in seqs],
                                    [len(s.output_ids) for s in seqs])
            rows = torch.arange(len(seqs), device=logits.device)
            chosen = token_logprobs[rows, torch.tensor(next_ids, device=logits.device)].tolist()
        return next_ids, chosen, token_logprobs
