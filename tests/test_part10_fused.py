"""step28: each projection with the RMSNorm before it and the residual add or SiLU * up after it (ops.linear), the
GEMV kernel that does all of it in one launch at one row (kernels/gemv.py), and the K/V write inside the q/k norm +
RoPE kernel.

On the CPU (Triton's interpreter for the kernels):
- the GEMV kernel equals its torch reference (rms_norm, matmul, silu * up, add, rounding where they round) on odd
  shapes, 1 to 8 rows, every combination of the fusions, several tiles, fp32 and fp16; bad shapes are ValueErrors;
- the fused q/k norm + RoPE + write stores, for a Llama and a Qwen3 head shape, exactly what write_kv stores, at the
  slots asked, and nothing elsewhere;
- the engine equals step27 bit for bit on the torch path (the same operations in the same order), greedy with
  logprobs, on both families and on the real model;
- with the kernels in the engine (the GEMV allowed on the CPU, a tiny model), the outputs equal step27's token for
  token and the GEMV ran in every projection of every one-row step (counted).
- flash decoding in one launch (the last program of each sequence and KV head merges) equals the split and merge
  kernels, the merge kernel never launched, the counters back at 0.
On the GPU (`gpu`): bf16 GEMV against the reference at the model's shapes; step28's outputs equal step27's up to
bf16 near-ties, and a decode step at batch 1 launches at least 5 kernels a layer fewer and at most 200, counted with
the profiler; one-launch flash decoding at every replay of a graph and the PDL launches change no number.
"""
import functools

import pytest
import torch

from helpers import BF16_LOGPROB_MAX_ATOL, compare_completions, load_engine, step_module
from registry import REAL, TINY, TINY_QWEN3, introducing, previous
from shared import SamplingParams

pytest.importorskip("triton")

FUSED = introducing("fused_projections")
BEFORE = previous(FUSED)
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    ", "Shopping list: 1. apples 2. bread 3.", "Hello"]


def gemv_module():
    return step_module(FUSED, "kernels.gemv")


# ---- the kernel against its reference --------------------------------------------------------------------------
CASES = [  # rows, output columns, K, norm, silu_mul, residual
    (1, 48, 40, False, False, False), (1, 13, 576, True, False, False), (3, 40, 96, True, False, True),
    (8, 24, 64, True, True, False), (5, 33, 70, False, False, True), (2, 12, 130, True, True, False),
    (7, 16, 200, False, True, True),
    # K past the default tile's 1024 inputs: the default config's only case of two K tiles (the second partial);
    # 13 columns are 2 of its column tiles and 4 of the small config's (the last partial in both)
    (4, 13, 1100, True, False, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[f"m{c[0]}-n{c[1]}-k{c[2]}{'-norm' * c[3]}{'-silu' * c[4]}{'-res' * c[5]}"
                                            for c in CASES])
def test_gemv_equals_its_reference(case, dtype):
    g = gemv_module()
    m, n, k, norm, silu, res = case
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(2 * n if silu else n, k, generator=gen) / k ** 0.5).to(dtype)
    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype) if norm else None
    r = torch.randn(m, n, generator=gen).to(dtype) if res else None
    want = g.gemv_reference(x, w, nw, 1e-6, r, silu)
    configs = [None, {"BLOCK_M": 8, "BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 4}]  # the default, and small tiles
    for config in configs:
        got = g.gemv(x, w, nw, 1e-6, r, silu, config=config)
        assert got.shape == (m, n) and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-3  # the order of the sum over K differs from the matmul's
        torch.testing.assert_close(got, want, atol=tol * max(1.0, want.abs().max().item()), rtol=tol)


def test_gemv_each_fusion_is_applied():
    """The flags are not ignored: each result differs from the plain product by what its fusion adds."""
    g = gemv_module()
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 64, generator=gen) * 3, torch.randn(32, 64, generator=gen)
    plain = g.gemv(x, w)
    torch.testing.assert_close(plain, x @ w.T, atol=1e-4, rtol=1e-5)
    nw = torch.rand(64, generator=gen) + 0.5
    assert not torch.allclose(g.gemv(x, w, nw), plain)
    r = torch.randn(2, 32, generator=gen)
    torch.testing.assert_close(g.gemv(x, w, residual=r) - r, plain, atol=1e-4, rtol=1e-5)
    gate, up = (x @ w.T).chunk(2, dim=-1)
    torch.testing.assert_close(g.gemv(x, w, silu_mul=True), torch.nn.functional.silu(gate) * up, atol=1e-4, rtol=1e-5)


def test_gemv_bad_shapes_are_value_errors():
    g = gemv_module()
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="rows"):
        g.gemv(torch.randn(g.MAX_ROWS + 1, 16), w)
    with pytest.raises(ValueError, match="contiguous in K"):
        g.gemv(x, torch.randn(8, 15))
    with pytest.raises(ValueError, match="even row count"):
        g.gemv(x, torch.randn(7, 16), silu_mul=True)
    with pytest.raises(ValueError, match="norm_weight"):
        g.gemv(x, w, norm_weight=torch.ones(15))
    with pytest.raises(ValueError, match="residual"):
        g.gemv(x, w, residual=torch.ones(2, 7))


