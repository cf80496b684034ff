"""step25: overlap scheduling. With async_scheduling=True a step launches step N + 1 before it reads step N's tokens.

On the CPU (one stream: the order, without overlap), on both model families:
- outputs == step24's, token for token, and == step25's own sync mode: greedy and seeded sampling, logprobs, a stop
  string across two tokens, max_tokens 1 and 2, ignore_eos, a stop at the first token (a stop token id and EOS);
- on the real model, step01's golden greedy answers (two end with the model's own EOS);
- the token computed for a request after its end is thrown away: counted in stats["discarded_tokens"] (one per
  request that ran on after its last token), never emitted;
- a 96-token pool that preempts requests whose newest token is still a placeholder, and an abort between two steps;
- a launch or a read that fails leaves no step in flight and puts the requests of the two steps it touched back, each
  to run alone until it gets a token (step23's rule for a step of several that fails): they end as the sync engine's;
- no block leaked, nothing left in flight once the engine is drained; AsyncLLM streams through it unchanged;
- two tensor-parallel ranks (gloo) with async scheduling: the worker fills its placeholders' inputs from rank 0's
  tokens;
- async_scheduling of the wrong type is a ValueError.
On the GPU (`gpu`): the same equality with CUDA graphs at 1, 7, 64 and 256 seats, and the overlap itself: step
N + 1's launch begins while step N's results are not reached on the device yet (an event query, an ordering).
"""
import asyncio
import functools

import pytest
import torch

from helpers import (BF16_LOGPROB_MAX_ATOL, STEP_LOGPROB_ATOL_FP32, compare_completions, load_engine, read_golden,
                     step_module)
from core_faults import STEP_FAILURE_SEED, inject_step_faults
from registry import EQUIV_MAX_TOKENS, REAL, TINY, TINY_QWEN3, having, introducing, previous
from shared import SamplingParams

OVERLAP = introducing("overlap_scheduling")
BEFORE = previous(OVERLAP)
MODELS = [TINY, TINY_QWEN3]
OPTIONS = dict(device="cpu", dtype="float32", max_kv_tokens=4096, max_num_seqs=8)
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    ", "Once upon a time", "1, 2, 3, 4,", "Hello",
           "The capital of France is", "Write a haiku about the sea.", "a b c"]


@functools.lru_cache(maxsize=2)
def engines(model: str) -> dict:
    """step24, step25 sync and step25 async on one model: built once per test process."""
    return {"before": load_engine(BEFORE).LLM(model, **OPTIONS),
            "sync": load_engine(OVERLAP).LLM(model, async_scheduling=False, **OPTIONS),
            "async": load_engine(OVERLAP).LLM(model, async_scheduling=True, **OPTIONS)}


def drain(llm) -> list:
    """Step until nothing waits, runs or is in flight. -> the outputs of those steps."""
    outs = []
    while llm.has_unfinished_requests():
        outs += llm.step()
    return outs


def assert_same(got, want, label: str) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = a.outputs[0], b.outputs[0]
        assert a.text == b.text, f"{label} {i}: text {a.text!r} vs {b.text!r}"
        assert a.stop_reason == b.stop_reason, f"{label} {i}"
        if a.logprobs is None:
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, f"{label} {i}"
        else:
            compare_completions(a, b, STEP_LOGPROB_ATOL_FP32, exact=True, label=f"{label} {i}")
            assert [set(r) for r in a.logprobs] == [set(r) for r in b.logprobs], f"{label} {i}: top sets differ"


