"""The engine's core (EngineCore, vLLM's name): the scheduler, the block manager and the model runner (rank 0 of
the tensor-parallel group, its workers started here), and the step that joins them. Sequences in, RequestOutputs
out. What a caller sees of a request before it is queued and after it is done is its front end's: the offline LLM
(engine.py) runs an EngineCore in its own process; the core process (engine_core.py) runs one in a busy loop that a
streaming AsyncLLM feeds. Both build it from an EngineConfig, and neither reaches into it.

    sequence.py       one request's state (status, tokens, placeholders, num_computed_tokens, block table)
    scheduler.py      which sequences run in the next step, and how many tokens each; the plan (SchedulerOutput)
    block_manager.py  which cache blocks hold which tokens (paged KV, prefix caching)
    model_runner.py   sequences -> tensors, the forward, the sampler, the read-back; owns the model and the KV cache
    attention.py      how attention runs, one object per backend: its metadata per step, its math per layer
    worker.py         one rank's build (its share of the model, the backend, the KV cache, the CUDA graphs) and
                      the tensor-parallel worker processes
    parallel.py       how the model is cut over N ranks, and the collectives that join them
    output.py         when a request stops (EOS, stop token ids, max_tokens, and stop strings in its text)

A step. The scheduler has no phases: every running request catches up on its tokens without K/V under one token
budget, the least behind first (a decode is a request one token behind; a prompt is computed in chunks). All of a
step's rows, decodes and chunks alike, go through one forward whose attention is one kernel launch per layer (or
flash decoding, for a step of long decodes), with the layer's small operators fused; a step of decodes only replays
a CUDA graph of its batch-size bucket. The sampler draws every sampling row at once, each keyed by its request's
(seed, position), and the runner reads the tokens back with one wait for the device. Each new token goes through the
stop checks (output.check_stop): a sequence with a detokenizer (the offline LLM's) grows its text and is checked for
stop strings too; one without (the core process's: its front end holds the text) is checked on its tokens only.

The overlapped order (async_scheduling, vLLM's name; None: on with CUDA, off elsewhere). _step_async schedules step
N + 1 and launches its forward and its sampling before it reads step N's tokens: the device runs step N + 1 while the
host reads step N, finishes what it finished, builds the outputs, and schedules and prepares the next step. A token
the host has not read is a placeholder of its sequence, only counted (num_output_placeholders); the device keeps it
(the runner's last_token) and the next step's inputs read it there (the plan's placeholders). Finish is known one step
late: a request that step N finishes was already scheduled into step N + 1, whose token for it is thrown away
(stats["discarded_tokens"]), never emitted. A launch or a read that fails leaves no step in flight, and the requests
of the two steps it touched fail as one step (below). The CPU runs the same order on its one stream.
async_scheduling=False runs each step's tokens read before the next is scheduled.

A step that fails (_fail_step) fails one request at most. A request that ran alone in it is dropped, and its caller
gets the error. The requests of a step of several are put back, preempted (their tokens kept, their KV recomputed),
each a suspect that the scheduler runs alone until it gets a token, in synchronous steps (no step in flight): only a
request whose own inputs fail a step fails, and the others get the tokens they would have had. The step raises its
error all the same (its caller may know better: a core process dies of a device error).

Speculative decoding (speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}, vLLM's option; speculative.py). Before a step's forward each decoding request may get up to
k drafts, looked up in its own tokens (Drafter.propose, in empty blocks only); it then runs as a chunk of k + 1 tokens
in the same mixed forward, whose logits the runner takes at every one of those places (logits_rows). The runner's verify
draws every place as a plain step draws it, and the drafts pass while they equal it: 1 to k + 1 tokens are emitted
(Drafter.apply_verdicts), exactly the plain decode's, and the scheduler rolls the rejected drafts back. A step
with drafts replays a verify graph (k + 1 tokens per row) up to VERIFY_GRAPH_MAX_SEQS requests, eagerly above, and
runs synchronously (the next step's drafts need this step's tokens). A step in which no request can get drafts runs
overlapped, as above: from disable_by_batch_size requests in the engine (speculative.DISABLE_BY_BATCH_SIZE unless the
config names one; None: never), and when no running request's known tokens end in an n-gram that occurs before
(Drafter.drafting). A step in flight is read before drafting resumes. Not with tensor parallelism in this step.
"""
from __future__ import annotations

