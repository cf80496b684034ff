"""The offline engine, LLM: requests in, RequestOutputs out. add_request makes a Sequence; each step() asks the
scheduler which sequences run and with how many tokens, has the model runner run one forward for all of them and
sample, then grows the sequences, finishes those that are done (their blocks freed) and returns the outputs.
generate() and chat() are add_request plus step() until every request is done. engine.py only wires the parts:

    sequence.py       one request's state (status, tokens, placeholders, num_computed_tokens, block table)
    scheduler.py      which sequences run in the next step, and how many tokens each
    block_manager.py  which cache blocks hold which tokens (paged KV, prefix caching)
    model_runner.py   sequences -> tensors, the forward, the sampler, the read-back; owns the model and the KV cache
    attention.py      how attention runs, one object per backend: its metadata per step, its math per layer
    worker.py         one rank's build (its share of the model, the backend, the KV cache, the CUDA graphs) and
                      the tensor-parallel worker processes
    parallel.py       how the model is cut over N ranks, and the collectives that join them

A step. The scheduler has no phases: every running request catches up on its tokens without K/V under one token
budget, the least behind first (a decode is a request one token behind; a prompt is computed in chunks). All of a
step's rows, decodes and chunks alike, go through one forward whose attention is one kernel launch per layer (or
flash decoding, for a step of long decodes), with the layer's small operators fused; a step of decodes only replays
a CUDA graph of its batch-size bucket. The sampler draws every sampling row at once, each keyed by its request's
(seed, position), and the runner reads the tokens back with one wait for the device.

The overlapped order (async_scheduling, vLLM's name; None: on with CUDA, off elsewhere). _step_async schedules step
N + 1 and launches its forward and its sampling before it reads step N's tokens: the device runs step N + 1 while the
host reads step N, finishes what it finished, builds the outputs, and schedules and prepares the next step. A token
the host has not read is a placeholder of its sequence, only counted (num_output_placeholders); the device keeps it
(the runner's last_token) and the next step's inputs read it there (execute's placeholders). Finish is known one step
late: a request that step N finishes was already scheduled into step N + 1, whose token for it is thrown away
(stats["discarded_tokens"]), never emitted. A launch or a read that fails leaves no step in flight, and the requests
of the two steps it touched fail as one step (below). The CPU runs the same order on its one stream.
async_scheduling=False runs each step's tokens read before the next is scheduled (_step).

Streaming: step(partial=True) also returns the requests that got a token and go on, their text held back by the
longest stop string's length minus one, so that a later stop string never takes back text already sent.
max_logprobs (vLLM's option, default 20) bounds the logprobs a request asks for, checked with the request.

A step that fails (step23's rule, _fail_step) fails one request at most. A request that ran alone in it is dropped,
and its caller gets the error. The requests of a step of several are put back, preempted (their tokens kept, their
KV recomputed), each a suspect that the scheduler runs alone until it gets a token, in synchronous steps (no step
in flight): only a request whose own inputs fail a step fails, and the others get the tokens they would have had.
The step raises its error all the same (its caller may know better: a core process dies of a device error).

Options: LLM(model, **options) takes every option of engine_args.py's EngineArgs by vLLM's name (its default, its
meaning and its group are written there once); config.py checks them. How the engine grew, step by step, is in the
step's README.
"""
from __future__ import annotations

import time
import weakref
from types import SimpleNamespace

import torch

from shared import (DEFAULT_MODEL, RequestMetrics, RequestOutput, SamplingParams, Tokenizer, check_conversations,
                    check_length, check_logprobs, normalize_prompts, normalize_sampling_params)

from .block_manager import BlockManager
from .config import EngineConfig, check_enforce_eager, choose_async_scheduling, choose_attention_backend  # noqa: F401
from .detokenizer import IncrementalDetokenizer
from .engine_args import check_option_names
from .kv_spec import KV_CACHE_DTYPES, check_kv_cache_dtype  # noqa: F401
from .model import ModelConfig  # noqa: F401
from .model_runner import CPU_DEFAULT_KV_TOKENS, kv_bytes_per_token, kv_pool_blocks, to_device  # noqa: F401
from .parallel import TensorParallel, WorkerError, rank_device
from .sampler import request_seed
from .scheduler import Scheduler
from .sequence import Finish, Sequence, SequenceStatus
from .worker import Workers, build_rank, start_tensor_parallel, stop_tensor_parallel


