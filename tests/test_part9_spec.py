"""step27: exact speculative decoding with n-gram drafts.

On the CPU, the tiny random models of both families (in CI):
- greedy outputs equal step26's token for token at 1, 4 and 16 requests, with drafts accepted in the same run;
- the rejection rule keeps the target's distribution: verify() on made-up logits (chi-square over many seeds), and
  the engine's sampled outputs against step26's (chi-square), each failing with a rule that always accepts;
- a seed gives the same tokens alone and in a batch;
- stop strings and max_tokens that fall inside an accepted run cut exactly where a plain decode stops;
- the KV pool balances after every step of many rejections, and preemption and abort in the middle are safe;
- a bad speculative_config is a ValueError naming the field.
"""
import collections
import random

import pytest
import torch

from helpers import load_engine, step_module
from registry import REAL, TINY, introducing, previous

SPEC = introducing("speculative_decoding")
BEFORE = previous(SPEC)
QWEN = "random:tiny-qwen3"
OPTIONS = dict(device="cpu", dtype="float32", max_kv_tokens=4096, max_num_seqs=16)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
ALWAYS = {**NGRAM, "disable_by_batch_size": None}  # every step may draft, at any batch size
# prompts that repeat themselves (words, a list, a sentence, code), and two that do not
PROMPTS = ["the the the the the the",
           "- apples\n- pears\n- plums\n- apples\n- pears\n-",
           "The cat sat on the mat. The cat sat on the",
           "x = [0, 0, 0, 0, 0, 0, 0, 0",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
           "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3",
           "Hello", "The quick brown fox"]


def sampling(**kw):
    from shared import SamplingParams

    return SamplingParams(**kw)


def spec_llm(model=QWEN, config=None, **options):
    """step27 with every step drafting (disable_by_batch_size None, unless config says): the checks hold at any batch
    size, not only below the engine's own limit (tested on its own below)."""
    config = {**ALWAYS, **(config or {})}
    return load_engine(SPEC).LLM(model, speculative_config=config, **{**OPTIONS, **options})


def prompts_of(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(n)]


def chi_square_p(table: list[list[int]]) -> float:
    """A contingency table's chi-square test of independence -> its p-value (the regularised upper incomplete gamma,
    torch.special.gammaincc)."""
    rows, cols = [sum(r) for r in table], [sum(c) for c in zip(*table)]
    total = sum(rows)
    stat = sum((table[i][j] - rows[i] * cols[j] / total) ** 2 / (rows[i] * cols[j] / total)
               for i in range(len(rows)) for j in range(len(cols)) if cols[j])
    dof = (len(rows) - 1) * (sum(1 for c in cols if c) - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("model", [TINY, QWEN])
@pytest.mark.parametrize("num", [1, 4, 16])
def test_greedy_outputs_equal_step26_with_drafts_accepted(model, num):
    prompts = prompts_of(num)
    params = sampling(temperature=0, max_tokens=48, ignore_eos=True)
    before = load_engine(BEFORE).LLM(model, **OPTIONS).generate(prompts, params)
    llm = spec_llm(model)
    after = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    assert [o.outputs[0].text for o in after] == [o.outputs[0].text for o in before]
    s = llm.stats
    assert s["spec_accepted"] > 0 and s["spec_verified"] > 0, s  # drafts were checked, and some passed
    assert s["emitted_tokens"] == sum(len(o.outputs[0].token_ids) for o in after)
    if num == 1:  # one request: fewer forwards than tokens
        assert s["forwards"] < len(after[0].outputs[0].token_ids), s
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def returned_tokens(stats: dict, num_prompts: int) -> int:
    """The tokens a synchronous run returned, from its counters: each prompt's first token (its last prefill chunk's
    plain draw), one per plain decode row (every decode row that did not verify) and what the verifies emitted. (A
    prompt shorter than a block: no prefix-cache hit leaves its last chunk one token, counted as a decode row.)"""
    return num_prompts + stats["decode_rows"] - stats["spec_verified"] + stats["spec_emitted"]


def attach_eager_verify_graphs(llm, max_seqs: int):
    """The engine's verify-step static buffers, built but never captured (a CPU): every verify step goes through
    their fill (rows padded to k + 1 tokens, the batch to its bucket) and the padded forward, run eagerly."""
    graphs = step_module(SPEC, "cuda_graphs")
    runner, block_size = llm.runner, llm.block_manager.block_size
    runner.verify_graphs = graphs.VerifyGraphs(llm.model, llm.device, max_seqs, NGRAM["num_speculative_tokens"] + 1,
                                               block_size, runner.scratch_block, runner.max_table_blocks(block_size))
    return runner.verify_graphs


def test_verify_steps_in_static_buffers_equal_the_plain_verify_forward():
    """The fill-and-forward code a verify graph records, run eagerly in Triton's interpreter: 6 requests (batches
    6 .. 1 in buckets 8, 4, 2, 1), rows with k drafts, fewer, and none (a plain decode padded to k + 1 tokens). The
    tokens are step26's, drafts were accepted, and every verify step went through the static buffers."""
    prompts, params = PROMPTS[:6], sampling(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(OPTIONS, attention_backend="triton", max_num_seqs=8)
    want = load_engine(BEFORE).LLM(TINY, **options).generate(prompts, params)
    llm = spec_llm(TINY, **options)
    graphs = attach_eager_verify_graphs(llm, 8)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    s = llm.stats
    assert s["spec_accepted"] > 0 and s["spec_steps"] > 0, s
    assert graphs.eager_runs == s["spec_steps"]  # every verify step ran through the static buffers
    assert s["padded_rows"] > 0  # some verify batches were padded up to their bucket


def test_greedy_logprobs_equal_step26():
    params = sampling(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    before = load_engine(BEFORE).LLM(QWEN, **OPTIONS).generate(PROMPTS[:2], params)
    llm = spec_llm()
    after = llm.generate(PROMPTS[:2], params)
    assert llm.stats["spec_accepted"] > 0
    for a, b in zip(after, before):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for got, want in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t] - want[t]) < 1e-4 for t in got)
        assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 1e-3


