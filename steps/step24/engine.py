"""The offline engine, LLM: requests in, RequestOutputs out. add_request makes a Sequence; each step() asks the
scheduler which sequences run and with how many tokens, has the model runner run one forward for all of them and
sample, then grows the sequences, finishes those that are done (their blocks freed) and returns the outputs.
generate() and chat() are add_request plus step() until every request is done. engine.py only wires the parts:

    sequence.py       one request's state (status, tokens, num_computed_tokens, block table)
    scheduler.py      which sequences run in the next step, and how many tokens each
    block_manager.py  which cache blocks hold which tokens (paged KV, prefix caching)
    model_runner.py   sequences -> tensors, the forward, the sampler; owns the model and the KV cache
    attention.py      how attention runs, one object per backend: its metadata per step, its math per layer
    worker.py         one rank's build (its share of the model, the backend, the KV cache, the CUDA graphs) and
                      the tensor-parallel worker processes
    parallel.py       how the model is cut over N ranks, and the collectives that join them

Options, with vLLM's names: attention_backend ("triton", the default on CUDA, or "torch", the default elsewhere;
the kernels run on a CPU only in Triton's interpreter), kv_cache_dtype ("auto" or "int8"), enforce_eager (False:
decode steps replay CUDA graphs where they can; llm.cuda_graphs says whether they do and why not) and
tensor_parallel_size (default 1: no worker, no collective).

What each part does (with the option that turns a part off, the outputs equal the engine's without it):
- Mixed batches: every row of a step, decodes and prefill chunks alike, is attended by one kernel launch per layer
  (kernels/attention.py's mixed_attention); a step of decodes only, with contexts long enough to split, runs flash
  decoding (kernels/decode.py). The scheduler has no phases: every running request catches up on its tokens
  without KV under one token budget, the least behind first (a decode is a request one token behind).
- Fusion: the layer's small operators run as three fused kernels (kernels/fused.py).
- kv_cache_dtype="int8" keeps K and V as int8 with one fp32 scale per (token, KV head), scale = max|x| / 127
  (model.py's quantize_kv and dequantize_kv; the kernels dequantise each tile they load): about 1.9x the tokens in
  the same memory, for a small rounding error in every key and value. "auto" keeps the model's dtype.
- CUDA graphs. The decode forward is recorded once per batch-size bucket (1, 2, 4, 8, then every 8) and
  replayed (cuda_graphs.py): one graph launch for the host instead of a kernel launch per operator. The batch is
  padded to its bucket, its inputs copied into static buffers from pinned staging; padding rows write to a scratch
  block. Steps with prompt chunks run eagerly. The host work around the forward is cut too: one wait for the GPU
  per step, to read the sampled tokens (model_runner.py's read_back), and sequences compare by identity.
- Tensor parallelism. This process is rank 0 (scheduler, block manager, sampler); N - 1 worker processes
  (worker.py, started with the spawn method) hold their share of every layer and of the KV cache. Each step rank 0
  broadcasts the step's inputs and every rank runs the same forward, joined by two all-reduces per layer (NCCL
  between GPUs, gloo between CPU processes); the logits are gathered on rank 0, which samples. shutdown(), the
  engine going away and this process exiting all stop the workers; a worker that dies is an error at the next step.
- What a streaming engine needs (async_llm.py's AsyncLLM runs this LLM in a thread of its own):
  step(partial=True) also returns the requests that got a token and go on, their text held back by the longest stop
  string's length minus one, so that a later stop string never takes back text already sent; add_request takes the
  caller's request_id; abort_request returns what it dropped. A step that fails fails one request at most: alone,
  its request is dropped (its caller gets the error); beside others the culprit is not known, so each of them is put
  back, preempted (its tokens kept, its KV recomputed), and runs alone until it gets a token (_fail_step, the
  scheduler's suspects): only a request whose own inputs fail a step fails, and the others get the tokens they would
  have had. The step raises its error all the same (its caller may know better: step26's core dies of a device
  error). max_logprobs (vLLM's option, default 20) bounds the logprobs a request asks for, checked with the request.
"""
from __future__ import annotations

import time
import weakref

import torch

