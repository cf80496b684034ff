"""step30: a float8 KV cache (kv_cache_dtype="fp8" or "fp8_e4m3"): K and V stored as e4m3, one scale per layer for K
and one for V (floats: vLLM's k_scale and v_scale, 1.0 unless given).

What is proven here, on the CPU (the kernels in Triton's interpreter, fp32):
- the quantiser is torch's own saturating cast of x / scale, and restoring multiplies by the scale;
- the fused q/k norm + RoPE kernel stores, in an fp8 cache, exactly the bytes the torch path stores;
- the kernels that read an fp8 cache (the mixed kernel, flash decoding's both exits and its one-launch merge) equal
  the torch reference on the explicitly dequantised cache, with scales that are not 1;
- the pool: one byte per element and nothing per token;
- on the real model, greedy answers follow "auto"'s up to near-ties with a measured, bounded logprob drift;
- bad input: a float8 format the engine does not store, a float8 cache without its scales."""
import importlib

import pytest
import torch

from shared import SamplingParams
from helpers import VLLM_RULE_TOP_K, load_engine
from registry import REAL, introducing
from test_part6 import make_case
from test_part6_mixed import CACHED, QUERY_LENS
import test_part6_decode

pytest.importorskip("triton")

FP8_STEP = introducing("fp8_kv")
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.5, 2.0  # not 1: a kernel that forgets a scale is off by 2x


def module(name: str):
    return importlib.import_module(f"steps.{FP8_STEP}.{name}")


def quantized(k: torch.Tensor, v: torch.Tensor):
    """A cache in the model's dtype -> the fp8 caches, quantised by the step's own quantize_fp8 (what write_kv
    stores), with K_SCALE and V_SCALE."""
    quantize = module("model").quantize_fp8
    return quantize(k, K_SCALE), quantize(v, V_SCALE)


def dequantized(q8: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return module("model").dequantize_fp8(q8, scale, dtype)


# ---- the quantiser --------------------------------------------------------------------------------------------
def test_quantize_fp8_is_torchs_saturating_cast():
    """quantize_fp8(x, s) stores x / s rounded to the nearest e4m3 value, as torch's cast does, saturated at 448
    (e4m3fn has no infinity); restoring gives it back times s, within 1/16 of each value in e4m3's normal range and
    within half a subnormal step (2^-10 s) below it."""
    mod = module("model")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=gen) * 10 ** torch.empty(4000).uniform_(-3, 2.5, generator=gen)
    x[:4] = torch.tensor([1000.0, -900.0, 0.0, -0.0])
    for scale in (1.0, K_SCALE, V_SCALE):
        q = mod.quantize_fp8(x, scale)
        assert q.dtype == FP8
        assert torch.equal(q.view(torch.uint8), (x / scale).to(FP8).view(torch.uint8))  # torch saturates too
        back = mod.dequantize_fp8(q, scale, torch.float32)
        assert back[0] == 448 * scale and back[1] == -448 * scale and not back.isnan().any()
        y = x[4:] / scale
        err = (back[4:] / scale - y).abs()
        normal, small = (y.abs() >= 2 ** -6) & (y.abs() <= 448), y.abs() < 2 ** -6
        assert (err[normal] <= y.abs()[normal] / 16).all() and (err[small] <= 2 ** -10 + 1e-12).all()
        assert (back[4:][y.abs() > 448].abs() == 448 * scale).all()


def test_write_and_gather_round_trip_an_fp8_cache():
    """write_kv into an fp8 cache stores quantize_fp8's bytes at the slots (the layer's scale, a float); gather_kv
    returns them restored, in the dtype asked for."""
    mod = module("model")
    cache = torch.zeros(6, 4, 2, 16, dtype=FP8)
    slots = torch.tensor([5, 17, 0, 22, 9])
    new = torch.randn(5, 2, 16)
    mod.write_kv(cache, slots, new, V_SCALE)
    q = mod.quantize_fp8(new, V_SCALE)
    assert torch.equal(cache.view(torch.uint8).view(-1, 2, 16)[slots], q.view(torch.uint8))
    got = mod.gather_kv(cache, slots, V_SCALE, torch.float16)
    assert got.dtype == torch.float16
    assert torch.equal(got, mod.dequantize_fp8(q, V_SCALE, torch.float16))


