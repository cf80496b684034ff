"""step32: a second tier for the KV cache in host memory (kv_offloading_size, GiB: vLLM's name). Evicted prefix-cache
blocks are stored in host slots keyed by their hashes; a GPU miss that the host tier holds is restored before the
forward that reads it; the copies run in the order they were asked for (offload.py).

What is proven here, on the CPU (both tiers are host memory; the mechanism and its accounting are the same):
- multi-turn chats in a pool too small for them: the same tokens as step31 without the tier (with an int8 or fp8
  cache, up to near-ties: step31 rounds a recomputed block again), while blocks were stored and restored (the
  counters), and the GPU blocks and host slots balance after every step;
- the block manager and the tier on a fake cache whose every block holds a value of its tokens: restored blocks hold
  their tokens' values; a block evicted again before its restore ran, an abort while restores are queued, a full
  tier (its least recently used block dropped), a hash collision (refused);
- tensor parallelism over gloo: two ranks with the tier give one rank's tokens, and each rank copied its own share
  of every block stored and restored (the copies travel with the step);
- bad input: a negative size, a size that holds no block, a size above the host's available memory, the tier without
  prefix caching.
On the GPU (marked gpu): the same chats on CUDA (side-stream copies) follow the engine without the tier."""
import importlib

import pytest
import torch

from helpers import BF16_LOGPROB_MAX_ATOL, TP_LOGPROB_ATOL_FP32, FakeRequest, compare_completions, load_engine
from registry import introducing, last_before
from shared import SamplingParams

TIER = introducing("kv_offload")
BEFORE = last_before("kv_offload")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")


def module(name: str):
    return importlib.import_module(f"steps.{TIER}.{name}")