def test_verify_keeps_the_target_distribution():
    """One place's target distribution p over 6 tokens and a fixed draft x, through the model runner's verify: over
    many seeds the emitted token follows p (x accepted with probability p(x), else a token drawn from p without x). A
    rule that always accepts emits x only."""
    runner = spec_llm(TINY).runner
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -30.0, -30.0]])  # two tokens of ~0 probability
    p = torch.softmax(logits[0], -1)
    draft = 1
    counts = collections.Counter()
    n = 4000
    # each request's (params, seed, output index of its draft), as the step's plan holds them
    requests = [(sampling(temperature=1.0), seed, 5) for seed in range(n)]
    rows = logits.repeat(2 * n, 1)  # each request: its draft's place, then the bonus place
    for verdict in runner.verify(rows, list(range(2 * n)), requests, [[draft]] * n):
        counts[verdict.tokens[0]] += 1
    observed = [counts[t] for t in range(6)]
    expected = [n * float(p[t]) for t in range(6)]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    p_value = float(torch.special.gammaincc(torch.tensor(2.5, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    assert p_value > 1e-3, (observed, expected)
    assert sum(counts.values()) == n and counts[6] == counts[7] == 0


def test_sampled_outputs_follow_step26s_distribution():
    """The engine, sampling (temperature 1, top-k 3, so each place has 3 tokens to choose from), a prompt whose
    n-grams its outputs meet again: the 6-token outputs of many seeds under step27 and under step26, in a
    chi-square test per pair of places. Drafts are proposed and accepted in the same run."""
    n, prompt = 600, "a b a b a b a b"
    params = [sampling(temperature=1.0, top_k=3, max_tokens=6, ignore_eos=True, seed=s) for s in range(n)]
    config = {"prompt_lookup_min": 1, "num_speculative_tokens": 3}
    options = dict(max_num_seqs=64)
    before = load_engine(BEFORE).LLM(QWEN, **{**OPTIONS, **options}).generate([prompt] * n, params)
    llm = spec_llm(config=config, **options)
    after = llm.generate([prompt] * n, params)
    assert llm.stats["spec_accepted"] > 50, llm.stats
    for places in (slice(1, 3), slice(4, 6)):  # the pair after the first token, and the last pair
        a = collections.Counter(tuple(o.outputs[0].token_ids[places]) for o in after)
        b = collections.Counter(tuple(o.outputs[0].token_ids[places]) for o in before)
        common = sorted(k for k in set(a) | set(b) if a[k] + b[k] >= 10)
        table = [[a[k] for k in common] + [n - sum(a[k] for k in common)],
                 [b[k] for k in common] + [n - sum(b[k] for k in common)]]
        assert len(common) >= 3, table
        assert chi_square_p(table) > 1e-3, (places, table)


def test_a_seed_gives_the_same_tokens_alone_and_in_a_batch():
    params = sampling(temperature=1.0, top_k=3, max_tokens=32, ignore_eos=True, seed=11)
    llm = spec_llm(config={"prompt_lookup_min": 1})
    alone = llm.generate(["a b a b a b"], params)[0].outputs[0].token_ids
    assert llm.stats["spec_accepted"] > 0
    others = sampling(temperature=0.7, max_tokens=32, ignore_eos=True)
    batch = llm.generate(PROMPTS[1:4] + ["a b a b a b"], [others] * 3 + [params])[-1].outputs[0].token_ids
    assert alone == batch


@pytest.mark.parametrize("max_tokens", [3, 7, 10])
def test_max_tokens_inside_a_run_cuts_where_a_decode_stops(max_tokens):
    """A step emits at most what max_tokens leaves: the drafts are fewer near the end, and the length is exact."""
    params = sampling(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    want = load_engine(BEFORE).LLM(QWEN, **OPTIONS).generate(PROMPTS[:3], params)
    llm = spec_llm()
    got = llm.generate(PROMPTS[:3], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in got)
    assert max_tokens == 3 or llm.stats["spec_accepted"] > 0


def test_a_stop_string_inside_an_accepted_run_cuts_where_a_decode_stops():
    """Find a step where one request got 2 tokens or more from one verify; the text up to the first of them (an
    accepted draft) is a stop string that appears first when that token does. Run again with it: both engines end
    there (the text cut before the stop string: empty), and the verify's run was cut short."""
    llm, params = spec_llm(TINY), sampling(temperature=0, max_tokens=48, ignore_eos=True)
    llm.add_request(PROMPTS[0], params, request_id="find")
    seen, stop = 0, None
    while llm.has_unfinished_requests() and stop is None:
        for out in llm.step(partial=True):
            ids = out.outputs[0].token_ids
            if len(ids) - seen >= 2:
                stop = llm.tokenizer.decode(ids[:seen + 1]) or None
            seen = len(ids)
    while llm.has_unfinished_requests():
        llm.step()
    assert stop is not None, "no verify emitted 2 tokens or more: the prompt no longer makes drafts"
    params = sampling(temperature=0, max_tokens=48, ignore_eos=True, stop=[stop])
    want = load_engine(BEFORE).LLM(TINY, **OPTIONS).generate([PROMPTS[0]], params)[0].outputs[0]
    before = dict(llm.stats)
    got = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (want.text, want.token_ids, "stop", stop) and got.text == ""
    delta = {k: v - before[k] for k, v in llm.stats.items() if isinstance(v, int)}
    assert delta["spec_cut"] == 1
    assert len(got.token_ids) == returned_tokens(delta, 1)  # spec_emitted counts no token past the stop


def check_pool(llm) -> None:
    """After a step: every running request holds exactly the blocks its tokens need (no block of a rejected draft
    is kept), its tokens all have KV but the newest, no draft is left in its tokens, and every block is either
    held or free."""
    bm, held = llm.block_manager, set()
    for seq in llm.scheduler.running:
        assert seq.token_ids == seq.prompt_ids + seq.output_ids, seq.request_id
        assert bm.blocks_for(seq.num_computed_tokens) <= len(seq.block_table) <= bm.blocks_for(seq.num_tokens), \
            (seq.request_id, seq.block_table)
        assert seq.num_computed_tokens <= seq.num_tokens - 1, seq.request_id  # no rejected draft counts
        held.update(seq.block_table)
    assert not held & set(bm.free_blocks)
    assert all(bm.blocks[b].ref_count > 0 for b in held)
    assert len(held) + bm.num_free_blocks <= bm.num_blocks
    assert sum(b.ref_count == 0 for b in bm.blocks) == bm.num_free_blocks


def test_kv_blocks_balance_after_every_step_of_rejections_preemption_and_abort():
    """A small pool (preemptions), sampling among 3 tokens per place (drafts proposed often, rejected often), the
    pool checked after every step; one request aborted in the middle. At the end every block is free again."""
    llm = spec_llm(config={"prompt_lookup_min": 1}, max_kv_tokens=256, block_size=4, max_num_seqs=8)
    for i, prompt in enumerate(prompts_of(10)):
        params = sampling(temperature=1.0, top_k=3, max_tokens=40, ignore_eos=True, seed=i)
        llm.add_request(prompt, params, request_id=f"r{i}")
    steps, aborted = 0, False
    while llm.has_unfinished_requests():
        llm.step()
        steps += 1
        if steps == 6 and not aborted:
            aborted = llm.abort_request("r3") is not None
        check_pool(llm)
    s = llm.stats
    assert s["spec_proposed"] > s["spec_accepted"] > 0, s  # rejections happened, and acceptances
    assert llm.scheduler.num_preemptions > 0 and aborted
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_disable_by_batch_size_turns_drafting_off_and_overlap_on(async_scheduling):
    """From disable_by_batch_size requests in the engine a step drafts nothing and runs as step26's (overlapped with
    async_scheduling); below it, drafting resumes (the step in flight is read first). The outputs stay step26's."""
    params = sampling(temperature=0, max_tokens=24, ignore_eos=True)
    want = load_engine(BEFORE).LLM(QWEN, **OPTIONS).generate(PROMPTS[:5], params)
    llm = spec_llm(config={"disable_by_batch_size": 3}, async_scheduling=async_scheduling)
    llm.add_request(PROMPTS[0], params, request_id="first")
    for _ in range(12):  # alone: it drafts once its tokens repeat
        llm.step()
        if llm.stats["spec_proposed"]:
            break
    drafted = llm.stats["spec_proposed"]
    assert drafted > 0
    outs = {o.request_id: o for o in llm.generate(PROMPTS[1:5], params)}  # five in the engine: no drafts
    while True:  # "first" ended inside generate(): step() hands it out
        outs.update((o.request_id, o) for o in llm.step())
        if not llm.has_unfinished_requests():
            break
    got = [outs["first"]] + [outs[str(i)] for i in range(4)]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.stats["spec_disabled_steps"] > 0
    # the overlapped order ran: a request that ended had a token computed one step past its end, thrown away
    assert (llm.stats["discarded_tokens"] > 0) == async_scheduling
    llm.generate(PROMPTS[:1], params)  # alone again: it drafts
    assert llm.stats["spec_proposed"] > drafted


@pytest.mark.parametrize("config, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ("ngram", "speculative_config"),
])
def test_a_bad_speculative_config_is_a_value_error_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        load_engine(SPEC).LLM(TINY, speculative_config=config, **OPTIONS)


def test_speculation_refuses_tensor_parallelism():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        load_engine(SPEC).LLM(TINY, speculative_config=NGRAM, tensor_parallel_size=2, **OPTIONS)


def test_the_engine_turns_drafting_off_by_itself_from_the_batch_size_it_states():
    """A config that names no disable_by_batch_size gets the engine's own (speculative.DISABLE_BY_BATCH_SIZE): the
    engine's line states it, async scheduling is allowed, and with that many requests in the engine no step
    drafts. The outputs stay step26's."""
    limit = step_module(SPEC, "speculative").DISABLE_BY_BATCH_SIZE
    llm = load_engine(SPEC).LLM(QWEN, speculative_config=NGRAM, **{**OPTIONS, "async_scheduling": True})
    assert llm.speculative.disable_by_batch_size == limit
    assert f"off from {limit} running requests" in llm.backend
    prompts = prompts_of(limit)
    params = sampling(temperature=0, max_tokens=6, ignore_eos=True)
    want = load_engine(BEFORE).LLM(QWEN, **OPTIONS).generate(prompts, params)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.stats["spec_disabled_steps"] > 0 and llm.stats["spec_proposed"] == 0, llm.stats
    llm.generate(PROMPTS[:1], sampling(temperature=0, max_tokens=24, ignore_eos=True))  # alone: it drafts
    assert llm.stats["spec_proposed"] > 0


def test_the_proposer_finds_the_longest_ngram_and_its_continuation():
    spec = step_module(SPEC, "speculative")
    proposer = spec.NgramProposer(spec.SpeculativeConfig.parse(NGRAM))
    assert proposer.propose([1, 2, 3, 4, 9, 9, 1, 2, 3]) == [4, 9, 9, 1]
    assert proposer.propose([1, 2, 3, 4, 9, 9, 1, 2, 3], k=2) == [4, 9]
    assert proposer.propose([5, 6, 7, 8]) == []  # no n-gram of 2..4 occurs before
    assert proposer.propose([7, 7, 7, 7, 7, 7]) == [7, 7]  # a loop: no match has 4 after it, the earliest
    assert proposer.propose([1, 2, 8, 1, 2, 9, 1, 2], k=1) == [9]  # the latest occurrence with k tokens after it


def lookup_by_hand(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The proposer's rule, written as plainly as it reads: the longest n first, every earlier window compared."""
    if k <= 0 or len(tokens) <= n_min:
        return []
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if starts:
            full = [s for s in starts if s + n + k <= len(tokens)]
            follow = (full[-1] if full else starts[0]) + n
            return tokens[follow:follow + k]
    return []


def test_the_proposer_equals_the_lookup_written_by_hand():
    """The proposer matches every n at once (one array narrowed per round); on 3,000 random token lists, small
    vocabularies (many matches, loops) and large, it proposes what the plain search does."""
    spec = step_module(SPEC, "speculative")
    rng = random.Random(27)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randint(0, 40))]
        n_min = rng.randint(1, 3)
        n_max, k = rng.randint(n_min, 5), rng.randint(0, 6)
        config = spec.SpeculativeConfig(num_speculative_tokens=max(k, 1), prompt_lookup_max=n_max,
                                        prompt_lookup_min=n_min)
        got = spec.NgramProposer(config).propose(tokens, k)
        assert got == lookup_by_hand(tokens, k, n_max, n_min), (tokens, k, n_max, n_min)


def test_the_engine_core_process_streams_what_step26_makes_with_drafts():
    """AsyncLLM with speculation in its core process: a verify step's several tokens cross as one delta, and the
    streamed outputs equal step26's offline ones."""
    import asyncio

    params = sampling(temperature=0, max_tokens=32, ignore_eos=True)
    want = load_engine(BEFORE).LLM(QWEN, **OPTIONS).generate(PROMPTS[:3], params)
    engine = step_module(SPEC, "async_llm").AsyncLLM(QWEN, speculative_config=NGRAM, **OPTIONS)

    async def one(prompt):
        outs = [out async for out in engine.generate(prompt, params)]
        return outs[-1].outputs[0].token_ids, max(len(b.outputs[0].token_ids) - len(a.outputs[0].token_ids)
                                                  for a, b in zip(outs, outs[1:]))

    async def run():
        return await asyncio.gather(*(one(p) for p in PROMPTS[:3]))

    try:
        got = asyncio.run(run())
    finally:
        engine.shutdown()
    assert [ids for ids, _ in got] == [o.outputs[0].token_ids for o in want]
    assert max(jump for _, jump in got) >= 2  # one output carried several tokens: only a verify emits them


@pytest.mark.gpu
def test_gpu_greedy_outputs_follow_step26_up_to_bf16_near_ties():
    """On the GPU in bf16, with CUDA graphs for the plain decodes: step27's greedy outputs equal step26's up to a first
    difference at a near-tie (each run's token among the other's 5 most likely: the rule of the other gpu tests),
    with drafts verified and accepted in the same run."""
    from shared.anatomy import TOP_K_NEAR_TIE, diverge_at_near_ties

    options = dict(device="cuda", max_kv_tokens=16384, max_num_seqs=16)
    params = sampling(temperature=0, max_tokens=64, ignore_eos=True, logprobs=TOP_K_NEAR_TIE)
    runs = []
    for step, extra in ((BEFORE, {}), (SPEC, {"speculative_config": ALWAYS})):  # 8 requests: a verify graph of 8
        llm = load_engine(step).LLM("random:qwen3-0.6b", **options, **extra)
        outs = llm.generate(PROMPTS, params)
        runs.append({"token_ids": [o.outputs[0].token_ids for o in outs],
                     "logprobs": [o.outputs[0].logprobs for o in outs], "stats": dict(llm.stats)})
        llm.shutdown()
    diverged, broken = diverge_at_near_ties(runs[0], runs[1])
    assert broken is None, broken
    assert runs[1]["stats"]["spec_accepted"] > 0 and runs[1]["stats"]["spec_verified"] > 0
    assert runs[1]["stats"]["verify_replays"] > 0  # verify steps replayed their graphs
    print(f"{diverged} of {len(PROMPTS)} requests parted from step26's at a near-tie")


# ---- a seeded request's tokens are step26's whatever decides the drafts ---------------------------------------------
def real_chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_the_sampled_shopping_list_runs_and_equals_step26():
    """Three sampled requests whose filtered distribution can put all its mass on a rejected draft (top-p 0.95):
    every token is a real one and each request's tokens are step26's, with drafts verified in the same run."""
    prompts = ["Shopping list: 1. apples 2. bread 3."] * 3
    params = [sampling(temperature=0.8, top_p=0.95, max_tokens=16, seed=seed) for seed in (8, 9, 10)]
    want = load_engine(BEFORE).LLM(REAL, **OPTIONS).generate(prompts, params)
    llm = load_engine(SPEC).LLM(REAL, speculative_config=NGRAM, **OPTIONS)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.stats["spec_verified"] > 0, llm.stats


def test_a_seeded_sampled_request_gets_step26s_tokens_alone_in_a_batch_and_under_budget_pressure():
    """The engine's own config (drafting off from DISABLE_BY_BATCH_SIZE requests): alone, the request drafts; in a
    batch of 6 no step drafts; with a token budget of 6 its drafts are cut to what the budget leaves. In every case
    its tokens are step26's: each is the draw a plain step makes at that place, with that place's key."""
    spec = step_module(SPEC, "speculative")
    prompt_text = "Repeat this list exactly, twice:\\n- apples\\n- pears\\n- plums\\n- cherries\\n- lemons"
    params = sampling(temperature=0.8, max_tokens=40, ignore_eos=True, seed=7)
    others = [sampling(temperature=0.8, max_tokens=40, ignore_eos=True, seed=s) for s in range(5)]
    step26 = load_engine(BEFORE).LLM(REAL, **OPTIONS)
    prompt = real_chat(step26, prompt_text)
    want = step26.generate([prompt], params)[0].outputs[0].token_ids
    fillers = [real_chat(step26, t) for t in ("Name a river.", "Count to ten.", "Say hi.", "Why is the sky blue?",
                                             "Name two colours.")]

    llm = load_engine(SPEC).LLM(REAL, speculative_config=NGRAM, **OPTIONS)
    assert llm.speculative.disable_by_batch_size == spec.DISABLE_BY_BATCH_SIZE < 6
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    s = dict(llm.stats)
    assert s["spec_accepted"] > 0 and s["spec_proposed"] > s["spec_accepted"], s  # accepted and rejected drafts
    assert alone == want

    batch = llm.generate(fillers + [prompt], others + [params])[-1].outputs[0].token_ids
    assert llm.stats["spec_disabled_steps"] > s["spec_disabled_steps"]
    assert batch == want

    pressed = load_engine(SPEC).LLM(REAL, speculative_config=NGRAM, **{**OPTIONS, "max_num_batched_tokens": 6})
    outs = pressed.generate(fillers[:2] + [prompt], others[:2] + [params])
    p = pressed.stats
    assert p["spec_accepted"] > 0 and p["spec_proposed"] < NGRAM["num_speculative_tokens"] * p["spec_verified"], p
    assert outs[-1].outputs[0].token_ids == want


# ---- the prefix cache under speculation ---------------------------------------------------------------------------
def prefix_hits_after(config, first: str, again: str, **options) -> tuple[int, dict]:
    """Run `first`, then `again` (tokens_saved counts from there): -> the tokens `again` found in the prefix cache."""
    extra = {"speculative_config": config} if config else {}
    llm = load_engine(SPEC if config else BEFORE).LLM(QWEN, **{**OPTIONS, **options}, **extra)
    greedy = sampling(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate([first], greedy)
    saved = llm.block_manager.stats["tokens_saved"]
    llm.generate([again], sampling(temperature=0, max_tokens=1))
    return llm.block_manager.stats["tokens_saved"] - saved, llm.stats


def test_a_request_that_finishes_inside_a_verify_step_registers_its_blocks():
    """A request whose last step is a verify (max_tokens reached inside an accepted run), then its prompt and output
    as a new prompt: it finds every full block of them in the prefix cache, as without speculation."""
    greedy = sampling(temperature=0, max_tokens=24, ignore_eos=True)
    out = load_engine(BEFORE).LLM(QWEN, **OPTIONS).generate([PROMPTS[0]], greedy)[0]
    again = out.prompt_token_ids + out.outputs[0].token_ids
    plain, _ = prefix_hits_after(None, PROMPTS[0], again, block_size=4)
    got, stats = prefix_hits_after(ALWAYS, PROMPTS[0], again, block_size=4)
    assert stats["spec_accepted"] > 0, stats
    assert plain == (len(again) - 1) // 4 * 4
    assert got == plain


def test_drafts_never_evict_a_cached_block():
    """A cached prompt's blocks wait, evictable, while a drafting request runs in the empty blocks left, as many as
    its tokens need. Its output repeats one token, then ends at a stop token, the first other one: its drafts (16
    of the repeated token) reach past its end. No draft takes a cached block (a rejected draft would hand it back
    empty): the cached prompt finds all its blocks again, as without speculation."""
    cached, size, one = PROMPTS[4] * 2, 4, sampling(temperature=0, max_tokens=1)
    greedy = dict(temperature=0, max_tokens=40, ignore_eos=True)
    plain_out = load_engine(BEFORE).LLM(QWEN, **OPTIONS).generate([PROMPTS[1]], sampling(**greedy))[0]
    ids = plain_out.outputs[0].token_ids
    stop_token = next(t for t in ids if t != ids[0])
    ends_at = ids.index(stop_token) + 1  # it ends at the first other token
    blocks = -(-(len(plain_out.prompt_token_ids) + ends_at) // size)
    hits = {}
    for name, config in (("plain", None), ("spec", {**ALWAYS, "num_speculative_tokens": 16, "prompt_lookup_min": 1})):
        extra = {"speculative_config": config} if config else {}
        pool = dict(OPTIONS, block_size=size, max_kv_tokens=size * (blocks + 12))  # 12 blocks: the cached prompt's
        llm = load_engine(SPEC if config else BEFORE).LLM(QWEN, **pool, **extra)
        llm.generate([cached], one)  # its blocks are cached, then evictable
        out = llm.generate([PROMPTS[1]], sampling(**greedy, stop_token_ids=[stop_token]))[0].outputs[0]
        assert len(out.token_ids) == ends_at < greedy["max_tokens"] - 16
        saved = llm.block_manager.stats["tokens_saved"]
        llm.generate([cached], one)
        hits[name] = (llm.block_manager.stats["tokens_saved"] - saved, dict(llm.stats))
    num_cached = len(load_engine(BEFORE).LLM(QWEN, **OPTIONS).tokenizer.encode(cached))
    assert hits["spec"][1]["spec_proposed"] > 0, hits["spec"][1]
    assert hits["plain"][0] == (num_cached - 1) // size * size, (num_cached, hits["plain"][0])
    assert hits["spec"][0] == hits["plain"][0], hits


def test_a_step_in_which_no_request_can_draft_runs_overlapped():
    """One request below the engine's disable_by_batch_size, async_scheduling on, a prompt of token ids that never
    repeat and near-uniform draws: no n-gram of its known tokens occurs before, so no step can draft, and the steps
    run in step26's overlapped order (a step returns with the next one launched and not read: llm.in_flight). The
    outputs are step26's; on a self-repeating prompt the same engine drafts."""
    params = sampling(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)  # near-uniform over 151,936 ids
    prompt = list(range(100, 140))  # 40 distinct ids
    want = load_engine(BEFORE).LLM(QWEN, **OPTIONS, async_scheduling=True).generate([prompt], params)
    llm = load_engine(SPEC).LLM(QWEN, speculative_config=NGRAM, **OPTIONS, async_scheduling=True)
    llm.add_request(prompt, params)
    got, steps_left_in_flight = None, 0
    while llm.has_unfinished_requests():
        got = llm.step() or got
        steps_left_in_flight += llm.in_flight is not None
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    s = llm.stats
    assert len(set(prompt + got[0].outputs[0].token_ids)) == len(prompt) + 12  # nothing repeats
    assert s["spec_proposed"] == 0 and s["spec_undraftable_steps"] > 0, s
    assert steps_left_in_flight >= 10  # every step but the last overlapped
    llm.generate(PROMPTS[:1], sampling(temperature=0, max_tokens=24, ignore_eos=True))
    assert llm.stats["spec_accepted"] > 0


# ---- stops, logprobs and preemption with drafts accepted -----------------------------------------------------------
def test_eos_and_a_stop_token_inside_an_accepted_run_end_the_request_there():
    """smollm2-135m copies a text it was given, without ignore_eos: the end of the user's turn in the prompt makes
    the drafts after the text <|im_end|> (EOS) and what follows it, so EOS is accepted inside a run and the run is cut
    there; a stop token inside the text cuts a run the same way. Both equal step26's: tokens, text, finish and stop
    reason."""
    step26 = load_engine(BEFORE).LLM(REAL, **OPTIONS)
    prompt = real_chat(step26, "Copy this text: one two three four five.")
    greedy = sampling(temperature=0, max_tokens=48)
    plain = step26.generate([prompt], greedy)[0].outputs[0]
    stop_token = plain.token_ids[len(plain.token_ids) // 2]
    cases = [greedy, sampling(temperature=0, max_tokens=48, stop_token_ids=[stop_token])]
    want = step26.generate([prompt] * 2, cases)
    assert want[0].outputs[0].finish_reason == "stop" and want[0].outputs[0].stop_reason is None  # EOS
    llm = load_engine(SPEC).LLM(REAL, speculative_config=ALWAYS, **OPTIONS)
    for params, w in zip(cases, want):
        cut = llm.stats["spec_cut"]
        got = llm.generate([prompt], params)[0].outputs[0]
        w = w.outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (w.token_ids, w.text, w.finish_reason, w.stop_reason)
        assert llm.stats["spec_cut"] == cut + 1, llm.stats  # the stop fell inside an accepted run


def test_sampled_logprobs_under_speculation_equal_step26s():
    """Seeded sampled requests with logprobs=3, drafts accepted: the same tokens as step26, and each token's top-3,
    its own logprob and the cumulative logprob within float32's rounding of a verify chunk against a decode."""
    params = [sampling(temperature=1.0, top_k=3, max_tokens=24, ignore_eos=True, seed=s, logprobs=3) for s in (1, 2)]
    prompts = ["a b a b a b a b", PROMPTS[1]]
    before = load_engine(BEFORE).LLM(QWEN, **OPTIONS).generate(prompts, params)
    llm = spec_llm(config={"prompt_lookup_min": 1})
    after = llm.generate(prompts, params)
    assert llm.stats["spec_accepted"] > 0, llm.stats
    for a, b in zip(after, before):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for token, got, want in zip(a.token_ids, a.logprobs, b.logprobs):
            assert got.keys() == want.keys() and token in got
            assert all(abs(got[t] - want[t]) < 1e-4 for t in got)
        assert abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-3
        assert abs(a.cumulative_logprob - sum(lp[t] for t, lp in zip(a.token_ids, a.logprobs))) < 1e-3


def test_a_request_preempted_right_after_it_drafted_resumes_with_step26s_tokens():
    """A pool small enough to preempt, every step drafting: some request is preempted in the step after one in
    which it verified drafts (its rolled-back blocks and its counted tokens are what a recompute starts from). The
    outputs equal step26's with the same pool."""
    prompts, params = prompts_of(8), sampling(temperature=0, max_tokens=40, ignore_eos=True)
    options = dict(max_kv_tokens=160, block_size=4, max_num_seqs=8)
    want = load_engine(BEFORE).LLM(QWEN, **{**OPTIONS, **options}).generate(prompts, params)
    llm = spec_llm(**options)
    # the scheduler's public calls: schedule() starts a step (and may preempt), postprocess_verified() ends a verify
    verified_now, verified_last_step, preempted_after_drafting = set(), set(), []
    sched = llm.scheduler
    schedule, postprocess_verified, preempt = sched.schedule, sched.postprocess_verified, sched.preempt

    def spy_schedule(*args, **kwargs):
        verified_last_step.clear()
        verified_last_step.update(verified_now)
        verified_now.clear()
        return schedule(*args, **kwargs)

    def spy_postprocess_verified(verified):
        verified_now.update(seq.request_id for seq, _ in verified)
        return postprocess_verified(verified)

    def spy_preempt(request):
        if request.request_id in verified_last_step:
            preempted_after_drafting.append(request.request_id)
        preempt(request)

    sched.schedule, sched.postprocess_verified, sched.preempt = spy_schedule, spy_postprocess_verified, spy_preempt
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert preempted_after_drafting, (llm.scheduler.num_preemptions, llm.stats)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
