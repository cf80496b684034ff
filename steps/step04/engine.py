"""step04: static batching. All prompts go through the model together, left-padded to one length."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from shared import (DEFAULT_MODEL, CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, Tokenizer,
                    check_conversations, check_length, normalize_prompts, normalize_sampling_params,
                    resolve_device_dtype, resolve_model)

from .model import KVCache, Llama
from .sampler import request_seed, sample


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
    """One prompt's state while its batch runs."""

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

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(0, self.finish.text, self.output_ids, self.cumulative_logprob, self.logprobs,
                                      self.finish.reason, self.finish.stop_reason)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), [completion], True, self.metrics)


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, device=None, dtype=None):
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.model_name = str(model)
        model_dir = resolve_model(model)
        self.tokenizer = Tokenizer(model_dir)
        self.model = Llama.from_pretrained(model_dir, self.device, self.dtype)
        self.max_model_len = self.model.config.max_position_embeddings
        self.backend = "plain PyTorch, static batch, contiguous KV cache"
        self.stats = {"slots": 0, "padding": 0, "finished": 0}  # token slots computed, and how many were wasted

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = normalize_prompts(prompts, self.tokenizer, self.model.config.vocab_size)
        params = normalize_sampling_params(sampling_params, len(prompts), SamplingParams(temperature=0))
        for i, ((_, ids), sp) in enumerate(zip(prompts, params)):
            check_length(i, len(ids), sp, self.max_model_len)
        arrival = time.perf_counter()  # every request arrives now and they all run as one batch
        requests = [Request(str(i), text, ids, sp, request_seed(sp), RequestMetrics(arrival),
                            logprobs=[] if sp.logprobs is not None else None)
                    for i, ((text, ids), sp) in enumerate(zip(prompts, params))]
        self._run_batch(requests)
        return [r.to_output() for r in requests]

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
        r.output_ids.append(next_id)
        now = time.perf_counter()
        r.metrics.token_times.append(now)
        r.metrics.first_token_time = r.metrics.first_token_time or now
        r.finish = self._check_stop(r.output_ids, r.params)
        if r.finish is not None:
            r.metrics.finished_time = now

    def _run_batch(self, requests: list[Request]) -> None:
        """Prefill all prompts together, then decode all rows together until the last one finishes."""
        B = len(requests)
        prompt_len = max(len(r.prompt_ids) for r in requests)
        pads = [prompt_len - len(r.prompt_ids) for r in requests]  # left padding: every prompt ends in the same column
        max_len = prompt_len + max(r.params.max_tokens for r in requests)
        cache = KVCache(self.model.config, B, max_len, self.device, self.dtype)
        pad = torch.tensor(pads, device=self.device)
        real_keys = torch.arange(max_len, device=self.device)[None, :] >= pad[:, None]  # [B, max_len]
        input_ids = torch.tensor([[0] * n + r.prompt_ids for n, r in zip(pads, requests)], device=self.device)  # [B, L]
        positions = (torch.arange(prompt_len, device=self.device)[None, :] - pad[:, None]).clamp(min=0)  # [B, L]
        start = 0
        while any(r.finish is None for r in requests):
            done_rows = sum(r.finish is not None for r in requests)
            self.stats["slots"] += B * input_ids.shape[1]
            self.stats["padding"] += sum(pads) if start == 0 else 0
            self.stats["finished"] += done_rows * input_ids.shape[1]
            logits = self.model.forward(input_ids, positions, start, cache, real_keys)  # [B, vocab]
            for row, r in enumerate(requests):
                if r.finish is None:
                    self._append_token(r, logits[row])
            # Every row takes one more step, finished or not: a static batch runs until its longest request ends.
            start += input_ids.shape[1]
            input_ids = torch.tensor([[r.output_ids[-1]] for r in requests], device=self.device)  # [B, 1]
            positions = positions[:, -1:] + 1
