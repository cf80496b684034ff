"""Checks and conversions every step's LLM does the same way: devices, dtypes, prompts, limits."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .params import SamplingParams

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}


def resolve_device_dtype(device=None, dtype=None):
    """None = auto: cuda + bfloat16 when a GPU is present, else cpu + float32."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device: {device!r} is not a torch device ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: only 'cpu' and 'cuda' are supported, got {device.type!r}")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: unknown {dtype!r}; use one of {sorted(set(DTYPES))}")
        dtype = getattr(torch, DTYPES[dtype])
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: only float32, bfloat16 and float16 are supported, got {dtype}")
    return device, dtype


def check_engine_options(may_be_none: tuple[str, ...] = (), **options) -> None:
    """An engine's sizes and switches (the LLM's keyword arguments since step05), checked before anything loads.
    Only the options given are checked, each with a ValueError that names it and its limit:

        max_num_seqs, max_num_batched_tokens, max_kv_tokens   integers >= 1
        max_logprobs                                          an integer >= 1 (step23 on; check_max_logprobs
                                                              bounds it by the vocabulary once the model is read)
        gpu_memory_utilization                                a number in (0, 1]
        block_size                                            an integer in [1, max_kv_tokens]
        enable_prefix_caching                                 True or False

    may_be_none names the options that may be None (max_kv_tokens from step11: the pool is then sized from the
    GPU's free memory, and block_size can only be bounded by 2**20 tokens)."""
    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for name in ("max_num_seqs", "max_num_batched_tokens", "max_logprobs"):
        if name in options and (not is_int(options[name]) or options[name] < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {options[name]!r}")
    if "gpu_memory_utilization" in options:
        share = options["gpu_memory_utilization"]
        if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {share!r}")
    kv_tokens = options.get("max_kv_tokens")
    if "max_kv_tokens" in options and not (kv_tokens is None and "max_kv_tokens" in may_be_none):
        if not is_int(kv_tokens) or kv_tokens < 1:
            what = "None or an integer" if "max_kv_tokens" in may_be_none else "an integer"
            raise ValueError(f"max_kv_tokens must be {what} >= 1, got {kv_tokens!r}")
    if "block_size" in options:
        block_size, largest = options["block_size"], kv_tokens or 2**20
        if not is_int(block_size) or not 1 <= block_size <= largest:
            raise ValueError(f"block_size must be an integer in [1, max_kv_tokens={kv_tokens}], got {block_size!r}")
    if "enable_prefix_caching" in options and not isinstance(options["enable_prefix_caching"], bool):
        raise ValueError(f"enable_prefix_caching must be True or False, got {options['enable_prefix_caching']!r}")


def normalize_prompts(prompts, tokenizer, vocab_size: int, one: bool = False) -> list[tuple[str | None, list[int]]]:
    """Strings or lists of token ids (or one of either) -> [(prompt text or None, token ids)]. one=True: `prompts`
    is [the one prompt of add_request], which is never unwrapped, so that a bare number is refused, not read as a
    token id."""
    bare = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
    if bare and not one:
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts: give a string, a list of token ids, or a non-empty list of either")
    result = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if p == "":
                raise ValueError(f"prompts[{i}]: empty prompt")
            ids = tokenizer.encode(p)
            if not ids:
                raise ValueError(f"prompts[{i}]: the prompt encodes to zero tokens")
            result.append((p, ids))
        elif isinstance(p, (list, tuple)):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}]: empty prompt")
            for t in p:
                if not isinstance(t, int) or isinstance(t, bool):
                    raise ValueError(f"prompts[{i}]: token id {t!r}: expected an int, got {type(t).__name__}")
                if not 0 <= t < vocab_size:
                    raise ValueError(f"prompts[{i}]: token id {t!r} is outside the vocabulary [0, {vocab_size})")
            result.append((None, list(p)))
        else:
            raise ValueError(f"{'prompt' if one else f'prompts[{i}]'}: expected a string or a list of token ids, "
                             f"got {type(p).__name__}")
    return result


