"""Part 5 (step14 .. step14_7): each change is proven where it happens, and changes no output.

- The grid: every Part 5 step gives step13's tokens (logprobs within tolerance) on Llama and Qwen3, for block
  sizes 1, 16 and 64 and chunk budgets 1, 7 and 512, on prompts of mixed lengths.
- step14: one KV tensor for all layers; the model runner is the only door to the model.
- step14_1 / 14_2: the vectorized write and the index_select gather equal step13's loops (property tests).
- step14_3: attention with GQA by a view equals attention with repeat_interleave copies.
- step14_4: the mask built once equals the per-row mask; decodes get none.
- step14_5: every block hash equals step14_4's, and each block is hashed once.
- step14_6: under eviction pressure more hits than step14_5, same outputs; the new API keeps its invariants.
- step14_7: one model forward per engine step, whatever the mix.
"""
import functools
import importlib
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import SamplingParams
from helpers import STEP_LOGPROB_ATOL_FP32, FakeRequest, compare_completions, load_engine, scheduled_work

from registry import TINY, TINY_QWEN3, having, introducing, last_before

RUNNER = having("model_runner")  # step14 and every later step: they keep Part 5's anatomy
BEFORE_PART5 = last_before("model_runner")  # step13: the engine Part 5 re-cuts


def model_module(step):
    return importlib.import_module(f"steps.{step}.model")


def grid_cases():
    """The grid in full (2 models x 3 block sizes x 3 budgets) where the whole engine was re-cut (step14) and where
    every chunk and decode became one flat batch (step14_7); in every other step its diagonal, each block size
    and budget once per model: the same code paths, a third of the runs."""
    full = {introducing("model_runner"), introducing("flat_varlen_batch")}
    cases = []
    for step in RUNNER:
        for model in (TINY, TINY_QWEN3):
            pairs = [(b, n) for b in (1, 16, 64) for n in (1, 7, 512)] if step in full else \
                [(1, 1), (16, 7), (64, 512)]
            cases += [pytest.param(step, model, b, n, id=f"{step}-{model}-{b}-{n}") for b, n in pairs]
    return cases


# ---- the grid: outputs equal step13's -----------------------------------------------------------------
GRID_PROMPT_LENS = [3, 17, 40, 9, 64]  # mixed lengths: under, over and exactly at block boundaries


def grid_prompts(vocab):
    rng = random.Random(5)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in GRID_PROMPT_LENS]


@functools.lru_cache(maxsize=None)
def grid_outputs(step, model, block_size, budget):
    llm = load_engine(step).LLM(model, device="cpu", dtype="float32", block_size=block_size,
                                max_num_batched_tokens=budget, max_num_seqs=4, max_kv_tokens=2048)
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True, logprobs=2)
              for i in range(len(GRID_PROMPT_LENS))]
    return llm.generate(grid_prompts(llm.model.config.vocab_size), params)


@pytest.mark.parametrize("step,model,block_size,budget", grid_cases())
def test_outputs_equal_step13(step, model, block_size, budget):
    ours, ref = grid_outputs(step, model, block_size, budget), grid_outputs(BEFORE_PART5, model, block_size, budget)
    assert len(ours) == len(ref) == len(GRID_PROMPT_LENS)
    for i, (a, b) in enumerate(zip(ours, ref)):
        compare_completions(a.outputs[0], b.outputs[0], STEP_LOGPROB_ATOL_FP32, label=f"{step} prompt {i}")