def cases(llm) -> list[SamplingParams]:
    """One request per prompt, each with its own way to end. The stop string and the stop token come from the
    greedy answers of the engine before (the tiny random models never reach EOS by themselves)."""
    greedy = llm["before"].generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ids = greedy[0].outputs[0].token_ids
    tok = llm["before"].tokenizer
    # a stop string made of the last character of token k's text and the first of token k + 1's: it spans two
    texts = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    k = next(k for k in range(3, len(ids)) if texts[k] and texts[k + 1].startswith(texts[k])
             and len(texts[k + 1]) > len(texts[k]))
    stop = texts[k][-1] + texts[k + 1][len(texts[k])]
    first = greedy[1].outputs[0].token_ids[0]
    return [SamplingParams(temperature=0, max_tokens=12, stop=[stop], logprobs=2),
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first]),  # ends at its first token
            SamplingParams(temperature=0, max_tokens=1),
            SamplingParams(temperature=0, max_tokens=2, logprobs=0),
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=9),
            SamplingParams(temperature=0.7, seed=3, max_tokens=14, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]


@pytest.mark.parametrize("model", MODELS)
def test_async_outputs_equal_step24_and_sync(model):
    llm = engines(model)
    params = cases(llm)
    want = llm["before"].generate(PROMPTS, params)
    assert len(want[1].outputs[0].token_ids) == 1 and want[1].outputs[0].finish_reason == "stop"  # its first token
    assert want[0].outputs[0].stop_reason is not None, "the stop string should end request 0"
    engine = llm["async"]
    discarded = engine.stats["discarded_tokens"]
    got = engine.generate(PROMPTS, params)
    assert_same(got, want, f"{OVERLAP} async vs {BEFORE}")
    assert_same(llm["sync"].generate(PROMPTS, params), want, f"{OVERLAP} sync vs {BEFORE}")
    assert drain(engine) == []  # what is left in flight are tokens after the ends: read, thrown away
    # Each request ran one step past its end (all 8 seats, no preemption): one token each thrown away, none emitted.
    assert engine.stats["discarded_tokens"] - discarded == len(PROMPTS)
    assert llm["sync"].stats["discarded_tokens"] == 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine.in_flight is None
    assert all(seq.num_output_placeholders == 0 for seq in engine.scheduler.requests.values())


def test_async_matches_the_golden_file_on_the_real_model():
    """step01's greedy answers on the real model (tests/golden/step01.json), through async scheduling: two of them
    end with the model's own EOS, which the engine learns one step late."""
    prompts, golden = read_golden(REAL)
    llm = load_engine(OVERLAP).LLM(REAL, device="cpu", dtype="float32", async_scheduling=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=EQUIV_MAX_TOKENS, logprobs=5))
    for i, (a, b) in enumerate(zip(outs, golden, strict=True)):
        compare_completions(a.outputs[0], b, STEP_LOGPROB_ATOL_FP32, exact=True, label=f"async vs golden prompt {i}")
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 2
    drain(llm)
    assert llm.stats["discarded_tokens"] == len(prompts)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("model", MODELS)
def test_eos_at_the_first_token(model, monkeypatch):
    """EOS itself (not a stop token id): the tokenizer is told that the first greedy token is an EOS token."""
    llm = engines(model)
    first = llm["before"].generate(PROMPTS[4:5], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    params = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    outs = {}
    for name in ("before", "async"):
        monkeypatch.setattr(llm[name].tokenizer, "eos_token_ids", {first})
        outs[name] = llm[name].generate([PROMPTS[4]] * 2, params)
    assert len(outs["before"][0].outputs[0].token_ids) == 1 and outs["before"][0].outputs[0].finish_reason == "stop"
    assert_same(outs["async"], outs["before"], "EOS at the first token")
    drain(llm["async"])


def test_preemption_with_pending_tokens_in_a_96_token_pool():
    """6 blocks of 16 tokens for 5 requests: the scheduler preempts, and some request it preempts has a placeholder
    (a token launched, not read): it is read at the next step, and the request is recomputed from real ids."""
    options = dict(OPTIONS, max_kv_tokens=96, max_num_seqs=5)
    before = load_engine(BEFORE).LLM(TINY, **options)
    after = load_engine(OVERLAP).LLM(TINY, async_scheduling=True, **options)
    prompts = [f"Request {i}: count on from {i * 3}" for i in range(5)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=30 + 4 * i, ignore_eos=True)
              for i in range(5)]
    pending_at_preemption = []
    preempt = after.scheduler.preempt

    def watched(request):
        pending_at_preemption.append(request.num_output_placeholders)
        preempt(request)

    after.scheduler.preempt = watched
    want = before.generate(prompts, params)
    got = after.generate(prompts, params)
    assert_same(got, want, "96-token pool")
    assert before.scheduler.num_preemptions > 0 and after.scheduler.num_preemptions > 0
    assert any(pending_at_preemption), f"no request was preempted with a pending token: {pending_at_preemption}"
    drain(after)
    assert after.block_manager.num_free_blocks == after.block_manager.num_blocks
    assert after.runner.block_tables.row_of == {}


