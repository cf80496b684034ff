"""step01 gives what HF transformers gives; the golden file holds step01's outputs; every step gives them.

The golden file (tests/golden/step01.json, written by `python tests/golden.py`) holds step01's greedy tokens and
top-5 logprobs on the harness prompts. step01 is checked against HF transformers and against the file; every other
step against the file: on the tiny model in every step, on the real model where a Part ends and in the newest step
(registry.real_model_steps()). Equal to the same reference, the steps are equal to each other.
"""
import functools

import pytest
import torch

from conftest import EQUIV_MAX_TOKENS, STEPS, cached_llm, equivalence_prompts, greedy_outputs
from helpers import HF_LOGITS_ATOL_FP32, STEP_LOGPROB_ATOL_FP32, compare_completions, read_golden
from registry import REAL, TINY, real_model_steps
from shared import resolve_model

MODELS = [REAL, TINY]
# step01's greedy outputs (about 30 s on the real model: step01 re-runs the whole sequence per token) are computed
# once per test process; the tests that read them run on the worker that runs step01's other tests.
ON_STEP01S_WORKER = pytest.mark.xdist_group(STEPS[0])


@functools.lru_cache(maxsize=2)
def hf_model(model: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32).eval()


@ON_STEP01S_WORKER
@pytest.mark.parametrize("model", MODELS)
def test_step01_logits_match_hf(model):
    llm = cached_llm(STEPS[0], model)
    hf = hf_model(model)
    worst = 0.0
    for prompt, out in zip(equivalence_prompts(llm.tokenizer), greedy_outputs(STEPS[0], model), strict=True):
        ids = torch.tensor(prompt + out.outputs[0].token_ids)
        with torch.inference_mode():
            ref = hf(ids[None]).logits[0].float()
        ours = llm.model.forward(ids)
        worst = max(worst, (ref - ours).abs().max().item())
    print(f"{model}: max |logit diff| step01 vs HF = {worst:.2e} (bound {HF_LOGITS_ATOL_FP32:.0e})")
    assert worst <= HF_LOGITS_ATOL_FP32


@ON_STEP01S_WORKER
@pytest.mark.parametrize("model", MODELS)
def test_step01_greedy_matches_hf_generate(model):
    """HF generates for the harness prompts in one batch (left-padded, masked): 32 steps, not 5 x 32. A row that
    reaches EOS is padded after it; step01's answer is the row up to its first EOS, and nothing but padding after."""
    llm = cached_llm(STEPS[0], model)
    hf = hf_model(model)
    prompts, eos, pad = equivalence_prompts(llm.tokenizer), sorted(llm.tokenizer.eos_token_ids), 0
    width = max(map(len, prompts))
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([[0] * (width - len(p)) + p for p in prompts]),
                          attention_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
                          max_new_tokens=EQUIV_MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    for i, out in enumerate(greedy_outputs(STEPS[0], model)):
        row = ref[i, width:].tolist()
        end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        assert out.outputs[0].token_ids == row[:end] and set(row[end:]) <= {pad}, f"prompt {i}"


@ON_STEP01S_WORKER
@pytest.mark.parametrize("model", MODELS)
def test_golden_file_is_step01s_output(model):
    """The file is what step01 gives today, top-5 candidates included (regenerate: python tests/golden.py)."""
    prompts, golden = read_golden(model)
    outs = greedy_outputs(STEPS[0], model)
    assert [list(o.prompt_token_ids) for o in outs] == prompts, "the harness prompts changed: regenerate the file"
    assert len(golden) == len(outs) > 0
    for i, (a, b) in enumerate(zip(outs, golden)):
        compare_completions(a.outputs[0], b, STEP_LOGPROB_ATOL_FP32, exact=True, label=f"step01 vs golden prompt {i}")
        for row_a, row_b in zip(a.outputs[0].logprobs, b.logprobs, strict=True):
            top_a = sorted(row_a, key=row_a.get, reverse=True)[:5]
            top_b = sorted(row_b, key=row_b.get, reverse=True)[:5]
            assert set(top_a) == set(top_b) and max(abs(row_a[t] - row_b[t]) for t in top_a) <= STEP_LOGPROB_ATOL_FP32
    # Two of the real model's three chat answers end with EOS within the harness's max_tokens, so every step's
    # comparison with the file checks its EOS handling too (the tiny random model never stops early).
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= (2 if model == REAL else 0), \
        "the real model's chat answers should end with EOS: the harness checks EOS handling too"


def golden_cases():
    return [pytest.param(step, model, id=f"{step}-{model}") for step in STEPS[1:] for model in MODELS
            if model == TINY or step in real_model_steps()]


@pytest.mark.parametrize("step,model", golden_cases())
def test_step_matches_golden(step, model):
    prompts, golden = read_golden(model)
    outs = greedy_outputs(step, model)
    assert len(outs) == len(golden) == len(prompts) > 0
    worst = 0.0
    for i, (a, b) in enumerate(zip(outs, golden)):
        assert a.prompt_token_ids == prompts[i]
        worst = max(worst, compare_completions(a.outputs[0], b, STEP_LOGPROB_ATOL_FP32, exact=True,
                                               label=f"{step} vs golden (step01) prompt {i}"))
    print(f"{step} vs step01 on {model}: max |logprob diff| = {worst:.2e}")