# ---- q/k norm + RoPE + the cache write -------------------------------------------------------------------------
@pytest.mark.parametrize("heads, kv_heads, head_dim, qk_norm", [(9, 3, 64, False), (16, 8, 128, True), (4, 1, 32, True)])
def test_qk_norm_rope_write_stores_what_write_kv_stores(heads, kv_heads, head_dim, qk_norm):
    fused = step_module(FUSED, "kernels.fused")
    model = step_module(FUSED, "model")
    n, blocks, block = 5, 4, 4
    gen = torch.Generator().manual_seed(heads)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen)
    cos, sin = model.rope_cos_sin(torch.tensor([0, 3, 7, 8, 15]), head_dim, 10000.0, torch.float32)
    qw, kw = ((torch.rand(head_dim, generator=gen) + 0.5, torch.rand(head_dim, generator=gen) + 0.5)
              if qk_norm else (None, None))
    slots = torch.tensor([2, 9, 10, 0, 15])
    caches = {}
    for name, ops in (("torch", model.TorchLayerOps()), ("fused", fused.TritonLayerOps())):
        k_cache = torch.full((blocks, block, kv_heads, head_dim), 7.0)  # anything not written stays 7
        v_cache = torch.full((blocks, block, kv_heads, head_dim), 7.0)
        q = ops.qk_norm_rope_write(qkv, cos, sin, qw, kw, 1e-6, heads, kv_heads, head_dim, k_cache, v_cache, None,
                                   None, slots)
        caches[name] = (q, k_cache, v_cache)
    (q1, k1, v1), (q2, k2, v2) = caches["torch"], caches["fused"]
    torch.testing.assert_close(q2, q1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-5)
    assert torch.equal(v2, v1)  # V is copied, not computed
    written = torch.zeros(blocks * block, dtype=torch.bool)
    written[slots] = True
    assert (k2.view(blocks * block, -1)[~written] == 7).all() and (v2.view(blocks * block, -1)[~written] == 7).all()
    assert not (k2.view(blocks * block, -1)[written] == 7).any()