def test_the_fused_write_stores_what_the_torch_path_stores():
    """The q/k norm + RoPE kernel with an fp8 cache: q as the torch path computes it, and K and V in the cache byte
    for byte what model.py's write_kv stores (the kernel rounds to e4m3 itself: _to_fp8_range), on both models'
    layouts (q/k norms or none), with K_SCALE and V_SCALE."""
    fused, mod = module("kernels.fused"), module("model")
    gen = torch.Generator().manual_seed(1)
    for heads, kv_heads, head_dim, norm in ((4, 2, 64, True), (3, 1, 32, False)):
        n = 7
        qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
        qkv[0, :8] = 600.0  # saturates
        positions = torch.arange(10, 10 + n)
        cos, sin = mod.rope_cos_sin(positions, head_dim, 10000.0, torch.float32)
        weights = ((torch.rand(head_dim, generator=gen) + 0.5, torch.rand(head_dim, generator=gen) + 0.5) if norm
                   else (None, None))
        slots = torch.tensor([3, 40, 7, 12, 0, 33, 21])
        caches = {}
        for name, ops in (("torch", mod.TorchLayerOps()), ("triton", fused.TritonLayerOps())):
            k_cache, v_cache = (torch.zeros(3, 16, kv_heads, head_dim, dtype=FP8) for _ in range(2))
            q = ops.qk_norm_rope_write(qkv, cos, sin, *weights, 1e-6, heads, kv_heads, head_dim, k_cache, v_cache,
                                       K_SCALE, V_SCALE, slots)
            caches[name] = (q, k_cache.view(torch.uint8), v_cache.view(torch.uint8))
        torch.testing.assert_close(caches["triton"][0], caches["torch"][0], rtol=1e-6, atol=1e-6)
        assert torch.equal(caches["triton"][1], caches["torch"][1])
        assert torch.equal(caches["triton"][2], caches["torch"][2])


# ---- the kernels ------------------------------------------------------------------------------------------------
KERNEL_CASES = [(16, 4, 4, 64), (64, 6, 2, 128), (16, 8, 1, 128)]


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", KERNEL_CASES)
def test_mixed_kernel_fp8_equals_dequantised_reference(block_size, heads, kv_heads, head_dim):
    """Ragged rows (decodes, chunks after cached prefixes, a prompt from scratch) over an fp8 cache."""
    kern = module("kernels.attention")
    q, k, v, tables, cu, lens = make_case(QUERY_LENS, CACHED, block_size, heads, kv_heads, head_dim, torch.float32)
    k8, v8 = quantized(k, v)
    scale = head_dim ** -0.5
    expected = kern.attention_reference(q, dequantized(k8, K_SCALE, q.dtype), dequantized(v8, V_SCALE, q.dtype),
                                        tables, cu, lens, scale)
    got = kern.mixed_attention(q, k8, v8, tables, cu, lens, scale, max(QUERY_LENS), k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    same = kern.attention_reference(q, k8, v8, tables, cu, lens, scale, K_SCALE, V_SCALE)  # it dequantises too
    torch.testing.assert_close(same, expected, rtol=0, atol=0)
    plain = kern.attention_reference(q, k, v, tables, cu, lens, scale)
    assert (got - plain).abs().max() > 1e-3  # the cache really was rounded: fp8 is not the fp32 result


def test_mixed_kernel_fp8_decode_rows_take_long_key_tiles():
    """A step of decodes only (16-row tiles): on an fp8 cache the mixed kernel reads key tiles of 128 (as on int8)
    and still equals the reference on the dequantised cache, contexts shorter and longer than a tile."""
    kern = module("kernels.attention")
    q, k, v, tables, cu, lens = make_case([1, 1, 1, 1], [40, 300, 7, 128], 16, 4, 2, 64, torch.float32)
    k8, v8 = quantized(k, v)
    expected = kern.attention_reference(q, k8, v8, tables, cu, lens, 0.125, K_SCALE, V_SCALE)
    got = kern.mixed_attention(q, k8, v8, tables, cu, lens, 0.125, 1, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,num_splits,one_launch", [
    (16, 4, 4, 64, 1, False), (64, 6, 2, 128, 3, False), (16, 8, 1, 128, 2, True), (16, 6, 2, 64, 4, True)])
