"""step07: preemption. A KV memory budget; when it runs out, the newest request is preempted and recomputed."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from shared import (DEFAULT_MODEL, CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, Tokenizer,
                    check_conversations, check_engine_options, check_length, normalize_prompts,
                    normalize_sampling_params, resolve_device_dtype, resolve_model)

from .model import KVCache, Llama
from .sampler import request_seed, sample
from .scheduler import RequestStatus, Scheduler


class Finish(NamedTuple):
    """Why and where a request ended."""

    reason: str  # "stop" (EOS, a stop token or a stop string) or "length" (max_tokens reached)
    stop_reason: int | str | None  # the stop token id or stop string that ended it; None for EOS and length
    text: str  # the output text, cut just before a stop string


def top_logprobs(logprobs: torch.Tensor, chosen: int, n: int) -> dict[int, float]:
    """The n most likely tokens and the chosen one: {token_id: logprob}."""
    values, ids = torch.topk(logprobs, n) if n > 0 else (logprobs[:0], logprobs[:0].long())
    result = {int(i): float(v) for i, v in zip(ids, values)}
    result[chosen] = float(logprobs[chosen])
    return result


@dataclass
class Request:
    """One request's state from arrival to finish."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # keys its draws, with the position of each token (sampler.py)
    metrics: RequestMetrics
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish: Finish | None = None  # set once the request has finished
    status: RequestStatus = RequestStatus.WAITING  # set by the scheduler (see RequestStatus)
    cache: KVCache | None = None  # allocated when the request starts running, freed when it finishes
    num_computed_tokens: int = 0  # tokens (prompt, then generated) whose K/V are in the cache
    reserved_tokens: int = 0  # KV slots the scheduler has reserved for this request (its cache's capacity)

    @property
    def max_len(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    def __post_init__(self):
        # prompt then output in one list, grown by append_token: read every step, so never rebuilt
        self.token_ids: list[int] = self.prompt_ids + self.output_ids

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(0, self.finish.text, self.output_ids, self.cumulative_logprob, self.logprobs,
                                      self.finish.reason, self.finish.stop_reason)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), [completion], True, self.metrics)


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, device=None, dtype=None, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, max_kv_tokens: int = 32768):
        check_engine_options(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_kv_tokens=max_kv_tokens)
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.model_name = str(model)
        model_dir = resolve_model(model)
        self.tokenizer = Tokenizer(model_dir)
        self.model = Llama.from_pretrained(model_dir, self.device, self.dtype)
        self.max_model_len = self.model.config.max_position_embeddings
        self.backend = "plain PyTorch, continuous batching + chunked prefill + preemption, growing KV cache per request"
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, max_kv_tokens)
        self.next_request_id = 0
        self.finished_outputs: list[RequestOutput] = []  # finished, not handed out yet (see generate)
        self.stats = {"prefill_chunks": 0, "decode_steps": 0, "decode_rows": 0}  # rows: requests decoded, summed

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
        """A request that could never fit in the KV budget, even alone, is refused now instead of waiting forever."""
        if prompt_len + sp.max_tokens > self.scheduler.max_kv_tokens:
            raise ValueError(f"prompts[{index}]: prompt ({prompt_len} tokens) + max_tokens ({sp.max_tokens}) = "
                             f"{prompt_len + sp.max_tokens} exceeds max_kv_tokens ({self.scheduler.max_kv_tokens}): "
                             "it could never fit in the KV budget")

    def _add(self, text: str | None, ids: list[int], sp: SamplingParams) -> str:
        request_id = str(self.next_request_id)
        self.next_request_id += 1
        self.scheduler.add(Request(request_id, text, ids, sp, request_seed(sp),
                                   RequestMetrics(time.perf_counter()), logprobs=[] if sp.logprobs is not None else None))
        return request_id

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_request(self, request_id: str) -> None:
        """Drop a waiting or running request: it leaves the queues, releases its KV memory and is never returned."""
        r = self.scheduler.requests.get(request_id)
        if r is not None:
            self.scheduler.finish(r)
            r.cache = None

    def step(self) -> list[RequestOutput]:
        """One iteration: decode one token for every decoding request, then prefill the scheduled prompt
        chunks, all within the token budget. Returns the requests that finished in this iteration,
        and any that finished earlier without being handed out (while another caller's generate() ran).
        An idle engine returns []."""
        handed_out, self.finished_outputs = self.finished_outputs, []
        return handed_out + self._step()

    def _step(self) -> list[RequestOutput]:
        decodes, chunks = self.scheduler.schedule()
        scheduled = decodes + [r for r, _ in chunks]
        if not scheduled:  # idle: nothing waits or runs
            return []
        try:
            for r in decodes + [r for r, _ in chunks]:  # a cache follows its request's reservation
                if r.cache is None:
                    r.cache = KVCache(self.model.config, r.reserved_tokens, self.device, self.dtype)
                elif r.cache.capacity < r.reserved_tokens:
                    r.cache.grow(r.reserved_tokens)
            if decodes:  # decodes first: a long prompt arriving does not stall the running requests
                self.stats["decode_steps"] += 1
                self.stats["decode_rows"] += len(decodes)
                input_ids = torch.tensor([[r.token_ids[-1]] for r in decodes], device=self.device)  # [B, 1]
                logits = self.model.forward(input_ids, [r.num_computed_tokens for r in decodes], [r.cache for r in decodes])
                for r, row_logits in zip(decodes, logits):
                    r.num_computed_tokens += 1
                    self._append_token(r, row_logits)
            for r, n in chunks:  # prompts differ in length: one forward per chunk
                self.stats["prefill_chunks"] += 1
                start = r.num_computed_tokens
                chunk = torch.tensor([r.token_ids[start:start + n]], device=self.device)  # [1, n]
                logits = self.model.forward(chunk, [start], [r.cache])
                r.num_computed_tokens += n
                if r.num_computed_tokens == r.num_tokens:  # the prompt's last chunk: its logits give the first token
                    self._append_token(r, logits[0])
        except BaseException:  # a failure mid-step leaves these requests half-updated: drop them, then re-raise
            for r in scheduled:
                self.abort_request(r.request_id)
            raise
        finished = [r for r in scheduled if r.finish is not None]
        for r in finished:
            self.scheduler.finish(r)
            r.cache = None  # its memory is free for the next request
        return [r.to_output() for r in finished]

    def chat(self, conversations, sampling_params=None) -> list[RequestOutput]:
        prompts = [self.tokenizer.apply_chat_template(c) for c in check_conversations(conversations)]
        return self.generate(prompts, sampling_params)

    def _check_stop(self, output_ids: list[int], sp: SamplingParams):
        """-> a Finish once the request must end, else None."""
        last = output_ids[-1]
        if last in self.tokenizer.eos_token_ids and not sp.ignore_eos:
            return Finish("stop", None, self.tokenizer.decode(output_ids[:-1]))
        if last in sp.stop_token_ids:
            return Finish("stop", last, self.tokenizer.decode(output_ids[:-1]))
        text = self.tokenizer.decode(output_ids)
        hits = [(text.find(s), s) for s in sp.stop if s in text]
        if hits:
            cut, stop = min(hits)  # the earliest stop string; the text ends just before it
            return Finish("stop", stop, text[:cut])
        if len(output_ids) >= sp.max_tokens:
            return Finish("length", None, text)
        return None

    def _append_token(self, r: Request, logits: torch.Tensor) -> None:
        """Sample one token for request r from its logits [vocab], record it, check whether r must stop."""
        token_logprobs = torch.log_softmax(logits, dim=-1)
        next_id = sample(logits, r.params, r.seed, len(r.output_ids))
        r.cumulative_logprob += float(token_logprobs[next_id])
        if r.logprobs is not None:
            r.logprobs.append(top_logprobs(token_logprobs, next_id, r.params.logprobs))
        r.append_token(next_id)
        now = time.perf_counter()
        r.metrics.token_times.append(now)
        r.metrics.first_token_time = r.metrics.first_token_time or now
        r.finish = self._check_stop(r.output_ids, r.params)
        if r.finish is not None:
            r.metrics.finished_time = now
