"""step31: a mixture of experts (Qwen3-MoE): the router, the top-k experts of each token, the experts as a loop
(model.py's expert_loop, the reference) or as two grouped GEMMs (kernels/moe.py), and expert parallelism.

What is proven here, on the CPU (the kernels in Triton's interpreter, fp32; tensor parallelism over gloo):
- the engine's greedy tokens equal HF's Qwen3MoeForCausalLM on random:tiny-qwen3-moe (8 experts, 2 per token,
  renormalised; one dense layer), float32, exactly, batched, chunked and with prefix hits (their counters);
- the fused kernels equal the loop on every routing pattern: random, one expert taking every token, experts taking
  none, ties in the router, another rank's experts left out; two launches however many experts were hit;
- align sorts every pair into its expert's run, each run padded to whole blocks, nothing lost;
- the engine on the fused path follows the loop's tokens, two launches per sparse layer;
- ep=2 (whole experts split) and tp=2 (each expert's width split) equal one rank;
- bad input: an expert count the ranks do not divide, an expert width they do not divide, a missing router or
  expert tensor (on rank 1 only too), enable_expert_parallel on a dense model: a ValueError that names it.
On the GPU (marked gpu): the fused layer against the loop in bf16 at Qwen3-30B-A3B's layer shape, and the engine with
CUDA graphs (the MoE layer inside them) following the torch path."""
import importlib
import multiprocessing

import pytest
import torch

from helpers import TP_LOGPROB_ATOL_FP32, compare_completions, edited_model, load_engine, step_module
from registry import having, introducing
from shared import SamplingParams, resolve_model

MOE_STEP = introducing("moe")
TINY_MOE = "random:tiny-qwen3-moe"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")


def module(name: str):
    return importlib.import_module(f"steps.{MOE_STEP}.{name}")


def prompts_with_a_shared_prefix(num: int = 4) -> list[list[int]]:
    """Prompts that share a 32-token prefix (two blocks of 16: prefix-cache hits), each with its own tail."""
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, 49152, (32,), generator=g).tolist()
    return [prefix + torch.randint(0, 49152, (3 + 7 * i,), generator=g).tolist() for i in range(num)]


