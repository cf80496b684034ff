"""The offline engine, LLM: requests in, RequestOutputs out. add_request makes a Sequence; each step() asks the
scheduler which sequences run and with how many tokens, has the model runner run one forward for all of them and
sample, then grows the sequences, finishes those that are done (their blocks freed) and returns the outputs.
generate() and chat() are add_request plus step() until every request is done. engine.py only wires the parts:

    sequence.py       one request's state (status, tokens, num_computed_tokens, block table)
    scheduler.py      which sequences run in the next step, and how many tokens each
    block_manager.py  which cache blocks hold which tokens (paged KV, prefix caching)
    model_runner.py   sequences -> tensors, the forward, the sampler; owns the model and the KV cache
    attention.py      how attention runs, one object per backend: its metadata per step, its math per layer

Options, with vLLM's names: attention_backend ("triton", the default on CUDA, or "torch", the default elsewhere;
the kernels run on a CPU only in Triton's interpreter) and kv_cache_dtype ("auto" or "int8").

What each part does (with the option that turns a part off, the outputs equal the engine's without it):
- Mixed batches: every row of a step, decodes and prefill chunks alike, is attended by one kernel launch per layer
  (kernels/attention.py's mixed_attention); a step of decodes only, with contexts long enough to split, runs flash
  decoding (kernels/decode.py). The scheduler has no phases: every running request catches up on its tokens
  without KV under one token budget, the least behind first (a decode is a request one token behind).
- Fusion: the layer's small operators run as three fused kernels (kernels/fused.py).
- kv_cache_dtype="int8" keeps K and V as int8 with one fp32 scale per (token, KV head), scale = max|x| / 127
  (model.py's quantize_kv and dequantize_kv; the kernels dequantise each tile they load): about 1.9x the tokens in
  the same memory, for a small rounding error in every key and value. "auto" keeps the model's dtype.
"""
from __future__ import annotations

import time

import torch

from shared import (DEFAULT_MODEL, RequestMetrics, RequestOutput, SamplingParams, Tokenizer, check_conversations,
                    check_engine_options, check_length, normalize_prompts, normalize_sampling_params,
                    resolve_device_dtype, resolve_model)

from .attention import BACKENDS
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .kv_spec import KV_CACHE_DTYPES, check_kv_cache_dtype  # noqa: F401
from .model import CausalLM
from .model_runner import CPU_DEFAULT_KV_TOKENS, ModelRunner, kv_bytes_per_token, kv_pool_blocks  # noqa: F401
from .sampler import request_seed
from .scheduler import Scheduler
from .sequence import Finish, Sequence
from .timers import PhaseTimers


def top_logprobs(logprobs: torch.Tensor, chosen: int, n: int) -> dict[int, float]:
    """The n most likely tokens and the chosen one: {token_id: logprob}."""
    values, ids = torch.topk(logprobs, n) if n > 0 else (logprobs[:0], logprobs[:0].long())
    result = {int(i): float(v) for i, v in zip(ids, values)}
    result[chosen] = float(logprobs[chosen])
    return result