# ---- step14: one KV tensor ------------------------------------------------------------------------------
@pytest.mark.parametrize("step", RUNNER)
def test_one_kv_tensor_for_all_layers(step):
    llm = load_engine(step).LLM("random:tiny-llama", device="cpu", max_kv_tokens=256)
    data = llm.kv_cache.data
    c = llm.model.config
    scratch = llm.memory.get("scratch_blocks", 0)  # step21 on: one block past the pool for CUDA graphs' padding rows
    assert data.shape == (2, c.num_layers, 256 // 16 + scratch, 16, c.num_kv_heads, c.head_dim)
    for layer in range(c.num_layers):  # every layer's K and V are views into the one tensor, no copies
        assert llm.kv_cache.k[layer].data_ptr() == data[0, layer].data_ptr()
        assert llm.kv_cache.v[layer].data_ptr() == data[1, layer].data_ptr()
    assert llm.model.kv_cache is llm.kv_cache is llm.runner.kv_cache


# ---- step14_1 / step14_2: vectorized write and gather equal the loops ---------------------------------------
tables = st.integers(1, 6).flatmap(lambda size: st.tuples(
    st.just(size), st.permutations(range(12)), st.integers(0, 30), st.integers(1, 12)))


@pytest.mark.parametrize("step", having("slot_mapping_write"))
@settings(max_examples=60, deadline=None)
@given(case=tables)
def test_vectorized_write_equals_the_loop(step, case):
    block_size, blocks, start, new_tokens = case
    old = model_module(BEFORE_PART5)
    new = model_module(step)
    rows = 2  # two sequences, each with half of the blocks in a random order
    block_tables = [list(blocks[:6]), list(blocks[6:])]
    start = min(start, 6 * block_size - new_tokens) if 6 * block_size >= new_tokens else 0
    new_tokens = min(new_tokens, 6 * block_size - start)
    values = torch.randn(rows, new_tokens, 2, 4)
    expected, got = torch.zeros(12, block_size, 2, 4), torch.zeros(12, block_size, 2, 4)
    for row in range(rows):
        old.write_kv_to_blocks(expected, block_tables[row], start, values[row])
    if "query_lens" in new.slot_mapping.__code__.co_varnames:  # step14_7 on: a length per sequence
        slots = new.slot_mapping([start] * rows, [new_tokens] * rows, block_tables, block_size)
    else:
        slots = new.slot_mapping([start] * rows, new_tokens, block_tables, block_size)
    new.write_kv(got, torch.as_tensor(slots), values.reshape(-1, 2, 4))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("step", having("index_select_gather"))
@settings(max_examples=60, deadline=None)
@given(case=tables)
def test_index_select_gather_equals_the_loop(step, case):
    block_size, blocks, _, _ = case
    old, new = model_module(BEFORE_PART5), model_module(step)
    cache = torch.randn(12, block_size, 2, 4)
    table = list(blocks[:7])
    for num_tokens in range(1, 7 * block_size + 1):
        slots = new.context_slots(table, num_tokens, block_size, "cpu")
        assert torch.equal(new.gather_kv(cache, slots), old.gather_kv_from_blocks(cache, table, num_tokens))


# ---- step14_3: GQA by a view -----------------------------------------------------------------------------
@pytest.mark.parametrize("step", having("gqa_view"))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3), (8, 1)])
def test_grouped_attention_equals_copies(step, heads, kv_heads):
    grouped = model_module(step).grouped_attention
    torch.manual_seed(heads * 10 + kv_heads)
    for new, context in [(1, 1), (1, 37), (5, 5), (6, 20)]:
        q = torch.randn(new, heads, 16)
        keys, values = torch.randn(context, kv_heads, 16), torch.randn(context, kv_heads, 16)
        mask = torch.arange(context)[None, :] <= torch.arange(context - new, context)[:, None]
        group = heads // kv_heads  # the reference: step13's copies and einsums
        k, v = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / 16**0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        expected = torch.einsum("hqk,khd->qhd", probs, v).reshape(new, heads * 16)
        torch.testing.assert_close(grouped(q, keys, values, mask), expected, rtol=1e-5, atol=1e-5)


# ---- step14_4: the mask -----------------------------------------------------------------------------------
@pytest.mark.parametrize("step", having("mask_once"))
def test_mask_built_once_equals_the_per_row_mask(step):
    causal_mask = model_module(step).causal_mask
    for start in (0, 1, 15, 16, 40):
        assert causal_mask(start, 1, "cpu") is None  # a decode: no mask at all
        for new in (2, 7, 16):
            query_pos = torch.arange(start, start + new)
            expected = torch.arange(start + new)[None, :] <= query_pos[:, None]  # step13's, per row and layer
            assert torch.equal(causal_mask(start, new, "cpu"), expected)


# ---- step14_5: incremental hash --------------------------------------------------------------------------
def pressure_run(step, work, max_kv_tokens=160):
    llm = load_engine(step).LLM("random:tiny-llama", device="cpu", max_kv_tokens=max_kv_tokens, block_size=16)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = [llm.generate([p], sp)[0].outputs[0].token_ids for p in work]
    return llm, outs


def pressure_workload(rounds=6):
    """A 64-token system prompt every 4th request, one-off 40-token prompts between: blocks must be evicted."""
    rng = random.Random(1)
    system = [rng.randrange(1, 1000) for _ in range(64)]
    work = []
    for _ in range(rounds):
        work.append(system + [rng.randrange(1, 1000) for _ in range(8)])
        work += [[rng.randrange(1, 1000) for _ in range(40)] for _ in range(3)]
    return work