# ---- the model against HF --------------------------------------------------------------------------------------
def test_engine_equals_hf_qwen3_moe_batched_chunked_and_cached():
    """One prompt, then three at once, in a budget of 24 tokens (every prompt is prefilled in chunks), the three
    finding the first one's prefix in the cache: each greedy answer equals HF's generate on the same model, token for token, and the
    loop ran (two matmuls per expert hit)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model(TINY_MOE), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.norm_topk_prob
    prompts = prompts_with_a_shared_prefix()
    llm = load_engine(MOE_STEP).LLM(TINY_MOE, device="cpu", dtype="float32", max_kv_tokens=1024,
                                    max_num_batched_tokens=24, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts[:1], sp) + llm.generate(prompts[1:], sp)  # the first one's prefix, then found
    assert llm.stats["prefill_chunks"] > len(prompts) and llm.block_manager.stats["hits"] > 0
    c = llm.model.config
    assert [c.is_moe_layer(i) for i in range(c.num_layers)] == [True, False, True]
    assert llm.model.ops.expert_matmuls > 0 and llm.model.ops.expert_matmuls % 2 == 0
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
            assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_route_renormalises_the_top_k():
    """route: softmax over the experts in fp32, the k most probable, most probable first; renormalised they sum to 1,
    otherwise they are the probabilities themselves."""
    mod = module("model")
    g = torch.Generator().manual_seed(0)
    h, router = torch.randn(7, 16, generator=g), torch.randn(6, 16, generator=g)
    probs = torch.softmax(h @ router.T, dim=-1)
    w, e = mod.route(h, router, 3, renormalize=False)
    assert torch.equal(e, probs.topk(3).indices) and torch.allclose(w, probs.topk(3).values)
    w, e = mod.route(h, router, 3, renormalize=True)
    assert torch.allclose(w.sum(-1), torch.ones(7)) and (w[:, :-1] >= w[:, 1:]).all()


# ---- the fused kernels against the loop ------------------------------------------------------------------------
def experts_case(E=8, hidden=64, width=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * width, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(E, hidden, width, generator=g) / width ** 0.5
    return gate_up, down


def routing(pattern: str, N: int, E: int, k: int):
    """(weights [N, k], experts [N, k]) of a routing pattern."""
    g = torch.Generator().manual_seed(N + k)
    if pattern == "random":
        experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    elif pattern == "one-expert-takes-every-token":  # expert 3 first for everyone, the rest random
        experts = torch.stack([torch.cat([torch.tensor([3]), torch.randperm(E - 1, generator=g)[:k - 1] + 4]) % E
                               for _ in range(N)])
    elif pattern == "half-the-experts-idle":  # only experts 0, 2, 4, 6
        experts = torch.stack([torch.randperm(E // 2, generator=g)[:k] * 2 for _ in range(N)])
    else:
        raise ValueError(pattern)
    weights = torch.softmax(torch.randn(N, k, generator=g), dim=-1)
    return weights, experts


@pytest.mark.parametrize("pattern", ["random", "one-expert-takes-every-token", "half-the-experts-idle"])
@pytest.mark.parametrize("N,k,block_m", [(1, 2, None), (5, 2, None), (37, 3, 16), (40, 2, 32), (300, 2, None)])
def test_fused_moe_equals_the_loop(pattern, N, k, block_m):
    """Two launches (gate_up with SiLU * up, then down with the router weight) equal the loop over the experts
    however the tokens are routed; the loop ran two matmuls per expert that got a token."""
    ops, moe = module("model").TorchLayerOps(), module("kernels.moe")
    gate_up, down = experts_case()
    h = torch.randn(N, 64, generator=torch.Generator().manual_seed(N))
    weights, experts = routing(pattern, N, 8, k)
    expected = ops.expert_loop(h, weights, experts, gate_up, down)
    assert ops.expert_matmuls == 2 * experts.unique().numel()
    got = moe.fused_moe(h, weights, experts, gate_up, down, block_m=block_m)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fused_moe_leaves_out_another_ranks_experts():
    """Expert parallelism: a rank holding experts 4..7 gets each token's chosen experts minus 4; the pairs outside
    0..3 are another rank's, skipped by both paths, and the two ranks' partial sums add up to the whole layer."""
    ops, moe = module("model").TorchLayerOps(), module("kernels.moe")
    gate_up, down = experts_case()
    h = torch.randn(23, 64, generator=torch.Generator().manual_seed(1))
    weights, experts = routing("random", 23, 8, 2)
    whole = ops.expert_loop(h, weights, experts, gate_up, down)
    parts = []
    for first in (0, 4):
        local = experts - first
        expected = ops.expert_loop(h, weights, local, gate_up[first:first + 4], down[first:first + 4])
        got = moe.fused_moe(h, weights, local, gate_up[first:first + 4], down[first:first + 4])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        parts.append(got)
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)


def test_ties_in_the_router_route_both_paths_alike():
    """Experts 2 and 5 have the same router row, and every token leans towards it: the two tie for every token's one
    expert. Both paths run after the one router (route), so they get the same choice and agree; the fused ops launch
    two kernels for the layer."""
    mod, fused = module("model"), module("kernels.fused")
    gate_up, down = experts_case()
    g = torch.Generator().manual_seed(5)
    lean = torch.randn(64, generator=g)
    router = torch.randn(8, 64, generator=g) / 8
    router[2] = router[5] = lean / 2
    h = torch.randn(12, 64, generator=g) + 2 * lean
    loop, triton_ops = mod.TorchLayerOps(), fused.TritonLayerOps()
    weights, chosen = mod.route(h, router, 1, True)
    assert ((chosen == 2) | (chosen == 5)).all()  # a tie, for every token
    expected = loop.experts(h, weights, chosen, gate_up, down)
    got = triton_ops.experts(h, weights, chosen, gate_up, down)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert triton_ops.moe_launches == 2 and loop.expert_matmuls == 2 * chosen.unique().numel()


def test_align_sorts_every_pair_into_its_experts_padded_run():
    """align: each block of block_m rows belongs to one expert (block_expert), its rows are that expert's pairs (or
    padding, N * k), every pair appears exactly once, in token order within its expert; past the runs, -1."""
    moe = module("kernels.moe")
    weights, experts = routing("half-the-experts-idle", 29, 8, 2)
    experts[0, 0] = 9  # another rank's expert: left out
    sorted_pairs, block_expert = moe.align(experts, 8, 16)
    assert sorted_pairs.numel() == moe.padded_pairs(58, 8, 16) and sorted_pairs.numel() % 16 == 0
    flat = experts.flatten()
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_pairs[b * 16:(b + 1) * 16].tolist()
        real = [r for r in rows if r != 58]
        if e < 0:
            assert not real
            continue
        assert all(flat[r] == e for r in real) and real == sorted(real)
        seen += real
    assert sorted(seen) == sorted(i for i in range(58) if flat[i] < 8)
    assert set(block_expert.tolist()) - {-1} == {0, 2, 4, 6}


def test_the_kernels_compile_for_hopper():
    """Both grouped GEMMs compile for sm_90 (the H200) here, without a GPU (docs/data/sass_step31.py, outside the
    interpreter), at 16- and 64-row blocks, and their K loops multiply on the tensor cores: HMMA at 16 rows, Hopper's
    warpgroup HGMMA at 64."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "docs/data/sass_step31.py"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"BLOCK_M\s+(\d+) .*?gate_up loop \d+ instructions, (\d+) (\w+).*?down loop \d+ instructions, "
                      r"(\d+) (\w+)", proc.stdout)
    assert len(rows) == 4, proc.stdout
    for block_m, up, up_kind, down, down_kind in rows:
        assert int(up) > 0 and int(down) > 0
        assert up_kind == down_kind == ("HGMMA" if block_m == "64" else "HMMA"), rows