def test_abort_between_two_steps():
    """A request aborted while its token is in flight: its blocks are free at once, the token is thrown away, the
    other requests go on as if it had never run."""
    llm = engines(TINY)
    engine, params = llm["async"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm["before"].generate(PROMPTS[:2], params)
    discarded = engine.stats["discarded_tokens"]
    kept = engine.add_request(PROMPTS[0], params)
    dropped = engine.add_request(PROMPTS[2], params)
    outs = engine.step(partial=True) + engine.step(partial=True)
    assert dropped in {s.request_id for s in engine.in_flight.seqs}, "the request should have a step in flight"
    seq = engine.abort_request(dropped)
    assert seq is not None and not seq.block_table
    later = engine.add_request(PROMPTS[1], params)  # joins after the abort
    while engine.has_unfinished_requests():
        outs += engine.step(partial=True)
    finished = {o.request_id: o for o in outs if o.finished}
    assert set(finished) == {kept, later}
    assert_same([finished[kept], finished[later]], want, "abort between two steps")
    assert engine.stats["discarded_tokens"] - discarded == 3  # the aborted one's, and one past each end
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("where", ["launch", "read"])
def test_a_failed_launch_or_read_puts_its_requests_back_and_leaves_no_step_in_flight(where, monkeypatch):
    """The offline LLM, overlapped: a step whose launch (the runner's execute) or whose read (step N's sampled tokens)
    raises leaves no step in flight, whose results a later step would read. The requests of step N and step N + 1
    (half-updated: tokens counted that were never computed or read) fail as one step of two (LLM._fail_step): each is
    put back, preempted, its placeholders dropped, a suspect that runs alone (synchronously) until it gets a token.
    A request that was waiting is not touched; they, it and a new request get the tokens the sync engine gives."""
    llm = load_engine(OVERLAP).LLM(TINY, async_scheduling=True, **{**OPTIONS, "max_num_seqs": 2})
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    running = [llm.add_request(p, params) for p in PROMPTS[:2]]
    waiting = llm.add_request(PROMPTS[2], params)  # no seat for it while the two run
    for _ in range(3):
        assert llm.step() == []
    assert llm.in_flight is not None and {s.request_id for s in llm.in_flight.seqs} == set(running)
    assert [s.request_id for s in llm.scheduler.waiting] == [waiting]
    name = {"launch": "execute", "read": "read_sampled"}[where]
    works, calls = getattr(llm.runner, name), []

    def fails_once(*args, **kwargs):
        calls.append(name)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return works(*args, **kwargs)

    monkeypatch.setattr(llm.runner, name, fails_once)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.step()
    assert llm.in_flight is None, "a failed step left a step in flight"
    back = list(llm.scheduler.waiting)[:2]
    assert {s.request_id for s in back} == set(running) and llm.scheduler.waiting[2].request_id == waiting
    assert all(s.suspect and s.num_output_placeholders == 0 and not s.block_table for s in back), back
    assert llm.stats["requeued_after_failure"] == 2 and not llm.scheduler.running
    later = llm.add_request(PROMPTS[3], params)
    outs = {o.request_id: o for o in drain(llm)}
    assert set(outs) == {*running, waiting, later} and len(calls) > 1
    assert_same([outs[r] for r in (*running, waiting, later)], engines(TINY)["sync"].generate(PROMPTS[:4], params),
                "after a failure")
    assert llm.scheduler.num_suspects == 0 and llm.stats["requeued_after_failure"] == 2
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert llm.runner.block_tables.row_of == {}


def shows_only_read_tokens(out, final) -> bool:
    """A partial output holds the tokens read so far: the start of the request's final tokens, nothing in flight."""
    ids = out.outputs[0].token_ids
    return list(ids) == list(final.outputs[0].token_ids[:len(ids)])


def test_partial_outputs_never_show_a_pending_token():
    engine = engines(TINY)["async"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=["zz"])
    request_id = engine.add_request(PROMPTS[3], params)
    texts, ids = [], []
    while engine.has_unfinished_requests():
        for out in engine.step(partial=True):
            assert out.request_id == request_id
            texts.append(out.outputs[0].text)
            ids.append(list(out.outputs[0].token_ids))
    assert [len(i) for i in ids] == list(range(1, 7))  # one output per token, each one token longer
    assert all(ids[k] == ids[-1][:k + 1] for k in range(6))
    assert all(texts[-1].startswith(t) for t in texts)


def test_async_llm_streams_through_async_scheduling():
    async_llm = step_module(OVERLAP, "async_llm")
    engine = async_llm.AsyncLLM(TINY, async_scheduling=True, **OPTIONS)
    try:
        params = [SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True) for i in range(4)]
        want = engines(TINY)["before"].generate(PROMPTS[:4], params)

        async def main():
            async def one(i):
                return [out async for out in engine.generate(PROMPTS[i], params[i], f"r{i}")]
            return await asyncio.gather(*(one(i) for i in range(4)))

        streams = asyncio.run(main())
        assert_same([s[-1] for s in streams], want, "AsyncLLM, async scheduling")
        for stream in streams:
            assert all(shows_only_read_tokens(out, stream[-1]) for out in stream)
        assert engine.llm.block_manager.num_free_blocks == engine.llm.block_manager.num_blocks
    finally:
        engine.shutdown()


