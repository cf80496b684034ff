"""The scheduler: which sequences run in the next iteration, and how many of their tokens.

Requests wait in arrival order; up to max_num_seqs of them run at once. Every iteration has a budget of
max_num_batched_tokens tokens. Running requests that decode come first (one token each); what is left
of the budget goes to prompts: first the prompts that fit whole, then chunks of longer prompts in
arrival order. A long prompt is prefilled over several iterations and never stalls the decodes.

Preemption: KV memory is a pool of blocks (block_manager.py). A request joins only when blocks for its
tokens are free; it takes one more block each time its last one fills up. When a decode needs a block
and none is free, the newest running request is preempted: its blocks go back to the free list and it
goes back to the front of the queue, to be recomputed from its tokens later.
"""
from __future__ import annotations

from collections import deque

from .sequence import SequenceStatus


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_manager):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.num_preemptions = 0
        self.waiting: deque = deque()  # arrived, not started
        self.running: list = []  # started: each owns KV blocks
        self.requests: dict = {}  # every waiting or running request, by request_id

    def add(self, request) -> None:
        request.status = SequenceStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list, list[tuple]]:
        """-> (requests that decode one token, [(request, number of prompt tokens to prefill)])."""
        # Join in arrival order while a seat is free and blocks for the request's tokens are free.
        while self.waiting and len(self.running) < self.max_num_seqs:
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
        budget = self.max_num_batched_tokens
        # A request decodes when exactly one of its tokens (the newest) has no KV yet; oldest requests first.
        decodes = []
        for r in [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]:
            if len(decodes) == budget:
                break
            if r.status is SequenceStatus.RUNNING and self._make_room(r, r.num_tokens):  # r may have been preempted
                decodes.append(r)
        budget -= len(decodes)
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        chunks = []
        for r in prefilling:  # prompts that fit whole go first: a short request never waits behind a long one
            remaining = r.num_tokens - r.num_computed_tokens
            if remaining <= budget:
                chunks.append((r, remaining))
                budget -= remaining
        for r in prefilling:  # the rest of the budget: chunks of the longer prompts, in arrival order
            if budget > 0 and all(r is not c for c, _ in chunks):
                n = min(r.num_tokens - r.num_computed_tokens, budget)
                chunks.append((r, n))
                budget -= n
        return decodes, chunks

    def postprocess(self, decodes: list, chunks: list[tuple]) -> None:
        """After the forward: the scheduled tokens now have K/V in the cache; newly full blocks can be shared."""
        for seq, n in [(s, 1) for s in decodes] + chunks:
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)

    def _make_room(self, request, needed: int) -> bool:
        """Give request blocks for `needed` tokens, preempting the newest requests if no block is free.
        False if request itself had to be preempted."""
        while not self.block_manager.can_allocate(request, needed):
            victim = self.running[-1]  # the newest running request
            self.preempt(victim)
            if victim is request:
                return False
        self.block_manager.allocate(request, needed)
        return True

    def preempt(self, request) -> None:
        """Free the request's blocks and send it back to the front of the queue; it is recomputed later."""
        self.running.remove(request)
        self.waiting.appendleft(request)
        request.status = SequenceStatus.PREEMPTED
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        self.num_preemptions += 1

    def finish(self, request) -> None:
        """The request leaves for good (finished, or aborted while waiting or running), releasing its KV memory."""
        (self.running if request.status is SequenceStatus.RUNNING else self.waiting).remove(request)
        del self.requests[request.request_id]
        self.block_manager.free(request)
        request.status = SequenceStatus.FINISHED
