"""The API types every step shares: SamplingParams in, RequestOutput out (vLLM's names)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature logits / temperature can overflow fp32 (vLLM clamps to the same 1e-2).
MIN_TEMPERATURE = 1e-2


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """An int or a float (not a bool), and finite: NaN and infinity are refused."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature=0 means greedy. top_k=-1 (or 0) means no top-k cut, top_p=1 no nucleus cut,
    min_p=0 no min-p cut. `logprobs=N` returns, for every generated token, the N most likely
    tokens with their log-probabilities plus the chosen one.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Normalise `stop` and `stop_token_ids` to lists, then raise ValueError naming any field out of its
        limits. Engines call this again when a request is submitted, so a field changed after construction
        is checked too."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None or isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop or [])
        else:
            raise ValueError(f"stop must be a string, a list of strings or None, got {self.stop!r}")
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids or [])
        else:
            raise ValueError(f"stop_token_ids must be a list of token ids or None, got {self.stop_token_ids!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature!r} "
                             "(below that, logits / temperature overflow; use 0 for greedy)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k < 2**63:  # an int64 (a k past the vocabulary cuts nothing)
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer below 2**63 (int64), "
                             f"got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        # 64 bits, signed or not: what torch.Generator.manual_seed takes, and msgpack (the wire, step26 on)
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64 - 1] (64 bits), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter()) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one entry per generated token
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per generated token: {token_id: logprob}, top-N + chosen
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None for EOS/length)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # prefill and decode apart (step35): a kv_producer's answer, what the decode engine needs to pull the prompt's KV
    kv_transfer_params: dict | None = None
