"""step01: naive generation. For every new token, run the model over the whole sequence again."""
from __future__ import annotations

import time

import torch

from shared import (DEFAULT_MODEL, CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, Tokenizer,
                    check_conversations, check_length, normalize_prompts, normalize_sampling_params,
                    resolve_device_dtype, resolve_model)

from .model import Llama


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
            self._check_supported(sp)
            check_length(i, len(ids), sp, self.max_model_len)
        arrival = time.perf_counter()  # every request arrives now; they are served one after another
        return [self._generate_one(str(i), text, ids, sp, arrival)
                for i, ((text, ids), sp) in enumerate(zip(prompts, params))]

    def chat(self, conversations, sampling_params=None) -> list[RequestOutput]:
        prompts = [self.tokenizer.apply_chat_template(c) for c in check_conversations(conversations)]
        return self.generate(prompts, sampling_params)

    @staticmethod
    def _check_supported(sp: SamplingParams) -> None:
        if not sp.greedy:
            raise ValueError(f"temperature: step01 decodes greedily only (temperature=0), got {sp.temperature}; "
                             "sampling arrives in step02")
        if sp.stop or sp.stop_token_ids:
            raise ValueError("stop / stop_token_ids: step01 stops only at EOS or max_tokens; stop strings arrive in step02")

    def _generate_one(self, request_id: str, prompt: str | None, prompt_ids: list[int], sp: SamplingParams,
                      arrival: float) -> RequestOutput:
        metrics = RequestMetrics(arrival_time=arrival)
        tokens = list(prompt_ids)
        output_ids: list[int] = []
        logprobs: list[dict[int, float]] | None = [] if sp.logprobs is not None else None
        cumulative = 0.0
        finish_reason = None
        while finish_reason is None:
            # The naive part: the whole sequence (prompt + everything generated so far) goes through the model.
            logits = self.model.forward(torch.tensor(tokens, device=self.device))[-1]  # [vocab]
            token_logprobs = torch.log_softmax(logits, dim=-1)
            next_id = int(torch.argmax(logits))  # greedy
            cumulative += float(token_logprobs[next_id])
            if logprobs is not None:
                logprobs.append(top_logprobs(token_logprobs, next_id, sp.logprobs))
            output_ids.append(next_id)
            tokens.append(next_id)
            now = time.perf_counter()
            metrics.token_times.append(now)
            metrics.first_token_time = metrics.first_token_time or now
            if next_id in self.tokenizer.eos_token_ids and not sp.ignore_eos:
                finish_reason = "stop"
            elif len(output_ids) >= sp.max_tokens:
                finish_reason = "length"
        metrics.finished_time = time.perf_counter()
        completion = CompletionOutput(0, self.tokenizer.decode(output_ids), output_ids, cumulative, logprobs, finish_reason)
        return RequestOutput(request_id, prompt, list(prompt_ids), [completion], True, metrics)
