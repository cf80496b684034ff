"""Part 3 (steps 08-09): paged KV memory and prefix caching never change what a request gets."""
import importlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import cached_llm
from shared import SamplingParams
from helpers import FakeRequest, copies_params, load_engine
from registry import has, having
from test_part2 import MAX_TOKENS, PROMPTS, REFERENCE, TINY, assert_same, greedy, reference

PAGED = having("paged_kv")
PREFIX = having("prefix_cache")


@pytest.mark.parametrize("step", PAGED)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_outputs_unchanged_for_any_block_size(step, block_size):
    llm = load_engine(step).LLM(TINY, device="cpu", max_num_seqs=4, max_num_batched_tokens=32, block_size=block_size)
    params = [greedy(n) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    assert_same([o.outputs[0] for o in outs], reference(params), f"{step} block_size {block_size}")
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "a block leaked"


@pytest.mark.parametrize("step", PAGED)
def test_pool_too_small_preempts_and_changes_nothing(step):
    # 5 blocks of 16 tokens for 8 requests of up to 64 tokens each: the running set cannot fit.
    llm = load_engine(step).LLM(TINY, device="cpu", max_num_seqs=8, max_kv_tokens=80, block_size=16)
    params = [greedy(n) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    assert llm.scheduler.num_preemptions > 0
    assert_same([o.outputs[0] for o in outs], reference(params), step)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("step", PAGED)
def test_bad_paged_options(step):
    LLM = load_engine(step).LLM
    with pytest.raises(ValueError, match=r"block_size must be an integer in \[1, max_kv_tokens=32768\], got 0"):
        LLM(TINY, device="cpu", block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        LLM(TINY, device="cpu", block_size=64, max_kv_tokens=32)
    llm = LLM(TINY, device="cpu", block_size=16, max_kv_tokens=64)
    with pytest.raises(ValueError, match=r"= 70 exceeds max_kv_tokens \(64 = 4 blocks of 16\)"):
        llm.generate([[1] * 40], SamplingParams(temperature=0, max_tokens=30))
    assert not llm.has_unfinished_requests()
    if has(step, "prefix_cache"):
        with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
            LLM(TINY, device="cpu", enable_prefix_caching="yes")


# ---- block manager invariants under random operations -------------------------------------------

def check_invariants(bm, requests):
    owners = {}
    for r in requests:
        for b in r.block_table:
            owners[b] = owners.get(b, 0) + 1
    free = list(bm.free_blocks)
    assert len(free) == len(set(free)), "a block is twice in the free list"
    for b in range(bm.num_blocks):
        assert not (b in owners and b in bm.free_blocks), f"block {b} is both free and owned"
        assert b in owners or b in bm.free_blocks, f"block {b} is neither free nor owned: leaked"
        if hasattr(bm, "blocks"):  # prefix caching: blocks are shared, counted by ref_count
            assert bm.blocks[b].ref_count == owners.get(b, 0), f"block {b}: ref count {bm.blocks[b].ref_count}"
    if hasattr(bm, "cached"):
        assert all(bm.blocks[b].hash == h for h, b in bm.cached.items()), "the prefix cache points at a wrong block"
        assert len(set(bm.cached.values())) == len(bm.cached), "one block cached under two hashes"
        for r in requests:  # shared blocks are full and computed: nobody writes into them
            registered = r.num_cached_blocks if hasattr(bm, "hash_new_blocks") else len(r.block_hashes)
            assert registered <= r.num_computed_tokens // bm.block_size


@pytest.mark.parametrize("step", copies_params(PAGED, "block_manager"))  # once per distinct block_manager.py
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "grow", "finish", "preempt"]), st.integers(0, 10_000)),
                    max_size=60))
def test_block_manager_invariants(step, ops):
    bm = importlib.import_module(f"steps.{step}.block_manager").BlockManager(num_blocks=12, block_size=4)
    rng = random.Random(0)
    shared_prefix = [7] * 9
    live = []
    for op, x in ops:
        if op == "add":  # half of the requests share a prefix, so prefix caching gets hits
            tokens = (shared_prefix if x % 2 else []) + [rng.randrange(50) for _ in range(1 + x % 10)]
            r = FakeRequest(tokens)
            if bm.can_allocate(r, r.num_tokens):
                r.num_computed_tokens = bm.allocate(r, r.num_tokens) or 0  # step09: tokens found in the cache
                live.append(r)
        elif op in ("grow", "finish", "preempt") and live:
            r = live[x % len(live)]
            if op == "grow":  # compute what it holds, then append a token and allocate for it
                r.num_computed_tokens = r.num_tokens
                if hasattr(bm, "cache_full_blocks"):
                    bm.cache_full_blocks(r)
                r.token_ids = r.token_ids + [x % 50]
                if bm.can_allocate(r, r.num_tokens):
                    bm.allocate(r, r.num_tokens)
            else:
                (bm.release if hasattr(bm, "release") else bm.free)(r)  # step14_6 on: release()
                live.remove(r)
                if op == "preempt":  # back later, from nothing
                    r.num_computed_tokens = 0
                    if bm.can_allocate(r, r.num_tokens):
                        r.num_computed_tokens = bm.allocate(r, r.num_tokens) or 0
                        live.append(r)
        check_invariants(bm, live)
    for r in live:
        (bm.release if hasattr(bm, "release") else bm.free)(r)
    check_invariants(bm, [])
    assert bm.num_free_blocks == bm.num_blocks
    everything = FakeRequest(list(range(12 * 4)))
    bm.allocate(everything, 12 * 4)  # every block is reusable after all requests finish
    assert sorted(everything.block_table) == list(range(12))


# ---- prefix caching ------------------------------------------------------------------------------

