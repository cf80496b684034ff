"""step19: the layer's small operators fused into three Triton kernels.

Each kernel equals the torch operators it replaces (model.py's TorchLayerOps) on ragged token counts and the hidden
sizes and head shapes of both families (Triton's interpreter on the CPU, fp32 and fp16; compiled in bf16 at real
shapes on the GPU); the engine equals step18 token for token, with the fused kernels launched in every layer of
every forward, counted; a layer launches 11 kernels where step18's launched 33 (Llama) or 45 (Qwen3), counted."""
import pytest
import torch

from shared.anatomy import LaunchCounter, decode_forward_inputs, layer_launches
from helpers import compare_completions, copies_param, STEP_LOGPROB_ATOL_FP32, load_engine
from registry import introducing, last_before, lesson_and_copies
from test_part6 import DEVICE, kernels, mixed_requests

pytest.importorskip("triton")

FUSED = introducing("fused_kernels")
BEFORE = last_before("fused_kernels")
HIDDEN = {"smollm2-135m": 576, "qwen3-0.6b": 1024}  # hidden sizes: 576 is not a power of two (masked columns)
HEADS = {"smollm2-135m": (9, 3, 64, False), "qwen3-0.6b": (16, 8, 128, True)}  # heads, KV heads, head_dim, q/k norm
TOKENS = [1, 4, 11]  # a decode, ragged token counts (every program handles one row, or one (token, head))


def torch_ops(step):
    import importlib

    return importlib.import_module(f"steps.{step}.model").TorchLayerOps()


def fused_cases():
    """Every hidden size, token count and dtype where the kernels are introduced; one corner in every later copy
    that differs. The tests load kernels/fused.py and the torch operators of model.py (and what model.py imports):
    steps where all of those are the same files run them once (registry.distinct_copies)."""
    full = [(name, n, dtype) for name in HIDDEN for n in TOKENS for dtype in (torch.float32, torch.float16)]
    return [copies_param(group, *c, id=f"{c[0]}-n{c[1]}-{str(c[2])[6:]}")
            for group, lesson in lesson_and_copies("fused_kernels", "kernels.fused", "model")
            for c in (full if lesson else [full[-1]])]


def inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


def assert_same(got, expected, dtype):
    """fp32: equal up to the order of a sum; fp16/bf16: one rounding step (the kernels round where torch rounds)."""
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("step,shape,n,dtype", fused_cases())
def test_add_rms_norm_equals_torch(step, shape, n, dtype):
    mod, ref = kernels(step, "fused"), torch_ops(step)
    h = HIDDEN[shape]
    x, residual, weight = inputs((n, h), dtype, 0), inputs((n, h), dtype, 1), inputs((h,), dtype, 2)
    for res in (residual, None):  # a layer's adds, and the first layer's norm with nothing to add
        normed, new_res = mod.add_rms_norm(x, res, weight, 1e-5)
        want_normed, want_res = ref.add_rms_norm(x, res, weight, 1e-5)
        assert_same(new_res, want_res, dtype)
        assert_same(normed, want_normed, dtype)


@pytest.mark.parametrize("step,shape,n,dtype", fused_cases())
def test_silu_mul_equals_torch(step, shape, n, dtype):
    mod, ref = kernels(step, "fused"), torch_ops(step)
    intermediate = {"smollm2-135m": 1536, "qwen3-0.6b": 3072}[shape]  # more columns than one tile of 1024
    gate_up = inputs((n, 2 * intermediate), dtype, 3)
    assert_same(mod.silu_mul(gate_up), ref.silu_mul(gate_up), dtype)