import time
import weakref
from collections import deque
from types import SimpleNamespace

from shared import RequestMetrics, RequestOutput, SamplingParams, Tokenizer

from .block_manager import BlockManager
from .kv_connector import KVConsumer, KVProducer, check_transfer_params, identity_of
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .offload import HostKVTier
from .output import Finish, check_stop
from .parallel import Pipeline, TensorParallel, WorkerError, rank_device
from .sampler import request_seed
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceStatus
from .speculative import Drafter
from .worker import Workers, build_rank, start_workers, stop_workers


class EngineCore:
    """The scheduler, the block manager and the model runner of one engine, and its step. Built from an EngineConfig
    (checked already) and the model's tokenizer (its EOS token ids, for the stop checks); a request comes in as
    add_request's arguments, and step() returns the requests it finished (and, with partial=True, those that got a
    token)."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer):
        self.config = config
        self.device, self.tokenizer = config.device, tokenizer
        self.async_scheduling = config.async_scheduling  # read at every step (run.py switches it)
        self.in_flight: SimpleNamespace | None = None  # the step launched and not read yet
        # n-gram drafts (config.py parsed them); a step that drafts is synchronous
        self.speculative = config.speculative_config
        self.is_shut_down = False  # shutdown() sets it: nothing runs after
        self.workers: Workers | None = None
        self.pipe = Pipeline()  # one stage (every layer) unless pipeline_parallel_size > 1
        # pipeline parallel: the steps launched and not read yet, oldest first (vLLM's batch queue), at most `depth`
        self.batches: deque = deque()
        self.depth = config.batches_in_flight
        self.launches: list[tuple] = []  # ("launch" | "read", batch number, its request ids), in order (pp > 1)
        if config.world_size == 1:
            self.tp = TensorParallel()
        else:  # the workers start, then every rank builds its share; rank 0 is this process
            self.device = rank_device(self.device, 0)
            self.workers, self.tp, self.pipe = start_workers(config, self.device)
        self._finalizer = weakref.finalize(self, stop_workers, self.workers, self.tp) if self.workers else None
        try:
            self.runner, self.memory, self.cuda_graphs = build_rank(config, self.device, self.tp, self.pipe)
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
        self.runner.share_tokens = self.async_scheduling and self.workers is not None and self.pipe.size == 1
        self.model, self.stats, self.timers = self.runner.model, self.runner.stats, self.runner.timers
        self.stats["requeued_after_failure"] = 0  # requests put back by a step that failed beside them
        # tokens computed for requests that had finished (thrown away); launches that began while the step
        # before still ran on the device (CUDA: its results' event not reached yet)
        self.stats.update(discarded_tokens=0, overlapped_launches=0)
        self.stats["emitted_tokens"] = 0  # every emitted token
        self.drafter = Drafter(self.speculative, self.stats, self.timers)  # its counters join the stats
        # the prefix cache's second tier, in host memory (offload.py): its decisions here, its blocks on every rank
        self.host_tier = HostKVTier(self.memory["host_blocks"], self.stats) if config.kv_offloading_size else None
        self.kv_cache = self.runner.kv_cache  # one tensor for all layers (model.py, KVCache)
        # a request's released blocks free its block-table row in the runner
        tables = self.runner.block_tables
        self.block_manager = BlockManager(self.memory["num_blocks"], config.block_size, config.enable_prefix_caching,
                                          on_release=lambda r: tables.release(r.request_id),
                                          on_trim=lambda r: tables.trim(r.request_id, len(r.block_table)),
                                          host=self.host_tier)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.block_manager,
                                   batches_in_flight=self.depth)
        self._connect_transfer(config)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the group, and free the KV cache and the CUDA graphs' memory
        now (runner.release): the core serves nothing after this. Idempotent. The workers are also stopped when
        the core is garbage-collected and when the process exits."""
        if self._finalizer is not None:
            self._finalizer()
        for side in (getattr(self, "producer", None), getattr(self, "consumer", None)):
            if side is not None:
                side.close()
        self.producer = self.consumer = None
        self.is_shut_down = True
        self.in_flight = None  # its results are not read (runner.release waits for the device first)
        self.batches.clear()
        self.kv_cache = None  # before the runner hands the memory back: no reference to the cache may be left
        if getattr(self, "runner", None) is not None:
            self.runner.release()

    def __del__(self):
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()

    def check_fits_kv_budget(self, index: int, prompt_len: int, sp: SamplingParams) -> None:
        """A request that could never fit in the KV pool, even alone, is refused now instead of waiting forever."""
        bm = self.block_manager
        if bm.blocks_for(prompt_len + sp.max_tokens) > bm.num_blocks:
            raise ValueError(f"prompts[{index}]: prompt ({prompt_len} tokens) + max_tokens ({sp.max_tokens}) = "
                             f"{prompt_len + sp.max_tokens} exceeds max_kv_tokens ({bm.num_blocks * bm.block_size} "
                             f"= {bm.num_blocks} blocks of {bm.block_size}): it could never fit in the KV pool")

    def add_request(self, request_id: str, text: str | None, ids: list[int], sp: SamplingParams,
                    detokenizer: IncrementalDetokenizer | None = None, kv_transfer_params: dict | None = None) -> Sequence:
        """Queue a checked request under a request_id no queued or running request has (ValueError otherwise). With a
        detokenizer its text grows token by token and its stop strings are checked here; without, its tokens only.
        kv_transfer_params (kv_connector.py): on a kv_producer {"do_remote_decode": True}, its blocks lent when it
        finishes; on a kv_consumer a producer's answer: the request starts from the producer's first token, and its
        prompt's blocks are pulled once it has blocks of its own."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already queued or running")
        transfer = check_transfer_params(kv_transfer_params, self.kv_role, len(ids), self.config.block_size)
        seq = Sequence(request_id, text, ids, sp, request_seed(sp), RequestMetrics(time.perf_counter()),
                       logprobs=[] if sp.logprobs is not None else None, detokenizer=detokenizer)
        if transfer is not None and self.kv_role == "kv_producer":
            seq.remote_decode = True
        elif transfer is not None:
            seq.remote_prefill = transfer
            self._start_from_first_tokens(seq, transfer)
            if seq.finish is not None:  # the producer's token ends it: nothing to compute here
                self.ready.append(seq.to_output())
                return seq
        self.scheduler.add(seq)
        return seq

    # ---- prefill and decode apart ----------------------------------------------------------------------------------
    def _connect_transfer(self, config: EngineConfig) -> None:
        """This engine's side of the transfer (kv_connector.py), if its kv_transfer_config gives it a role."""
        transfer = config.kv_transfer_config
        self.kv_role = transfer.kv_role if transfer is not None else None
        self.producer = self.consumer = None
        self.ready: list[RequestOutput] = []  # finished without a step: a first token that ends it, a failed load
        self.load_errors: dict[str, str] = {}  # request id -> why its transfer failed (policy "fail")
        self.loading: dict[str, Sequence] = {}  # a consumer's requests whose blocks are arriving
        self.stats["remote_prompt_tokens_computed"] = 0  # a consumer's prompt tokens run here for transferred requests
        if transfer is None:
            return
        identity = identity_of(self.kv_cache, config.model, config.block_size)
        if self.kv_role == "kv_producer":
            self.producer = KVProducer(transfer, self.kv_cache, identity, self.stats)
        else:
            self.consumer = KVConsumer(transfer, self.kv_cache, identity, self.stats)
            self.scheduler.on_admit = self._start_load

    def _start_from_first_tokens(self, seq: Sequence, transfer: dict) -> None:
        """A consumer's request starts with the producer's token(s) as its output, through the same stop checks."""
        now = time.perf_counter()
        tops = transfer["output_logprobs"] or []
        for i, token in enumerate(transfer["output_token_ids"]):
            if seq.logprobs is not None:
                seq.logprobs.append({int(k): v for k, v in tops[i].items()} if i < len(tops) else {})
            seq.append_token(token)
            seq.metrics.first_token_time = seq.metrics.first_token_time or now
            seq.metrics.token_times.append(now)
            seq.finish = self._finish_at(seq, token, i + 1)
            if seq.finish is not None:
                break
        seq.cumulative_logprob = transfer["cumulative_logprob"]

    def _start_load(self, seq: Sequence) -> None:
        """The scheduler gave a consumer's request its blocks (the scheduler's on_admit): its own prefix hits stay,
        the prompt's other blocks are pulled from the producer into its blocks; it is not scheduled until they are
        written (scheduler.loading)."""
        if seq.remote_prefill is None or seq.remote_done:
            return
        size, prompt_len = self.config.block_size, len(seq.prompt_ids)
        first, last = seq.num_computed_tokens // size, -(-prompt_len // size)
        self.stats["kv_blocks_hit_here"] = self.stats.get("kv_blocks_hit_here", 0) + first
        # (every block of the prompt in this engine's prefix cache already: nothing is pulled, the lease is freed)
        self.scheduler.loading.add(seq.request_id)
        self.loading[seq.request_id] = seq
        self.consumer.start_load(seq.request_id, seq.remote_prefill, first, seq.block_table[first:last])

    def poll_transfers(self) -> None:
        """The transfers' news, on the engine's thread: a producer frees the blocks of leases acknowledged or expired;
        a consumer's request whose blocks arrived has its prompt computed, one whose pull failed follows the policy
        (recompute: its prompt runs here; fail: it ends with the error), one aborted meanwhile gives its blocks back."""
        if self.producer is not None:
            self.producer.poll(self.block_manager.release)
        if self.consumer is None:
            return
        for kind, request_id, detail in self.consumer.poll():
            seq = self.loading.pop(request_id)
            self.scheduler.loading.discard(request_id)
            seq.remote_done = True
            if seq.status is SequenceStatus.FINISHED:  # aborted while its blocks arrived: they are free now
                self.block_manager.release(seq)
                continue
            if kind == "loaded":
                seq.num_computed_tokens = len(seq.prompt_ids)
                self.block_manager.cache_full_blocks(seq)  # its full prompt blocks join the prefix cache
                self.stats["kv_loads"] += 1
            elif self.config.kv_transfer_config.kv_load_failure_policy == "fail":
                self.load_errors[request_id] = f"the KV transfer from the kv_producer failed: {detail}"
                seq.finish = Finish("error", None, "")
                self.scheduler.finish(seq)
                self.ready.append(seq.to_output())
            else:  # recompute: the prompt runs here, from this engine's own prefix hits
                self.stats["kv_recomputed"] = self.stats.get("kv_recomputed", 0) + 1

    def _finish(self, seq: Sequence) -> None:
        """A request that ended leaves the scheduler; a producer's request sent for a remote decode keeps its blocks,
        lent (KVProducer.hold), and its output carries what the consumer needs."""
        if seq.remote_decode and self.producer is not None and seq.finish.reason in ("stop", "length"):
            self.scheduler.finish(seq, release=False)
            self.runner.block_tables.release(seq.request_id)  # its table row is free; its blocks are not
            seq.kv_transfer_params = self.producer.hold(seq, self.config.block_size)
        else:
            self.scheduler.finish(seq)

    def _count_remote_prompt(self, work) -> None:
        """A consumer's prompt tokens that this engine computes for requests whose prompt came from a producer: 0
        unless a transfer failed (recompute) or the request was preempted."""
        for seq, n in work:
            if seq.remote_prefill is not None and seq.num_computed_tokens < len(seq.prompt_ids):
                self.stats["remote_prompt_tokens_computed"] += min(n, len(seq.prompt_ids) - seq.num_computed_tokens)

    def has_unfinished_requests(self) -> bool:
        # a step's results to read (with several stages, up to `depth` of them)
        return (self.scheduler.has_unfinished() or self.in_flight is not None or bool(self.batches)
                or bool(self.ready) or bool(self.loading))

    def abort_request(self, request_id: str) -> Sequence | None:
        """Drop a waiting or running request: it leaves the queues, releases its KV memory and is never returned.
        -> the dropped sequence (None: no such request is queued or running)."""
        r = self.scheduler.requests.get(request_id)
        if r is not None:  # a request whose blocks are still being written keeps them until the transfer ends
            self.scheduler.finish(r, release=request_id not in self.loading)
        return r

    def step(self, partial: bool = False) -> list[RequestOutput]:
        """One iteration (the overlapped one, _step_async, where it may): -> the requests it finished, and with
        partial=True also each request that got a token and goes on. An idle core returns []. With a
        kv_transfer_config, the transfers' news first (poll_transfers), and the requests they ended."""
        self.poll_transfers()
        ready, self.ready = self.ready, []
        if self.loading and len(self.loading) == len(self.scheduler.running) and not self.scheduler.waiting:
            time.sleep(0.001)  # only transfers are under way: wait for them without spinning
        return ready + self._step(partial)

    def _step(self, partial: bool) -> list[RequestOutput]:
        if self.pipe.size > 1:  # several stages: up to `depth` batches in flight
            return self._step_pipelined(partial)
        drafting = self.drafter.drafting(self.scheduler, self.async_scheduling)
        if drafting and self.in_flight is not None:  # drafts need every token read: read the step in flight
            step_n, self.in_flight = self.in_flight, None
            try:
                return self._read_step(step_n, partial)
            except BaseException:  # a read that fails fails its requests as one step
                self._fail_step(step_n.seqs)
                raise
        if self.async_scheduling and not drafting and not self.scheduler.num_suspects:  # requests put back run in sync
            return self._step_async(partial)
        return self._step_sync(partial, drafting)

    def _step_sync(self, partial: bool, drafting: bool = False) -> list[RequestOutput]:
        """A synchronous step: schedule, one forward, one sampler call, and the tokens read before the next step is
        scheduled; then what is done is finished."""
        timer = self.timers.phase
        with timer("schedule"):
            work = self.scheduler.schedule()  # [(sequence, tokens to compute)]: decodes and chunks alike
        scheduled = [seq for seq, _ in work]
        if not scheduled:  # idle: nothing waits or runs
            return []
        self.timers.steps += 1
        spec = self.drafter.propose(work, self.scheduler) if drafting else {}  # {work index: drafts}
        with timer("schedule"):
            plan = SchedulerOutput.build(work, drafts=spec, copies=self._host_copies())  # the step's plan
            self.stats["decode_steps"] += bool(plan.num_decodes)
            self.stats["decode_rows"] += plan.num_decodes
            self.stats["prefill_chunks"] += len(work) - plan.num_decodes
            self._count_remote_prompt(work)
        sampled = [scheduled[i] for i in plan.sample_rows]
        try:
            launched, verdicts = self.runner.execute_model(plan)  # the forward, one draw, the verdict on the drafts
            with timer("schedule"):
                # a drafting sequence counts its tokens as computed after the verdict, not before
                self.scheduler.postprocess([(seq, n) for i, (seq, n) in enumerate(work) if i not in spec])
            if launched is not None:  # host lists: the step's one wait for the GPU
                self._record_tokens(sampled, *self.runner.read_sampled(launched))
            if spec:  # the verdicts' tokens through the stop checks, then the rejected drafts' rollback
                self.drafter.apply_verdicts(spec, scheduled, verdicts, self._record_tokens, self.scheduler)
        except BaseException:  # a failure mid-step leaves these sequences half-updated (_fail_step), then re-raise
            self._fail_step(scheduled)
            raise
        with timer("schedule"):
            finished = [seq for seq in scheduled if seq.finish is not None]
            for seq in finished:
                self._finish(seq)  # its blocks are released (or lent): free again, or evictable if cached
        with timer("detokenize"):
            outputs = [seq.to_output() for seq in finished]
            if partial:  # the requests that got a token (or several: a verify step) and go on
                outputs += [seq.partial_output() for seq in sampled + [scheduled[i] for i in spec]
                            if seq.finish is None]
            return outputs

    def _fail_step(self, seqs: list[Sequence]) -> None:
        """A step raised, and left these sequences half-updated. One that ran alone failed on its own inputs:
        it is dropped (it leaves the queues, its blocks are freed) and its caller gets the error. Beside others, which
        one failed the step is not known: each is put back (scheduler.requeue: preempted, its tokens kept and its KV
        recomputed, so the same tokens follow) and runs alone until it gets a token, where a failure is its own. A
        sequence no longer queued or running is left alone. A suspect runs in synchronous steps."""
        live = [seq for seq in dict.fromkeys(seqs) if self.scheduler.requests.get(seq.request_id) is seq]
        if len(live) == 1:
            self.scheduler.finish(live[0])
            return
        for seq in live:
            seq.num_output_placeholders = 0  # its tokens in flight are never read
            seq.token_ids = seq.prompt_ids + seq.output_ids  # no draft of a verify step that failed stays
            self.scheduler.requeue(seq)
        self.stats["requeued_after_failure"] += len(live)

    def _finish_at(self, r: Sequence, last: int, num_outputs: int) -> Finish | None:
        """-> a Finish once the request must end at its newest token, else None: output.check_stop on its tokens
        and on the text its detokenizer grows (stop strings). last is its newest token, its num_outputs-th
        (num_outputs: len(r.output_ids)). A sequence without a detokenizer is checked on its tokens only."""
        return check_stop(r.params, last, num_outputs, self.tokenizer.eos_token_ids, r.detokenizer)

    def _record_tokens(self, seqs: list[Sequence], next_ids, chosen, tops, read_late: bool = False) -> None:
        """Append each sequence's new token, check which sequences must stop. read_late: the tokens of a
        step read one step late (async): each was one of its sequence's placeholders, and the count drops. A
        sequence that stops drops the placeholders behind its end (a step launched before the end was known)."""
        with self.timers.phase("sample"):
            now = time.perf_counter()
            for seq, top, next_id, logprob in zip(seqs, tops, next_ids, chosen):
                seq.cumulative_logprob += logprob
                if seq.cumulative_logprobs is not None:  # kept for a front end that asks
                    seq.cumulative_logprobs.append(seq.cumulative_logprob)
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
            self.stats["emitted_tokens"] += len(seqs)
        with self.timers.phase("detokenize"):
            for seq, next_id in zip(seqs, next_ids):
                seq.finish = self._finish_at(seq, next_id, len(seq.output_ids))
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

    def _host_copies(self) -> list:
        """The host tier's copies that this step's scheduling asked for: the step's plan carries them to every rank."""
        return self.host_tier.copies() if self.host_tier is not None else []

    def _launch(self, work) -> SimpleNamespace | None:
        """Step N + 1's forward and sampling, queued on the device. A sequence whose newest input is step N's token
        (a placeholder) has it filled on the device; each sequence that samples gets a placeholder for its token.
        -> the step in flight: its sampling sequences and its results on their way to the host (None: no sequence
        samples, every row a chunk before its prompt's end)."""
        timer = self.timers.phase
        scheduled = [seq for seq, _ in work]
        self.timers.steps += 1
        with timer("schedule"):
            # the step's plan; its placeholders: inputs past the tokens the host knows (step N's, on the device)
            plan = SchedulerOutput.build(work, copies=self._host_copies())
            self.stats["decode_steps"] += bool(plan.num_decodes)
            self.stats["decode_rows"] += plan.num_decodes
            self.stats["prefill_chunks"] += len(work) - plan.num_decodes
            self._count_remote_prompt(work)
        results, _ = self.runner.execute_model(plan, keep_on_device=True)
        if results is None:
            return None
        sampled = [scheduled[i] for i in plan.sample_rows]
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
                self._finish(seq)  # its blocks are released (or lent); its place in step N + 1 is thrown away later
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

    # ---- pipeline parallelism: batches in flight -----------------------------------------------------------------
    def _step_pipelined(self, partial: bool) -> list[RequestOutput]:
        """One step with several stages (vLLM's batch queue). While fewer than `depth` batches are in flight, schedule
        one more from the requests not in flight (the scheduler skips those: a request is in one batch at most) and
        launch it: rank 0 runs stage 0's layers and sends the stream on, and the call returns, so stage 0 starts
        batch k + 1 while batch k is in a later stage. Once `depth` batches are in flight, or nothing more can be
        scheduled, read the oldest batch's tokens (the wait for the last stage is there) and finish what they finish.
        depth: pipeline_parallel_size with async_scheduling, else 1 (each batch read before the next is launched)."""
        with self.timers.phase("schedule"):
            work = self.scheduler.schedule() if len(self.batches) < self.depth else []
        launched = False
        if work:
            batch = self._launch_batch(work)
            self.batches.append(batch)
            launched = True
        if not self.batches or (launched and len(self.batches) < self.depth):
            return []
        batch = self.batches.popleft()
        try:
            return self._read_batch(batch, partial)
        except BaseException:  # a read that fails: no batch stays in flight, their requests fail as one step
            batches, self.batches = list(self.batches), deque()
            self.scheduler.in_flight.clear()
            self._fail_step(batch.seqs + [seq for b in batches for seq in b.seqs])
            raise

    def _launch_batch(self, work) -> SimpleNamespace:
        """Launch one batch: its plan to every rank, stage 0's forward here, its requests marked in flight (none is
        scheduled again before its tokens are read) and their tokens counted as computed (every stage runs the
        batches in the order they were launched, so a later batch finds their K/V written)."""
        self.timers.steps += 1
        scheduled = [seq for seq, _ in work]
        with self.timers.phase("schedule"):
            plan = SchedulerOutput.build(work, copies=self._host_copies())
            self.stats["decode_steps"] += bool(plan.num_decodes)
            self.stats["decode_rows"] += plan.num_decodes
            self.stats["prefill_chunks"] += len(work) - plan.num_decodes
            self._count_remote_prompt(work)
        number = self.stats["batches_launched"] = self.stats.get("batches_launched", 0) + 1
        self.launches.append(("launch", number, tuple(plan.request_ids)))
        self.stats["most_batches_in_flight"] = max(self.stats.get("most_batches_in_flight", 0), len(self.batches) + 1)
        try:
            results, _ = self.runner.execute_model(plan)
        except BaseException:
            batches, self.batches = list(self.batches), deque()
            self.scheduler.in_flight.clear()
            self._fail_step(scheduled + [seq for b in batches for seq in b.seqs])
            raise
        self.scheduler.in_flight.update(plan.request_ids)
        with self.timers.phase("schedule"):
            self.scheduler.postprocess(work)
        return SimpleNamespace(number=number, seqs=scheduled, sampled=[scheduled[i] for i in plan.sample_rows],
                               results=results)

    def _read_batch(self, batch: SimpleNamespace, partial: bool) -> list[RequestOutput]:
        """The oldest batch's tokens (from the last stage): each joins its request, then what finishes is finished;
        its requests may be scheduled again. A request aborted meanwhile is skipped: its token is thrown away."""
        self.scheduler.in_flight.difference_update(seq.request_id for seq in batch.seqs)
        self.launches.append(("read", batch.number, tuple(seq.request_id for seq in batch.seqs)))
        if batch.results is None:  # no row sampled (prompt chunks before their ends)
            return []
        next_ids, chosen, tops = self.runner.read_sampled(batch.results)
        live = [i for i, seq in enumerate(batch.sampled) if seq.status is not SequenceStatus.FINISHED]
        self.stats["discarded_tokens"] += len(batch.sampled) - len(live)
        seqs = [batch.sampled[i] for i in live]
        self._record_tokens(seqs, [next_ids[i] for i in live], [chosen[i] for i in live], [tops[i] for i in live])
        with self.timers.phase("schedule"):
            finished = [seq for seq in seqs if seq.finish is not None]
            for seq in finished:
                self._finish(seq)
        with self.timers.phase("detokenize"):
            outputs = [seq.to_output() for seq in finished]
            if partial:
                outputs += [seq.partial_output() for seq in seqs if seq.finish is None]
            return outputs
