"""Stop strings, stop token ids, EOS, max_tokens, and the finish_reason of each (real model)."""
import pytest

from conftest import STEPS, cached_llm
from shared import SamplingParams

STOP_STEPS = [s for s in STEPS if s != "step01"]  # stop strings and stop ids arrive in step02
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG_ASK = [{"role": "user", "content": "Describe Paris in three sentences."}]


@pytest.mark.parametrize("step", STEPS)
def test_eos_and_max_tokens(step):
    llm = cached_llm(step, "smollm2-135m")
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids  # EOS is kept in token_ids ...
    assert "Paris" in out.text and "<|im_end|>" not in out.text  # ... but not in the text
    short = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    assert short.token_ids == out.token_ids[:3]
    ignored = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 2, ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == len(out.token_ids) + 2


@pytest.mark.slow  # two 40-token real-model runs per step: in make test, not make test-fast
@pytest.mark.parametrize("step", STOP_STEPS)
def test_stop_string_cuts_the_text(step):
    llm = cached_llm(step, "smollm2-135m")
    free = llm.chat(LONG_ASK, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    words = free.text.split()
    stop = words[len(words) // 2]  # a word from the middle of the free-running answer
    cut = free.text.find(stop)
    out = llm.chat(LONG_ASK, SamplingParams(temperature=0, max_tokens=40, stop=["@@never@@", stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:cut]  # everything before the stop string, nothing of it
    assert len(out.token_ids) < len(free.token_ids)
    assert out.token_ids == free.token_ids[:len(out.token_ids)]


@pytest.mark.parametrize("step", STOP_STEPS)
def test_stop_token_id(step):
    llm = cached_llm(step, "smollm2-135m")
    free = llm.chat(LONG_ASK, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = llm.chat(LONG_ASK, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free.token_ids[:first + 1]  # the stop token is the last token ...
    assert out.text == llm.tokenizer.decode(free.token_ids[:first])  # ... and is not in the text
