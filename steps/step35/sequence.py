"""One request's whole state, in one place: what the scheduler, the block manager and the model runner read.

A Sequence is a request as the engine sees it: its tokens (prompt, then output), where it is in its life
(status), how many of its tokens already have K/V in the cache (num_computed_tokens), and which cache blocks
hold them (block_table, with the chained hash of each full block).

With async_scheduling a sequence's newest tokens may not be known to the host yet: the step that samples
one has been launched, its result not read. token_ids and output_ids hold only the tokens the host has read;
num_output_placeholders (vLLM's name) counts the tokens in flight (at most two: one in the step the engine is about
to read, one in the step just launched), and num_tokens counts them too, so the scheduler and the block manager give
each a place. The engine appends a step's tokens when it reads them, and the count drops; a sequence that finishes
drops the placeholders behind its end.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams

from .detokenizer import IncrementalDetokenizer
from .output import Finish


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life (sequence.status)."""

    WAITING = "waiting"  # queued, holds no KV memory yet
    RUNNING = "running"  # in the batch: holds KV memory
    PREEMPTED = "preempted"  # lost its KV to make room; waits at the front of the queue to be recomputed
    FINISHED = "finished"  # done or aborted: it has left the queues and holds nothing


@dataclass(eq=False)
class Sequence:
    """One request's state from arrival to finish.

    eq=False. Two sequences are the same only if they are one object. A dataclass's default __eq__ compares
    every field, and the scheduler's `running.remove(r)` (finish, preempt) calls it once per element before r: at
    256 running sequences, up to 255 field-by-field comparisons for each sequence that leaves."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # keys its draws with each token's position (sampler.py): the same in any batch
    metrics: RequestMetrics
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    cumulative_logprobs: list[float] | None = None  # after each output token, kept if a front end asks
    finish: Finish | None = None  # set once the sequence has finished
    status: SequenceStatus = SequenceStatus.WAITING  # set by the scheduler
    detokenizer: IncrementalDetokenizer | None = None  # the output text so far, grown token by token
    block_table: list[int] = field(default_factory=list)  # the cache blocks holding this sequence's K/V, in order
    num_computed_tokens: int = 0  # tokens (prompt, then generated) whose K/V are in the cache
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full block of its tokens, computed
    # once, as the block fills (block_manager.hash_new_blocks), and kept for life: preemption does not drop them
    num_cached_blocks: int = 0  # how many blocks of block_table are registered in the prefix cache
    suspect: bool = False  # put back by a step that failed beside it; runs alone until it gets a token
    num_output_placeholders: int = 0  # its tokens sampled on the device and not read yet (not in token_ids)
    # prefill and decode apart (kv_connector.py): on a kv_producer, whether its blocks are lent when it finishes
    # (remote_decode) and the answer its output carries (kv_transfer_params); on a kv_consumer, the producer's answer
    # (remote_prefill) and whether its blocks came (or the policy ruled: remote_done)
    remote_decode: bool = False
    kv_transfer_params: dict | None = None
    remote_prefill: dict | None = None
    remote_done: bool = False

    def __post_init__(self):
        # prompt then output in one list, grown by append_token: read every step, so never rebuilt
        self.token_ids: list[int] = self.prompt_ids + self.output_ids

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)

    def add_drafts(self, drafts: list[int]) -> None:
        """A verify step's drafts join token_ids for that step only (their K/V is computed with it)."""
        self.token_ids.extend(drafts)

    def drop_drafts(self, num_drafts: int) -> None:
        """The verify step is read: its drafts leave token_ids (the accepted ones come back as tokens)."""
        del self.token_ids[len(self.token_ids) - num_drafts:]

    @property
    def num_known_outputs(self) -> int:
        """Output tokens the host has read: all of output_ids (the tokens in flight are only counted)."""
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        """Its tokens as the scheduler and the block manager count them, its placeholders too."""
        return len(self.token_ids) + self.num_output_placeholders

    def partial_output(self) -> RequestOutput:
        """The request so far, while it goes on (finished=False): its tokens, and its text minus the last
        (longest stop string - 1) characters, which a stop string completed later could still cut; a text shorter
        than that shows nothing yet. So every partial text is the start of the final one, and a stream's texts only
        grow. Its output ids and logprobs are copies (what the request had then); its prompt ids are not copied each
        step but shared: all of a request's partial outputs hold the sequence's own prompt_ids list, which nothing
        changes after the request is made."""
        hold = max(map(len, self.params.stop), default=1) - 1 if self.params.stop else 0
        text = self.detokenizer.text
        completion = CompletionOutput(0, text[:max(0, len(text) - hold)], list(self.output_ids),
                                      self.cumulative_logprob, list(self.logprobs) if self.logprobs is not None else None,
                                      None)
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, [completion], False, self.metrics)

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(0, self.finish.text, self.output_ids, self.cumulative_logprob, self.logprobs,
                                      self.finish.reason, self.finish.stop_reason)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), [completion], True, self.metrics,
                             self.kv_transfer_params)
