"""Part 2 (steps 04-07): batching, scheduling, chunking and preemption never change what a request gets."""
import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import cached_llm
from shared import SamplingParams
from helpers import STEP_LOGPROB_ATOL_FP32, compare_completions, load_engine, scheduled_work
from registry import TINY, has, having, introducing, last_before

# Part 2's properties must hold in every later step too.
PART2 = having("batch")
SCHEDULED = having("scheduler")  # the steps with a scheduler (add_request / step)
CHUNKED = having("chunked_prefill")
PREEMPTING = having("preemption")  # a KV budget
REFERENCE = last_before("batch")  # each request alone, through the last step without batching (step03)

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(49152) for _ in range(n)] for n in (3, 17, 5, 40, 9, 28, 1, 12)]
MAX_TOKENS = [6, 24, 1, 12, 18, 3, 9, 15]


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)


_REFERENCES: dict = {}


def reference(params):
    """Each request alone through the last step before batching (no batching at all). Computed once per test
    process for each list of parameters (keyed by their repr, which names every field): the tests only read it."""
    key = tuple(repr(sp) for sp in params)
    if key not in _REFERENCES:
        llm = cached_llm(REFERENCE, TINY)
        _REFERENCES[key] = tuple(llm.generate([p], sp)[0].outputs[0] for p, sp in zip(PROMPTS, params))
    return list(_REFERENCES[key])


def assert_same(outputs, expected, label):
    assert len(outputs) == len(expected)
    for i, (a, b) in enumerate(zip(outputs, expected)):
        compare_completions(a, b, STEP_LOGPROB_ATOL_FP32, exact=True, label=f"{label} request {i}")


@pytest.mark.parametrize("step", PART2)
def test_each_request_equals_its_single_request_output(step):
    params = [greedy(n) for n in MAX_TOKENS]
    outs = cached_llm(step, TINY).generate(PROMPTS, params)
    assert_same([o.outputs[0] for o in outs], reference(params), step)


@pytest.mark.parametrize("step", PART2)
def test_mixed_sampling_params_in_one_batch(step):
    params = [greedy(n) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=100 + i, max_tokens=n, logprobs=5, ignore_eos=True)
              for i, n in enumerate(MAX_TOKENS)]
    outs = cached_llm(step, TINY).generate(PROMPTS, params)
    assert_same([o.outputs[0] for o in outs], reference(params), step)


def test_static_batching_counts_its_wasted_slots():
    llm = load_engine(introducing("batch")).LLM(TINY, device="cpu")
    llm.generate([[1, 2, 3], list(range(10, 20))], [greedy(2), greedy(5)])
    # prefill: 2 rows x 10 columns, 7 of them padding; then 4 decode forwards of 2 rows, of which the
    # first request (finished after 2 tokens) wastes the last 3.
    assert llm.stats == {"slots": 28, "padding": 7, "finished": 3}


def drive(llm, order, gaps):
    """Add requests in `order`, with gaps[i] step() calls before the i-th arrival; run to the end."""
    params = [greedy(n) for n in MAX_TOKENS]
    ids, done, iterations = {}, {}, 0
    for index, gap in zip(order, gaps):
        for _ in range(gap):
            done.update({o.request_id: o for o in llm.step()})  # an idle step() returns []
        ids[index] = llm.add_request(PROMPTS[index], params[index])
    while llm.has_unfinished_requests():
        iterations += 1
        assert iterations < 10_000, "the engine does not finish"
        done.update({o.request_id: o for o in llm.step()})
    lost = sorted(set(ids.values()) - set(done))
    assert not lost, f"requests {lost} never came out of step()"
    return [done[ids[i]].outputs[0] for i in range(len(PROMPTS))], params


def watch_limits(llm) -> dict:
    """Wrap the scheduler so that every step checks the limits: never more than max_num_seqs running, never
    more than max_num_batched_tokens scheduled. Returns the largest values seen."""
    scheduler, schedule = llm.scheduler, llm.scheduler.schedule
    seen = {"running": 0, "tokens": 0}

    def checked_schedule():
        result = schedule()
        running = len(scheduler.running)
        assert running <= scheduler.max_num_seqs, f"{running} running > max_num_seqs={scheduler.max_num_seqs}"
        seen["running"] = max(seen["running"], running)
        if hasattr(scheduler, "max_num_batched_tokens"):
            tokens = sum(n for _, n in scheduled_work(result))
            assert tokens <= scheduler.max_num_batched_tokens, (
                f"{tokens} tokens scheduled > max_num_batched_tokens={scheduler.max_num_batched_tokens}")
            seen["tokens"] = max(seen["tokens"], tokens)
        return result

    scheduler.schedule = checked_schedule
    return seen


