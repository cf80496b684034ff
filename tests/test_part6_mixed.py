"""step18: one attention kernel for a batch that mixes decodes and prefill chunks, and a scheduler with no phases.

The kernel equals the torch reference on ragged mixed rows after cached prefixes (Triton's interpreter on the CPU,
fp32 and fp16; compiled in bf16 at real shapes on the GPU); the engine equals step17 token for token for chunk
budgets 1, 7 and 512, with one attention launch per layer in every step, counted where Triton launches it; a long
prompt never keeps a running request from its next token."""
import pytest
import torch

from shared import SamplingParams
from helpers import TritonLaunches, compare_completions, copies_param, STEP_LOGPROB_ATOL_FP32, load_engine
from helpers import scheduled_work
from registry import introducing, last_before, lesson_and_copies
from test_part6 import DEVICE, kernels, make_case, mixed_requests

pytest.importorskip("triton")

MIXED = introducing("mixed_batch_kernel")
BEFORE = last_before("mixed_batch_kernel")
# Decodes after long and short contexts, a chunk after a cached prefix, a prompt from scratch longer than a tile,
# a 1-token context, a decode right at a block boundary.
QUERY_LENS = [1, 5, 1, 40, 1, 33, 1]
CACHED = [70, 3, 0, 20, 15, 0, 64]


def mixed_cases():
    """The full grid (block sizes 16 and 64, GQA ratios 1, 3 and 8, head dims 64 and 128) where the kernel is
    introduced, two corners in every later copy of kernels/attention.py that differs (steps with the same file run
    it once, registry.distinct_copies)."""
    full = [(b, h, kv, d) for b in (16, 64) for h, kv in ((4, 4), (6, 2), (8, 1)) for d in (64, 128)]
    return [copies_param(group, *c, id=f"bs{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}")
            for group, lesson in lesson_and_copies("mixed_batch_kernel", "kernels.attention")
            for c in (full if lesson else [full[0], full[-1]])]


@pytest.mark.parametrize("step,block_size,heads,kv_heads,head_dim", mixed_cases())
def test_mixed_kernel_equals_reference(step, block_size, heads, kv_heads, head_dim):
    mod = kernels(step)
    q, k, v, tables, cu, lens = make_case(QUERY_LENS, CACHED, block_size, heads, kv_heads, head_dim, torch.float32)
    expected = mod.attention_reference(q, k, v, tables, cu, lens, head_dim ** -0.5)
    got = mod.mixed_attention(q, k, v, tables, cu, lens, head_dim ** -0.5, max(QUERY_LENS))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_m", [16, 64])
def test_mixed_kernel_fp16_and_tile_sizes(block_m):
    """fp16, and both tile heights: 16 rows (a decode's few heads) and 64 (several tokens of a chunk per tile)."""
    mod = kernels(MIXED)
    q, k, v, tables, cu, lens = make_case(QUERY_LENS, CACHED, 16, 9, 3, 64, torch.float16)
    expected = mod.attention_reference(q, k, v, tables, cu, lens, 0.125)
    got = mod.mixed_attention(q, k, v, tables, cu, lens, 0.125, max(QUERY_LENS), block_m=block_m, block_n=32)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-3, atol=2e-3)


def test_tile_map_cuts_every_row_into_tiles():
    mod = kernels(MIXED)
    seq, first = mod.tile_map(torch.tensor([1, 5, 12, 1]), 5)
    assert seq.tolist() == [0, 1, 2, 2, 2, 3] and first.tolist() == [0, 0, 0, 5, 10, 0]


def test_tile_rows_hold_a_tokens_heads():
    """tile_rows, the one rule for a program's rows that mixed_attention and the backends' metadata share:
    tile_config's rows (16 for short rows, 64 for chunks), the caller's where given, never fewer than one token's
    query heads rounded up to a power of two."""
    mod = kernels(MIXED)
    assert mod.tile_rows(1, 1) == mod.tile_rows(1, 3) == 16 and mod.tile_rows(100, 3) == 64
    assert mod.tile_rows(1, 24) == 32 and mod.tile_rows(1, 64) == 64  # more heads than the tile's 16 rows
    assert mod.tile_rows(1, 3, block_m=64) == 64 and mod.tile_rows(100, 3, block_m=4) == 4
    assert mod.tile_rows(1, 8, block_m=4) == 8  # an override too small for one token's heads is raised


