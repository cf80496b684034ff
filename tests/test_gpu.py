"""On CUDA in bf16, every step's logprobs stay close to HF transformers' on the same weights."""
import functools

import pytest
import torch

from conftest import CHAT_PROMPTS, STEPS
from shared import SamplingParams, resolve_model
from helpers import (BF16_LOGPROB_MAX_ATOL, BF16_LOGPROB_MEAN_ATOL, VLLM_RULE_TOP_K, load_engine)

MODEL = "random:smollm2-135m"
MAX_TOKENS = 32


@functools.lru_cache(maxsize=1)
def hf_model(model: str = MODEL):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.bfloat16).cuda().eval()


@pytest.mark.gpu
@pytest.mark.parametrize("step", STEPS)
def test_step_matches_hf_in_bf16(step):
    check_against_hf(step, MODEL)


def check_against_hf(step: str, model: str, **options) -> None:
    """The step's greedy bf16 answers to the chat prompts against HF's logprobs on the same tokens (vLLM rule)."""
    llm = load_engine(step).LLM(model, device="cuda", dtype="bfloat16", **options)
    assert llm.dtype == torch.bfloat16 and llm.device.type == "cuda"
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=VLLM_RULE_TOP_K,
                                                ignore_eos=True))
    diffs = []
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.outputs[0].token_ids], device="cuda")
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(model)(ids).logits[0].float(), dim=-1)[len(prompt) - 1:-1]  # [gen, vocab]
        for i, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            hf_top = torch.topk(ref[i], VLLM_RULE_TOP_K).indices.tolist()
            if tok != hf_top[0]:
                # vLLM rule: our token must be a near-tie in HF's eyes, and HF's choice in our top-k.
                assert tok in hf_top and hf_top[0] in lp, f"{step}: token {i} {tok} vs HF {hf_top}"
                break  # after a divergence the sequences are no longer comparable
            diffs.append(abs(lp[tok] - float(ref[i, tok])))
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    print(f"{step} vs HF (bf16, cuda, {model}): {len(diffs)} tokens, mean |dlogprob| {mean:.4f}, max {worst:.4f}")
    assert mean <= BF16_LOGPROB_MEAN_ATOL and worst <= BF16_LOGPROB_MAX_ATOL