_rng = random.Random(1)
PREFIX_64 = [_rng.randrange(49152) for _ in range(64)]
SHARING_PROMPTS = [PREFIX_64 + [_rng.randrange(49152) for _ in range(n)] for n in (1, 5, 20, 33)]


@pytest.mark.parametrize("step", PREFIX)
def test_outputs_identical_with_cache_on_and_off(step):
    params = [greedy(n) for n in (12, 7, 20, 3)]
    runs = {}
    for enabled in (False, True):
        llm = load_engine(step).LLM(TINY, device="cpu", max_num_seqs=2, enable_prefix_caching=enabled)
        runs[enabled] = [o.outputs[0] for o in llm.generate(SHARING_PROMPTS, params)]
        hits = llm.block_manager.stats["hits"]
        assert (hits > 0) == enabled, f"prefix caching {'on' if enabled else 'off'}: {hits} hits"
    assert_same(runs[True], runs[False], step)
    single = cached_llm(REFERENCE, TINY)
    assert_same(runs[True], [single.generate([p], sp)[0].outputs[0] for p, sp in zip(SHARING_PROMPTS, params)], step)


def run_two(llm, first, second):
    """Start `first`, let it compute its prompt, then submit `second`; run both to the end."""
    sp = greedy(8)
    ids = [llm.add_request(first, sp)]
    outs = {}
    while llm.scheduler.waiting or any(r.num_computed_tokens < len(first) for r in llm.scheduler.running):
        outs.update({o.request_id: o for o in llm.step()})
    ids.append(llm.add_request(second, sp))
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step()})
    assert sorted(outs) == sorted(ids), f"requests {sorted(set(ids) - set(outs))} never came out of step()"
    return outs


@pytest.mark.parametrize("step", PREFIX)
def test_second_request_with_the_same_prefix_hits(step):
    llm = load_engine(step).LLM(TINY, device="cpu", block_size=16)
    run_two(llm, SHARING_PROMPTS[0], SHARING_PROMPTS[2])
    assert llm.block_manager.stats["hits"] == 64 // 16  # all four blocks of the shared 64-token prefix
    assert llm.block_manager.stats["tokens_saved"] == 64


@pytest.mark.parametrize("step", PREFIX)
def test_hash_collisions_never_share_different_tokens(step, monkeypatch):
    block_manager = importlib.import_module(f"steps.{step}.block_manager")
    monkeypatch.setattr(block_manager, "block_hash", lambda parent_hash, token_ids: 42)  # every block collides
    llm = load_engine(step).LLM(TINY, device="cpu", block_size=16)
    other = [t + 1 for t in PREFIX_64] + [5, 6, 7]  # different tokens, same (forced) hashes
    outs = run_two(llm, SHARING_PROMPTS[1], other)
    assert llm.block_manager.stats["hits"] == 0, "a hash collision shared blocks of different tokens"
    expected = cached_llm(REFERENCE, TINY).generate([other], greedy(8))[0].outputs[0]
    assert_same([outs["1"].outputs[0]], [expected], step)
    # Same tokens as the first request: block 0 hits (same hash, same tokens, no previous block). Block 1 finds
    # block 0 under the forced hash 42 too, and there the token check refuses it: never a wrong block.
    llm2 = load_engine(step).LLM(TINY, device="cpu", block_size=16)
    outs2 = run_two(llm2, SHARING_PROMPTS[1], SHARING_PROMPTS[3])
    assert llm2.block_manager.stats["hits"] == 1
    expected = cached_llm(REFERENCE, TINY).generate([SHARING_PROMPTS[3]], greedy(8))[0].outputs[0]
    assert_same([outs2["1"].outputs[0]], [expected], step)


@pytest.mark.parametrize("step", PREFIX)
def test_the_parent_block_tells_repeated_blocks_apart(step, monkeypatch):
    """A hash of the block's tokens alone (the chain dropped): blocks of repeated tokens then collide with
    equal tokens, and only the parent check keeps the second [5]*16 block from reusing the first one's K/V
    (computed at positions 0-15, not 16-31)."""
    block_manager = importlib.import_module(f"steps.{step}.block_manager")
    monkeypatch.setattr(block_manager, "block_hash", lambda parent_hash, token_ids: hash(token_ids))
    llm = load_engine(step).LLM(TINY, device="cpu", block_size=16)
    first = [5] * 16 + [7] * 16 + [9, 8, 7]
    second = [5] * 16 + [5] * 16 + [7] * 16 + [1, 2]
    outs = run_two(llm, first, second)
    assert llm.block_manager.stats["hits"] == 1, "only block 0 may be shared"
    expected = cached_llm(REFERENCE, TINY).generate([second], greedy(8))[0].outputs[0]
    assert_same([outs["1"].outputs[0]], [expected], step)


@pytest.mark.parametrize("step", PREFIX)
def test_can_allocate_counts_hits_and_allocate_returns_them(step):
    bm = importlib.import_module(f"steps.{step}.block_manager").BlockManager(num_blocks=6, block_size=4)
    a = FakeRequest(list(range(17)))  # 4 full blocks + 1
    assert bm.allocate(a, a.num_tokens) == 0
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    assert bm.num_free_blocks == 1
    b = FakeRequest(list(range(16)) + [99, 98, 97])  # shares a's 4 full blocks, needs 5 in all
    assert bm.can_allocate(b, b.num_tokens), "4 of b's 5 blocks are cached and held by a: 1 free block is enough"
    assert bm.allocate(b, b.num_tokens) == 16, "allocate returns the tokens found in the cache"
    assert b.block_table[:4] == a.block_table[:4] and bm.num_free_blocks == 0
    c = FakeRequest(list(range(16)) + list(range(50, 60)))  # 4 cached blocks + 3 new ones, and none is free
    assert not bm.can_allocate(c, c.num_tokens)