# ---- the engine: multi-turn chats --------------------------------------------------------------------------------
def chat(engine, conversations=6, turns=3, max_tokens=12, seed=0, check=None):
    """`conversations` chats of `turns` turns, each turn sent whole: a shared 40-token system prompt, then the
    conversation's history (its earlier turns and answers) and 10 new tokens. The turn's requests run together
    through add_request/step. -> every answer's token ids, turn by turn; `check` is called after every step."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 49152, (40,), generator=g).tolist()
    history = [system + torch.randint(0, 49152, (20,), generator=g).tolist() for _ in range(conversations)]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    answers = []
    for _ in range(turns):
        ids = [engine.add_request(h, sp) for h in history]
        done = {}
        while len(done) < len(ids):
            for out in engine.step():
                done[out.request_id] = out.outputs[0]
            if check is not None:
                check(engine)
        turn = [done[i] for i in ids]
        answers.append(turn)
        history = [h + list(a.token_ids) + torch.randint(0, 49152, (10,), generator=g).tolist()
                   for h, a in zip(history, turn)]
    return answers


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny-qwen3"])
def test_chats_equal_the_step_before_while_blocks_go_to_host_memory_and_back(model):
    """A pool of 256 tokens holds less than a turn's conversations: every turn evicts the histories the next turn
    needs. With a host tier of ~1 MiB the answers are the step before's (no tier), the tier stored and restored
    blocks (restores > 0), the prompts found more of their tokens cached, and the blocks and host slots balance after
    every step."""
    options = dict(device="cpu", dtype="float32", max_kv_tokens=256, max_num_seqs=4)
    ref_engine = load_engine(BEFORE).LLM(model, **options)
    ref = chat(ref_engine)
    llm = load_engine(TIER).LLM(model, kv_offloading_size=0.001, **options)
    out = chat(llm, check=lambda e: e.block_manager.check_balance())
    for turn, (a_turn, b_turn) in enumerate(zip(out, ref)):
        for i, (a, b) in enumerate(zip(a_turn, b_turn)):
            compare_completions(a, b, 1e-4, label=f"turn {turn} conversation {i}")
    s = llm.stats
    assert s["host_stores"] > 0 and s["host_restores"] > 0 and llm.block_manager.stats["host_hits"] == s["host_restores"]
    assert s["host_bytes_in"] == s["host_restores"] * module("offload").block_bytes(llm.kv_cache)
    assert llm.block_manager.stats["tokens_saved"] > ref_engine.block_manager.stats["tokens_saved"]
    assert f"host KV tier: {s['host_blocks']} blocks" in llm.backend


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantised_caches_go_to_host_memory_and_back(kv_cache_dtype):
    """An int8 cache's blocks travel with their scales, an fp8 cache's as bytes: the chats' answers follow the step
    before's with the same cache, while blocks were restored. Follow, not equal: the step before computes an evicted
    block again and rounds it to the cache's format again, and a number of K or V that the batch around it moved by
    a rounding error can land one step of the format away from where it was first stored, which can turn a near-tie.
    The tier brings back the bytes first stored. So the rule is the near-tie rule (helpers.compare_completions with
    exact=False): the same tokens up to the first that differs, and there each side's among the other's most likely."""
    options = dict(device="cpu", dtype="float32", max_kv_tokens=256, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
    ref = chat(load_engine(BEFORE).LLM("random:tiny-qwen3", **options), conversations=5, turns=3)
    llm = load_engine(TIER).LLM("random:tiny-qwen3", kv_offloading_size=0.001, **options)
    out = chat(llm, conversations=5, turns=3)
    assert llm.stats["host_restores"] > 0
    assert (llm.runner.host_store.scales is not None) == (kv_cache_dtype == "int8")
    for turn, (a_turn, b_turn) in enumerate(zip(out, ref)):
        for i, (a, b) in enumerate(zip(a_turn, b_turn)):
            compare_completions(a, b, 1e-4, exact=False, label=f"turn {turn} conversation {i}")


def test_without_the_tier_nothing_is_stored_and_the_line_says_off():
    llm = load_engine(TIER).LLM("random:tiny-llama", device="cpu", max_kv_tokens=256, max_num_seqs=4)
    chat(llm, conversations=3, turns=2)
    assert llm.host_tier is None and "host KV tier: off" in llm.backend and "host_stores" not in llm.stats


def test_preempted_requests_resume_from_the_host_tier():
    """Long answers in a pool of 128 tokens: the scheduler preempts, the preempted requests' full blocks are evicted
    to the host tier, and their resumption restores them; the answers are the step before's."""
    prompts = [[(7 * i + 3 * j) % 49152 for j in range(30 + 5 * i)] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", max_kv_tokens=128, max_num_seqs=4)
    ref = load_engine(BEFORE).LLM("random:tiny-llama", **options).generate(prompts, sp)
    llm = load_engine(TIER).LLM("random:tiny-llama", kv_offloading_size=0.001, **options)
    out = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert llm.scheduler.num_preemptions > 0 and llm.stats["host_restores"] > 0


def test_two_ranks_with_the_tier_equal_one_and_every_rank_copies_its_share():
    """tp=2 over gloo with the host tier: rank 0 decides what is stored and restored, and the step carries the copies
    to both ranks, each running them on its own half of the KV heads. The chats give one rank's tokens (logprobs
    within the all-reduce's reordering bound), as many blocks were restored as on one rank, and each rank copied
    every stored and restored block's share of its own cache (a worker that skipped its copies would attend to
    blocks holding another request's K and V)."""
    options = dict(device="cpu", dtype="float32", max_kv_tokens=256, max_num_seqs=4, kv_offloading_size=0.002)
    LLM = load_engine(TIER).LLM
    one = LLM("random:tiny-qwen3", **options)
    ref = chat(one, conversations=5, turns=3)
    llm = LLM("random:tiny-qwen3", tensor_parallel_size=2, **options)
    try:
        out = chat(llm, conversations=5, turns=3)
        workers = llm.workers.host_counts()
        rank0 = {k: v for k, v in llm.stats.items() if k.startswith("host_")}
        per_block = llm.runner.host_store.bytes_per_block
    finally:
        llm.shutdown()
    for turn, (a_turn, b_turn) in enumerate(zip(out, ref)):
        for i, (a, b) in enumerate(zip(a_turn, b_turn)):
            compare_completions(a, b, TP_LOGPROB_ATOL_FP32, label=f"turn {turn} conversation {i}")
    s = one.stats
    assert s["host_restores"] > 0 and rank0["host_restores"] == s["host_restores"]
    assert rank0["host_stores"] == s["host_stores"] and rank0["host_blocks"] == s["host_blocks"]
    assert 2 * per_block == one.runner.host_store.bytes_per_block  # each rank holds half of a block
    for counts in [rank0, *workers]:
        assert counts["host_bytes_in"] == s["host_restores"] * per_block
        assert counts["host_bytes_out"] == s["host_stores"] * per_block


# ---- the block manager and the tier on a fake cache ----------------------------------------------------------------
class FakeCache:
    """A cache of num_blocks blocks of 4 tokens, one layer, one KV head, head_dim 2: data [2, 1, blocks, 4, 1, 2]."""

    def __init__(self, num_blocks: int):
        self.data = torch.zeros(2, 1, num_blocks, 4, 1, 2)
        self.scales = None


class FakeTier:
    """The tier's two halves on a fake cache: the decisions (HostKVTier) and the host blocks (HostKVStore); run()
    runs the copies decided so far, as a step does before its forward."""

    def __init__(self, cache, host_slots):
        offload = module("offload")
        self.policy = offload.HostKVTier(host_slots)
        self.store = offload.HostKVStore(cache, host_slots, torch.device("cpu"), self.policy.stats)

    def run(self):
        self.store.run(self.policy.copies())


def manager(num_blocks=4, host_slots=8):
    cache = FakeCache(num_blocks)
    tier = FakeTier(cache, host_slots)
    return module("block_manager").BlockManager(num_blocks, 4, True, host=tier.policy), tier, cache


def forward(bm, cache, req, tier):
    """Admit req if it has no blocks (prefix hits and restores), run the tier's copies, then 'compute' its blocks
    past the cached ones: each block's K and V become the value of its tokens (their sum), then cache them."""
    if not req.block_table:
        req.num_computed_tokens = bm.allocate(req, req.num_tokens)
    tier.run()
    for i in range(req.num_computed_tokens // 4, bm.blocks_for(req.num_tokens)):
        cache.data[:, :, req.block_table[i]] = float(sum(req.token_ids[i * 4:(i + 1) * 4]))
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


def check_content(bm, tier, cache):
    """Every cached GPU block and every host slot holds its tokens' value; the blocks and slots balance."""
    tier.run()
    for h, b in bm.cached.items():
        assert (cache.data[:, :, b] == float(sum(bm.blocks[b].token_ids))).all(), f"GPU block {b}"
    for h, e in tier.policy.entries.items():
        assert (tier.store.data[e.slot] == float(sum(e.token_ids))).all(), f"host slot {e.slot}"
    bm.check_balance()


def test_evicted_blocks_come_back_from_host_memory():
    bm, tier, cache = manager()
    a = FakeRequest(range(1, 14))  # 3 full blocks + 1 token: 4 blocks, the whole pool
    forward(bm, cache, a, tier)
    bm.release(a)
    b = FakeRequest(range(100, 113))  # other tokens: evicts all of a's cached blocks into the host tier
    forward(bm, cache, b, tier)
    bm.release(b)
    assert tier.policy.stats["host_stores"] == 3 and not any(h in bm.cached for h in a.block_hashes)
    again = FakeRequest(range(1, 14))
    forward(bm, cache, again, tier)
    assert bm.stats["host_hits"] == 3 and tier.policy.stats["host_restores"] == 3
    check_content(bm, tier, cache)


def test_a_block_evicted_again_before_its_restore_ran():
    """Restores queued, the request aborted before any forward (released), and its blocks taken by another request
    before the copies ran: the copies run in order, so the new request computes over the restored blocks, and a
    third request still restores the right content."""
    bm, tier, cache = manager()
    a, b = FakeRequest(range(1, 14)), FakeRequest(range(100, 113))
    for r in (a, b):
        forward(bm, cache, r, tier)
        bm.release(r)
    again = FakeRequest(range(1, 14))
    again.num_computed_tokens = bm.allocate(again, again.num_tokens)  # 3 restores queued, not run
    assert len(tier.policy.queue) == 3 + 3  # b's blocks stored (a's took the pool), then a's restored
    bm.release(again)  # an abort during the restore
    bm.check_balance()
    c = FakeRequest(range(200, 213))  # takes every block: a's restored blocks are evicted again (already in the tier)
    forward(bm, cache, c, tier)
    bm.release(c)
    check_content(bm, tier, cache)
    third, before = FakeRequest(range(1, 14)), bm.stats["host_hits"]
    forward(bm, cache, third, tier)
    assert bm.stats["host_hits"] == before + 3
    check_content(bm, tier, cache)


def test_an_abort_during_a_restore_gives_every_block_back():
    bm, tier, cache = manager()
    for r in (FakeRequest(range(1, 14)), FakeRequest(range(100, 113))):
        forward(bm, cache, r, tier)
        bm.release(r)
    again = FakeRequest(range(1, 14))
    bm.allocate(again, again.num_tokens)
    assert tier.policy.queue and len(again.block_table) == 4
    bm.release(again)
    assert bm.num_free_blocks == 4
    check_content(bm, tier, cache)


def test_a_full_host_tier_drops_its_least_recently_used_block():
    bm, tier, cache = manager(num_blocks=4, host_slots=2)
    a = FakeRequest(range(1, 14))
    forward(bm, cache, a, tier)
    bm.release(a)
    b = FakeRequest(range(100, 113))
    forward(bm, cache, b, tier)  # a's 3 blocks evicted into 2 slots: the first one stored is dropped
    stats = tier.policy.stats
    assert stats["host_stores"] == 3 and stats["host_drops"] == 1 and len(tier.policy.entries) == 2
    # release() gives a table back last block first, so a's third block was evicted, stored and dropped first: the
    # tier keeps the prefix's start, which a hit needs (hits run from the first block)
    assert a.block_hashes[2] not in tier.policy.entries and a.block_hashes[0] in tier.policy.entries
    check_content(bm, tier, cache)
    bm.release(b)
    again = FakeRequest(range(1, 14))
    forward(bm, cache, again, tier)
    assert bm.stats["host_hits"] == 2 and tier.policy.stats["host_restores"] == 2
    check_content(bm, tier, cache)


def test_a_hash_collision_is_refused():
    """The tier trusts no hash alone: the same hash with other tokens, or after another block, is a miss."""
    tier = module("offload").HostKVTier(8)
    tier.store(0, 1234, (1, 2, 3, 4), None)
    assert tier.lookup(1234, (1, 2, 3, 4), None) is not None
    assert tier.lookup(1234, (1, 2, 3, 5), None) is None
    assert tier.lookup(1234, (1, 2, 3, 4), 99) is None
    tier.store(1, 1234, (9, 9, 9, 9), None)  # a colliding block takes the key; the tier still balances
    assert tier.lookup(1234, (1, 2, 3, 4), None) is None and tier.lookup(1234, (9, 9, 9, 9), None) is not None
    tier.check_balance()


# ---- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, expected", [
    (dict(kv_offloading_size=-1), "kv_offloading_size must be a size in GiB"),
    (dict(kv_offloading_size="4"), "kv_offloading_size must be a size in GiB"),
    (dict(kv_offloading_size=1e-9), "holds no block of the cache"),
    (dict(kv_offloading_size=1, enable_prefix_caching=False), "needs enable_prefix_caching=True"),
])
def test_bad_host_tier_options_are_value_errors(options, expected):
    with pytest.raises(ValueError, match=expected):
        load_engine(TIER).LLM("random:tiny-llama", device="cpu", max_kv_tokens=256, **options)