def choose_attention_backend(asked: str | None, device: torch.device) -> str:
    """"triton" (the kernels for prefill chunks and decodes) or "torch" (step14_7's loop). Default: triton on
    CUDA when Triton is installed, torch elsewhere. On a CPU the kernel runs only in Triton's interpreter."""
    import importlib.util
    import os

    has_triton = importlib.util.find_spec("triton") is not None
    if asked is None:
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if asked not in ("triton", "torch"):
        raise ValueError(f"attention_backend must be 'triton', 'torch' or None, got {asked!r}")
    if asked == "triton" and not has_triton:
        raise ValueError("attention_backend='triton': Triton is not installed")
    if asked == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' on the CPU runs only in Triton's interpreter: set TRITON_INTERPRET=1")
    return asked


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, device=None, dtype=None, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, max_kv_tokens: int | None = None, block_size: int = 16,
                 enable_prefix_caching: bool = True, gpu_memory_utilization: float = 0.9,
                 attention_backend: str | None = None, kv_cache_dtype: str = "auto"):
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)  # "auto" or "int8", checked before anything loads
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        if max_kv_tokens is None and self.device.type == "cpu":
            max_kv_tokens = CPU_DEFAULT_KV_TOKENS  # the CPU knob; on CUDA, None = size the pool from free memory
        check_engine_options(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             gpu_memory_utilization=gpu_memory_utilization, max_kv_tokens=max_kv_tokens,
                             block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                             may_be_none=("max_kv_tokens",))
        self.model_name = str(model)
        model_dir = resolve_model(model)
        self.tokenizer = Tokenizer(model_dir)
        self.model = CausalLM.from_pretrained(model_dir, self.device, self.dtype)
        # One object decides how attention runs: its metadata every step (the runner), its attention every layer
        # (the model). attention.py: TorchAttention (step14_7's loop) or TritonAttention (the kernels).
        backend = BACKENDS[choose_attention_backend(attention_backend, self.device)]
        self.model.attention_backend = backend(self.model.config, self.device)
        if backend.name == "triton":  # the kernels' path: the layer's elementwise groups fused too (kernels/fused.py)
            from .kernels.fused import TritonLayerOps
            self.model.ops = TritonLayerOps()
        self.stats = {"prefill_chunks": 0, "decode_steps": 0, "decode_rows": 0, "forwards": 0}  # rows: summed
        self.timers = PhaseTimers(self.device)  # where each step's time goes (timers.py)
        self.runner = ModelRunner(self.model, self.device, self.dtype, self.timers, self.stats, kv_cache_dtype,
                                  max_num_seqs=max_num_seqs)
        self.max_model_len = self.model.config.max_position_embeddings
        self.memory = self.runner.allocate_kv_cache(max_kv_tokens, block_size,
                                                    min(max_num_batched_tokens, self.max_model_len),
                                                    gpu_memory_utilization)
        num_blocks = self.memory["num_blocks"]
        kv = self.memory["kv_spec"].describe()  # its dtype and scales
        self.backend = (f"plain PyTorch, {self.model.config.model_type} (fused qkv / gate-up), continuous batching + "
                        f"chunked prefill + preemption, paged KV ({num_blocks} blocks of {block_size}, KV dtype {kv}, "
                        f"sized by {self.memory['sized_by']}), "
                        f"prefix caching {'on' if enable_prefix_caching else 'off'}, "
                        f"attention: {self.model.attention_backend.name}, elementwise: "
                        f"{'fused kernels' if self.model.ops.name == 'triton' else 'torch operators'}")
        self.kv_cache = self.runner.kv_cache  # one tensor for all layers (model.py, KVCache)
        # a request's released blocks free its block-table row in the runner
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching,
                                          on_release=self.runner.block_tables.release)
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, self.block_manager)
        self.next_request_id = 0
        self.finished_outputs: list[RequestOutput] = []  # finished, not handed out yet (see generate)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = normalize_prompts(prompts, self.tokenizer, self.model.config.vocab_size)
        params = normalize_sampling_params(sampling_params, len(prompts), SamplingParams(temperature=0))
        for i, ((_, ids), sp) in enumerate(zip(prompts, params)):
            check_length(i, len(ids), sp, self.max_model_len)
            self._check_fits_kv_budget(i, len(ids), sp)
        # Everything is checked above, before anything is queued.
        request_ids = [self._add(text, ids, sp) for (text, ids), sp in zip(prompts, params)]
        mine: dict[str, RequestOutput | None] = dict.fromkeys(request_ids)
        try:
            while None in mine.values():  # until all of ours have finished
                if not self.has_unfinished_requests():
                    raise RuntimeError("generate(): the scheduler lost a request")  # a bug, never a silent hang
                for out in self._step():
                    if out.request_id in mine:
                        mine[out.request_id] = out
                    else:  # a request queued with add_request(): a later step() hands it out
                        self.finished_outputs.append(out)
        except BaseException:  # the caller gets the error, not our outputs: drop what is left of ours
            for request_id, out in mine.items():
                if out is None:
                    self.abort_request(request_id)
            raise
        return list(mine.values())

    def add_request(self, prompt, sampling_params: SamplingParams | None = None) -> str:
        """Queue one request (a string or token ids); it joins the running batch at a coming step()."""
        (text, ids), = normalize_prompts([prompt], self.tokenizer, self.model.config.vocab_size, one=True)
        sp = normalize_sampling_params(sampling_params, 1, SamplingParams(temperature=0))[0]
        check_length(0, len(ids), sp, self.max_model_len)
        self._check_fits_kv_budget(0, len(ids), sp)
        return self._add(text, ids, sp)

    def _check_fits_kv_budget(self, index: int, prompt_len: int, sp: SamplingParams) -> None:
        """A request that could never fit in the KV pool, even alone, is refused now instead of waiting forever."""
        bm = self.block_manager
        if bm.blocks_for(prompt_len + sp.max_tokens) > bm.num_blocks:
            raise ValueError(f"prompts[{index}]: prompt ({prompt_len} tokens) + max_tokens ({sp.max_tokens}) = "
                             f"{prompt_len + sp.max_tokens} exceeds max_kv_tokens ({bm.num_blocks * bm.block_size} "
                             f"= {bm.num_blocks} blocks of {bm.block_size}): it could never fit in the KV pool")

    def _add(self, text: str | None, ids: list[int], sp: SamplingParams) -> str:
        request_id = str(self.next_request_id)
        self.next_request_id += 1
        self.scheduler.add(Sequence(request_id, text, ids, sp, request_seed(sp),
                                   RequestMetrics(time.perf_counter()), logprobs=[] if sp.logprobs is not None else None,
                                   detokenizer=IncrementalDetokenizer(self.tokenizer)))
        return request_id

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_request(self, request_id: str) -> None:
        """Drop a waiting or running request: it leaves the queues, releases its KV memory and is never returned."""
        r = self.scheduler.requests.get(request_id)
        if r is not None:
            self.scheduler.finish(r)

    def step(self) -> list[RequestOutput]:
        """One iteration: every running request computes the tokens the scheduler gave it (one for a decode, a
        chunk of its prompt otherwise), all in one forward within the token budget. Returns the requests that finished in this iteration,
        and any that finished earlier without being handed out (while another caller's generate() ran).
        An idle engine returns []."""
        handed_out, self.finished_outputs = self.finished_outputs, []
        return handed_out + self._step()

    def _step(self) -> list[RequestOutput]:
        timer = self.timers.phase
        with timer("schedule"):
            work = self.scheduler.schedule()  # [(sequence, tokens to compute)]: decodes and chunks alike
        scheduled = [seq for seq, _ in work]
        if not scheduled:  # idle: nothing waits or runs
            return []
        self.timers.steps += 1
        with timer("schedule"):
            decodes = sum(n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens for seq, n in work)
            self.stats["decode_steps"] += bool(decodes)
            self.stats["decode_rows"] += decodes
            self.stats["prefill_chunks"] += len(work) - decodes
        try:
            logits = self.runner.execute(work)  # one row per scheduled sequence, in that order
            with timer("schedule"):
                self.scheduler.postprocess(work)
                # Decodes get a token; a chunk gets one only if it was its prompt's last (its logits are the next
                # token's), otherwise its row is dropped.
                rows = [i for i, seq in enumerate(scheduled) if seq.num_computed_tokens == seq.num_tokens]
            if rows:  # one sampler call for the whole batch
                with timer("sample"):
                    sampled, row_logits = [scheduled[i] for i in rows], logits[rows]
                self._append_tokens(sampled, row_logits)
        except BaseException:  # a failure mid-step leaves these sequences half-updated: drop them, then re-raise
            for seq in scheduled:
                self.abort_request(seq.request_id)
            raise
        with timer("schedule"):
            finished = [seq for seq in scheduled if seq.finish is not None]
            for seq in finished:
                self.scheduler.finish(seq)  # its blocks are released: free again, or evictable if cached
        with timer("detokenize"):
            return [seq.to_output() for seq in finished]

    def chat(self, conversations, sampling_params=None) -> list[RequestOutput]:
        prompts = [self.tokenizer.apply_chat_template(c) for c in check_conversations(conversations)]
        return self.generate(prompts, sampling_params)

    def _check_stop(self, r: Sequence) -> Finish | None:
        """-> a Finish once the request must end, else None. Text grows through the request's detokenizer, and
        stop strings are looked for only where new text could complete one: O(1) per token, not O(n)."""
        sp, last = r.params, r.output_ids[-1]
        if last in self.tokenizer.eos_token_ids and not sp.ignore_eos:
            return Finish("stop", None, r.detokenizer.final_text())  # the stop token is not in the text
        if last in sp.stop_token_ids:
            return Finish("stop", last, r.detokenizer.final_text())
        new = r.detokenizer.add(last)
        if new and sp.stop:
            text = r.detokenizer.text
            # A stop string that ends in the new text starts at most len(stop) - 1 characters before it.
            window_start = max(0, len(text) - len(new) - max(len(s) for s in sp.stop) + 1)
            window = text[window_start:]
            hits = [(window.find(s), s) for s in sp.stop if s in window]
            if hits:
                cut, stop = min(hits)  # the earliest stop string; the text ends just before it
                return Finish("stop", stop, text[:window_start + cut])
        if len(r.output_ids) >= sp.max_tokens:
            return Finish("length", None, r.detokenizer.final_text())
        return None

    def _append_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token for each sequence from its row of logits [B, vocab] in one sampler call (the model
        runner's), record them, check which sequences must stop."""
        next_ids, chosen, token_logprobs = self.runner.sample(seqs, logits)
        with self.timers.phase("sample"):
            now = time.perf_counter()
            for seq, row, next_id, logprob in zip(seqs, token_logprobs, next_ids, chosen):
                seq.cumulative_logprob += logprob
                if seq.logprobs is not None:
                    seq.logprobs.append(top_logprobs(row, next_id, seq.params.logprobs))
                seq.append_token(next_id)
                seq.metrics.token_times.append(now)
                seq.metrics.first_token_time = seq.metrics.first_token_time or now
        with self.timers.phase("detokenize"):
            for seq in seqs:
                seq.finish = self._check_stop(seq)
                if seq.finish is not None:
                    seq.metrics.finished_time = now
