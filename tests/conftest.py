import functools
import os
import sys
from pathlib import Path

import pytest
import torch

# Part 6's Triton kernels: without CUDA they run in Triton's interpreter. It is chosen when a kernel is defined
# (at import), so the variable is set here, before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The step list: a new step joins every equivalence and API test by being added here.
STEPS = ["step01", "step02", "step03", "step04", "step05", "step06", "step07", "step08", "step09", "step10",
         "step11", "step12", "step13", "step14", "step14_1", "step14_2", "step14_3", "step14_4", "step14_5", "step14_6", "step14_7",
         "step15", "step16", "step17"]
# The prompts the equivalence harness runs through every step (chat questions and plain text).
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]
TEXT_PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    "]
EQUIV_MAX_TOKENS = 32


# `make test-fast` (pytest -m "not slow") tests every step-independent thing and the newest steps fully;
# `make test` tests every step. A test that takes a step is marked slow unless its step is one of these, so
# the quick run stays the same size however many steps there are.
FAST_STEPS = 2


def pytest_collection_modifyitems(config, items):
    import torch

    newest = set(STEPS[-FAST_STEPS:])
    for item in items:
        step = getattr(item, "callspec", None) and item.callspec.params.get("step")
        if step is not None and step not in newest:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def equivalence_prompts(tokenizer) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_PROMPTS]
    return chats + [tokenizer.encode(t) for t in TEXT_PROMPTS]


@functools.lru_cache(maxsize=None)
def greedy_outputs(step: str, model: str):
    """Each step's greedy outputs on the harness prompts, computed once per test session (CPU, fp32)."""
    from shared import SamplingParams
    from shared.testing import load_engine

    llm = load_engine(step).LLM(model, device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=EQUIV_MAX_TOKENS, logprobs=5)
    return llm.generate(equivalence_prompts(llm.tokenizer), params)


@functools.lru_cache(maxsize=4)
def cached_llm(step: str, model: str):
    """An engine shared by tests across files, to save load time. Use it with its default options only and
    never change its settings or limits: a test that needs other options builds its own engine."""
    from shared.testing import load_engine

    return load_engine(step).LLM(model, device="cpu", dtype="float32")