# ---- flash decoding's split and merge in one launch ------------------------------------------------------------
def decode_case(seqs, heads, kv_heads, head_dim, dtype, device="cpu", longest=300, block=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = seqs * -(-longest // block) + 2
    case = dict(q=torch.randn(seqs, heads, head_dim, generator=gen),
                k_cache=torch.randn(blocks, block, kv_heads, head_dim, generator=gen),
                v_cache=torch.randn(blocks, block, kv_heads, head_dim, generator=gen),
                block_tables=torch.randperm(blocks, generator=gen)[:seqs * -(-longest // block)].view(seqs, -1).int(),
                seq_lens=torch.randint(1, longest + 1, (seqs,), generator=gen, dtype=torch.int32))
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in case.items()}


@pytest.mark.parametrize("seqs, heads, kv_heads, splits", [(3, 4, 2, 5), (2, 8, 2, 20), (1, 6, 3, 7), (2, 4, 4, 1)])
def test_one_launch_flash_decoding_equals_split_then_merge(seqs, heads, kv_heads, splits):
    """The last program of each (sequence, KV head) merges the parts: the same output as the merge kernel's (bit for
    bit in the interpreter), in one launch, and every counter back at 0 for the next launch, used twice."""
    decode = step_module(FUSED, "kernels.decode")
    case = decode_case(seqs, heads, kv_heads, 32, torch.float32)
    want = decode.flash_decode(**case, scale=0.1, num_splits=splits, block_n=16)
    counters = decode.decode_counters(seqs, kv_heads, "cpu")
    launches = []
    original = decode._flash_decode_merge_kernel
    decode._flash_decode_merge_kernel = lambda *a, **k: launches.append(1)  # noqa: E731 (must not be launched)
    try:
        for _ in range(2):
            got = decode.flash_decode(**case, scale=0.1, num_splits=splits, block_n=16, counters=counters)
            assert torch.equal(got, want)
            assert not counters.any()
    finally:
        decode._flash_decode_merge_kernel = original
    assert launches == []
    with pytest.raises(ValueError, match="counters"):
        decode.flash_decode(**case, scale=0.1, num_splits=2, block_n=16, counters=counters[:1].long())


# ---- the engine ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def outputs(step: str, model: str, backend: str = "torch", gemv_on_cpu: bool = False, tokens: int = 16,
            prompt: tuple | None = None):
    """The requests' outputs through one engine -> (outputs, the GEMV kernel's launches (the rows of each), the
    engine's line, its layer count). With the Triton backend (interpreted): one request (`prompt`'s token ids, or the
    first of PROMPTS), so its decodes are one row."""
    llm = load_engine(step).LLM(model, device="cpu", dtype="float32", max_kv_tokens=2048, attention_backend=backend)
    if gemv_on_cpu:
        llm.model.ops.gemv_devices.add("cpu")
    launches = []
    gemv = step_module(step, "kernels.gemv") if gemv_on_cpu else None
    if gemv is not None:
        original = gemv._gemv_kernel

        class Counted:  # counts the GEMV kernel's launches, and the rows of each
            def __getitem__(self, grid):
                def launch(x, *args, **kwargs):
                    launches.append(x.shape[0])
                    return original[grid](x, *args, **kwargs)
                return launch
        gemv._gemv_kernel = Counted()
    try:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2)
        one = [list(prompt)] if prompt is not None else PROMPTS[:1]
        outs = llm.generate(one if backend == "triton" else PROMPTS, params)
    finally:
        if gemv is not None:
            gemv._gemv_kernel = original
    return outs, launches, llm.backend, llm.model.config.num_layers


@pytest.mark.parametrize("model", [TINY, TINY_QWEN3, REAL])
def test_engine_equals_step27_bit_for_bit_on_the_torch_path(model):
    """The torch path runs step27's operations in step27's order: every token and every logprob is the same."""
    got, _, backend, _ = outputs(FUSED, model)
    want, _, _, _ = outputs(BEFORE, model)
    assert "projections: torch matmuls" in backend
    for i, (a, b) in enumerate(zip(got, want)):
        compare_completions(a.outputs[0], b.outputs[0], 0.0, exact=True, label=f"{model} request {i}")


SMALL_VOCAB = 256  # the tiny model's first 256 tokens: lm_head's GEMV is 256 columns, not 49,152, in the interpreter


@pytest.fixture(scope="module")
def small_vocab_qwen3(tmp_path_factory) -> str:
    """random:tiny-qwen3 with only its first SMALL_VOCAB tokens (the tied embedding's first rows): the same layers, and
    an lm_head of 192 times fewer columns for the interpreter to run (a folder of config.json, safetensors and the tokenizer)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from shared.models import resolve_model

    source, folder = resolve_model(TINY_QWEN3), tmp_path_factory.mktemp("small-vocab-qwen3")
    for f in source.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, folder / f.name)
    config = json.loads((source / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["vocab_size"] > SMALL_VOCAB
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": SMALL_VOCAB}))
    weights = {}
    for f in source.glob("*.safetensors"):
        weights.update(load_file(f))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:SMALL_VOCAB].clone()
    save_file(weights, folder / "model.safetensors")
    return str(folder)


def test_engine_with_the_gemv_kernel_equals_step27(small_vocab_qwen3):
    """The kernels in the engine (interpreted), one request of 3 tokens: its prefill runs the matmul path (many rows)
    and lm_head's GEMV (one row: the last token's); each of its 2 decodes runs the GEMV in the 4 projections of every
    layer and in lm_head. The tokens are step27's; the logprobs agree up to the order of the sums over K. The tiny
    Qwen3 with a vocabulary of SMALL_VOCAB tokens: test_engine_with_the_gemv_kernel_at_the_full_vocabulary runs
    lm_head's 49,152 columns (slow)."""
    check_gemv_engine(small_vocab_qwen3, (17, 200, 31, 5, 99, 140, 7))


@pytest.mark.slow
def test_engine_with_the_gemv_kernel_at_the_full_vocabulary():
    check_gemv_engine(TINY_QWEN3, None)


def check_gemv_engine(model: str, prompt: tuple | None, tokens: int = 3) -> None:
    got, launches, backend, layers = outputs(FUSED, model, "triton", True, tokens, prompt)
    want, _, _, _ = outputs(BEFORE, model, "triton", False, tokens, prompt)
    assert "projections: torch matmuls" in backend  # the engine's line says the CPU's default, set when it was built
    for i, (a, b) in enumerate(zip(got, want)):
        compare_completions(a.outputs[0], b.outputs[0], 1e-4, exact=True, label=f"request {i}")
    assert set(launches) == {1} and len(launches) == 1 + (tokens - 1) * (4 * layers + 1), launches