from shared import (DEFAULT_MODEL, RequestMetrics, RequestOutput, SamplingParams, Tokenizer, check_conversations,
                    check_engine_options, check_length, check_logprobs, check_max_logprobs, normalize_prompts,
                    normalize_sampling_params, resolve_device_dtype, resolve_model)

from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .kv_spec import KV_CACHE_DTYPES, check_kv_cache_dtype  # noqa: F401
from .model import ModelConfig  # noqa: F401
from .model_runner import CPU_DEFAULT_KV_TOKENS, kv_bytes_per_token, kv_pool_blocks, to_device  # noqa: F401
from .parallel import TensorParallel, WorkerError, check_tensor_parallel_size, rank_device
from .sampler import request_seed
from .scheduler import Scheduler
from .sequence import Finish, Sequence
from .worker import Workers, build_rank, start_tensor_parallel, stop_tensor_parallel


def check_enforce_eager(enforce_eager) -> bool:
    """enforce_eager must be a bool (vLLM's option): True runs every step eagerly, False replays CUDA graphs."""
    if not isinstance(enforce_eager, bool):
        raise ValueError(f"enforce_eager must be True or False, got {enforce_eager!r}")
    return enforce_eager


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
                 attention_backend: str | None = None, kv_cache_dtype: str = "auto", enforce_eager: bool = False,
                 tensor_parallel_size: int = 1, max_logprobs: int = 20):
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)  # "auto" or "int8", checked before anything loads
        self.enforce_eager = check_enforce_eager(enforce_eager)
        check_tensor_parallel_size(tensor_parallel_size)  # its type now; how it splits the model once it is found
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        if max_kv_tokens is None and self.device.type == "cpu":
            max_kv_tokens = CPU_DEFAULT_KV_TOKENS  # the CPU knob; on CUDA, None = size the pool from free memory
        check_engine_options(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             gpu_memory_utilization=gpu_memory_utilization, max_kv_tokens=max_kv_tokens,
                             block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                             max_logprobs=max_logprobs, may_be_none=("max_kv_tokens",))
        self.model_name = str(model)
        model_dir = resolve_model(model)
        # the split must fit the model's heads: checked on its config, before any process starts
        config = ModelConfig.from_json(model_dir / "config.json")
        self.tensor_parallel_size = check_tensor_parallel_size(tensor_parallel_size, config, self.device)
        self.max_logprobs = check_max_logprobs(max_logprobs, config.vocab_size)  # a request's most logprobs
        self.tokenizer = Tokenizer(model_dir)
        options = dict(dtype=self.dtype, attention_backend=choose_attention_backend(attention_backend, self.device),
                       kv_cache_dtype=kv_cache_dtype, enforce_eager=self.enforce_eager, max_num_seqs=max_num_seqs,
                       max_kv_tokens=max_kv_tokens, block_size=block_size,
                       warmup_tokens=min(max_num_batched_tokens, config.max_position_embeddings),
                       gpu_memory_utilization=gpu_memory_utilization)
        self.is_shut_down = False  # shutdown() sets it: nothing runs after
        self.workers: Workers | None = None
        if self.tensor_parallel_size == 1:
            self.tp = TensorParallel()
        else:  # the workers start, then every rank builds its share; rank 0 is this process
            self.device = rank_device(self.device, 0)
            self.workers, self.tp = start_tensor_parallel(self.tensor_parallel_size, self.device, model_dir, options)
        self._finalizer = weakref.finalize(self, stop_tensor_parallel, self.workers, self.tp) if self.workers else None
        try:
            self.runner, self.memory, self.cuda_graphs = build_rank(model_dir, self.device, self.tp, **options)
            if self.workers is not None:
                self.workers.wait_ready()
        except BaseException as e:  # a worker's own error says more than the closed connection rank 0 saw
            # (a ValueError of rank 0's own is the caller's: a bad option or checkpoint, which the workers share)
            failure = (self.workers.failure(wait_s=5)
                       if self.workers and not isinstance(e, (WorkerError, ValueError)) else None)
            self.shutdown()
            if failure:
                raise failure from e
            raise
        self.runner.workers = self.workers  # rank 0 sends each step to the workers before running it
        self.model, self.stats, self.timers = self.runner.model, self.runner.stats, self.runner.timers
        self.stats["requeued_after_failure"] = 0  # requests put back by a step that failed beside them
        self.max_model_len = self.model.config.max_position_embeddings
        num_blocks = self.memory["num_blocks"]
        if self.cuda_graphs["enabled"]:
            sizes = self.cuda_graphs["sizes"]
            graphs = (f"CUDA graphs: {len(sizes)} captured (decode batches of {', '.join(map(str, sizes[:5]))}"
                      f"{' .. ' + str(sizes[-1]) if len(sizes) > 5 else ''}), replayed for steps of decodes")
        else:
            graphs = f"CUDA graphs: off, eager ({self.cuda_graphs['reason']})"
        c = self.model.config
        split = (f"tensor parallel: {self.tp.size} ranks ({self.tp.backend}), each {c.num_heads} heads / "
                 f"{c.num_kv_heads} KV heads / {c.intermediate_size} MLP columns"
                 if self.tp.size > 1 else "tensor parallel: off (1 rank)")
        kv = self.memory["kv_spec"].describe()  # its dtype and scales
        self.backend = (f"plain PyTorch, {c.model_type} (fused qkv / gate-up), continuous batching + "
                        f"chunked prefill + preemption, paged KV ({num_blocks} blocks of {block_size}, KV dtype {kv}, "
                        f"sized by {self.memory['sized_by']}), "
                        f"prefix caching {'on' if enable_prefix_caching else 'off'}, "
                        f"attention: {self.model.attention_backend.name}, elementwise: "
                        f"{'fused kernels' if self.model.ops.name == 'triton' else 'torch operators'}, {graphs}, "
                        f"{split}")
        self.kv_cache = self.runner.kv_cache  # one tensor for all layers (model.py, KVCache)
        # a request's released blocks free its block-table row in the runner
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching,
                                          on_release=self.runner.block_tables.release)
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, self.block_manager)
        self.next_request_id = 0
        self.finished_outputs: list[RequestOutput] = []  # finished, not handed out yet (see generate)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the group, and free the KV cache and the CUDA graphs' memory
        now (runner.release): the engine serves nothing after this. Idempotent. The workers are also stopped when
        the engine is garbage-collected and when the process exits."""
        if self._finalizer is not None:
            self._finalizer()
        self.is_shut_down = True
        self.kv_cache = None  # before the runner hands the memory back: no reference to the cache may be left
        if getattr(self, "runner", None) is not None:
            self.runner.release()

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("LLM: this engine was shut down (shutdown() freed its KV cache): make a new LLM")

    def __del__(self):
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = normalize_prompts(prompts, self.tokenizer, self.model.config.vocab_size)
        params = normalize_sampling_params(sampling_params, len(prompts), SamplingParams(temperature=0))
        for i, ((_, ids), sp) in enumerate(zip(prompts, params)):
            check_length(i, len(ids), sp, self.max_model_len)
            check_logprobs(i, sp, self.max_logprobs)
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

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue one request (a string or token ids); it joins the running batch at a coming step().
        request_id names it (any string no queued or running request has; None: the engine numbers it)."""
        text, ids, sp = self.check_request(prompt, sampling_params)
        return self._add(text, ids, sp, request_id)

    def check_request(self, prompt, sampling_params: SamplingParams | None = None):
        """One request's checks, before anything is queued: -> (its text, its token ids, its SamplingParams).
        ValueError names what is wrong. Reads no engine state that a step changes (safe beside a running step)."""
        (text, ids), = normalize_prompts([prompt], self.tokenizer, self.model.config.vocab_size, one=True)
        sp = normalize_sampling_params(sampling_params, 1, SamplingParams(temperature=0))[0]
        check_length(0, len(ids), sp, self.max_model_len)
        check_logprobs(0, sp, self.max_logprobs)
        self._check_fits_kv_budget(0, len(ids), sp)
        return text, ids, sp

    def _check_fits_kv_budget(self, index: int, prompt_len: int, sp: SamplingParams) -> None:
        """A request that could never fit in the KV pool, even alone, is refused now instead of waiting forever."""
        bm = self.block_manager
        if bm.blocks_for(prompt_len + sp.max_tokens) > bm.num_blocks:
            raise ValueError(f"prompts[{index}]: prompt ({prompt_len} tokens) + max_tokens ({sp.max_tokens}) = "
                             f"{prompt_len + sp.max_tokens} exceeds max_kv_tokens ({bm.num_blocks * bm.block_size} "
                             f"= {bm.num_blocks} blocks of {bm.block_size}): it could never fit in the KV pool")

    def _add(self, text: str | None, ids: list[int], sp: SamplingParams, request_id: str | None = None) -> str:
        self._check_running()
        if request_id is None:
            request_id = str(self.next_request_id)
            self.next_request_id += 1
        elif request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already queued or running")
        self.scheduler.add(Sequence(request_id, text, ids, sp, request_seed(sp),
                                   RequestMetrics(time.perf_counter()), logprobs=[] if sp.logprobs is not None else None,
                                   detokenizer=IncrementalDetokenizer(self.tokenizer)))
        return request_id

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_request(self, request_id: str) -> Sequence | None:
        """Drop a waiting or running request: it leaves the queues, releases its KV memory and is never returned.
        -> the dropped sequence (None: no such request is queued or running)."""
        r = self.scheduler.requests.get(request_id)
        if r is not None:
            self.scheduler.finish(r)
        return r

    def step(self, partial: bool = False) -> list[RequestOutput]:
        """One iteration: every running request computes the tokens the scheduler gave it (one for a decode, a
        chunk of its prompt otherwise), all in one forward within the token budget. Returns the requests that finished in this iteration,
        and any that finished earlier without being handed out (while another caller's generate() ran).
        partial=True also returns each request that got a token and goes on (finished=False, its text so
        far). An idle engine returns []."""
        self._check_running()
        handed_out, self.finished_outputs = self.finished_outputs, []
        return handed_out + self._step(partial)

    def _step(self, partial: bool = False) -> list[RequestOutput]:
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
                    sampled = [scheduled[i] for i in rows]
                    if len(rows) < len(scheduled):  # the index goes to the device without a wait (pinned)
                        logits = logits[to_device(torch.tensor(rows), logits.device)]
                self._append_tokens(sampled, logits)
        except BaseException:  # a failure mid-step leaves these sequences half-updated (_fail_step), then re-raise
            self._fail_step(scheduled)
            raise
        with timer("schedule"):
            finished = [seq for seq in scheduled if seq.finish is not None]
            for seq in finished:
                self.scheduler.finish(seq)  # its blocks are released: free again, or evictable if cached
        with timer("detokenize"):
            outputs = [seq.to_output() for seq in finished]
            if partial and rows:  # the requests that got a token and go on
                outputs += [seq.partial_output() for seq in sampled if seq.finish is None]
            return outputs

    def _fail_step(self, seqs: list[Sequence]) -> None:
        """A step raised, and left these sequences half-updated. One that ran alone failed on its own inputs:
        it is dropped (it leaves the queues, its blocks are freed) and its caller gets the error. Beside others, which
        one failed the step is not known: each is put back (scheduler.requeue: preempted, its tokens kept and its KV
        recomputed, so the same tokens follow) and runs alone until it gets a token, where a failure is its own. A
        sequence no longer queued or running is left alone."""
        live = [seq for seq in dict.fromkeys(seqs) if self.scheduler.requests.get(seq.request_id) is seq]
        if len(live) == 1:
            self.scheduler.finish(live[0])
            return
        for seq in live:
            self.scheduler.requeue(seq)
        self.stats["requeued_after_failure"] += len(live)

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
        next_ids, chosen, tops = self.runner.sample(seqs, logits)  # host lists: the step's one wait for the GPU
        with self.timers.phase("sample"):
            now = time.perf_counter()
            for seq, top, next_id, logprob in zip(seqs, tops, next_ids, chosen):
                seq.cumulative_logprob += logprob
                if seq.logprobs is not None:  # the n most likely tokens and the chosen one: {token_id: logprob}
                    top[next_id] = logprob
                    seq.logprobs.append(top)
                seq.append_token(next_id)
                seq.metrics.token_times.append(now)
                seq.metrics.first_token_time = seq.metrics.first_token_time or now
            if self.scheduler.num_suspects:  # a suspect that got a token (alone) runs with the others again
                for seq in seqs:
                    self.scheduler.clear_suspect(seq)
        with self.timers.phase("detokenize"):
            for seq in seqs:
                seq.finish = self._check_stop(seq)
                if seq.finish is not None:
                    seq.metrics.finished_time = now