def test_a_tier_larger_than_the_hosts_available_memory_is_refused_before_the_model_loads(monkeypatch):
    """The tier allocates all of its size at start: a size above the host memory available now is a ValueError with
    both figures, before the model is found (an unknown model's name would be the error otherwise)."""
    offload = module("offload")
    assert offload.available_host_memory() > 0  # this machine says how much it can give
    monkeypatch.setattr(offload, "available_host_memory", lambda: 2 * 2**30)
    with pytest.raises(ValueError, match=r"kv_offloading_size=3 GiB is more than this host's available memory "
                                         r"\(2.0 GiB\)"):
        load_engine(TIER).LLM("no-such-model", device="cpu", kv_offloading_size=3)
    assert offload.check_kv_offloading_size(1.5) == 1.5


def test_the_crossover_file_is_what_its_script_prints():
    """The chapter's copy-or-compute figures (docs/data/raw/cpu_step32_crossover.txt) are what
    docs/data/crossover_step32.py computes from the models' shapes, as it stands (no timing: it is exact)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "docs/data/crossover_step32.py"], cwd=root, capture_output=True, text=True,
                         check=True).stdout
    assert out == (root / "docs" / "data" / "raw" / "cpu_step32_crossover.txt").read_text()
    assert "qwen3-8b link 64 GB/s mfu 0.5" in out and "the tier wins from position 0" in out


# ---- on the GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@cuda
def test_gpu_chats_with_the_host_tier_follow_the_engine_without_it():
    """On CUDA the copies run on a side stream ordered before the forward that reads them: the chats' answers with
    the tier (pinned host memory, CUDA graphs, async scheduling) follow those without it up to bf16 near-ties, and
    blocks came back from host memory."""
    options = dict(device="cuda", dtype="bfloat16", max_kv_tokens=256, max_num_seqs=4, gpu_memory_utilization=0.3)
    ref = chat(load_engine(TIER).LLM("random:tiny-qwen3", **options))
    llm = load_engine(TIER).LLM("random:tiny-qwen3", kv_offloading_size=0.001, **options)
    out = chat(llm, check=lambda e: e.block_manager.check_balance())
    assert llm.stats["host_restores"] > 0 and llm.runner.host_store.data.is_pinned()
    for turn, (a_turn, b_turn) in enumerate(zip(out, ref)):
        for i, (a, b) in enumerate(zip(a_turn, b_turn)):
            compare_completions(a, b, BF16_LOGPROB_MAX_ATOL, exact=False, label=f"turn {turn} conversation {i}")