def test_the_gemv_path_is_chosen_by_rows(monkeypatch):
    """gemv_max_rows decides: a step of one row runs the GEMV kernel (and nothing else), a step of two runs the norm
    kernel and the matmul; both give TorchLayerOps.linear's result."""
    fused = step_module(FUSED, "kernels.fused")
    calls = []
    gemv = fused.gemv
    monkeypatch.setattr(fused, "gemv", lambda x, *a, **k: calls.append(x.shape[0]) or gemv(x, *a, **k))
    ops = fused.TritonLayerOps()
    ops.gemv_devices.add("cpu")
    x, w, nw, r = torch.randn(2, 32), torch.randn(16, 32), torch.rand(32) + 0.5, torch.randn(2, 16)
    reference = step_module(FUSED, "model").TorchLayerOps()
    torch.testing.assert_close(ops.linear(x[:1], w, nw, residual=r[:1]), reference.linear(x[:1], w, nw, residual=r[:1]),
                               atol=1e-5, rtol=1e-5)
    assert calls == [1] and ops.launches == 1  # one kernel: the GEMV with its norm and its add
    torch.testing.assert_close(ops.linear(x, w, nw, residual=r), reference.linear(x, w, nw, residual=r),
                               atol=1e-5, rtol=1e-5)
    assert calls == [1] and ops.launches == 2  # two rows: the norm kernel; the matmul and the add are torch's


# ---- the GPU ---------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")


@pytest.mark.gpu
@cuda
def test_gpu_gemv_bf16_at_the_model_shapes():
    g = gemv_module()
    for m in (1, 4, 8):
        for n, k, silu in ((4096, 1024, False), (1024, 2048, False), (6144, 1024, True), (1024, 3072, False)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
            want = g.gemv_reference(x, w, nw, 1e-6, None, silu).float()
            got = g.gemv(x, w, nw, 1e-6, None, silu).float()
            assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2, (m, n, k)


@pytest.mark.gpu
@cuda
def test_gpu_step28_equals_step27_up_to_near_ties_with_fewer_kernels_a_decode():
    """Batch 1 with CUDA graphs: the tokens are step27's up to bf16 near-ties (the sums over K run in another order),
    and a decode step launches at least 5 kernels a layer fewer (the profiler's count: the two KV scatters, the two
    add + RMSNorm and the SiLU * up kernels are gone, and cuBLAS's split-K reduce where it had one)."""
    prompts = [[(7 * i + 13 * j) % 5000 + 1 for j in range(40 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)
    decode_kernels = step_module(FUSED, "run").decode_kernels
    outs, kernels = {}, {}
    for name, step in (("before", BEFORE), ("fused", FUSED)):
        llm = load_engine(step).LLM("random:qwen3-0.6b", device="cuda", dtype="bfloat16", max_kv_tokens=16384,
                                    gpu_memory_utilization=0.3)
        outs[name] = [llm.generate([p], params)[0] for p in prompts]  # batch 1: the GEMV's path
        kernels[name], _ = decode_kernels(llm)
        layers = llm.model.config.num_layers
        llm.shutdown()
    for i, (a, b) in enumerate(zip(outs["fused"], outs["before"])):
        compare_completions(a.outputs[0], b.outputs[0], BF16_LOGPROB_MAX_ATOL, exact=False, label=f"request {i}")
    assert kernels["fused"] <= kernels["before"] - 5 * layers, kernels
    assert kernels["fused"] <= 200, kernels  # with graphs: flash decoding's merge is in its split kernel


@pytest.mark.gpu
@cuda
def test_gpu_one_launch_flash_decoding_and_pdl_change_no_number():
    """bf16 on the H200: flash decoding in one launch equals split + merge at every replay of a graph (whichever
    program comes last), the counters back at 0; the layer's projections launched as programmatic dependents (PDL)
    give the same numbers as launched one after the other."""
    decode, g = step_module(FUSED, "kernels.decode"), gemv_module()
    assert g.pdl_supported(torch.device("cuda"))
    case = decode_case(2, 16, 8, 128, torch.bfloat16, "cuda", longest=3000)
    want = decode.flash_decode(**case, scale=0.088, num_splits=33)
    counters = decode.decode_counters(2, 8, "cuda")
    graph = torch.cuda.CUDAGraph()
    decode.flash_decode(**case, scale=0.088, num_splits=33, counters=counters, pdl=True)
    with torch.cuda.graph(graph):
        got = decode.flash_decode(**case, scale=0.088, num_splits=33, counters=counters, pdl=True)
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)  # the merge's sums in another order only
        assert not counters.any()
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
          for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))]
    nw = torch.rand(1024, device="cuda", dtype=torch.bfloat16) + 0.5

    def layer(pdl):
        a = g.gemv(x, ws[0], nw, pdl=pdl)[:, :2048]
        y = g.gemv(a, ws[1], residual=x, pdl=pdl)
        return g.gemv(g.gemv(y, ws[2], nw, silu_mul=True, pdl=pdl), ws[3], residual=y, pdl=pdl)
    assert torch.equal(layer(True), layer(False))
