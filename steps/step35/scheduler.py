"""The scheduler: which sequences run in the next iteration, and how many of their tokens.

Requests wait in arrival order; up to max_num_seqs of them run at once. Every iteration has a budget of
max_num_batched_tokens tokens, and one rule: every running request catches up on the tokens that have no KV
yet, the requests that are least behind first, each taking what it needs or what is left of the budget. There
are no phases: a decode is a request one token behind, a prompt one many tokens behind. Being least behind,
the decodes always run; then the prompts that fit whole; a long prompt takes the rest of the budget, over as
many iterations as it needs, and never stalls the decodes for more than one iteration's budget.

Preemption: KV memory is a pool of blocks (block_manager.py). A request joins only when blocks for its
tokens are free; it takes one more block each time its last one fills up. When a decode needs a block
and none is free, the newest running request is preempted: its blocks are released and it
goes back to the front of the queue, to be recomputed from its tokens later.

Suspects. When a step of several requests fails (engine.py's _fail_step), each of them is put back as a
preempted request and marked suspect (requeue). A suspect that holds a seat runs alone, so that a step that fails
then is its own; once it gets a token it is cleared (clear_suspect) and runs with the others again.

The plan. What schedule() returns is the step's work, [(request, tokens)]; the core turns it once into a
SchedulerOutput (vLLM V1's name), the step's plan, which the runner, the attention metadata and the CUDA graphs read
instead of asking each request again which kind of row it is.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .sequence import SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's plan, built once from the scheduler's work (build), then only read: by the core (its counters, the
    requests that get a token), the model runner (the inputs, the draws), the attention backend (its metadata) and
    the CUDA graphs (whether the step replays one). It names requests by id and holds plain values: the runner reads
    nothing else of a request, and a tensor-parallel worker gets the same plan, serialised (parallel.py's pack_plan).

        request_ids   each row's request, in the scheduler's order: decodes first, then prompt chunks [S]
        query_lens    each row's new tokens [S]
        starts        each row's first new token's position: the request's num_computed_tokens [S]
        token_ids     each row's new input ids that the host knows: all of them, or all but the last for a
                      placeholder row [S lists]
        decodes       the rows that are decodes: one new token, the request's newest
        sample_rows   the rows that get a token: a decode, or a chunk that reaches its prompt's last token (its
                      logits are the next token's); a chunk before the end gets none, its row is dropped
        placeholders  the rows whose last new token is a placeholder (sampled by the step in flight, not read by the
                      host): its input id is taken on the device (model_runner.py's fill_placeholders)
        drafts        {row: its drafts} (Drafter.propose): a decode run with its drafts, whose tokens are the verdict's
        copies        the host tier's copies (offload.py) that the step's scheduling asked for, run before its forward
        block_tables  each row's block table (the block manager's list): the runner's rows take the blocks new since
                      its last step from it (BlockTables.changes); None on a worker, which is told the changes
        sampling      each row's (sampling params, seed, output index of its next token): what its draw is keyed by;
                      None on a worker (rank 0 samples)

    Every list of rows holds indices into the rows."""

    request_ids: list[str]
    query_lens: list[int]
    starts: list[int]
    token_ids: list[list[int]]
    decodes: list[int]
    sample_rows: list[int]
    placeholders: list[int]
    drafts: dict[int, list[int]]
    copies: list[tuple]
    block_tables: list[list[int]] | None = None
    sampling: list[tuple] | None = None

    @classmethod
    def build(cls, work: list[tuple], drafts=None, copies=()) -> SchedulerOutput:
        """The scheduler's [(request, new tokens)] -> the step's plan. A row's placeholder: its new tokens run past
        the tokens the host has read."""
        drafts = drafts or {}
        query_lens = [n + len(drafts.get(i, ())) for i, (_, n) in enumerate(work)]
        starts = [seq.num_computed_tokens for seq, _ in work]
        late = [start + n > len(seq.token_ids) for (seq, _), start, n in zip(work, starts, query_lens)]
        ends = [start + n == seq.num_tokens for (seq, _), start, n in zip(work, starts, query_lens)]
        return cls.of([seq.request_id for seq, _ in work], starts, query_lens, ends,
                      [seq.token_ids[start:start + n - placeholder]
                       for (seq, _), start, n, placeholder in zip(work, starts, query_lens, late)],
                      [i for i, placeholder in enumerate(late) if placeholder], drafts, copies,
                      block_tables=[seq.block_table for seq, _ in work],
                      sampling=[(seq.params, seq.seed, len(seq.output_ids) + seq.num_output_placeholders)
                                for seq, _ in work])

    @classmethod
    def of(cls, request_ids, starts, query_lens, ends, token_ids, placeholders, drafts=None, copies=(),
           block_tables=None, sampling=None) -> SchedulerOutput:
        """The plan from its rows' values (ends: whether each row reaches its request's newest token): which rows are
        decodes and which sample follows from them, the same on rank 0 (build) and on a worker (unpack_plan)."""
        drafts = drafts or {}
        return cls(request_ids=list(request_ids), query_lens=list(query_lens), starts=list(starts),
                   token_ids=token_ids, placeholders=list(placeholders), drafts=drafts, copies=list(copies),
                   decodes=[i for i, n in enumerate(query_lens) if n - len(drafts.get(i, ())) == 1 and ends[i]],
                   sample_rows=[i for i, end in enumerate(ends) if end and i not in drafts],
                   block_tables=block_tables, sampling=sampling)

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    @property
    def num_decodes(self) -> int:
        return len(self.decodes)

    @property
    def decodes_only(self) -> bool:
        """Every row a decode of one token (as many decodes as new tokens): the step a CUDA graph can replay, and
        flash decoding may split."""
        return len(self.decodes) == sum(self.query_lens)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_manager, batches_in_flight: int = 1):
        self.max_num_seqs = max_num_seqs  # the requests of one step
        self.batches_in_flight = batches_in_flight  # with several pipeline stages, up to pp (core.py's depth)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.num_preemptions = 0
        self.waiting: deque = deque()  # arrived, not started
        self.running: list = []  # started: each owns KV blocks
        self.requests: dict = {}  # every waiting or running request, by request_id
        self.num_suspects = 0  # requests put back by a step that failed beside them (requeue)
        # pipeline parallel: the requests of the batches in flight (their tokens not read yet): not scheduled, not
        # preempted, until their batch is read (core.py's _step_pipelined)
        self.in_flight: set[str] = set()
        # prefill and decode apart: the requests whose prompt blocks are arriving from a kv_producer (core.py's
        # KVConsumer): not scheduled, not preempted, until their blocks are written
        self.loading: set[str] = set()
        self.on_admit = None  # called with each request given its blocks (the core starts a transfer there)

    def add(self, request) -> None:
        request.status = SequenceStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    @property
    def max_running(self) -> int:
        """The requests that hold a seat: max_num_seqs for each batch in flight (config.py's max_running_seqs)."""
        return self.max_num_seqs * self.batches_in_flight

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple]:
        """-> [(request, number of its tokens to compute now)]: a decode's is 1, a prompt chunk's up to the budget."""
        # Join in arrival order while a seat is free and blocks for the request's tokens are free.
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            if not self.block_manager.can_allocate(request, request.num_tokens):
                if not self.running:  # nobody will ever free a block: only a leak can bring us here
                    raise RuntimeError(f"KV pool: {self.block_manager.num_free_blocks} free blocks cannot hold a "
                                       f"request of {request.num_tokens} tokens with nothing running (blocks leaked?)")
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = SequenceStatus.RUNNING
            request.num_computed_tokens = self.block_manager.allocate(request, request.num_tokens)  # prefix hits
            if self.on_admit is not None:
                self.on_admit(request)
        budget, work = self.max_num_batched_tokens, []
        behind = lambda r: r.num_tokens - r.num_computed_tokens  # noqa: E731  tokens with no KV yet
        running = self.running
        if self.num_suspects:  # a suspect that holds a seat runs alone
            running = next(([r] for r in self.running if r.suspect), running)
        for r in sorted(running, key=behind):  # stable: equally behind, the older request first
            if budget == 0 or len(work) == self.max_num_seqs:
                break
            if r.status is not SequenceStatus.RUNNING:  # preempted while making room for a request before it
                continue
            if r.request_id in self.in_flight:  # in a batch the pipeline still runs: one batch at a time
                continue
            if r.request_id in self.loading:  # its prompt's blocks are on their way
                continue
            if behind(r) == 1 and not self._make_room(r):  # its newest token may need a new block
                continue
            n = min(behind(r), budget)
            work.append((r, n))
            budget -= n
        return work

    def postprocess(self, work: list[tuple]) -> None:
        """After the forward: the scheduled tokens now have K/V in the cache; newly full blocks can be shared."""
        for seq, n in work:
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)

    def postprocess_verified(self, verified: list[tuple]) -> None:
        """After a verify step, [(request, tokens its verdict emitted)]: its newest token and its accepted
        drafts now have K/V (a run a stop cut short keeps every token it kept: each was an accepted draft), its newly
        full blocks can be shared (a request that finished here too, before its blocks are released), and the
        blocks taken for its rejected drafts go back to the pool."""
        for seq, n in verified:
            seq.num_computed_tokens = min(seq.num_computed_tokens + n, seq.num_tokens)
            self.block_manager.cache_full_blocks(seq)
            if seq.finish is None:
                self.block_manager.trim(seq, seq.num_tokens)

    def _make_room(self, request) -> bool:
        """Give request room for its newest token (block_manager.append), preempting the newest requests if no
        block is free. False if request itself had to be preempted."""
        while not self.block_manager.can_append(request):
            # the newest running request not in flight (a batch in a later stage still writes the others' blocks)
            victim = next(r for r in reversed(self.running)
                          if r.request_id not in self.in_flight and r.request_id not in self.loading)
            self.preempt(victim)
            if victim is request:
                return False
        self.block_manager.append(request)
        return True

    def preempt(self, request) -> None:
        """Free the request's blocks and send it back to the front of the queue; it is recomputed later."""
        self.running.remove(request)
        self.waiting.appendleft(request)
        request.status = SequenceStatus.PREEMPTED
        self.block_manager.release(request)
        request.num_computed_tokens = 0
        self.num_preemptions += 1

    def requeue(self, request) -> None:
        """A request of a step that failed beside others is preempted (a waiting one holds nothing to give
        back): its tokens are kept and its KV recomputed, so the same tokens follow. Suspect, it runs alone."""
        if request.status is SequenceStatus.RUNNING:
            self.preempt(request)
        request.suspect = True
        self.num_suspects += 1

    def clear_suspect(self, request) -> None:
        """The request got a token in a step of its own (or it leaves): it is no suspect any more."""
        if request.suspect:
            request.suspect = False
            self.num_suspects -= 1

    def finish(self, request, release: bool = True) -> None:
        """The request leaves for good (finished, or aborted while waiting or running), releasing its KV memory
        (release=False: its blocks stay held, lent to a decode engine or still being written: the caller releases them
        later, block_manager.release)."""
        (self.running if request.status is SequenceStatus.RUNNING else self.waiting).remove(request)
        del self.requests[request.request_id]
        self.clear_suspect(request)
        if release:
            self.block_manager.release(request)
        request.status = SequenceStatus.FINISHED
