"""step29 (work in progress): 4-bit weights kept as the checkpoint ships them.

On the CPU:
- quant.py reads the embedded GGUF's tensors: every one dequantises, bit for bit, to the float32 checkpoint every
  earlier step loads (the linear layers stay 4-bit blocks, 0.3125x their bfloat16 bytes);
- a Q4_1 file written here (gguf's own writer and quantiser) reads back as gguf's own dequantiser reads it;
- int4 round-to-nearest puts a weight on the nearest of each group's 16 levels, and reproduces a weight already on
  a Q4_1 grid exactly;
- the 4-bit GEMV kernel (the interpreter) equals dequantise-then-matmul on odd shapes with every fusion;
- bad input: an unknown quantization, a K that is not whole blocks, a GGUF tensor type it does not read, a model
  whose projections a rank would hold in part blocks (refused from its config, before a worker starts or a weight
  loads).
"""
import dataclasses

import numpy as np
import pytest
import torch

from helpers import edited_model, step_module
from registry import has, having, introducing
from shared import resolve_model

STEP = introducing("int4_weights")


def quant():
    return step_module(STEP, "quant")


def test_embedded_gguf_dequantises_to_the_float_checkpoint():
    from safetensors.torch import load_file

    from shared.models import _gguf_path, resolve_model
    import json

    q = quant()
    folder = resolve_model("smollm2-135m")
    cfg = json.loads((folder / "config.json").read_text())
    want = {}
    for f in folder.glob("*.safetensors"):
        want.update(load_file(f))
    got = q.read_gguf(_gguf_path(), cfg["num_attention_heads"], cfg["num_key_value_heads"])
    assert set(got) == set(want)
    blocks = [w for w in got.values() if isinstance(w, q.Q4Weight)]
    assert len(blocks) == 7 * cfg["num_hidden_layers"]  # q, k, v, o, gate, up, down: all 4-bit
    for name, w in got.items():
        value = w.dequantize() if isinstance(w, q.Q4Weight) else w
        assert torch.equal(value, want[name].float()), name
    assert sum(w.nbytes for w in blocks) * 32 == sum(w.shape[0] * w.shape[1] for w in blocks) * 20


def test_a_q4_1_file_reads_back_as_gguf_reads_it(tmp_path):
    import gguf

    q = quant()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    writer.add_tensor("blk.0.attn_v.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = q.read_gguf(tmp_path / "m.gguf", 4, 4)["model.layers.0.self_attn.v_proj.weight"]
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)
    assert isinstance(got, q.Q4Weight) and torch.equal(got.dequantize(), torch.from_numpy(want))


def test_int4_rounds_to_the_nearest_level_and_keeps_a_q4_grid():
    q = quant()
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(1))
    blocks = q.quantize_int4(w)
    back = blocks.dequantize()
    groups = w.view(6, 3, 32)
    step = blocks.scale.float()[..., None]
    assert ((back.view(6, 3, 32) - groups).abs() <= step / 2 + 1e-3 * groups.abs().amax()).all()
    again = q.quantize_int4(back)  # already on a 4-bit grid: rounding it changes nothing
    assert torch.equal(again.dequantize(), back)


@pytest.mark.parametrize("m, n, k, norm, silu, res", [(1, 48, 64, False, False, False), (3, 40, 96, True, False, True),
                                                      (2, 24, 160, True, True, False), (5, 9, 1088, False, False, True)])
def test_gemv4_equals_dequantise_then_matmul(m, n, k, norm, silu, res):
    """K = 1088 is 34 blocks: two trips of the default config's 32 blocks (the second partial), the only such case;
    its 9 columns are 3 column tiles of 4, the last partial."""
    pytest.importorskip("triton")
    q, g4 = quant(), step_module(STEP, "kernels.gemv4")
    reference = step_module(STEP, "kernels.gemv").gemv_reference
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen)
    w = q.quantize_int4(torch.randn(2 * n if silu else n, k, generator=gen) / k ** 0.5)
    nw = torch.rand(k, generator=gen) + 0.5 if norm else None
    r = torch.randn(m, n, generator=gen) if res else None
    want = reference(x, w.dequantize(), nw, 1e-6, r, silu)
    for config in (None, {"BLOCK_M": 8, "BLOCK_N": 4, "BLOCK_G": 1, "num_warps": 4},
                   {"BLOCK_M": 8, "BLOCK_N": 4, "BLOCK_G": 2, "num_warps": 4, "EXPONENT_TRICK": True}):
        torch.testing.assert_close(g4.gemv4(x, w, nw, 1e-6, r, silu, config), want, atol=1e-5, rtol=1e-5)