# ---- the engine ----------------------------------------------------------------------------------------------
def test_fused_engine_follows_the_loop_with_two_launches_per_sparse_layer(monkeypatch):
    """The Triton path (interpreter) against the torch path on the tiny MoE, float32: the same greedy tokens, logprobs
    within the fp32 reordering bound; the fused engine ran no expert matmul of the loop, two launches per sparse layer
    per forward."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    prompts = prompts_with_a_shared_prefix(3)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    LLM = load_engine(MOE_STEP).LLM
    loop = LLM(TINY_MOE, device="cpu", dtype="float32", max_kv_tokens=1024)
    fused = LLM(TINY_MOE, device="cpu", dtype="float32", max_kv_tokens=1024, attention_backend="triton")
    assert "run as a loop over the experts hit" in loop.backend and "run as two grouped GEMMs" in fused.backend
    a, b = loop.generate(prompts, sp), fused.generate(prompts, sp)
    for i, (x, y) in enumerate(zip(a, b)):
        compare_completions(x.outputs[0], y.outputs[0], 1e-4, label=f"prompt {i}")
    sparse = sum(map(fused.model.config.is_moe_layer, range(fused.model.config.num_layers)))
    assert fused.model.ops.moe_launches == 2 * sparse * fused.stats["forwards"]
    assert fused.model.ops.expert_matmuls == 0 and loop.model.ops.expert_matmuls > 2 * sparse * loop.stats["forwards"]


def generate_over_ranks(prompts, params, **options):
    LLM = load_engine(MOE_STEP).LLM
    llm = LLM(TINY_MOE, device="cpu", dtype="float32", max_kv_tokens=1024, tensor_parallel_size=2, **options)
    try:
        out = llm.generate(prompts, params)
        w = llm.model.w["model.layers.0.mlp.experts.gate_up_proj.weight"]
        held = (llm.model.experts, tuple(w.shape), llm.tp.all_reduces, llm.stats["forwards"])
        assert ("experts 0..3 whole (expert parallel)" in llm.backend) == options["enable_expert_parallel"]
    finally:
        llm.shutdown()
    return out, held


@pytest.mark.parametrize("expert_parallel", [True, False])
def test_two_ranks_equal_one(expert_parallel):
    """tp=2 over gloo: with enable_expert_parallel each rank holds 4 whole experts (rank 0: experts 0..3), without it
    every expert's half width; either way one all-reduce completes each layer's MLP, as a dense layer's, and the
    tokens are one rank's, logprobs within the reordering bound."""
    prompts = prompts_with_a_shared_prefix(3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    ref = load_engine(MOE_STEP).LLM(TINY_MOE, device="cpu", dtype="float32", max_kv_tokens=1024).generate(
        prompts, params)
    out, (experts, shape, all_reduces, forwards) = generate_over_ranks(prompts, params,
                                                                       enable_expert_parallel=expert_parallel)
    assert (experts, shape) == ((range(0, 4), (4, 64, 64)) if expert_parallel else (range(0, 8), (8, 32, 64)))
    assert all_reduces == forwards * (2 * 3 + 1)  # the embedding, then attention's and the MLP's in each layer
    for i, (a, b) in enumerate(zip(out, ref)):
        compare_completions(a.outputs[0], b.outputs[0], TP_LOGPROB_ATOL_FP32, label=f"prompt {i}")


# ---- bad input --------------------------------------------------------------------------------------------------
def edited_moe(tmp_path, edit_config=None, drop=None):
    """A copy of the tiny MoE's folder with its config edited, or one tensor left out of its checkpoint."""
    return edited_model(tmp_path, TINY_MOE, edit_config, drop)


def test_expert_parallel_over_ranks_that_do_not_divide_the_experts_is_a_value_error(tmp_path):
    folder = edited_moe(tmp_path, lambda c: c.update(num_experts=7))
    with pytest.raises(ValueError, match="num_experts=7"):
        load_engine(MOE_STEP).LLM(folder, device="cpu", tensor_parallel_size=2, enable_expert_parallel=True)


def test_an_expert_width_the_ranks_do_not_divide_is_a_value_error(tmp_path):
    folder = edited_moe(tmp_path, lambda c: c.update(moe_intermediate_size=33))
    with pytest.raises(ValueError, match="moe_intermediate_size=33"):
        load_engine(MOE_STEP).LLM(folder, device="cpu", tensor_parallel_size=2)


@pytest.mark.parametrize("missing", ["model.layers.2.mlp.gate.weight", "model.layers.0.mlp.experts.5.up_proj.weight"])
def test_a_missing_router_or_expert_is_a_value_error_naming_it(tmp_path, missing):
    folder = edited_moe(tmp_path, drop=missing)
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        load_engine(MOE_STEP).LLM(folder, device="cpu", max_kv_tokens=256)


@pytest.mark.parametrize("step", having("moe"))
def test_a_missing_expert_of_rank_1_is_a_value_error_naming_the_rank(step, tmp_path):
    """Expert parallel over two ranks: expert 5 is rank 1's, and only rank 1 reads it. Its ValueError reaches the
    caller as a ValueError (parallel.py's WorkerValueError, a WorkerError too) that names the worker and ends with
    the worker's own message."""
    missing = "model.layers.0.mlp.experts.5.up_proj.weight"
    folder = edited_moe(tmp_path, drop=missing)
    with pytest.raises(ValueError, match=r"tensor-parallel worker 1 \(pid \d+\) failed") as caught:
        load_engine(step).LLM(folder, device="cpu", max_kv_tokens=256, tensor_parallel_size=2,
                              enable_expert_parallel=True)
    assert isinstance(caught.value, step_module(step, "parallel").WorkerError)
    assert str(caught.value).splitlines()[-1].startswith("ValueError: ") and missing in str(caught.value)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("step", having("moe"))
@pytest.mark.parametrize("size", [1, 2])
def test_expert_parallel_on_a_dense_model_is_a_value_error(step, size):
    """enable_expert_parallel=True splits a model's experts: a model without any is refused by name, not ignored, on
    one rank and on two (before any worker starts)."""
    with pytest.raises(ValueError, match=r"enable_expert_parallel=True: .*has no experts"):
        load_engine(step).LLM("random:tiny-llama", device="cpu", tensor_parallel_size=size,
                              enable_expert_parallel=True)
    assert not multiprocessing.active_children()


def test_a_shared_expert_is_refused_by_name(tmp_path):
    folder = edited_moe(tmp_path, lambda c: c.update(shared_expert_intermediate_size=64))
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        load_engine(MOE_STEP).LLM(folder, device="cpu", max_kv_tokens=256)


# ---- on the GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@cuda
def test_gpu_fused_moe_at_qwen3_30b_a3b_layer_shape_in_bf16():
    """Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts of width 768, 8 per token), bf16, at 1, 16, 256 and 4,096
    tokens: the compiled kernels against the loop, within bf16's rounding of the sums' order."""
    mod, moe = module("model"), module("kernels.moe")
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(128, 1536, 2048, generator=g, device="cuda") / 2048 ** 0.5).bfloat16()
    down = (torch.randn(128, 2048, 768, generator=g, device="cuda") / 768 ** 0.5).bfloat16()
    router = (torch.randn(128, 2048, generator=g, device="cuda") / 2048 ** 0.5).bfloat16()
    for N in (1, 16, 256, 4096):
        h = torch.randn(N, 2048, generator=g, device="cuda").bfloat16()
        weights, experts = mod.route(h, router, 8, True)
        expected = mod.TorchLayerOps().expert_loop(h, weights, experts, gate_up, down).float()
        got = moe.fused_moe(h, weights, experts, gate_up, down).float()
        assert ((got - expected).abs().max() / expected.abs().max()).item() < 2e-2, N


@pytest.mark.gpu
@cuda
def test_gpu_moe_engine_with_graphs_follows_the_torch_path():
    """The tiny MoE in bf16 with CUDA graphs (the routing, align and both kernels captured per batch bucket): the
    Triton path's tokens follow the torch loop's up to bf16 near-ties, and decode steps replayed graphs."""
    from helpers import BF16_LOGPROB_MAX_ATOL

    prompts = prompts_with_a_shared_prefix(4)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    outs = {}
    for backend in ("torch", "triton"):
        llm = load_engine(MOE_STEP).LLM(TINY_MOE, device="cuda", dtype="bfloat16", max_kv_tokens=4096,
                                        gpu_memory_utilization=0.3, attention_backend=backend)
        outs[backend] = llm.generate(prompts, sp)
        if backend == "triton":
            assert llm.stats["graph_replays"] > 0 and llm.model.ops.moe_launches > 0
        llm.shutdown()
    for i, (a, b) in enumerate(zip(outs["triton"], outs["torch"])):
        compare_completions(a.outputs[0], b.outputs[0], BF16_LOGPROB_MAX_ATOL, exact=False, label=f"request {i}")