def describe_engine(config: EngineConfig, model, memory: dict, cuda_graphs: dict, tp: TensorParallel) -> str:
    """The engine in one line (llm.backend, which run.py prints): what the config asked for and what the build found
    (the KV pool's blocks and dtype and what sized it, the CUDA graphs captured or why none, the tensor split)."""
    if cuda_graphs["enabled"]:
        sizes = cuda_graphs["sizes"]
        graphs = (f"CUDA graphs: {len(sizes)} captured (decode batches of {', '.join(map(str, sizes[:5]))}"
                  f"{' .. ' + str(sizes[-1]) if len(sizes) > 5 else ''}), replayed for steps of decodes")
    else:
        graphs = f"CUDA graphs: off, eager ({cuda_graphs['reason']})"
    c = model.config
    split = (f"tensor parallel: {tp.size} ranks ({tp.backend}), each {c.num_heads} heads / "
             f"{c.num_kv_heads} KV heads / {c.intermediate_size} MLP columns"
             if tp.size > 1 else "tensor parallel: off (1 rank)")
    kv = memory["kv_spec"].describe()  # its dtype and scales
    scheduling = ("scheduling: async (step N + 1 launched before step N's tokens are read"
                  f"{'; one stream on the CPU: the order, no overlap' if config.device.type != 'cuda' else ''})"
                  if config.async_scheduling else
                  "scheduling: sync (each step's tokens read before the next step is scheduled)")
    return (f"plain PyTorch, {c.model_type} (fused qkv / gate-up), continuous batching + "
            f"chunked prefill + preemption, paged KV ({memory['num_blocks']} blocks of {config.block_size}, KV dtype "
            f"{kv}, sized by {memory['sized_by']}), "
            f"prefix caching {'on' if config.enable_prefix_caching else 'off'}, "
            f"attention: {model.attention_backend.name}, elementwise: "
            f"{'fused kernels' if model.ops.name == 'triton' else 'torch operators'}, {graphs}, "
            f"{split}, {scheduling}")


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **options):
        # Every option (engine_args.py's EngineArgs) checked, the auto ones resolved and the model found (config.py),
        # before anything loads.
        check_option_names(options)
        self.config = config = EngineConfig(model=model, **options)
        self.model_name, self.device, self.dtype = config.model, config.device, config.dtype
        self.async_scheduling = config.async_scheduling  # read at every step (run.py switches it)
        self.in_flight: SimpleNamespace | None = None  # the step launched and not read yet
        self.tokenizer = Tokenizer(config.model_dir)
        self.is_shut_down = False  # shutdown() sets it: nothing runs after
        self.workers: Workers | None = None
        if config.tensor_parallel_size == 1:
            self.tp = TensorParallel()
        else:  # the workers start, then every rank builds its share; rank 0 is this process
            self.device = rank_device(self.device, 0)
            self.workers, self.tp = start_tensor_parallel(config, self.device)
        self._finalizer = weakref.finalize(self, stop_tensor_parallel, self.workers, self.tp) if self.workers else None
        try:
            self.runner, self.memory, self.cuda_graphs = build_rank(config, self.device, self.tp)
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
        # with workers, rank 0 sends them each step's sampled tokens on the devices (placeholders' inputs)
        self.runner.share_tokens = self.async_scheduling and self.workers is not None
        self.model, self.stats, self.timers = self.runner.model, self.runner.stats, self.runner.timers
        self.stats["requeued_after_failure"] = 0  # requests put back by a step that failed beside them
        # tokens computed for requests that had finished (thrown away); launches that began while the step
        # before still ran on the device (CUDA: its results' event not reached yet)
        self.stats.update(discarded_tokens=0, overlapped_launches=0)
        self.max_model_len = config.max_model_len
        self.max_logprobs = config.max_logprobs  # a request's most logprobs
        self.backend = describe_engine(config, self.model, self.memory, self.cuda_graphs, self.tp)
        self.kv_cache = self.runner.kv_cache  # one tensor for all layers (model.py, KVCache)
        # a request's released blocks free its block-table row in the runner
        self.block_manager = BlockManager(self.memory["num_blocks"], config.block_size, config.enable_prefix_caching,
                                          on_release=self.runner.block_tables.release)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.block_manager)
        self.next_request_id = 0
        self.finished_outputs: list[RequestOutput] = []  # finished, not handed out yet (see generate)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the group, and free the KV cache and the CUDA graphs' memory
        now (runner.release): the engine serves nothing after this. Idempotent. The workers are also stopped when
        the engine is garbage-collected and when the process exits."""
        if self._finalizer is not None:
            self._finalizer()
        self.is_shut_down = True
        self.in_flight = None  # its results are not read (runner.release waits for the device first)
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
        return self.scheduler.has_unfinished() or self.in_flight is not None  # a step's results to read

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
        if self.async_scheduling and not self.scheduler.num_suspects:  # requests put back (suspects) run in sync
            return self._step_async(partial)
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
        sequence no longer queued or running is left alone. A suspect runs in synchronous steps (_step)."""
        live = [seq for seq in dict.fromkeys(seqs) if self.scheduler.requests.get(seq.request_id) is seq]
        if len(live) == 1:
            self.scheduler.finish(live[0])
            return
        for seq in live:
            seq.num_output_placeholders = 0  # its tokens in flight are never read
            self.scheduler.requeue(seq)
        self.stats["requeued_after_failure"] += len(live)

    def chat(self, conversations, sampling_params=None) -> list[RequestOutput]:
        prompts = [self.tokenizer.apply_chat_template(c) for c in check_conversations(conversations)]
        return self.generate(prompts, sampling_params)

    def _check_stop(self, r: Sequence, last: int, num_outputs: int) -> Finish | None:
        """-> a Finish once the request must end, else None. Text grows through the request's detokenizer, and
        stop strings are looked for only where new text could complete one: O(1) per token, not O(n).
        last is its newest token, its num_outputs-th (num_outputs: len(r.output_ids))."""
        sp = r.params
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
        if num_outputs >= sp.max_tokens:
            return Finish("length", None, r.detokenizer.final_text())
        return None

    def _append_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token for each sequence from its row of logits [B, vocab] in one sampler call (the model
        runner's), record them, check which sequences must stop."""
        next_ids, chosen, tops = self.runner.sample(seqs, logits)  # host lists: the step's one wait for the GPU
        self._record_tokens(seqs, next_ids, chosen, tops)

    def _record_tokens(self, seqs: list[Sequence], next_ids, chosen, tops, read_late: bool = False) -> None:
        """Append each sequence's new token, check which sequences must stop. read_late: the tokens of a
        step read one step late (async): each was one of its sequence's placeholders, and the count drops. A
        sequence that stops drops the placeholders behind its end (a step launched before the end was known)."""
        with self.timers.phase("sample"):
            now = time.perf_counter()
            for seq, top, next_id, logprob in zip(seqs, tops, next_ids, chosen):
                seq.cumulative_logprob += logprob
                if seq.logprobs is not None:  # the n most likely tokens and the chosen one: {token_id: logprob}
                    top[next_id] = logprob
                    seq.logprobs.append(top)
                seq.append_token(next_id)
                if read_late:
                    seq.num_output_placeholders -= 1
                seq.metrics.token_times.append(now)
                seq.metrics.first_token_time = seq.metrics.first_token_time or now
            if self.scheduler.num_suspects:  # a suspect that got a token (alone) runs with the others again
                for seq in seqs:
                    self.scheduler.clear_suspect(seq)
        with self.timers.phase("detokenize"):
            for seq, next_id in zip(seqs, next_ids):
                seq.finish = self._check_stop(seq, next_id, len(seq.output_ids))
                if seq.finish is not None:
                    seq.num_output_placeholders = 0  # the tokens launched after its end are thrown away when read
                    seq.metrics.finished_time = now

    # ---- the overlapped loop --------------------------------------------------------------------------------
    def _step_async(self, partial: bool) -> list[RequestOutput]:
        """One step of the overlapped loop: (1) schedule step N + 1 and launch its forward and its sampling, reading
        nothing back; (2) only then read step N's tokens and finish what they finish (_read_step); (3) count step
        N + 1's tokens as computed, for the requests still running. The device runs step N + 1 during (2), (3) and
        the next call's (1). A call with nothing to schedule still reads the step in flight."""
        with self.timers.phase("schedule"):
            work = self.scheduler.schedule()  # counts step N's tokens as placeholders: one more token each
        step_n = self.in_flight
        try:
            self.in_flight = self._launch(work) if work else None
            outputs = self._read_step(step_n, partial) if step_n is not None else []
        except BaseException:  # a launch or a read failed: no step stays in flight, its requests fail as one step
            self._fail_overlapped_steps(work, step_n)
            raise
        if work:
            with self.timers.phase("schedule"):  # a request step N finished or that was aborted is gone already
                self.scheduler.postprocess([(seq, n) for seq, n in work if seq.status is SequenceStatus.RUNNING])
        return outputs

    def _launch(self, work) -> SimpleNamespace | None:
        """Step N + 1's forward and sampling, queued on the device. A sequence whose newest input is step N's token
        (a placeholder) has it filled on the device; each sequence that samples gets a placeholder for its token.
        -> the step in flight: its sampling sequences and its results on their way to the host (None: no sequence
        samples, every row a chunk before its prompt's end)."""
        timer = self.timers.phase
        scheduled = [seq for seq, _ in work]
        self.timers.steps += 1
        with timer("schedule"):
            decodes = sum(n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens for seq, n in work)
            self.stats["decode_steps"] += bool(decodes)
            self.stats["decode_rows"] += decodes
            self.stats["prefill_chunks"] += len(work) - decodes
            # a sequence gets a token if this step reaches its last token (a prompt chunk before the end does not)
            rows = [i for i, (seq, n) in enumerate(work) if seq.num_computed_tokens + n == seq.num_tokens]
            # inputs past the tokens the host knows: a sequence's newest one, step N's token, still on the device
            placeholders = [i for i, (seq, n) in enumerate(work) if seq.num_computed_tokens + n > len(seq.token_ids)]
        logits = self.runner.execute(work, placeholders=placeholders, keep_on_device=True)  # a row per sequence
        if not rows:
            return None
        with timer("sample"):
            sampled = [scheduled[i] for i in rows]
            if len(rows) < len(scheduled):
                logits = logits[to_device(torch.tensor(rows), logits.device)]
        results = self.runner.launch_sample(sampled, logits, keep_on_device=True)
        for seq in sampled:  # after the draw: its keys count the outputs before
            seq.num_output_placeholders += 1
        event = results.copies.event
        return SimpleNamespace(seqs=sampled, results=results, done=lambda: event is None or event.query())

    def _read_step(self, step: SimpleNamespace, partial: bool) -> list[RequestOutput]:
        """Step N's tokens, read one step late (the wait for the device is here, while step N + 1 is queued behind):
        each joins its sequence's tokens in place of a placeholder, then what finishes is finished. A sequence that
        finished at the step before (its token here was computed after its end) or was aborted is skipped: the token
        is thrown away."""
        next_ids, chosen, tops = self.runner.read_sampled(step.results)  # if it fails, its caller fails the step
        live = [i for i, seq in enumerate(step.seqs) if seq.status is not SequenceStatus.FINISHED]
        self.stats["discarded_tokens"] += len(step.seqs) - len(live)
        seqs = [step.seqs[i] for i in live]
        self._record_tokens(seqs, [next_ids[i] for i in live], [chosen[i] for i in live], [tops[i] for i in live],
                            read_late=True)
        with self.timers.phase("schedule"):
            finished = [seq for seq in seqs if seq.finish is not None]
            for seq in finished:
                self.scheduler.finish(seq)  # its blocks are released; its place in step N + 1 is thrown away later
        with self.timers.phase("detokenize"):
            outputs = [seq.to_output() for seq in finished]
            if partial:  # the requests that got a token and go on
                outputs += [seq.partial_output() for seq in seqs if seq.finish is None]
            return outputs

    def _fail_overlapped_steps(self, work, step_n: SimpleNamespace | None) -> None:
        """After a launch or a read that failed (_step_async): no step is left in flight, whose results a later step
        would read (after a device error they cannot be read at all). The sequences of step N + 1 (the work) and of
        step N are half-updated (placeholders counted for tokens never computed or read): they fail as one step
        (_fail_step), one alone dropped, several put back."""
        self.in_flight = None
        self._fail_step([seq for seq, _ in work] + (step_n.seqs if step_n is not None else []))
