"""Part 6: the Triton kernels equal their torch references, and the engines that use them equal step14_7.

Without CUDA the kernels run in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1), in fp32 and fp16;
the `gpu` tests compile them and check bf16 at real model shapes."""
import functools
import importlib
import random

import pytest
import torch

from shared import SamplingParams
from helpers import STEP_LOGPROB_ATOL_FP32, compare_completions, copies_param, copies_params, load_engine
from registry import STEPS, has, having, introducing, last_before, lesson_and_copies

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernels(step: str, name: str = "attention"):
    return importlib.import_module(f"steps.{step}.kernels.{name}")


def make_case(query_lens, cached, block_size, heads, kv_heads, head_dim, dtype, seed=0, device=DEVICE):
    """A flat varlen batch over a paged cache whose blocks are scattered: sequence i has cached[i] tokens in the
    cache and query_lens[i] new ones (their K/V written too). -> q, k_cache, v_cache, block_tables,
    cu_seqlens_q, seq_lens_k."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ctx = [c + n for c, n in zip(cached, query_lens)]
    blocks_needed = [-(-c // block_size) for c in ctx]
    num_blocks = sum(blocks_needed) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)  # a sequence's blocks are anywhere in the pool
    tables = torch.full((len(ctx), max(blocks_needed) + 1), 10**6, dtype=torch.int32)  # junk past the end
    used = 0
    for i, n in enumerate(blocks_needed):
        tables[i, :n] = torch.tensor(order[used:used + n])
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(ctx, dtype=torch.int32)
    return [t.to(device) for t in (q, k, v, tables, cu, lens)]


# ---- step15: flash attention over the paged cache -----------------------------------------------------------
# Decodes, a chunk after a cached prefix, a prompt from scratch longer than one query tile, a 1-token context.
QUERY_LENS = [1, 5, 40, 1, 33]
CACHED = [0, 3, 20, 70, 0]


def prefill_kernel_cases():
    """Each distinct copy of the prefill kernel (steps whose kernels/attention.py is the same file run it once,
    registry.distinct_copies): the full grid (block sizes 16 and 64, GQA ratios 1, 3 and 8, head dims 64 and 128)
    where it is introduced, two corners of it in every later copy that differs."""
    full = [(b, h, kv, d) for b in (16, 64) for h, kv in ((4, 4), (6, 2), (8, 1)) for d in (64, 128)]
    return [copies_param(group, *c, id=f"bs{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}")
            for group, lesson in lesson_and_copies("triton_prefill", "kernels.attention")
            for c in (full if lesson else [(16, 6, 2, 64), (64, 8, 1, 128)])]


PREFILL_COPIES = copies_params(having("triton_prefill"), "kernels.attention")


@pytest.mark.parametrize("step,block_size,heads,kv_heads,head_dim", prefill_kernel_cases())
def test_flash_attention_equals_reference(step, block_size, heads, kv_heads, head_dim):
    mod = kernels(step)
    q, k, v, tables, cu, lens = make_case(QUERY_LENS, CACHED, block_size, heads, kv_heads, head_dim, torch.float32)
    scale = head_dim ** -0.5
    expected = mod.attention_reference(q, k, v, tables, cu, lens, scale)
    # Small tiles, so that chunks span several query tiles and contexts several key tiles (both kernel phases).
    got = mod.paged_attention(q, k, v, tables, cu, lens, scale, max(QUERY_LENS), block_m=16, block_n=32)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tiles", [dict(), dict(block_m=32, block_n=16)])
@pytest.mark.parametrize("step", PREFILL_COPIES)
def test_flash_attention_fp16(step, tiles):
    mod = kernels(step)
    q, k, v, tables, cu, lens = make_case([3, 1, 20, 64], [10, 30, 0, 5], 16, 8, 2, 64, torch.float16, seed=3)
    expected = mod.attention_reference(q, k, v, tables, cu, lens, 0.125)
    got = mod.paged_attention(q, k, v, tables, cu, lens, 0.125, 64, **tiles)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("step", PREFILL_COPIES)
def test_flash_attention_refuses_bad_input(step):
    mod = kernels(step)
    q, k, v, tables, cu, lens = make_case([2], [0], 16, 4, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        mod.paged_attention(q[:, :3], k, v, tables, cu, lens, 0.1, 2)
    with pytest.raises(ValueError, match="power of two"):
        mod.paged_attention(q[..., :48], k[..., :48], v[..., :48], tables, cu, lens, 0.1, 2)


def counting(monkeypatch, module, name):
    """Count the calls of module.name (and, for flash_decode, record each call's split count)."""
    calls = {"n": 0, "splits": []}
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls["n"] += 1
        if name == "flash_decode":
            calls["splits"].append(args[6] if len(args) > 6 else kwargs["num_splits"])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def mixed_requests(seed=5, budget=None):
    """Five prompts of 3 to 64 tokens, greedy answers of 6 to 10 tokens. At a token budget of 1 every step is one
    token, a prompt's chunks included, so the two longest prompts would only add steps: the other three (their
    contexts still long enough for flash decoding's lowered split rule)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in (3, 17, 40, 9, 64)]
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True, logprobs=2) for i in range(5)]
    if budget == 1:
        return [prompts[i] for i in (0, 1, 3)], [params[i] for i in (0, 1, 3)]
    return prompts, params


@functools.lru_cache(maxsize=None)
def before_kernels_outputs(model, budget):
    """step14_7's outputs on mixed_requests() (options as in test_kernel_engine_equals_step14_7), computed once per
    test process: every kernel step is compared with the same run, and the tests only read it."""
    options = dict(device="cpu", max_num_batched_tokens=budget, max_num_seqs=4)
    return load_engine(last_before("triton_prefill")).LLM(model, **options).generate(*mixed_requests(budget=budget))


@pytest.mark.parametrize("budget", [1, 7, 512])
@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny-qwen3"])
@pytest.mark.parametrize("step", having("triton_prefill"))
def test_kernel_engine_equals_step14_7(step, model, budget, monkeypatch):
    """The prefill kernel's steps against the step before it (step14_7). step15: every prefill chunk goes through
    the kernel, one launch per layer in a step with chunks; only the decodes loop. step16 (triton_decode): the
    decodes too, one launch per layer in a step with decodes; nothing loops. step17 (flash_decoding): the decodes
    through flash decoding where the rule splits (lowered to 8 tokens per part so that these short contexts
    split), step16's kernel where it picks one part."""
    decodes_kernel, splits = has(step, "triton_decode"), has(step, "flash_decoding")
    backends = importlib.import_module(f"steps.{step}.attention")  # where the loop calls grouped_attention
    prefill = counting(monkeypatch, kernels(step), "paged_attention")
    decode = counting(monkeypatch, kernels(step, "decode"), "paged_decode_v2") if decodes_kernel else {"n": 0}
    split = counting(monkeypatch, kernels(step, "decode"), "flash_decode") if splits else {"n": 0}
    looped = counting(monkeypatch, backends, "grouped_attention")
    prompts, params = mixed_requests(budget=budget)
    options = dict(device="cpu", max_num_batched_tokens=budget, max_num_seqs=4)
    expected = before_kernels_outputs(model, budget)
    llm = load_engine(step).LLM(model, attention_backend="triton", **options)
    if splits:
        llm.model.attention_backend.split_rule["min_tokens_per_split"] = 8
    schedule, decodes, steps_with = llm.scheduler.schedule, 0, {"decodes": 0, "chunks": 0}

    def counted_schedule():
        nonlocal decodes
        decoding, chunks = schedule()
        decodes += len(decoding)
        steps_with["decodes"] += bool(decoding)
        steps_with["chunks"] += bool(chunks)
        return decoding, chunks

    llm.scheduler.schedule = counted_schedule
    got = llm.generate(prompts, params)
    for a, b in zip(got, expected):
        compare_completions(a.outputs[0], b.outputs[0], STEP_LOGPROB_ATOL_FP32)
    layers = llm.model.config.num_layers
    assert prefill["n"] == steps_with["chunks"] * layers > 0, (prefill, steps_with)  # one launch per layer
    if not decodes_kernel:
        assert looped["n"] == decodes * layers, (looped, decodes)  # the loop saw decode rows only, never a chunk
    else:
        # one decode launch per layer in a step with decodes (step17: v2 when one part suffices, else split + merge)
        assert decode["n"] + split["n"] == steps_with["decodes"] * layers > 0, (decode, split, steps_with)
        assert looped["n"] == 0, looped  # no sequence attends on its own any more
    if splits:
        assert split["n"] > 0 and min(split["splits"]) > 1, split["splits"]  # contexts were really split


KERNEL_STEPS = [s for s in STEPS if s in having("triton_prefill") + having("mixed_batch_kernel")]


@pytest.mark.parametrize("step", KERNEL_STEPS)
def test_attention_backend_choice(step):
    engine = load_engine(step)
    assert engine.choose_attention_backend(None, torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="attention_backend must be"):
        engine.LLM("random:tiny-llama", device="cpu", attention_backend="cuda")


@pytest.fixture(scope="module")
def head_dim_20(tmp_path_factory):
    """tiny-llama's shape with heads of 20 numbers: not a power of two."""
    from shared.models import RANDOM_SHAPES, write_random_model

    return str(write_random_model({**RANDOM_SHAPES["tiny-llama"], "head_dim": 20}, tmp_path_factory.mktemp("hd20")))


@pytest.mark.parametrize("step", KERNEL_STEPS)
def test_a_head_dim_the_kernels_cannot_take_is_refused_when_the_engine_is_built(step, head_dim_20):
    """The kernels' tiles need head_dim to be a power of two >= 16 (tl.arange, tl.dot): head_dim 20 with
    attention_backend="triton" is a ValueError naming both when the engine is built, not at its first generate. The
    torch backend runs it."""
    LLM = load_engine(step).LLM
    with pytest.raises(ValueError, match=r"attention_backend='triton'.*head_dim.*this model's is 20"):
        LLM(head_dim_20, device="cpu", attention_backend="triton", max_kv_tokens=256)
    llm = LLM(head_dim_20, device="cpu", attention_backend="torch", max_kv_tokens=256)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2


# ---- on the GPU: compiled, bf16, real model shapes ----------------------------------------------------------
SHAPES = {"smollm2-135m": (9, 3, 64), "qwen3-0.6b": (16, 8, 128)}  # (query heads, KV heads, head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("step", PREFILL_COPIES)
def test_flash_attention_compiled_bf16(step, shape, block_size):
    mod = kernels(step)
    heads, kv_heads, head_dim = SHAPES[shape]
    query_lens, cached = [1, 7, 300, 1, 129, 512], [0, 100, 40, 2000, 0, 1000]
    q, k, v, tables, cu, lens = make_case(query_lens, cached, block_size, heads, kv_heads, head_dim, torch.bfloat16)
    expected = mod.attention_reference(q, k, v, tables, cu, lens, head_dim ** -0.5)
    got = mod.paged_attention(q, k, v, tables, cu, lens, head_dim ** -0.5, max(query_lens))
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("step", [introducing("triton_prefill")])
def test_qwen3_shape_matches_hf_in_bf16(step):
    from test_gpu import check_against_hf

    check_against_hf(step, "random:qwen3-0.6b")
