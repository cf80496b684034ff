"""step29 (work in progress): 4-bit weights kept as the checkpoint ships them.

On the CPU:
- quant.py reads the embedded GGUF's tensors: every one dequantises, bit for bit, to the float32 checkpoint every
  earlier step loads (the linear layers stay 4-bit blocks, 0.3125x their bfloat16 bytes);
- a Q4_1 file written here (gguf's own writer and quantiser) reads back as gguf's own dequantiser reads it;
- int4 round-to-nearest puts a weight on the nearest of each group's 16 levels, and reproduces a weight already on
  a Q4_1 grid exactly;
- the 4-bit GEMV kernel (the interpreter) equals dequantise-then-matmul on odd shapes with every fusion;
- bad input: an unknown quantization, a K that is not whole blocks, a GGUF tensor type it does not read.
"""
import numpy as np
import pytest
import torch

from helpers import step_module

STEP = "step29"


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
                                                      (2, 24, 160, True, True, False), (5, 33, 1088, False, False, True)])
def test_gemv4_equals_dequantise_then_matmul(m, n, k, norm, silu, res):
    pytest.importorskip("triton")
    q, g4 = quant(), step_module(STEP, "kernels.gemv4")
    reference = step_module(STEP, "kernels.gemv").gemv_reference
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen)
    w = q.quantize_int4(torch.randn(2 * n if silu else n, k, generator=gen) / k ** 0.5)
    nw = torch.rand(k, generator=gen) + 0.5 if norm else None
    r = torch.randn(m, n, generator=gen) if res else None
    want = reference(x, w.dequantize(), nw, 1e-6, r, silu)
    for config in (None, {"BLOCK_M": 8, "BLOCK_N": 4, "BLOCK_B": 16, "num_warps": 4}):
        torch.testing.assert_close(g4.gemv4(x, w, nw, 1e-6, r, silu, config), want, atol=1e-5, rtol=1e-5)


def test_bad_input_is_a_value_error():
    q = quant()
    with pytest.raises(ValueError, match="quantization"):
        step_module(STEP, "engine").LLM("random:tiny-llama", quantization="int3")
    with pytest.raises(ValueError, match="multiple of the group size"):
        q.quantize_int4(torch.randn(4, 40))
    with pytest.raises(ValueError, match="block boundary|multiples of 32"):
        q.quantize_int4(torch.randn(4, 64)).columns(0, 40)
