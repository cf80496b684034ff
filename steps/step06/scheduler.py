"""Continuous batching with chunked prefill: which tokens run in the next iteration.

Requests wait in arrival order; up to max_num_seqs of them run at once. Every iteration has a budget of
max_num_batched_tokens tokens. Running requests that decode come first (one token each); what is left
of the budget goes to prompts: first the prompts that fit whole, then chunks of longer prompts in
arrival order. A long prompt is prefilled over several iterations and never stalls the decodes.
"""
from __future__ import annotations

import enum
from collections import deque


class RequestStatus(enum.Enum):
    """Where a request is in its life (request.status)."""

    WAITING = "waiting"  # queued, holds no KV memory yet
    RUNNING = "running"  # in the batch: holds KV memory
    FINISHED = "finished"  # done or aborted: it has left the queues and holds nothing


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque = deque()  # arrived, not started
        self.running: list = []  # started: each holds a KV cache
        self.requests: dict = {}  # every waiting or running request, by request_id

    def add(self, request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list, list[tuple]]:
        """-> (requests that decode one token, [(request, number of prompt tokens to prefill)])."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
        budget = self.max_num_batched_tokens
        # A request decodes when exactly one of its tokens (the newest) has no KV yet.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1][:budget]
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

    def finish(self, request) -> None:
        """The request leaves for good (finished, or aborted while waiting or running), releasing its KV memory."""
        (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
        del self.requests[request.request_id]
        request.status = RequestStatus.FINISHED
