"""The project's shared package: what every step uses but no step teaches."""
from .inputs import (ContextLengthExceededError, check_conversations, check_engine_options, check_fits_kv_pool,
                     check_length, check_logprobs, check_max_logprobs, check_messages, normalize_prompts,
                     normalize_sampling_params, resolve_device_dtype)
from .models import DEFAULT_MODEL, known_model_names, resolve_model
from .params import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams
from .tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL", "CompletionOutput", "ContextLengthExceededError", "RequestMetrics", "RequestOutput",
    "SamplingParams", "Tokenizer", "check_conversations", "check_engine_options", "check_fits_kv_pool", "check_length",
    "check_logprobs", "check_max_logprobs", "check_messages", "known_model_names", "normalize_prompts",
    "normalize_sampling_params", "resolve_device_dtype", "resolve_model",
]
