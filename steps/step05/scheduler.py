"""Continuous batching: which requests run in the next iteration.

Requests wait in arrival order; up to max_num_seqs of them run at once. Every iteration a finished
request leaves and a waiting one takes its seat, instead of the whole batch waiting for its longest
member (step04). An iteration either prefills the requests that just joined, or decodes one token
for every running request.
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
    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.waiting: deque = deque()  # arrived, not started
        self.running: list = []  # started: each holds a KV cache
        self.requests: dict = {}  # every waiting or running request, by request_id

    def add(self, request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[str, list]:
        """-> ("prefill", requests that join now) if a seat is free and someone waits, else ("decode", running)."""
        joined = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            joined.append(request)
        if joined:
            return "prefill", joined
        return "decode", list(self.running)

    def finish(self, request) -> None:
        """The request leaves for good (finished, or aborted while waiting or running), releasing its KV memory."""
        (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
        del self.requests[request.request_id]
        request.status = RequestStatus.FINISHED