def test_flash_decode_fp8_equals_dequantised_reference(block_size, heads, kv_heads, head_dim, num_splits, one_launch):
    """Both of the split kernel's exits (1 split: it writes the output itself; several: partials, merged by the
    merge kernel or, with counters, by the last program of each group in the same launch)."""
    decode = module("kernels.decode")
    case = test_part6_decode.make_case(block_size, heads, kv_heads, head_dim, torch.float32)
    k8, v8 = quantized(case["k_cache"], case["v_cache"])  # NaN where no kernel may read stays NaN
    q, tables, lens, scale = case["q"], case["block_tables"], case["seq_lens"], case["scale"]
    expected = decode.decode_reference(q, dequantized(k8, K_SCALE, q.dtype), dequantized(v8, V_SCALE, q.dtype),
                                       tables, lens, scale)
    counters = decode.decode_counters(q.shape[0], kv_heads, q.device) if one_launch else None
    got = decode.flash_decode(q, k8, v8, tables, lens, scale, num_splits, k_scale=K_SCALE, v_scale=V_SCALE,
                              counters=counters)
    torch.testing.assert_close(got, expected, **test_part6_decode.TOL[torch.float32])
    if counters is not None:
        assert (counters == 0).all()


def test_kernels_refuse_an_fp8_cache_without_its_scales():
    kern, decode = module("kernels.attention"), module("kernels.decode")
    q, k, v, tables, cu, lens = make_case([2], [3], 16, 4, 2, 64, torch.float32)
    k8, v8 = quantized(k, v)
    with pytest.raises(ValueError, match="positive floats"):
        kern.mixed_attention(q, k8, v8, tables, cu, lens, 0.1, 2)
    with pytest.raises(ValueError, match="positive floats"):
        kern.mixed_attention(q, k8, v8, tables, cu, lens, 0.1, 2, k_scale=torch.ones(1), v_scale=1.0)
    case = test_part6_decode.make_case(16, 4, 2, 64, torch.float32)
    k8, v8 = quantized(case["k_cache"], case["v_cache"])
    with pytest.raises(ValueError, match="positive floats"):
        decode.flash_decode(case["q"], k8, v8, case["block_tables"], case["seq_lens"], 0.1, 2, k_scale=0.0,
                            v_scale=1.0)


# ---- the pool and the engine --------------------------------------------------------------------------------------
def test_fp8_pool_counts_one_byte_per_element():
    from shared.models import RANDOM_SHAPES
    from test_part6_int8 import Shape, tokens_that_fit

    engine = load_engine(FP8_STEP)
    qwen3 = Shape(RANDOM_SHAPES["qwen3-0.6b"])
    assert engine.kv_bytes_per_token(qwen3, torch.bfloat16, "fp8") == 2 * 28 * 8 * 128  # no per-token scales
    assert engine.kv_bytes_per_token(qwen3, torch.bfloat16, "fp8_e4m3") == 2 * 28 * 8 * 128
    auto, int8, fp8 = (tokens_that_fit(engine, qwen3, torch.bfloat16, d) for d in ("auto", "int8", "fp8"))
    assert 1.99 <= fp8 / auto <= 2.01 and fp8 > int8, (auto, int8, fp8)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_the_cache_is_fp8_and_the_line_says_so(kv_cache_dtype):
    llm = load_engine(FP8_STEP).LLM("random:tiny-qwen3", device="cpu", max_kv_tokens=512,
                                    kv_cache_dtype=kv_cache_dtype)
    cache, c = llm.kv_cache, llm.model.config
    assert cache.data.dtype == FP8 and cache.scales is None
    assert cache.k_scale == [1.0] * c.num_layers and cache.v_scale == [1.0] * c.num_layers
    assert cache.data.nbytes == (512 + 16) * llm.memory["bytes_per_token"]  # and the scratch block
    assert "KV dtype float8_e4m3fn + a scale per layer for K and for V" in llm.backend
    out = llm.generate([[5, 9, 2, 7] * 4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_an_fp8_format_it_does_not_store_is_a_value_error():
    with pytest.raises(ValueError, match="fp8_e5m2"):
        load_engine(FP8_STEP).LLM("random:tiny-qwen3", device="cpu", max_kv_tokens=512, kv_cache_dtype="fp8_e5m2")


def test_the_torch_and_triton_backends_agree_on_an_fp8_cache():
    """The same requests through both attention backends on an fp8 cache (tiny Llama, fp32): the Triton path's
    fused write stores the torch path's bytes, and its kernels read them as the torch loop does, so the greedy tokens
    are equal."""
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(12 + 9 * i)] for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = load_engine(FP8_STEP).LLM("random:tiny-llama", device="cpu", max_kv_tokens=1024, kv_cache_dtype="fp8",
                                        attention_backend=backend)
        assert f"attention: {backend}" in llm.backend
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert outs["torch"] == outs["triton"]


# ---- fp8 weights ------------------------------------------------------------------------------------------------
def test_fp8_weights_round_per_row():
    """quantize_fp8_weight: per output row, scale = max|w| / 448, the row's largest weight stored as +-448, every
    weight within 1/16 of its value down to 2^-6 of the row's largest, a row of zeros kept as zeros (scale 1)."""
    quant = module("quant")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 96, generator=gen) * torch.logspace(-3, 1, 24)[:, None]
    w[5] = 0.0
    f = quant.quantize_fp8_weight(w)
    assert f.data.dtype == FP8 and f.scale.shape == (24,) and f.nbytes == 24 * 96 + 24 * 4
    assert f.scale[5] == 1 and (f.dequantize()[5] == 0).all()
    assert torch.equal(f.data.float().abs().amax(1)[f.scale != 1], torch.full((23,), 448.0))
    back, big = f.dequantize(), w.abs() >= w.abs().amax(1, keepdim=True) * 2 ** -6
    assert ((back - w).abs()[big] <= w.abs()[big] / 16).all()
    stacked = module("linear").method_of(f).cat_rows([f, quant.quantize_fp8_weight(w[:3])])
    assert torch.equal(stacked.dequantize(), torch.cat([back, f.dequantize()[:3]]))