@pytest.mark.parametrize("step", having("incremental_hash"))
def test_block_hashes_equal_step14_4s_and_are_computed_once(step):
    work = pressure_workload(rounds=3)
    old, old_outs = pressure_run(last_before("incremental_hash"), work, max_kv_tokens=4096)  # no eviction: every block stays cached
    new, new_outs = pressure_run(step, work, max_kv_tokens=4096)
    assert new_outs == old_outs
    assert set(new.block_manager.cached) == set(old.block_manager.cached), "a block got another hash"
    full_blocks = sum(len(p) // 16 for p in work)  # prompt blocks (4 new tokens never fill another block here)
    assert new.block_manager.num_hashed == full_blocks, "each full block is hashed exactly once"
    # and per sequence: the hashes kept on it equal the chain step14_4 computes block by block from scratch
    block_hash = importlib.import_module(f"steps.{last_before('incremental_hash')}.block_manager").block_hash
    tokens, chain, parent = work[0], [], None
    for i in range(len(tokens) // 16):
        parent = block_hash(parent, tuple(tokens[i * 16:(i + 1) * 16]))
        chain.append(parent)
    probe = FakeRequest(tokens)
    new.block_manager.hash_new_blocks(probe)
    assert probe.block_hashes == chain


# ---- step14_6: release(), LRU eviction --------------------------------------------------------------------
@pytest.mark.parametrize("step", having("lru_eviction"))
def test_lru_eviction_keeps_more_hits_than_step14_5(step):
    work = pressure_workload()
    before, before_outs = pressure_run(last_before("lru_eviction"), work)
    after, after_outs = pressure_run(step, work)
    assert after_outs == before_outs
    hits_before, hits_after = before.block_manager.stats["hits"], after.block_manager.stats["hits"]
    print(f"{step}: {hits_after} block hits vs step14_5's {hits_before} on {len(work)} requests, pool of 10 blocks")
    assert hits_after >= hits_before and hits_after > hits_before, "this workload is built to show the difference"


@pytest.mark.parametrize("step", having("lru_eviction"))
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "decode", "release"]), st.integers(0, 10_000)), max_size=80))
def test_allocate_append_release_invariants(step, ops):
    bm = importlib.import_module(f"steps.{step}.block_manager").BlockManager(num_blocks=10, block_size=4)
    rng, shared = random.Random(0), [3] * 9
    live = []

    def check():
        held = {}
        for s in live:
            for b in s.block_table:
                held[b] = held.get(b, 0) + 1
        assert not set(bm.empty) & set(bm.evictable), "a block is both empty and evictable"
        for b in range(bm.num_blocks):
            block = bm.blocks[b]
            assert block.ref_count == held.get(b, 0)
            free = b in bm.empty or b in bm.evictable
            assert free == (block.ref_count == 0), f"block {b}: free={free}, ref_count={block.ref_count}"
            if b in bm.evictable:
                assert block.hash is not None and bm.cached[block.hash] == b, "evictable blocks are cached ones"
            if b in bm.empty:
                assert block.hash is None, "an empty block holds nothing cached"
        for s in live:  # a table holds its tokens, plus at most one block of room
            assert len(s.block_table) == bm.blocks_for(s.num_tokens)

    for op, x in ops:
        if op == "admit":
            s = FakeRequest((shared if x % 2 else []) + [rng.randrange(30) for _ in range(1 + x % 7)])
            if bm.can_allocate(s, s.num_tokens):
                s.num_computed_tokens = bm.allocate(s, s.num_tokens)
                s.num_computed_tokens = s.num_tokens  # its prefill ran
                bm.cache_full_blocks(s)
                live.append(s)
        elif op == "decode" and live:
            s = live[x % len(live)]
            s.token_ids.append(x % 30)
            if bm.can_append(s):
                bm.append(s)
                s.num_computed_tokens += 1
                bm.cache_full_blocks(s)
            else:
                s.token_ids.pop()
        elif op == "release" and live:
            bm.release(live.pop(x % len(live)))
        check()
    for s in live:
        bm.release(s)
    live.clear()
    check()
    assert bm.num_free_blocks == bm.num_blocks


# ---- step14_7: one forward per step -----------------------------------------------------------------------
@pytest.mark.parametrize("budget", [7, 512])
@pytest.mark.parametrize("step", having("flat_varlen_batch"))
def test_one_forward_per_engine_step(step, budget):
    llm = load_engine(step).LLM("random:tiny-llama", device="cpu", max_num_batched_tokens=budget, max_num_seqs=4)
    prompts = grid_prompts(llm.model.config.vocab_size)
    mixed_steps = 0
    schedule = llm.scheduler.schedule

    def counting_schedule():  # count the steps that mix decodes and prefill chunks
        nonlocal mixed_steps
        result = schedule()
        work = scheduled_work(result)
        decodes = sum(n == 1 and r.num_computed_tokens + 1 == r.num_tokens for r, n in work)
        mixed_steps += bool(decodes and len(work) > decodes) or len(work) - decodes > 1
        return result

    llm.scheduler.schedule = counting_schedule
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * len(prompts))
    assert llm.stats["forwards"] == llm.timers.steps, llm.stats
    assert mixed_steps > 0, "the workload was meant to mix decodes and prefill chunks in one step"
    assert llm.stats["prefill_chunks"] + llm.stats["decode_steps"] > llm.stats["forwards"], \
        "step14_6 would have needed more forwards than steps here"
    previous = load_engine(last_before("flat_varlen_batch")).LLM("random:tiny-llama", device="cpu", max_num_batched_tokens=budget,
                                           max_num_seqs=4)
    expected = previous.generate(prompts, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * len(prompts))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert previous.stats["forwards"] > previous.timers.steps
