"""Part 4 (step10 on): Qwen3 beside Llama, one loader for HF checkpoint names, fused projections.

Qwen3 has no earlier step to be compared with, so it is compared with HF transformers itself: full-vocabulary
logits at every position, and greedy tokens against HF `generate`. Llama's outputs equal step09's through
the equivalence harness (test_equivalence.py).
"""
import functools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import STEPS
from shared import SamplingParams, resolve_model
from shared.testing import HF_LOGITS_ATOL_FP32, load_engine

FAMILIES = STEPS[STEPS.index("step10"):] if "step10" in STEPS else []
NEWEST = FAMILIES[-1:]  # the Qwen3 oracle runs on the newest step; later steps are chained to it by the harness
PROMPT = [(i * 7919) % 49152 for i in range(1, 41)]  # 40 token ids, spread over the vocabulary


@functools.lru_cache(maxsize=2)
def hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logits_at_every_position(llm, ids: list[int]) -> torch.Tensor:
    """Feed ids one token at a time through the step's model (a decode per position) -> [len(ids), vocab]."""
    bm = llm.block_manager
    block_table = [bm._take_free_block() for _ in range(bm.blocks_for(len(ids)))]
    rows = [llm.model.forward(torch.tensor([[t]]), [i], [block_table], llm.pool)[0] for i, t in enumerate(ids)]
    for block in block_table:  # give the blocks back
        bm.blocks[block].ref_count = 0
        bm.free_blocks[block] = None
    return torch.stack(rows)


def check_against_hf(step: str, folder: str, max_kv_tokens: int = 4096):
    llm = load_engine(step).LLM(folder, device="cpu", dtype="float32", max_kv_tokens=max_kv_tokens)
    hf = hf_model(folder)
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    worst = (logits_at_every_position(llm, PROMPT) - ref).abs().max().item()
    print(f"{folder}: max |logit diff| {step} vs HF = {worst:.2e} (bound {HF_LOGITS_ATOL_FP32:.0e})")
    assert worst <= HF_LOGITS_ATOL_FP32
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                               max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    assert out.token_ids == expected[0, len(PROMPT):].tolist()
    return llm


@pytest.mark.parametrize("step", NEWEST)
def test_tiny_qwen3_matches_hf(step):
    llm = check_against_hf(step, str(resolve_model("random:tiny-qwen3")))
    c = llm.model.config
    assert c.model_type == "qwen3" and c.qk_norm and c.num_heads * c.head_dim != c.hidden_size
    assert c.tie_word_embeddings


@pytest.mark.slow
@pytest.mark.parametrize("step", NEWEST)
def test_qwen3_0_6b_shape_matches_hf(step):
    check_against_hf(step, str(resolve_model("random:qwen3-0.6b")), max_kv_tokens=256)


@pytest.mark.parametrize("step", NEWEST)
def test_untied_qwen3_checkpoint_loads(step, tmp_path):
    """A Qwen3 checkpoint with its own lm_head (tie_word_embeddings false) loads and matches HF."""
    src = resolve_model("random:tiny-qwen3")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(src / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    weights["lm_head.weight"] = torch.randn(weights["model.embed_tokens.weight"].shape, generator=generator) * 0.02
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    llm = check_against_hf(step, str(tmp_path))
    assert not torch.equal(llm.model.w["lm_head.weight"], llm.model.w["model.embed_tokens.weight"])


@pytest.mark.parametrize("step", FAMILIES)
def test_projections_are_fused_at_load_time(step):
    llm = load_engine(step).LLM("random:tiny-qwen3", device="cpu")
    c, w = llm.model.config, llm.model.w
    assert not any(k.endswith((".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".gate_proj.weight", ".up_proj.weight"))
                   for k in w)
    assert w["model.layers.0.self_attn.qkv_proj.weight"].shape == ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                                                                   c.hidden_size)
    assert w["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * c.intermediate_size, c.hidden_size)


@pytest.mark.parametrize("step", FAMILIES)
def test_unsupported_checkpoints_are_refused(step, tmp_path):
    LLM = load_engine(step).LLM
    src = resolve_model("random:tiny-qwen3")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    for change, message in [({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
                            ({"attention_bias": True}, "attention_bias"),
                            ({"tie_word_embeddings": False}, "no lm_head.weight and tie_word_embeddings is false")]:
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path), device="cpu")