def test_tensor_parallel_ranks_read_the_pending_tokens_from_rank_0():
    """Two ranks on the CPU (gloo), async scheduling: the input ids of the worker's placeholders are filled from its
    copy of rank 0's last_token, broadcast after each step that samples. The outputs are step24's (one rank), token
    for token."""
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(3)]
    want = engines(TINY)["before"].generate(PROMPTS[:3], params)
    llm = load_engine(OVERLAP).LLM(TINY, async_scheduling=True, tensor_parallel_size=2, **OPTIONS)
    try:
        got = llm.generate(PROMPTS[:3], params)
        assert_same(got, want, "tensor parallel, async scheduling")
        assert llm.stats["discarded_tokens"] >= 1  # a request ran a step past its end: the one-step-late order ran
        assert llm.async_scheduling and llm.runner.share_tokens and "scheduling: async" in llm.backend
    finally:
        llm.shutdown()


@pytest.mark.parametrize("step", having("overlap_scheduling"))
def test_tensor_parallel_steps_in_sync_after_a_failed_step_keep_the_ranks_in_step(step):
    """Two ranks, async scheduling, and a step that fails beside another request: the request put back runs its next
    steps synchronously (a suspect), whose tokens are read on the host and never broadcast. The workers must not
    wait for a broadcast then (only a step that keeps its tokens on the device rings "step+tokens"), or the ranks'
    collectives part and a worker dies: the request put back finishes with all its tokens, the workers alive."""
    llm = load_engine(step).LLM(TINY, async_scheduling=True, tensor_parallel_size=2, **OPTIONS)
    try:
        inject_step_faults(llm)
        llm.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, seed=STEP_FAILURE_SEED))
        llm.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        done, failures = {}, 0
        for _ in range(60):
            try:
                done.update((out.request_id, out) for out in llm.step())
            except RuntimeError as e:
                assert "injected failure" in str(e), e  # a worker that died would raise a WorkerError here
                failures += 1
            if not llm.has_unfinished_requests():
                break
        assert failures >= 1 and llm.stats["requeued_after_failure"] >= 1
        assert [len(out.outputs[0].token_ids) for out in done.values()] == [8]
        assert all(p.is_alive() for p in llm.workers.processes)
    finally:
        llm.shutdown()


