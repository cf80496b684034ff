"""The API types every step shares: SamplingParams in, RequestOutput out (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field


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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and its limit."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature is None or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be None or an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
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