def work_counter(llm):
    """Count, per step, what the scheduler gave: steps mixing a decode and a chunk, and whether every request
    that was one token behind when the step was scheduled got its token in that step."""
    schedule, seen = llm.scheduler.schedule, {"mixed": 0, "decodes": 0, "skipped_decodes": 0, "steps": 0}

    def counted():
        ready = [r for r in llm.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        result = schedule()
        work = scheduled_work(result)
        got = {id(r) for r, _ in work}
        decodes = sum(n == 1 and r.num_computed_tokens + 1 == r.num_tokens for r, n in work)
        seen["steps"] += 1
        seen["decodes"] += decodes
        seen["mixed"] += bool(decodes) and len(work) > decodes
        seen["skipped_decodes"] += sum(id(r) not in got for r in ready if r in llm.scheduler.running)
        return result

    llm.scheduler.schedule = counted
    return seen


@pytest.mark.parametrize("budget", [1, 7, 512])
@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny-qwen3"])
def test_mixed_engine_equals_step17_with_one_launch_per_layer(model, budget):
    prompts, params = mixed_requests(budget=budget)
    options = dict(device="cpu", max_num_batched_tokens=budget, max_num_seqs=4, attention_backend="triton")
    expected = load_engine(BEFORE).LLM(model, **options).generate(prompts, params)
    llm = load_engine(MIXED).LLM(model, **options)
    seen = work_counter(llm)
    with TritonLaunches() as launched:  # every kernel launch, those inside the kernels' wrappers included
        got = llm.generate(prompts, params)
    for a, b in zip(got, expected):
        compare_completions(a.outputs[0], b.outputs[0], STEP_LOGPROB_ATOL_FP32)
    layers = llm.model.config.num_layers
    # One launch per layer, every step: the mixed kernel, nothing else (these short contexts never split).
    mixed = f"{kernels(MIXED).__name__}._mixed_attention_kernel"
    assert launched.by_kernel == {mixed: llm.timers.steps * layers}, launched.by_kernel
    if budget > 1:
        assert seen["mixed"] > 0, seen  # steps really mixed decodes and chunks in that one launch


def test_a_long_prompt_never_holds_back_a_decode():
    """A prompt of 300 tokens arrives while three requests decode, under a budget of 16 tokens: it is prefilled
    over many steps, and in every one of them each decoding request still gets its token."""
    llm = load_engine(MIXED).LLM("random:tiny-llama", device="cpu", max_num_batched_tokens=16, max_num_seqs=4)
    seen = work_counter(llm)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for n in (4, 6, 8):
        llm.add_request(list(range(1, n + 1)), sp)
    for _ in range(3):
        llm.step()
    llm.add_request(list(range(1, 301)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while llm.scheduler.has_unfinished():
        llm.step()
    assert llm.stats["prefill_chunks"] >= 300 // 16  # the long prompt went in chunks
    assert seen["mixed"] >= 300 // 16 - 1 and seen["skipped_decodes"] == 0, seen


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(9, 3, 64), (16, 8, 128)], ids=["smollm2-135m", "qwen3-0.6b"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_mixed_kernel_compiled_bf16(shape, block_size):
    mod = kernels(MIXED)
    heads, kv_heads, head_dim = shape
    query_lens, cached = [1, 7, 300, 1, 129, 512, 1], [0, 100, 40, 2000, 0, 1000, 4095]
    q, k, v, tables, cu, lens = make_case(query_lens, cached, block_size, heads, kv_heads, head_dim, torch.bfloat16,
                                          device=DEVICE)
    expected = mod.attention_reference(q, k, v, tables, cu, lens, head_dim ** -0.5)
    got = mod.mixed_attention(q, k, v, tables, cu, lens, head_dim ** -0.5, max(query_lens))
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
