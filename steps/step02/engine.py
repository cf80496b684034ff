"""step02: sampling and stopping. Still re-runs the whole sequence per token (step03 fixes that)."""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from shared import (DEFAULT_MODEL, CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, Tokenizer,
                    check_conversations, check_length, normalize_prompts, normalize_sampling_params,
                    resolve_device_dtype, resolve_model)

from .model import Llama
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


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, device=None, dtype=None):
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.model_name = str(model)
        model_dir = resolve_model(model)
        self.tokenizer = Tokenizer(model_dir)
        self.model = Llama.from_pretrained(model_dir, self.device, self.dtype)
        self.max_model_len = self.model.config.max_position_embeddings
        self.backend = "plain PyTorch, whole sequence re-run per token"

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = normalize_prompts(prompts, self.tokenizer, self.model.config.vocab_size)
        params = normalize_sampling_params(sampling_params, len(prompts), SamplingParams(temperature=0))
        for i, ((_, ids), sp) in enumerate(zip(prompts, params)):
            check_length(i, len(ids), sp, self.max_model_len)
        arrival = time.perf_counter()  # every request arrives now; they are served one after another
        return [self._generate_one(str(i), text, ids, sp, arrival)
                for i, ((text, ids), sp) in enumerate(zip(prompts, params))]

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

    def _generate_one(self, request_id: str, prompt: str | None, prompt_ids: list[int], sp: SamplingParams,
                      arrival: float) -> RequestOutput:
        metrics = RequestMetrics(arrival_time=arrival)
        tokens = list(prompt_ids)
        output_ids: list[int] = []
        logprobs: list[dict[int, float]] | None = [] if sp.logprobs is not None else None
        cumulative = 0.0
        seed = request_seed(sp)
        finish = None
        while finish is None:
            # The naive part: the whole sequence (prompt + everything generated so far) goes through the model.
            logits = self.model.forward(torch.tensor(tokens, device=self.device))[-1]  # [vocab]
            token_logprobs = torch.log_softmax(logits, dim=-1)
            next_id = sample(logits, sp, seed, len(output_ids))
            cumulative += float(token_logprobs[next_id])
            if logprobs is not None:
                logprobs.append(top_logprobs(token_logprobs, next_id, sp.logprobs))
            output_ids.append(next_id)
            tokens.append(next_id)
            now = time.perf_counter()
            metrics.token_times.append(now)
            metrics.first_token_time = metrics.first_token_time or now
            finish = self._check_stop(output_ids, sp)
        metrics.finished_time = time.perf_counter()
        completion = CompletionOutput(0, finish.text, output_ids, cumulative, logprobs, finish.reason,
                                      finish.stop_reason)
        return RequestOutput(request_id, prompt, list(prompt_ids), [completion], True, metrics)