def test_the_option_and_the_header():
    engine = load_engine(OVERLAP)
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
            engine.LLM("no-such-model", device="cpu", async_scheduling=bad)
    choose = engine.choose_async_scheduling
    assert choose(None, torch.device("cuda")) is True and choose(None, torch.device("cpu")) is False
    assert choose(True, torch.device("cpu")) is True and choose(False, torch.device("cuda")) is False
    llm = engines(TINY)
    # the header says which order ran, and that order is the one that ran: the overlapped order computes a token
    # one step past a request's end (thrown away), the sync order never does
    params = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[])
    for name, header in (("async", "scheduling: async"), ("sync", "scheduling: sync")):
        before = llm[name].stats["discarded_tokens"]
        llm[name].generate(PROMPTS[:2], [params, SamplingParams(temperature=0, max_tokens=3)])
        assert header in llm[name].backend
        assert (llm[name].stats["discarded_tokens"] > before) == (name == "async"), (name, llm[name].stats)


# ---- on the GPU ----------------------------------------------------------------------------------------------------
def gpu_workload(n: int, seed: int = 5):
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 5000) for _ in range(rng.randrange(5, 200))] for _ in range(n)]
    params = [SamplingParams(temperature=0 if i % 3 else 0.6, seed=i, max_tokens=rng.randrange(3, 64),
                             ignore_eos=i % 2 == 0, logprobs=5) for i in range(n)]
    return prompts, params


SAMPLED_NEIGHBOURS = 64  # ids: how far rounding may move an inverse-CDF draw (a wrong key: anywhere in 151,936)


def compare_sampled(a, b, label: str) -> list:
    """A sampled request (temperature, no filter) of two engines whose steps batch the requests differently: step25
    keeps a finished request in one more step, so a later prompt joins a step later, and bf16's rounding of a row
    depends on the shapes it is computed in. The draw is inverse-CDF with the same u (the request's seed and
    position), so rounding moves it at most to a nearby id: the first divergence must be within SAMPLED_NEIGHBOURS
    ids, after equal tokens whose logprobs agree to bf16's tolerance. A draw with a wrong key or position lands
    anywhere in the vocabulary. -> [(label, position, distance)] for the divergence, if any."""
    ta, tb = list(a.token_ids), list(b.token_ids)
    first = next((i for i in range(min(len(ta), len(tb))) if ta[i] != tb[i]), None)
    n = len(ta) if first is None else first
    worst = max((abs(a.logprobs[i][ta[i]] - b.logprobs[i][tb[i]]) for i in range(n)), default=0.0)
    assert worst <= BF16_LOGPROB_MAX_ATOL, f"{label}: logprob differs by {worst:.2e} before any divergence"
    if first is None:
        assert len(ta) == len(tb) and a.finish_reason == b.finish_reason, f"{label}: {len(ta)} vs {len(tb)} tokens"
        return []
    distance = abs(ta[first] - tb[first])
    assert distance <= SAMPLED_NEIGHBOURS, f"{label}: first divergence at {first}: {ta[first]} vs {tb[first]}"
    return [(label, first, distance)]