def normalize_sampling_params(sampling_params, n: int, default: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams for all prompts, or a list with one per prompt.

    Each is checked again and copied: a field changed after construction is caught here, and changing the
    caller's object later cannot change a request already queued."""
    if sampling_params is None:
        sampling_params = default
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * n
    elif isinstance(sampling_params, Sequence) and all(isinstance(s, SamplingParams) for s in sampling_params):
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params: got {len(sampling_params)} for {n} prompts; give one or one per prompt")
    else:
        raise ValueError(f"sampling_params: expected SamplingParams or a list of them, got {type(sampling_params).__name__}")
    return [dataclasses.replace(sp) for sp in sampling_params]  # replace() runs __post_init__: validate()


class ContextLengthExceededError(ValueError):
    """A request's prompt + max_tokens is longer than the model's context (a ValueError, of its own type so that a
    server can tell it from other bad input: OpenAI's code for it is context_length_exceeded)."""


def check_length(index: int, prompt_len: int, params: SamplingParams, max_model_len: int) -> None:
    """prompt + max_tokens must fit in the model's context; never truncate silently."""
    if prompt_len + params.max_tokens > max_model_len:
        raise ContextLengthExceededError(
            f"prompts[{index}]: prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = "
            f"{prompt_len + params.max_tokens} exceeds the model's context of {max_model_len} tokens"
        )


def check_fits_kv_pool(index: int, prompt_len: int, params: SamplingParams, num_blocks: int, block_size: int) -> None:
    """prompt + max_tokens must fit in a KV pool of num_blocks blocks of block_size tokens, even alone: a request
    that never could is refused at once instead of waiting forever (a plain ValueError: it fits the context)."""
    needed = prompt_len + params.max_tokens
    if -(-needed // block_size) > num_blocks:
        raise ValueError(f"prompts[{index}]: prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = "
                         f"{needed} exceeds max_kv_tokens ({num_blocks * block_size} = {num_blocks} blocks of "
                         f"{block_size}): it could never fit in the KV pool")


def check_max_logprobs(max_logprobs: int, vocab_size: int) -> int:
    """max_logprobs (checked an integer >= 1 with the other options) must be a number of tokens the vocabulary has:
    a request within it never asks the sampler for more tokens than a row of logits holds."""
    if max_logprobs > vocab_size:
        raise ValueError(f"max_logprobs={max_logprobs} is more than the model's vocabulary ({vocab_size} tokens)")
    return max_logprobs


def check_logprobs(index: int, params: SamplingParams, max_logprobs: int) -> None:
    """logprobs=N (the N most likely tokens at each place) may ask for at most the engine's max_logprobs (vLLM's
    option and default, 20): checked with the request, so that no step fails on it."""
    if params.logprobs is not None and params.logprobs > max_logprobs:
        raise ValueError(f"prompts[{index}]: logprobs={params.logprobs} is more than max_logprobs={max_logprobs}, the "
                         "most this engine returns (its max_logprobs option)")


def check_conversations(conversations) -> list[list[dict]]:
    """One conversation (a list of {"role", "content"} dicts) or a list of them."""
    if isinstance(conversations, list) and conversations and isinstance(conversations[0], dict):
        conversations = [conversations]
    if not isinstance(conversations, list) or not conversations:
        raise ValueError("conversations: give a list of messages or a non-empty list of conversations")
    for i, conv in enumerate(conversations):
        check_messages(conv, f"conversations[{i}]")
    return conversations


def check_messages(messages, name: str = "messages") -> list[dict]:
    """One conversation: a non-empty list of {"role", "content"} dicts. Each error starts with `name`, what the
    caller calls it (an OpenAI server: `messages`)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{name}: a conversation is a non-empty list of messages, got {messages!r:.40}")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{name}: each message needs 'role' and 'content', got {m!r}")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"{name}: unknown role {m['role']!r}")
        if not isinstance(m["content"], str):
            raise ValueError(f"{name}: a message's content must be a string, got "
                             f"{type(m['content']).__name__} ({m['content']!r:.40})")
    return messages