@pytest.mark.parametrize("m, n, k, norm, silu, res", [(1, 48, 64, False, False, False), (3, 40, 96, True, False, True),
                                                      (2, 24, 160, True, True, False)])
def test_fp8_gemv_equals_dequantise_then_matmul(m, n, k, norm, silu, res):
    """step28's GEMV with an fp8 weight (weight_scale): the rows converted in registers and each output times its
    row's scale, against the dequantised weight's product."""
    quant, g = module("quant"), module("kernels.gemv")
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen)
    w = quant.quantize_fp8_weight(torch.randn(2 * n if silu else n, k, generator=gen) / k ** 0.5)
    nw = torch.rand(k, generator=gen) + 0.5 if norm else None
    r = torch.randn(m, n, generator=gen) if res else None
    want = g.gemv_reference(x, w.dequantize(), nw, 1e-6, r, silu)
    torch.testing.assert_close(g.gemv(x, w.data, nw, 1e-6, r, silu, weight_scale=w.scale), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="weight_scale"):
        g.gemv(x, w.data, nw, 1e-6, r, silu)


def test_fp8_weights_on_load_stay_near_the_float_model():
    """quantization="fp8" on a float checkpoint (the tiny random models): every projection is an Fp8Weight, the line
    says so, and the first position's logprobs stay within 0.1 of the float model's on every token both top-20
    lists hold (at least 10)."""
    quant = module("quant")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=20)
    engine = load_engine(FP8_STEP)
    for model in ("random:tiny-qwen3", "random:tiny-llama"):
        floats = engine.LLM(model, device="cpu")
        fp8 = engine.LLM(model, device="cpu", quantization="fp8")
        assert sum(isinstance(w, quant.Fp8Weight) for w in fp8.model.w.values()) == 4 * fp8.model.config.num_layers
        assert "as float8 e4m3 rounded on load, a scale per output row" in fp8.backend
        for a, b in zip(floats.generate(["Hello there", "A B C D"], params), fp8.generate(["Hello there", "A B C D"],
                                                                                          params)):
            la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
            common = set(la) & set(lb)
            assert len(common) >= 10 and max(abs(la[t] - lb[t]) for t in common) < 0.1, model
    with pytest.raises(ValueError, match="fp4"):
        engine.LLM("random:tiny-qwen3", device="cpu", quantization="fp4")


