"""Each lesson of Parts 2-3 happens on the real model (smollm2-135m), is counted, and changes no output.

Every test below runs a step with options under which its lesson really happens (a seat limit that
makes requests join mid-batch, a token budget that chunks prompts, a KV budget that preempts, arrivals
that hit the prefix cache), asserts the counter that shows it happened, and compares the outputs with
the previous step's on the same requests. Each runs where the lesson is introduced and in the newest
step (the tiny-model tests of test_part2.py / test_part3.py cover every step in between), so the suite
grows by a constant per new step.
"""
import functools

import pytest

from shared import SamplingParams
from helpers import STEP_LOGPROB_ATOL_FP32, compare_completions, load_engine
from registry import REAL, has, lesson_and_newest, previous

pytestmark = pytest.mark.slow  # real-model runs: in `make test`, not in `make test-fast`

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "List three uses of a paperclip."]
MAX_TOKENS = [8, 24, 4, 16]  # unequal lengths: requests finish at different iterations


def params():
    return [SamplingParams(temperature=0, max_tokens=n, logprobs=5, ignore_eos=True) for n in MAX_TOKENS]


@functools.lru_cache(maxsize=None)
def default_outputs(step: str, system_prompt: str | None = None):
    """A step's outputs on the lesson workload with default options (its own fresh engine)."""
    llm = load_engine(step).LLM(REAL, device="cpu", dtype="float32")
    return [o.outputs[0] for o in llm.chat(conversations(system_prompt), params())]


def conversations(system_prompt: str | None = None):
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [system + [{"role": "user", "content": q}] for q in QUESTIONS]


def assert_same_as_previous(step, outputs, system_prompt=None):
    expected = default_outputs(previous(step), system_prompt)
    assert len(outputs) == len(expected)
    for i, (a, b) in enumerate(zip(outputs, expected)):
        compare_completions(a, b, STEP_LOGPROB_ATOL_FP32, exact=True, label=f"{step} vs {previous(step)} request {i}")


def run_stepwise(llm, prompts, sps):
    """Queue every prompt, then call step() until all finish, recording who runs at each iteration."""
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, sps)]
    done, running_sets = {}, []
    while llm.has_unfinished_requests():
        assert len(running_sets) < 10_000, "the engine does not finish"
        outs = llm.step()
        running_sets.append({r.request_id for r in llm.scheduler.running} | {o.request_id for o in outs})
        done.update({o.request_id: o for o in outs})
    missing = [i for i in ids if i not in done]
    assert not missing, f"requests {missing} never finished"
    return [done[i].outputs[0] for i in ids], running_sets


@pytest.mark.parametrize("step", lesson_and_newest("scheduler"))
def test_continuous_batching_joins_mid_batch(step):
    llm = load_engine(step).LLM(REAL, device="cpu", max_num_seqs=2)
    prompts = [llm.tokenizer.apply_chat_template(c) for c in conversations()]
    outputs, running_sets = run_stepwise(llm, prompts, params())
    assert max(len(s) for s in running_sets) == 2, "never more than max_num_seqs at once, and the limit is used"
    # A join mid-batch: an iteration whose running set holds a request from before and one that was not there.
    joins = sum(bool(before & after) and bool(after - before) for before, after in zip(running_sets, running_sets[1:]))
    assert joins >= 2, f"requests joined a running batch {joins} times"
    assert_same_as_previous(step, outputs)


@pytest.mark.parametrize("step", lesson_and_newest("chunked_prefill"))
def test_chunked_prefill_chunks_the_real_prompts(step):
    budget = 8
    llm = load_engine(step).LLM(REAL, device="cpu", max_num_batched_tokens=budget)
    outs = [o.outputs[0] for o in llm.chat(conversations(), params())]
    prompt_lens = [len(llm.tokenizer.apply_chat_template(c)) for c in conversations()]
    assert min(prompt_lens) > budget
    assert llm.stats["prefill_chunks"] >= sum(-(-n // budget) for n in prompt_lens), llm.stats
    assert_same_as_previous(step, outs)


@pytest.mark.parametrize("step", lesson_and_newest("preemption"))
def test_preemption_happens_on_the_real_model(step):
    llm = load_engine(step).LLM(REAL, device="cpu", max_kv_tokens=96, **({"block_size": 16} if has(step, "paged_kv") else {}))
    outs = [o.outputs[0] for o in llm.chat(conversations(), params())]
    assert llm.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert_same_as_previous(step, outs)
    assert not llm.scheduler.running and not llm.scheduler.waiting


@pytest.mark.parametrize("step", lesson_and_newest("paged_kv"))
def test_paged_pool_returns_every_block(step):
    llm = load_engine(step).LLM(REAL, device="cpu", max_kv_tokens=96, block_size=16)
    outs = [o.outputs[0] for o in llm.chat(conversations(), params())]
    assert llm.scheduler.num_preemptions > 0, "6 blocks for 4 requests of ~60 tokens: they cannot all fit"
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a block leaked"
    assert_same_as_previous(step, outs)


SYSTEM_PROMPT = ("You are the assistant of a small public library. It opens at nine and closes at six, except on "
                 "Sundays. Members borrow up to five books for three weeks. Answer briefly and politely.")


@pytest.mark.parametrize("step", lesson_and_newest("prefix_cache"))
def test_prefix_cache_hits_on_the_real_model(step):
    llm = load_engine(step).LLM(REAL, device="cpu", block_size=16)
    convs = conversations(SYSTEM_PROMPT)
    first = llm.chat(convs[:1], params()[:1])[0].outputs[0]  # computes the shared system prompt once
    bm = llm.block_manager
    assert bm.stats["hits"] == 0
    rest = [o.outputs[0] for o in llm.chat(convs[1:], params()[1:])]
    system_len = len(llm.tokenizer.apply_chat_template(convs[0][:1]))
    assert bm.stats["hits"] >= 3 * (system_len // 16), f"each later request hits the system prompt's blocks: {bm.stats}"
    assert bm.stats["tokens_saved"] >= 3 * 16 * (system_len // 16)
    assert_same_as_previous(step, [first] + rest, SYSTEM_PROMPT)