@functools.lru_cache(maxsize=None)
def private_engine(step):
    """An engine of this test's own: the limits it changes never leak into another test."""
    return load_engine(step).LLM(TINY, device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("step", SCHEDULED)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_arrivals_and_limits(step, data):
    llm = private_engine(step)
    order = data.draw(st.permutations(range(len(PROMPTS))))
    gaps = data.draw(st.lists(st.integers(0, 3), min_size=len(PROMPTS), max_size=len(PROMPTS)))
    scheduler = llm.scheduler
    scheduler.max_num_seqs = data.draw(st.integers(1, 5))
    if step in CHUNKED:
        scheduler.max_num_batched_tokens = data.draw(st.sampled_from([1, 7, 64, 4096]))
    if step in PREEMPTING:  # memory pressure: a KV budget from "the largest request alone" (64 tokens) up
        kv_tokens = data.draw(st.sampled_from([64, 100, 4096]))
        if hasattr(llm, "block_manager"):  # a block manager over the first blocks of the same pool
            bm = llm.block_manager
            llm.block_manager = scheduler.block_manager = type(bm)(kv_tokens // bm.block_size, bm.block_size)
            if hasattr(bm, "on_release"):  # step18 on: a release frees the request's block-table row, as wired
                llm.block_manager.on_release = bm.on_release  # by the engine
        else:
            scheduler.max_kv_tokens = kv_tokens
    watch_limits(llm)
    try:
        outputs, params = drive(llm, order, gaps)
    finally:
        del scheduler.schedule  # back to the class's method
    assert_same(outputs, reference(params), step)
    if hasattr(llm, "block_manager"):
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "a block leaked"


@pytest.mark.parametrize("step", CHUNKED)
@pytest.mark.parametrize("budget", [1, 7, 64, 10_000])
def test_chunked_prefill_any_budget(step, budget):
    llm = load_engine(step).LLM(TINY, device="cpu", max_num_seqs=4, max_num_batched_tokens=budget)
    params = [greedy(n) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    assert_same([o.outputs[0] for o in outs], reference(params), f"{step} budget {budget}")
    longer = sum(len(p) > budget for p in PROMPTS)  # prompts that cannot be prefilled in one chunk
    assert llm.stats["prefill_chunks"] >= sum(len(p) > 1 for p in PROMPTS) + longer


@pytest.mark.parametrize("step", having("preemption", "kv_budget_in_tokens"))
def test_preemption_happens_and_changes_nothing(step):
    llm = load_engine(step).LLM(TINY, device="cpu", max_num_seqs=8, max_kv_tokens=80)
    params = [greedy(n) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    assert llm.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert_same([o.outputs[0] for o in outs], reference(params), step)
    assert llm.scheduler.reserved_tokens == 0 and not llm.scheduler.running and not llm.scheduler.waiting


@pytest.mark.parametrize("step", having("preemption", "kv_budget_in_tokens"))
def test_a_request_that_can_never_fit_is_refused(step):
    llm = load_engine(step).LLM(TINY, device="cpu", max_kv_tokens=50)
    with pytest.raises(ValueError, match=r"prompt \(40 tokens\) \+ max_tokens \(20\) = 60 exceeds max_kv_tokens \(50\)"):
        llm.generate([[1] * 40], SamplingParams(temperature=0, max_tokens=20))
    with pytest.raises(ValueError, match="max_kv_tokens"):
        llm.add_request([1] * 40, SamplingParams(temperature=0, max_tokens=20))
    assert not llm.has_unfinished_requests()  # nothing half-queued
    out = llm.generate([[1] * 40], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))  # exactly fits
    assert len(out[0].outputs[0].token_ids) == 10


@pytest.mark.parametrize("step", SCHEDULED)
def test_bad_options(step):
    LLM = load_engine(step).LLM
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1, got 0"):
        LLM(TINY, device="cpu", max_num_seqs=0)
    if step in CHUNKED:
        with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1, got 0"):
            LLM(TINY, device="cpu", max_num_batched_tokens=0)
    if has(step, "preemption"):
        with pytest.raises(ValueError, match=r"max_kv_tokens must be (None or )?an integer >= 1, got -5"):
            LLM(TINY, device="cpu", max_kv_tokens=-5)