@pytest.mark.gpu
@pytest.mark.parametrize("seats", [1, 7, 64, 256])
def test_gpu_async_equals_step24_with_graphs(seats):
    prompts, params = gpu_workload(max(seats, 8) + 4)
    outs, llms = {}, {}
    for name, step, options in (("before", BEFORE, {}), ("async", OVERLAP, {"async_scheduling": True})):
        llm = load_engine(step).LLM("random:qwen3-0.6b", device="cuda", dtype="bfloat16", max_num_seqs=seats,
                                    max_kv_tokens=60000, **options)
        outs[name], llms[name] = llm.generate(prompts, params), llm
    flips = []
    for i, (a, b, sp) in enumerate(zip(outs["async"], outs["before"], params)):
        if sp.temperature == 0:  # greedy: the vLLM rule (a first divergence only at a near-tie)
            compare_completions(a.outputs[0], b.outputs[0], BF16_LOGPROB_MAX_ATOL, exact=False, label=f"request {i}")
        else:
            flips += compare_sampled(a.outputs[0], b.outputs[0], f"request {i}")
    print(f"{seats} seats: sampled requests that moved to a neighbouring token: {flips}")
    assert llms["async"].stats["graph_replays"] > 0 and llms["async"].stats["discarded_tokens"] > 0
    drain(llms["async"])
    assert llms["async"].block_manager.num_free_blocks == llms["async"].block_manager.num_blocks
    for llm in llms.values():  # the pools and the graphs' memory go back now, for the tests after this one
        llm.shutdown()


@pytest.mark.gpu
def test_gpu_async_equals_step24_exactly_while_the_batches_match():
    """64 requests of 6 prompt tokens in 64 seats: they are prefilled in one step (384 tokens) and all end at one
    step, so step25 batches every step as step24 does (max_tokens is known: no step runs past the end), and every
    token, greedy or sampled, must be the same and every logprob bit for bit. (Where requests end at different
    steps, step25 keeps each one a step longer, the batches' shapes differ, and bf16 rounds differently: the test
    above.)"""
    prompts, params = gpu_workload(64)
    prompts = [[(13 * i + 7 * j) % 5000 + 1 for j in range(6)] for i in range(64)]
    params = [SamplingParams(temperature=sp.temperature, seed=sp.seed, max_tokens=40, ignore_eos=True, logprobs=5)
              for sp in params]
    outs = {}
    for name, step, options in (("before", BEFORE, {}), ("async", OVERLAP, {"async_scheduling": True})):
        llm = load_engine(step).LLM("random:qwen3-0.6b", device="cuda", dtype="bfloat16", max_num_seqs=64,
                                    max_kv_tokens=60000, **options)
        launches = []  # per launch, how many of its inputs were a token the host had not read yet

        def counted(work, *args, _execute=llm.runner.execute, **kwargs):
            launches.append(len(kwargs.get("placeholders", ())))
            return _execute(work, *args, **kwargs)
        llm.runner.execute = counted
        outs[name] = llm.generate(prompts, params)
        # the overlapped order ran: every decode launch took step N's tokens from the device, before the host read them
        # (an ordering, not a timing; whether a launch began before the step before it ended is the 256-seat test's)
        assert llm.stats["graph_replays"] > 0 and llm.stats.get("discarded_tokens", 0) == 0
        assert launches.count(64) == (len(launches) - 1 if name == "async" else 0), launches
        llm.shutdown()
    for i, (a, b) in enumerate(zip(outs["async"], outs["before"])):
        compare_completions(a.outputs[0], b.outputs[0], 0.0, exact=True, label=f"request {i}")


@pytest.mark.gpu
def test_gpu_step_n_plus_1_is_launched_before_step_n_ends():
    """The ordering, not a timing: at 256 seats, when the host begins launching step N + 1, the event behind step
    N's results has not been reached on the device (event.query() is False) in some step; with async_scheduling
    off it never is (the host has read step N before it schedules). Both orders are counted by the same code, where
    every launch begins (the model runner's execute), so the sync count is a measurement, not a path never taken."""
    counts = {}
    for mode in (True, False):
        llm = load_engine(OVERLAP).LLM("random:qwen3-0.6b", device="cuda", dtype="bfloat16", max_num_seqs=256,
                                       async_scheduling=mode)
        prompts = [[(7 * i + j) % 5000 + 1 for j in range(32)] for i in range(256)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        counts[mode] = llm.stats["overlapped_launches"]
        llm.shutdown()
    print(f"steps launched while the step before still ran: async {counts[True]}, sync {counts[False]}")
    assert counts[True] >= 1 and counts[False] == 0
