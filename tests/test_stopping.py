"""Stop strings, stop token ids, EOS, max_tokens, and the finish_reason of each.

The real model where a Part ends and in the newest step (registry.real_model_steps()): it answers the question and
ends with its own EOS. Every step on the tiny model (it shares the real tokenizer), where EOS is a token the tiny
model really produces, declared EOS on a private engine, so that every step's EOS handling is exercised.
"""
import functools

import pytest

from conftest import STEPS, cached_llm
from helpers import load_engine
from registry import REAL, TINY, having, real_model_steps
from shared import SamplingParams

STOP_STEPS = having("sampling")  # stop strings and stop ids arrive with the sampler
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG_ASK = [{"role": "user", "content": "Describe Paris in three sentences."}]


# The length of the free-running answer that the stop tests cut: 16 tokens, 13 words of the real model's answer (a
# token of the real model costs some 0.3 s on a CPU from step29 on, which dequantises its 4-bit weights every forward).
FREE_TOKENS = 16


def model_for(step: str) -> str:
    return REAL if step in real_model_steps() else TINY


@functools.lru_cache(maxsize=None)
def free_answer(step: str):
    """The greedy answer to LONG_ASK, past any EOS: what a stop string or a stop token id must cut. Computed once per
    step and test process, for both stop tests (a step's tests run on one worker)."""
    llm = cached_llm(step, model_for(step))
    return llm.chat(LONG_ASK, SamplingParams(temperature=0, max_tokens=FREE_TOKENS, ignore_eos=True))[0].outputs[0]


@pytest.mark.parametrize("step", real_model_steps())
def test_eos_and_max_tokens(step):
    llm = cached_llm(step, REAL)
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids  # EOS is kept in token_ids ...
    assert "Paris" in out.text and "<|im_end|>" not in out.text  # ... but not in the text
    short = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    assert short.token_ids == out.token_ids[:3]
    ignored = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 2, ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == len(out.token_ids) + 2


@pytest.mark.parametrize("step", STEPS)
def test_eos_ends_a_request_on_the_tiny_model(step):
    """The tiny model's 7th greedy token is declared an EOS token: the answer ends there with it, EOS kept in
    token_ids; ignore_eos runs past it."""
    llm = load_engine(step).LLM(TINY, device="cpu", dtype="float32")  # its own engine: its tokenizer is changed
    prompt = llm.tokenizer.apply_chat_template(QUESTION)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    eos = free.token_ids[6]
    first = free.token_ids.index(eos)
    assert eos not in llm.tokenizer.eos_token_ids and free.finish_reason == "length"
    llm.tokenizer.eos_token_ids = {*llm.tokenizer.eos_token_ids, eos}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == free.token_ids[:first + 1]
    # The text is what came before the EOS token (step01 decodes every token and relies on a real EOS being a
    # special token, which decodes to nothing: that is checked on the real model above).
    assert out.text in (llm.tokenizer.decode(free.token_ids[:first]), llm.tokenizer.decode(free.token_ids[:first + 1]))
    ignored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


@pytest.mark.parametrize("step", STOP_STEPS)
def test_stop_string_cuts_the_text(step):
    llm = cached_llm(step, model_for(step))
    free = free_answer(step)
    words = free.text.split()
    assert len(words) >= 3, free.text
    stop = words[len(words) // 2]  # a word from the middle of the free-running answer
    cut = free.text.find(stop)
    out = llm.chat(LONG_ASK, SamplingParams(temperature=0, max_tokens=FREE_TOKENS, ignore_eos=True,
                                            stop=["@@never@@", stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:cut]  # everything before the stop string, nothing of it
    assert len(out.token_ids) < len(free.token_ids)
    assert out.token_ids == free.token_ids[:len(out.token_ids)]


@pytest.mark.parametrize("step", STOP_STEPS)
def test_stop_token_id(step):
    llm = cached_llm(step, model_for(step))
    free = free_answer(step)
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = llm.chat(LONG_ASK, SamplingParams(temperature=0, max_tokens=FREE_TOKENS, stop_token_ids=[stop_id],
                                            ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free.token_ids[:first + 1]  # the stop token is the last token ...
    assert out.text == llm.tokenizer.decode(free.token_ids[:first])  # ... and is not in the text