@pytest.mark.parametrize("step,shape,n,dtype", fused_cases())
def test_qk_norm_rope_equals_torch(step, shape, n, dtype):
    mod, ref = kernels(step, "fused"), torch_ops(step)
    model = __import__(f"steps.{step}.model", fromlist=["rope_cos_sin"])
    heads, kv_heads, head_dim, norm = HEADS[shape]
    qkv = inputs((n, (heads + 2 * kv_heads) * head_dim), dtype, 4)
    positions = torch.tensor([0, 4095, 17, 3, 100, 1, 2][:n] + list(range(200, 200 + max(n - 7, 0))), device=DEVICE)
    cos, sin = model.rope_cos_sin(positions, head_dim, 1e6, dtype)
    weights = (inputs((head_dim,), dtype, 5), inputs((head_dim,), dtype, 6)) if norm else (None, None)
    got = mod.qk_norm_rope(qkv, cos, sin, *weights, 1e-6, heads, kv_heads, head_dim)
    expected = ref.qk_norm_rope(qkv, cos, sin, *weights, 1e-6, heads, kv_heads, head_dim)
    for g, e in zip(got, expected):  # q [n, heads, head_dim], then k [n, kv_heads, head_dim]
        assert g.shape == e.shape
        assert_same(g, e, dtype)


def test_fused_kernels_refuse_wrong_shapes():
    mod = kernels(FUSED, "fused")
    with pytest.raises(ValueError, match="silu_mul"):
        mod.silu_mul(torch.zeros(2, 5))  # an odd column count has no gate/up halves
    with pytest.raises(ValueError, match="add_rms_norm"):
        mod.add_rms_norm(torch.zeros(2, 4), torch.zeros(3, 4), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="qk_norm_rope"):
        mod.qk_norm_rope(torch.zeros(2, 80), torch.zeros(2, 16), torch.zeros(2, 16), None, None, 1e-6, 2, 2, 16)


@pytest.mark.parametrize("model,budget", [("random:tiny-llama", 512), ("random:tiny-qwen3", 7)])
def test_fused_engine_equals_step18(model, budget):
    """Chunks and decodes in mixed steps (budget 7) and whole prompts (512); in the interpreter, so few requests."""
    prompts, params = (x[:3] for x in mixed_requests())
    options = dict(device="cpu", max_num_batched_tokens=budget, max_num_seqs=4, attention_backend="triton")
    expected = load_engine(BEFORE).LLM(model, **options).generate(prompts, params)
    llm = load_engine(FUSED).LLM(model, **options)
    got = llm.generate(prompts, params)
    for a, b in zip(got, expected):
        compare_completions(a.outputs[0], b.outputs[0], STEP_LOGPROB_ATOL_FP32)
    layers = llm.model.config.num_layers
    # Per forward: the first norm, then per layer q/k norm + RoPE, add + norm, SiLU * up, add + next layer's norm
    # (the last layer's goes to the final norm): 4 kernels a layer and 1, in every forward.
    assert llm.model.ops.name == "triton" and "fused kernels" in llm.backend
    assert llm.model.ops.launches == llm.stats["forwards"] * (4 * layers + 1) > 0


def launches_per_layer(llm) -> LaunchCounter:
    """What one layer of a decode forward of two requests launches (shared/anatomy.py's layer_launches: the forward
    counted with all its layers and with one fewer)."""
    inputs = decode_forward_inputs(llm)
    assert inputs[0].shape[0] == 2  # the last forward was a step of two decodes
    return layer_launches(llm, inputs)[1]