# ---- the real model -----------------------------------------------------------------------------------------------
AGREE_TOKENS = 16
# Mean |logprob(fp8) - logprob(auto)| of the chosen tokens over the tokens where both agree: measured 0.055 on SmolLM2
# (fp32, CPU) over the 16 questions x 32 tokens (largest single difference 0.55), 10 of 16 answers agreeing for their
# first 16 tokens. int8 per (token, KV head), same run: 0.022 and 15 of 16. e4m3 keeps 3 bits of mantissa: about
# 2.6% relative error on this model's K and V whatever the per-layer scale, against 1.2% (K) and 0.6% (V) for int8's
# per-row scales. The bound is 2x the measured mean.
MEAN_DRIFT_BOUND = 0.11


@pytest.mark.slow
def test_fp8_follows_auto_on_the_real_model():
    """Greedy answers to shared/prompts.py's 16 questions, fp8 against auto. Where two answers part, it is at a
    near-tie (the vLLM rule: each side's token among the other's 5 most likely); at least half agree for their first
    16 tokens; the mean logprob drift over the agreeing tokens stays under MEAN_DRIFT_BOUND."""
    from shared.prompts import QUESTIONS

    sp = SamplingParams(temperature=0, max_tokens=32, logprobs=VLLM_RULE_TOP_K)
    runs = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = load_engine(FP8_STEP).LLM(kv_cache_dtype=kv_cache_dtype)  # the embedded SmolLM2, the defaults
        assert llm.model_name == REAL and llm.kv_cache.data.dtype == (FP8 if kv_cache_dtype == "fp8" else llm.dtype)
        runs[kv_cache_dtype] = [o.outputs[0] for o in llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                                                               sp)]
    agreeing, drifts, firsts = 0, [], []
    for a, b in zip(runs["auto"], runs["fp8"]):
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        firsts.append(first)
        n = min(len(a.token_ids), len(b.token_ids)) if first is None else first
        agreeing += n >= min(AGREE_TOKENS, len(a.token_ids))
        if first is not None:
            assert a.token_ids[first] in b.logprobs[first] and b.token_ids[first] in a.logprobs[first], first
        drifts += [abs(b.logprobs[i][b.token_ids[i]] - a.logprobs[i][a.token_ids[i]]) for i in range(n)]
    mean = sum(drifts) / len(drifts)
    print(f"\nfp8 vs auto on {REAL}: {agreeing} of {len(QUESTIONS)} answers agree for their first {AGREE_TOKENS} "
          f"tokens (first differences {firsts}); mean |dlogprob| {mean:.4f} over {len(drifts)} agreeing tokens "
          f"(max {max(drifts):.3f})")
    assert agreeing >= len(QUESTIONS) // 2, agreeing
    assert 0 < mean <= MEAN_DRIFT_BOUND, mean


# ---- on the GPU: compiled, bf16, real model shapes --------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")


