"""Continuous batching with chunked prefill: which tokens run in the next iteration.

Requests wait in arrival order; up to max_num_seqs of them run at once. Every iteration has a budget of
max_num_batched_tokens tokens. Running requests that decode come first (one token each); what is left
of the budget goes to prompts: first the prompts that fit whole, then chunks of longer prompts in
arrival order. A long prompt is prefilled over several iterations and never stalls the decodes.

Preemption: the KV caches of all running requests together may hold at most max_kv_tokens tokens. A
request joins only when its tokens fit. Its reservation grows as it decodes (doubling, like a list);
when a decode needs more room than is left, the newest running request is preempted: its cache is
freed and it goes back to the front of the queue, to be recomputed from its tokens later.
"""
from __future__ import annotations

import enum
from collections import deque


class RequestStatus(enum.Enum):
    """Where a request is in its life (request.status)."""

    WAITING = "waiting"  # queued, holds no KV memory yet
    RUNNING = "running"  # in the batch: holds KV memory
    PREEMPTED = "preempted"  # lost its KV to make room; waits at the front of the queue to be recomputed
    FINISHED = "finished"  # done or aborted: it has left the queues and holds nothing


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_kv_tokens: int):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_kv_tokens = max_kv_tokens
        self.reserved_tokens = 0  # KV slots reserved by the running requests, summed
        self.num_preemptions = 0
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
        # Join in arrival order while a seat is free and the request's tokens fit in the KV budget.
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self.reserved_tokens + request.num_tokens > self.max_kv_tokens:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.reserved_tokens = request.num_tokens
            self.reserved_tokens += request.num_tokens
        budget = self.max_num_batched_tokens
        # A request decodes when exactly one of its tokens (the newest) has no KV yet; oldest requests first.
        decodes = []
        for r in [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]:
            if len(decodes) == budget:
                break
            if r.status is RequestStatus.RUNNING and self._make_room(r, r.num_tokens):  # r may have been preempted
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

    def _make_room(self, request, needed: int) -> bool:
        """Grow request's reservation to hold `needed` tokens, preempting the newest requests if the budget
        is short. False if request itself had to be preempted."""
        if request.reserved_tokens >= needed:
            return True
        free = self.max_kv_tokens - (self.reserved_tokens - request.reserved_tokens)  # what request could hold
        while free < needed:
            victim = self.running[-1]  # the newest running request
            self.preempt(victim)
            if victim is request:
                return False
            free = self.max_kv_tokens - (self.reserved_tokens - request.reserved_tokens)
        grown = min(max(needed, 2 * request.reserved_tokens), request.max_len, free)  # double, within limits
        self.reserved_tokens += grown - request.reserved_tokens
        request.reserved_tokens = grown
        return True

    def preempt(self, request) -> None:
        """Free the request's cache and send it back to the front of the queue; it is recomputed later."""
        self.running.remove(request)
        self.waiting.appendleft(request)
        request.status = RequestStatus.PREEMPTED
        self.reserved_tokens -= request.reserved_tokens
        request.reserved_tokens = 0
        request.num_computed_tokens = 0
        request.cache = None
        self.num_preemptions += 1

    def finish(self, request) -> None:
        """The request leaves for good (finished, or aborted while waiting or running), releasing its KV memory."""
        (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
        del self.requests[request.request_id]
        self.reserved_tokens -= request.reserved_tokens
        request.reserved_tokens = 0
        request.status = RequestStatus.FINISHED
