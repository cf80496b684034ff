"""Part 6, the decode kernels: paged attention (v1, v2; step16) and flash decoding (step17) against their torch
reference, in Triton's interpreter on a CPU (conftest.py sets TRITON_INTERPRET=1 there), compiled on a GPU (the
`gpu` tests, bf16 at real model shapes). Each step's tests run that step's own copy of the kernels (the one its
engine calls), once for each distinct content of the file (steps with the same kernels/decode.py share one run,
registry.distinct_copies): the full grid where a kernel is introduced, a few cases of it in every later copy that
differs."""
import importlib
import os

import pytest
import torch

pytest.importorskip("triton")
from helpers import copies_param, copies_params
from registry import STEPS, has, introducing, lesson_and_copies

V1_STEP = introducing("triton_decode")  # v1, the first version; the steps after it call v2 and flash decoding
SPLIT_STEP = introducing("flash_decoding")


def decode_kernels(step: str):
    """steps/<step>/kernels/decode.py: the copy of the kernels that the step's engine calls."""
    return importlib.import_module(f"steps.{step}.kernels.decode")


# step-independent tests (the split rule, bad input, empty batches) use the kernels where they are introduced
_v1 = decode_kernels(V1_STEP)
decode_reference, paged_decode_v1, paged_decode_v2 = _v1.decode_reference, _v1.paged_decode_v1, _v1.paged_decode_v2
_split = decode_kernels(SPLIT_STEP)
choose_num_splits, flash_decode, flash_decode_partials = _split.choose_num_splits, _split.flash_decode, _split.flash_decode_partials

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=3e-3),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