@pytest.mark.gpu
@cuda
def test_gpu_fp8_kernels_and_write_in_bf16_at_qwen3s_shape():
    """Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128), bf16: the compiled mixed kernel and
    flash decoding (one launch, PDL where supported) on an fp8 cache against the reference on the dequantised cache,
    and the compiled fused write storing quant.py's quantize_fp8 bytes: V's are torch's own; K is normalised and
    rotated first, where bf16 may part from torch by one rounding step (test_part6_fused's rule for qk_norm_rope),
    so K's bytes are quantize_fp8 of the kernel's own k (the same launch without the write) at every slot."""
    kern, decode, fused, mod = (module(n) for n in ("kernels.attention", "kernels.decode", "kernels.fused", "model"))
    pdl = module("kernels.gemv").pdl_supported(torch.device("cuda"))
    q, k, v, tables, cu, lens = make_case(QUERY_LENS, CACHED, 16, 16, 8, 128, torch.bfloat16, device="cuda")
    k8, v8 = quantized(k, v)
    expected = kern.attention_reference(q, k8, v8, tables, cu, lens, 128 ** -0.5, K_SCALE, V_SCALE)
    got = kern.mixed_attention(q, k8, v8, tables, cu, lens, 128 ** -0.5, max(QUERY_LENS), k_scale=K_SCALE,
                               v_scale=V_SCALE)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    case = test_part6_decode.make_case(16, 16, 8, 128, torch.bfloat16)
    case = {name: t.cuda() if isinstance(t, torch.Tensor) else t for name, t in case.items()}
    k8, v8 = quantized(case["k_cache"], case["v_cache"])
    expected = decode.decode_reference(case["q"], k8, v8, case["block_tables"], case["seq_lens"], case["scale"],
                                       K_SCALE, V_SCALE)
    counters = decode.decode_counters(case["q"].shape[0], 8, "cuda")
    got = decode.flash_decode(case["q"], k8, v8, case["block_tables"], case["seq_lens"], case["scale"], 4,
                              k_scale=K_SCALE, v_scale=V_SCALE, counters=counters, pdl=pdl)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    qkv = torch.randn(9, (16 + 16) * 128, device="cuda", dtype=torch.bfloat16) * 3
    cos, sin = mod.rope_cos_sin(torch.arange(9, device="cuda"), 128, 1e6, torch.bfloat16)
    weights = (torch.rand(128, device="cuda", dtype=torch.bfloat16) + 0.5,) * 2
    slots = torch.arange(9, device="cuda") * 3
    stored = []
    for ops in (mod.TorchLayerOps(), fused.TritonLayerOps()):
        caches = [torch.zeros(4, 16, 8, 128, device="cuda", dtype=FP8) for _ in range(2)]
        ops.qk_norm_rope_write(qkv, cos, sin, *weights, 1e-6, 16, 8, 128, *caches, K_SCALE, V_SCALE, slots)
        stored.append([c.view(torch.uint8) for c in caches])
    assert torch.equal(stored[0][1], stored[1][1])  # V: torch's bytes
    _, k = fused.qk_norm_rope(qkv, cos, sin, *weights, 1e-6, 16, 8, 128)  # the kernel's k, not written
    k_cache = torch.zeros(4, 16, 8, 128, device="cuda", dtype=FP8)
    mod.write_kv(k_cache, slots, k, K_SCALE)  # torch's fp8 write (quantize_fp8) of that k
    assert torch.equal(stored[1][0], k_cache.view(torch.uint8))
    assert (stored[0][0] != stored[1][0]).float().mean() < 0.02  # torch's k and the kernel's part rarely


@pytest.mark.gpu
@cuda
def test_gpu_fp8_weights_scaled_mm_and_gemv_in_bf16():
    """fp8 weights at Qwen3-0.6B's projection shapes, bf16: fp8_linear (x quantised per row, torch._scaled_mm)
    against the dequantised weight's matmul, at 256 rows; the GEMV (one row) against the same."""
    quant, linear, g = module("quant"), module("linear"), module("kernels.gemv")
    assert linear.scaled_mm_supported(torch.device("cuda"))
    for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):
        w = quant.quantize_fp8_weight(torch.randn(n, k, device="cuda") / k ** 0.5)
        for rows in (256, 1):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            want = (x.float() @ w.dequantize().T)
            got = (linear.fp8_linear(x, w) if rows > 1 else g.gemv(x, w.data, weight_scale=w.scale)).float()
            assert ((got - want).abs().max() / want.abs().max()).item() < 5e-2, (n, k, rows)


@pytest.mark.gpu
@cuda
def test_gpu_fp8_engine_with_graphs_follows_the_torch_path():
    """random:qwen3-0.6b with an fp8 cache, CUDA graphs: the Triton path's tokens follow the torch path's (the same
    cache bytes, attention summed in another order) up to bf16 near-ties, and decode steps replayed graphs."""
    from helpers import BF16_LOGPROB_MAX_ATOL, compare_completions

    prompts = [[(7 * i + 13 * j) % 5000 + 1 for j in range(40 + 9 * i)] for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    outs = {}
    for backend in ("torch", "triton"):
        llm = load_engine(FP8_STEP).LLM("random:qwen3-0.6b", device="cuda", dtype="bfloat16", max_kv_tokens=16384,
                                        gpu_memory_utilization=0.3, kv_cache_dtype="fp8", attention_backend=backend)
        assert "KV dtype float8_e4m3fn" in llm.backend
        outs[backend] = [llm.generate([p], sp)[0] for p in prompts]
        if backend == "triton":
            assert llm.stats["graph_replays"] > 0
        llm.shutdown()
    for i, (a, b) in enumerate(zip(outs["triton"], outs["torch"])):
        compare_completions(a.outputs[0], b.outputs[0], BF16_LOGPROB_MAX_ATOL, exact=False, label=f"request {i}")