def test_bad_input_is_a_value_error():
    q = quant()
    with pytest.raises(ValueError, match="quantization"):
        step_module(STEP, "engine").LLM("random:tiny-llama", quantization="int3")
    with pytest.raises(ValueError, match="multiple of the group size"):
        q.quantize_int4(torch.randn(4, 40))
    with pytest.raises(ValueError, match="block boundary|multiples of 32"):
        q.quantize_int4(torch.randn(4, 64)).columns(0, 40)


@pytest.mark.parametrize("step", having("int4_weights"))
def test_int4_widths_that_are_not_whole_blocks_are_refused_before_the_model_loads(step, tmp_path, monkeypatch):
    """A row-parallel projection (o_proj, down_proj) is cut by its inputs, and a 4-bit block holds 32 of them: over
    two ranks tiny-llama's MLP width 160 leaves down_proj 80 inputs a rank. On one rank an MLP width of 144 is not
    whole blocks either. Each is a ValueError naming quantization (and the split), from the model's config, before
    a worker starts or a weight loads."""
    import multiprocessing

    LLM = step_module(step, "engine").LLM
    with pytest.raises(ValueError, match=r"quantization='int4'.*tensor_parallel_size=2.*down_proj.*80 inputs"):
        LLM("random:tiny-llama", device="cpu", quantization="int4", tensor_parallel_size=2)
    assert not multiprocessing.active_children()

    def loaded(*args, **kwargs):
        raise AssertionError("the model loaded before its widths were checked")

    monkeypatch.setattr(step_module(step, "model").CausalLM, "from_pretrained", loaded)
    folder = edited_model(tmp_path, "random:tiny-llama", lambda c: c.update(intermediate_size=144))
    with pytest.raises(ValueError, match=r"quantization='int4'.*tensor_parallel_size=1.*down_proj.*144 inputs"):
        LLM(folder, device="cpu", quantization="int4")
    check, config_of = step_module(step, "config").check_int4_widths, step_module(step, "model").ModelConfig.from_json
    for size in (1, 3):  # the embedded model's own blocks split over its three KV heads
        check(config_of(resolve_model("smollm2-135m") / "config.json"), size, "the checkpoint's 4-bit blocks")
    if has(step, "moe"):  # the experts stay floats: only a dense layer's down_proj is 4-bit blocks
        moe = config_of(resolve_model("random:tiny-qwen3-moe") / "config.json")  # layer 1 dense, MLP width 160
        with pytest.raises(ValueError, match="down_proj has 80 inputs"):
            check(moe, 2, "quantization='int4'")
        check(dataclasses.replace(moe, mlp_only_layers=()), 2, "quantization='int4'")


def test_the_shipped_blocks_give_step28s_outputs_bit_for_bit():
    """The embedded model's projections as their Q4_1 blocks, dequantised by the torch path for each matmul: the
    float32 values step28 loads, so every token and logprob is step28's (greedy, batched: a prefill of three prompts,
    then decodes of three rows)."""
    from shared import SamplingParams

    q = quant()
    prompts = ["The quick brown fox", "def fibonacci(n):\n    ", "Hello"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    before = step_module("step28", "engine").LLM("smollm2-135m", device="cpu")
    after = step_module(STEP, "engine").LLM("smollm2-135m", device="cpu")
    assert sum(isinstance(w, q.Q4Weight) for w in after.model.w.values()) == 4 * after.model.config.num_layers
    assert "4-bit Q4_1 blocks as the GGUF ships them" in after.backend
    for a, b in zip(before.generate(prompts, params), after.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_int4_on_load_stays_near_the_float_model():
    """quantization="int4" on a float checkpoint (the tiny random models): every projection is 4-bit blocks, and the
    first position's distribution stays within the stated bound of the float model's: |logprob difference| < 0.1 on
    every token both top-20 lists hold (at least 10 of them). A random model's distribution is nearly flat (its top
    20 lie within about 0.1 of each other), so its argmax may change; the logprobs barely move."""
    from shared import SamplingParams

    q = quant()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=20)
    engine = step_module(STEP, "engine")
    for model in ("random:tiny-qwen3", "random:tiny-llama"):
        floats = engine.LLM(model, device="cpu")
        int4 = engine.LLM(model, device="cpu", quantization="int4")
        assert not any(isinstance(w, q.Q4Weight) for w in floats.model.w.values())
        assert sum(isinstance(w, q.Q4Weight) for w in int4.model.w.values()) == 4 * int4.model.config.num_layers
        for a, b in zip(floats.generate(["Hello there", "A B C D"], params), int4.generate(["Hello there", "A B C D"], params)):
            la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
            common = set(la) & set(lb)
            assert len(common) >= 10, (model, len(common))
            assert max(abs(la[t] - lb[t]) for t in common) < 0.1, model


def test_a_gguf_tensor_type_it_does_not_read_is_a_value_error(tmp_path):
    import gguf

    q = quant()
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    writer.add_tensor("blk.0.attn_v.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    bf = gguf.quants.quantize(w, gguf.GGMLQuantizationType.BF16)
    writer.add_tensor("blk.0.attn_k.weight", bf, raw_shape=bf.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="attn_k.*BF16"):
        q.read_gguf(tmp_path / "m.gguf", 4, 4)


@pytest.mark.parametrize("n, k", [(5, 64), (33, 96), (16, 1088)])
def test_dequantize4_is_the_blocks_dequantised(n, k):
    """The one-launch dequantiser (the path of steps with more rows) writes what Q4Weight.dequantize computes."""
    pytest.importorskip("triton")
    q, g4 = quant(), step_module(STEP, "kernels.gemv4")
    w = q.quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)))
    assert torch.equal(g4.dequantize4(w, torch.float32), w.dequantize(torch.float32))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")