def make_case(block_size, num_heads, kv_heads, head_dim, dtype, seed=0):
    """A small decode batch over a scattered paged cache.

    Contexts: 1 token, exactly one block, one block + 1, and several blocks with a partial last one. The
    sequences' physical blocks are a shuffled set of ids. Everything a correct kernel must not read is NaN:
    the unused physical blocks (block 0 among them), the unused slots of each last block; block_tables' entries
    past a sequence's blocks are 0, i.e. point at a NaN block. q and the caches are views with strides that
    are not those of contiguous tensors.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [1, block_size, block_size + 1, 3 * block_size + 5]
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    # K and V of one layer, interleaved in one tensor, as views: [num_blocks, block_size, kv_heads, head_dim]
    kv = torch.full((num_blocks, block_size, 2, kv_heads, head_dim), float("nan"))
    k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
    block_tables = torch.zeros(len(seq_lens), max(blocks_needed) + 1, dtype=torch.int32)
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 stays unused
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_needed)):
        for j in range(nb):
            b = physical.pop()
            block_tables[i, j] = b
            filled = min(block_size, n - j * block_size)
            k_cache[b, :filled] = torch.randn(filled, kv_heads, head_dim, generator=gen)
            v_cache[b, :filled] = torch.randn(filled, kv_heads, head_dim, generator=gen)
    qkv = torch.randn(len(seq_lens), num_heads + 2 * kv_heads, head_dim, generator=gen)
    qkv, kv = qkv.to(dtype=dtype, device=DEVICE), kv.to(dtype=dtype, device=DEVICE)
    # q: a view into a fused QKV projection's output
    return dict(q=qkv[:, :num_heads], k_cache=kv[:, :, 0], v_cache=kv[:, :, 1],
                block_tables=block_tables.to(DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), scale=head_dim ** -0.5)


def test_make_case_is_a_strided_paged_cache():
    case = make_case(16, 6, 2, 64, torch.float32)
    assert not case["k_cache"].is_contiguous() and case["k_cache"].stride(3) == 1
    assert not case["q"].is_contiguous() and case["q"].stride(2) == 1
    out = decode_reference(**case)
    assert out.shape == (4, 6, 64) and not out.isnan().any()


HEADS = [(4, 4), (6, 2), (8, 1)]  # GQA 1, 3 and 8
FP32_CASES = [(bs, h, kv, d) for bs in (16, 64) for (h, kv) in HEADS for d in (64, 128)]
FP16_CASES = [(16, 6, 2, 64), (64, 8, 1, 128)]


def _cases():
    return ([pytest.param(*c, torch.float32, id=f"bs{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}-fp32") for c in FP32_CASES]
            + [pytest.param(*c, torch.float16, id=f"bs{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}-fp16") for c in FP16_CASES])


@pytest.mark.parametrize("block_size,num_heads,kv_heads,head_dim,dtype", _cases())
def test_v1_matches_reference(block_size, num_heads, kv_heads, head_dim, dtype):
    case = make_case(block_size, num_heads, kv_heads, head_dim, dtype)
    out = paged_decode_v1(**case)
    assert out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, decode_reference(**case), **TOL[dtype])


def _per_copy(feature, full, reduced):
    """(step, *case) for each distinct copy of kernels/decode.py among the steps with `feature`: the full list of
    cases where it is introduced, `reduced` (a few of them) in each later copy that differs from it."""
    return [copies_param(group, *c.values, id=c.id) for group, lesson in lesson_and_copies(feature, "kernels.decode")
            for c in (full if lesson else reduced)]


def _v2_cases():
    tiles = (16, 64)  # a tile inside one block / a tile spanning several blocks
    full = [pytest.param(*c.values, n, id=f"{c.id}-n{n}") for c in _cases() for n in tiles]
    return _per_copy("triton_decode", full, [full[0], full[-1]])


@pytest.mark.parametrize("step,block_size,num_heads,kv_heads,head_dim,dtype,block_n", _v2_cases())
def test_v2_matches_reference(step, block_size, num_heads, kv_heads, head_dim, dtype, block_n):
    kernels = decode_kernels(step)
    case = make_case(block_size, num_heads, kv_heads, head_dim, dtype)
    out = kernels.paged_decode_v2(**case, block_n=block_n)
    assert out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, kernels.decode_reference(**case), **TOL[dtype])


def _bad(case, **changes):
    return {**case, **changes}


@pytest.mark.parametrize("kernel", [paged_decode_v1, paged_decode_v2])
def test_bad_inputs_raise_clear_errors(kernel):
    case = make_case(16, 4, 2, 64, torch.float32)
    q, k, v = case["q"], case["k_cache"], case["v_cache"]
    bad = {
        "multiple of kv_heads": _bad(case, q=q[:, :3]),  # 3 query heads, 2 KV heads
        "share a dtype": _bad(case, q=q.half()),
        "power of two": _bad(case, q=q[..., :48].contiguous(), k_cache=k[..., :48], v_cache=v[..., :48]),
        "differs from the cache": _bad(case, q=q[..., :32].contiguous()),
        "block_tables must be int32": _bad(case, block_tables=case["block_tables"].long()),
        "seq_lens must be int32": _bad(case, seq_lens=case["seq_lens"][:2]),
        "must be contiguous": _bad(case, q=q.transpose(1, 2).contiguous().transpose(1, 2)),
        r"q must be \[num_seqs": _bad(case, q=q[0]),
        "float16, bfloat16 or float32": _bad(case, q=q.double(), k_cache=k.double(), v_cache=v.double()),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=message):
            kernel(**args)


def test_v2_rejects_bad_block_n():
    with pytest.raises(ValueError, match="block_n"):
        paged_decode_v2(**make_case(16, 4, 2, 64, torch.float32), block_n=24)


@pytest.mark.skipif(not INTERPRETED, reason="an interpreter limitation")
def test_v2_refuses_bfloat16_in_the_interpreter():
    with pytest.raises(ValueError, match="bfloat16"):
        paged_decode_v2(**make_case(16, 4, 2, 64, torch.bfloat16))


def test_v2_any_block_size():
    """v2 looks each token up as (pos // block_size, pos % block_size): block_size need not be a power of two."""
    case = make_case(24, 6, 2, 64, torch.float32)
    torch.testing.assert_close(paged_decode_v2(**case, block_n=16), decode_reference(**case), **TOL[torch.float32])


@pytest.mark.parametrize("kernel", [paged_decode_v1, paged_decode_v2])
def test_empty_batch(kernel):
    case = make_case(16, 4, 2, 64, torch.float32)
    empty = {**case, "q": case["q"][:0], "block_tables": case["block_tables"][:0], "seq_lens": case["seq_lens"][:0]}
    assert kernel(**empty).shape == (0, 4, 64)


# The longest context of make_case is 3 * block_size + 5 tokens: with BLOCK_N = 16, 4 tiles (block 16) or
# 13 tiles (block 64). 20 splits is more than either: most splits get no tile and must merge as nothing.
SPLITS = [1, 2, 3, 8, 20]
BLOCK_N = 16


def _split_cases():
    full = [pytest.param(b, h, kv, n, id=f"{b}-{h}-{kv}-{n}") for b in (16, 64) for h, kv in HEADS for n in SPLITS]
    return _per_copy("flash_decoding", full, [p for p in full if p.id in ("16-6-2-3", "64-8-1-20")])


@pytest.mark.parametrize("step,block_size,num_heads,kv_heads,num_splits", _split_cases())
def test_flash_decode_matches_reference_and_v2(step, block_size, num_heads, kv_heads, num_splits):
    """The step's flash decoding equals its reference, its own v2 where the step still has one (step17: the kernel
    it falls back to for one part), and the v2 where v2 is introduced."""
    kernels = decode_kernels(step)
    case = make_case(block_size, num_heads, kv_heads, 64, torch.float32)
    out = kernels.flash_decode(**case, num_splits=num_splits, block_n=BLOCK_N)
    assert out.dtype == torch.float32 and out.is_contiguous() and not out.isnan().any()
    torch.testing.assert_close(out, kernels.decode_reference(**case), **TOL[torch.float32])
    if has(step, "triton_decode"):
        torch.testing.assert_close(out, kernels.paged_decode_v2(**case, block_n=BLOCK_N), **TOL[torch.float32])
    torch.testing.assert_close(out, paged_decode_v2(**case, block_n=BLOCK_N), **TOL[torch.float32])


@pytest.mark.parametrize("block_size,num_heads,kv_heads,head_dim,dtype,num_splits", [
    (16, 6, 2, 128, torch.float32, 3),
    (64, 8, 1, 128, torch.float32, 5),
    (16, 6, 2, 64, torch.float16, 2),
    (64, 8, 1, 128, torch.float16, 8),
])
def test_flash_decode_more_shapes(block_size, num_heads, kv_heads, head_dim, dtype, num_splits):
    case = make_case(block_size, num_heads, kv_heads, head_dim, dtype)
    out = flash_decode(**case, num_splits=num_splits, block_n=BLOCK_N)
    assert out.dtype == dtype
    torch.testing.assert_close(out, _split.decode_reference(**case), **TOL[dtype])


def test_flash_decode_default_tile():
    case = make_case(64, 6, 2, 64, torch.float32)  # BLOCK_N 64: tiles of one whole block each
    torch.testing.assert_close(flash_decode(**case, num_splits=3), _split.decode_reference(**case), **TOL[torch.float32])


def test_choose_num_splits_examples():
    assert choose_num_splits(64, 8, 2048) == 1        # 512 programs >= 2 per SM: no split
    assert choose_num_splits(33, 8, 32768) == 1       # 264 programs: exactly 2 per SM
    assert choose_num_splits(1, 8, 32768) == 33       # cdiv(264, 8)
    assert choose_num_splits(4, 8, 32768) == 9        # cdiv(264, 32)
    assert choose_num_splits(1, 8, 1024) == 4         # capped: 1024 // 256 tokens per split
    assert choose_num_splits(1, 8, 100) == 1          # too short to split at all
    assert choose_num_splits(1, 8, 32768, num_sms=16) == 4
    assert choose_num_splits(1, 8, 32768, min_tokens_per_split=8192) == 4


@pytest.mark.parametrize("num_seqs", [1, 2, 5, 16, 64, 300])
@pytest.mark.parametrize("max_seq_len", [1, 255, 256, 4096, 131072])
def test_choose_num_splits_rule(num_seqs, max_seq_len):
    kv_heads, sms, min_tokens = 8, 132, 256
    n = choose_num_splits(num_seqs, kv_heads, max_seq_len, num_sms=sms, min_tokens_per_split=min_tokens)
    programs = num_seqs * kv_heads
    assert isinstance(n, int) and n >= 1
    if programs >= 2 * sms:
        assert n == 1
    assert n == 1 or max_seq_len // n >= min_tokens                # no split shorter than the minimum
    assert n == 1 or (n - 1) * programs < 2 * sms                   # no more splits than needed to fill the GPU
    if n < -(-2 * sms // programs):                                 # fewer than wanted: only the length limits
        assert max_seq_len // (n + 1) < min_tokens


def test_flash_decode_bad_inputs():
    case = make_case(16, 4, 2, 64, torch.float32)
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="num_splits"):
            flash_decode(**case, num_splits=bad)
    with pytest.raises(ValueError, match="block_n"):
        flash_decode(**case, num_splits=2, block_n=48)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        flash_decode(**{**case, "q": case["q"][:, :3]}, num_splits=2)
    with pytest.raises(ValueError, match="share a dtype"):
        flash_decode(**{**case, "q": case["q"].half()}, num_splits=2)


def test_empty_splits_write_the_empty_state():
    """20 splits over contexts of 1 .. 13 tiles: the splits past each context hold m = -inf, l = 0, acc = 0
    (no NaN anywhere); the others saw at least one token (finite m, l >= 1)."""
    case = make_case(64, 6, 2, 64, torch.float32)
    part_m, part_l, part_acc = flash_decode_partials(**case, num_splits=20, block_n=BLOCK_N)
    for name, t in (("m", part_m), ("l", part_l), ("acc", part_acc)):
        assert not t.isnan().any(), f"NaN in part_{name}"
    for i, n in enumerate(case["seq_lens"].tolist()):
        tiles = -(-n // BLOCK_N)
        per_split = -(-tiles // 20)
        used = -(-tiles // per_split)  # splits that got at least one tile
        assert torch.isfinite(part_m[i, :, :used]).all() and (part_l[i, :, :used] >= 1).all()
        assert (part_m[i, :, used:] == float("-inf")).all()
        assert (part_l[i, :, used:] == 0).all() and (part_acc[i, :, used:] == 0).all()


@pytest.mark.skipif(not INTERPRETED, reason="an interpreter limitation")
def test_flash_decode_refuses_bfloat16_in_the_interpreter():
    with pytest.raises(ValueError, match="bfloat16"):
        flash_decode(**make_case(16, 4, 2, 64, torch.bfloat16), num_splits=2)


# ---- compiled on the GPU, bf16, real model shapes ---------------------------------------------------------
GPU_SHAPES = [(9, 3, 64), (16, 8, 128)]  # SmolLM2-135M's (query heads, KV heads, head_dim), Qwen3-0.6B's


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,kv_heads,head_dim", GPU_SHAPES)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("step", copies_params(
    [s for s in STEPS if has(s, "triton_decode") or has(s, "flash_decoding")], "kernels.decode"))
def test_decode_kernels_compiled_bf16(step, block_size, num_heads, kv_heads, head_dim):
    kernels = decode_kernels(step)
    case = make_case(block_size, num_heads, kv_heads, head_dim, torch.bfloat16)
    expected = kernels.decode_reference(**case).float()
    versions = [("v1", kernels.paged_decode_v1)] if hasattr(kernels, "paged_decode_v1") else []
    if hasattr(kernels, "paged_decode_v2"):
        versions.append(("v2", kernels.paged_decode_v2))
    if hasattr(kernels, "flash_decode"):
        versions += [(f"flash {n}", lambda n=n, **c: kernels.flash_decode(**c, num_splits=n)) for n in (1, 2, 3, 8, 64)]
    for name, kernel in versions:
        out = kernel(**case)
        torch.testing.assert_close(out.float(), expected, **TOL[torch.bfloat16], msg=name)