@pytest.mark.parametrize("model,qk_norm", [("random:tiny-llama", False), ("random:tiny-qwen3", True)])
def test_a_layer_launches_fewer_kernels(model, qk_norm):
    """step19's decode layer: 4 matmuls, 2 KV writes, 1 attention, 4 fused kernels = 11 launches. step18's (fp32 on
    the CPU: no casts) ran on top of the 4 matmuls, 2 writes and 1 attention: two RMSNorms of 6 operators (pow, mean,
    add, rsqrt, two mul) and two residual adds, RoPE's 5 (neg, cat, two mul, add) for q and for k, SiLU and its
    multiply, and for Qwen3 two more RMSNorms (q and k): 26 + 7 = 33 launches (Llama), 38 + 7 = 45 (Qwen3)."""
    counts = {}
    for step in (BEFORE, FUSED):
        counts[step] = launches_per_layer(load_engine(step).LLM(model, device="cpu", attention_backend="triton"))
    fused, before = counts[FUSED], counts[BEFORE]
    assert (fused.ops, fused.triton) == (7 - 1, 1 + 4), fused.by_op  # 4 matmuls + 2 writes; attention + 4 fused
    assert fused.by_op == {"aten.matmul.default": 4, "aten.index_copy_.default": 2}
    replaced = 2 * 6 + 2 + 2 * 5 + 2 + (2 * 6 if qk_norm else 0)
    assert before.launches == 7 + replaced, before.by_op
    assert before.launches - fused.launches == replaced - 4  # 22 (Llama) or 34 (Qwen3) fewer launches a layer


# ---- on the GPU: compiled, bf16, real shapes -----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(HIDDEN))
@pytest.mark.parametrize("step", [FUSED])
def test_fused_kernels_compiled_bf16(step, shape):
    mod, ref = kernels(step, "fused"), torch_ops(step)
    h, dtype = HIDDEN[shape], torch.bfloat16
    x, residual, weight = inputs((16384, h), dtype, 0), inputs((16384, h), dtype, 1), inputs((h,), dtype, 2)
    for got, want in zip(mod.add_rms_norm(x, residual, weight, 1e-5), ref.add_rms_norm(x, residual, weight, 1e-5)):
        assert_same(got, want, dtype)
    gate_up = inputs((300, 2 * {"smollm2-135m": 1536, "qwen3-0.6b": 3072}[shape]), dtype, 3)
    assert_same(mod.silu_mul(gate_up), ref.silu_mul(gate_up), dtype)
    heads, kv_heads, head_dim, norm = HEADS[shape]
    model = __import__(f"steps.{step}.model", fromlist=["rope_cos_sin"])
    qkv = inputs((300, (heads + 2 * kv_heads) * head_dim), dtype, 4)
    cos, sin = model.rope_cos_sin(torch.arange(300, device=DEVICE) * 13, head_dim, 1e6, dtype)
    weights = (inputs((head_dim,), dtype, 5), inputs((head_dim,), dtype, 6)) if norm else (None, None)
    for got, want in zip(mod.qk_norm_rope(qkv, cos, sin, *weights, 1e-6, heads, kv_heads, head_dim),
                         ref.qk_norm_rope(qkv, cos, sin, *weights, 1e-6, heads, kv_heads, head_dim)):
        assert_same(got, want, dtype)


@pytest.mark.gpu
def test_fused_engine_equals_step18_bf16():
    """On the GPU, in bf16, Qwen3's shape: the fused engine gives step18's greedy tokens under the vLLM rule (a
    kernel's fp32 rsqrt or exp may differ from torch's by an ulp, which moves a bf16 rounding now and then: with
    random weights the logits hold many near-ties), and the chosen tokens' logprobs stay within the bf16 bound."""
    from shared import SamplingParams
    from helpers import BF16_LOGPROB_MAX_ATOL, VLLM_RULE_TOP_K

    prompts, _ = mixed_requests()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=VLLM_RULE_TOP_K)
    # Two engines in one test: each takes under half the device, so the second fits whether or not the first's
    # memory is back yet (an engine holds reference cycles: its pool waits for the garbage collector).
    outs = {step: load_engine(step).LLM("random:qwen3-0.6b", device="cuda", dtype="bfloat16",
                                        gpu_memory_utilization=0.4).generate(prompts, params)
            for step in (BEFORE, FUSED)}
    for a, b in zip(outs[FUSED], outs[BEFORE]):
        compare_completions(a.outputs[0], b.outputs[0], BF16_LOGPROB_MAX_ATOL, exact=False)
    assert outs[FUSED][0].outputs[0].token_ids[0] == outs[BEFORE][0].outputs[0].token_ids[0]
