"""Every step gives what the step before it gave; step01 gives what HF transformers gives."""
import functools

import pytest
import torch

from conftest import EQUIV_MAX_TOKENS, STEPS, cached_llm, equivalence_prompts, greedy_outputs
from shared import resolve_model
from shared.testing import HF_LOGITS_ATOL_FP32, STEP_LOGPROB_ATOL_FP32, compare_completions

MODELS = ["smollm2-135m", "random:tiny-llama"]


@functools.lru_cache(maxsize=2)
def hf_model(model: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32).eval()


@pytest.mark.parametrize("model", MODELS)
def test_step01_logits_match_hf(model):
    llm = cached_llm("step01", model)
    hf = hf_model(model)
    worst = 0.0
    for prompt, out in zip(equivalence_prompts(llm.tokenizer), greedy_outputs("step01", model)):
        ids = torch.tensor(prompt + out.outputs[0].token_ids)
        with torch.inference_mode():
            ref = hf(ids[None]).logits[0].float()
        ours = llm.model.forward(ids)
        worst = max(worst, (ref - ours).abs().max().item())
    print(f"{model}: max |logit diff| step01 vs HF = {worst:.2e} (bound {HF_LOGITS_ATOL_FP32:.0e})")
    assert worst <= HF_LOGITS_ATOL_FP32


@pytest.mark.parametrize("model", MODELS)
def test_step01_greedy_matches_hf_generate(model):
    llm = cached_llm("step01", model)
    hf = hf_model(model)
    for prompt, out in zip(equivalence_prompts(llm.tokenizer), greedy_outputs("step01", model)):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=EQUIV_MAX_TOKENS, do_sample=False,
                              eos_token_id=sorted(llm.tokenizer.eos_token_ids), pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("prev,step", list(zip(STEPS, STEPS[1:])))
def test_consecutive_steps_agree(prev, step, model):
    worst = 0.0
    for i, (a, b) in enumerate(zip(greedy_outputs(prev, model), greedy_outputs(step, model))):
        assert a.prompt_token_ids == b.prompt_token_ids
        worst = max(worst, compare_completions(a.outputs[0], b.outputs[0], STEP_LOGPROB_ATOL_FP32, exact=True,
                                               label=f"{prev}->{step} prompt {i}"))
    print(f"{prev}->{step} on {model}: max |logprob diff| = {worst:.2e}")