@pytest.mark.gpu
@cuda
def test_gpu_gemv4_and_dequantize4_bf16_at_the_model_shapes():
    """bf16 on the GPU, Qwen3-0.6B's projection shapes: the 4-bit GEMV (PDL where supported) against dequantise-then-
    matmul, and the one-launch dequantiser equal to Q4Weight.dequantize."""
    q, g4 = quant(), step_module(STEP, "kernels.gemv4")
    reference = step_module(STEP, "kernels.gemv").gemv_reference
    pdl = step_module(STEP, "kernels.gemv").pdl_supported(torch.device("cuda"))
    for n, k, silu in ((4096, 1024, False), (1024, 2048, False), (6144, 1024, True), (1024, 3072, False)):
        w = q.quantize_int4(torch.randn(n, k, device="cuda") / k ** 0.5)
        assert torch.equal(g4.dequantize4(w, torch.bfloat16), w.dequantize(torch.bfloat16))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        want = reference(x, w.dequantize(torch.bfloat16), nw, 1e-6, None, silu).float()
        got = g4.gemv4(x, w, nw, 1e-6, None, silu, pdl=pdl).float()
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2, (n, k)


@pytest.mark.gpu
@cuda
def test_gpu_int4_gemv_path_equals_the_dequantise_path_up_to_near_ties():
    """random:qwen3-0.6b with quantization="int4", batch 1 with CUDA graphs: the 4-bit GEMV path's tokens follow
    the dequantise-then-cuBLAS path's (gemv4_max_rows = 0) up to bf16 near-ties, and the GEMV ran (counted)."""
    from helpers import BF16_LOGPROB_MAX_ATOL, compare_completions
    from shared import SamplingParams

    fused, linear = step_module(STEP, "kernels.fused"), step_module(STEP, "linear")
    prompts = [[(7 * i + 13 * j) % 5000 + 1 for j in range(40 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    outs, calls = {}, []
    limit = fused.TritonLayerOps.gemv4_max_rows
    original = linear.gemv4
    linear.gemv4 = lambda *a, **k: calls.append(1) or original(*a, **k)  # noqa: E731 (a graph captures the calls)
    for rows in (0, 1):
        fused.TritonLayerOps.gemv4_max_rows = rows
        calls.clear()
        try:
            llm = step_module(STEP, "engine").LLM("random:qwen3-0.6b", device="cuda", dtype="bfloat16",
                                                  max_kv_tokens=16384, gpu_memory_utilization=0.3, quantization="int4")
            assert "int4 blocks rounded on load" in llm.backend
            outs[rows] = [llm.generate([p], params)[0] for p in prompts]
            llm.shutdown()
            assert (len(calls) > 0) == (rows == 1), (rows, len(calls))
        finally:
            fused.TritonLayerOps.gemv4_max_rows = limit
    linear.gemv4 = original
    for i, (a, b) in enumerate(zip(outs[1], outs[0])):
        compare_completions(a.outputs[0], b.outputs[0], BF16_LOGPROB_MAX_ATOL, exact=False, label=f"request {i}")
