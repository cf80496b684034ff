"""The engine keeps every request and survives bad input (steps with a scheduler: add_request / step).

An idle step() returns []; a request queued with add_request() is never lost, even when another caller's
generate() runs meanwhile; a request has a status; a failure in the middle of a step releases what the
failed requests held and leaves the engine ready for the next request (from step23 on a step of several requests
that fails fails none of them: they are computed again, each alone until it gets a token).
"""
import importlib
import pytest

from shared import SamplingParams
from helpers import load_engine, step_module
from registry import has, having
from test_part2 import MAX_TOKENS, PROMPTS, TINY, assert_same, greedy, reference

SCHEDULED = having("scheduler")


def engine(step, **options):
    return load_engine(step).LLM(TINY, device="cpu", **options)


def drain(llm) -> dict:
    outs = {}
    for _ in range(10_000):
        if not llm.has_unfinished_requests():
            return outs
        outs.update({o.request_id: o for o in llm.step()})
    raise AssertionError("the engine does not finish")


def assert_clean(llm, step):
    """Nothing queued, nothing running, no KV memory held."""
    assert not llm.has_unfinished_requests()
    assert not llm.scheduler.running and not llm.scheduler.waiting
    assert not llm.scheduler.requests, f"requests left in scheduler.requests: {list(llm.scheduler.requests)}"
    if has(step, "kv_budget_in_tokens"):
        assert llm.scheduler.reserved_tokens == 0
    if has(step, "paged_kv"):
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "blocks leaked"


class InjectedFailure(RuntimeError):
    pass


def fail_forward_at(llm, fail_at: int, monkeypatch):
    """Make the model's forward call number fail_at raise. -> (the real forward, {"n": calls so far})."""
    forward, calls = llm.model.forward, {"n": 0}

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise InjectedFailure(f"forward call {fail_at}")
        return forward(*args, **kwargs)

    monkeypatch.setattr(llm.model, "forward", failing_forward)
    return forward, calls


@pytest.mark.parametrize("step", SCHEDULED)
def test_idle_step_returns_nothing(step):
    llm = engine(step)
    assert llm.step() == []
    llm.generate([[1, 2, 3]], greedy(2))
    assert llm.step() == []


@pytest.mark.parametrize("step", SCHEDULED)
def test_add_request_is_never_lost_to_generate(step):
    llm = engine(step)
    queued = llm.add_request(PROMPTS[2], greedy(MAX_TOKENS[2]))  # 1 token: it finishes during generate() below
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [greedy(MAX_TOKENS[0]), greedy(MAX_TOKENS[1])])
    assert [o.request_id for o in outs] == [str(int(queued) + 1), str(int(queued) + 2)], "generate returns its own"
    assert not llm.has_unfinished_requests()
    handed_out = llm.step()  # the engine is idle, but it still holds the finished request for its caller
    assert [o.request_id for o in handed_out] == [queued], "a request queued with add_request() was lost"
    expected = reference([greedy(n) for n in MAX_TOKENS])
    assert_same([o.outputs[0] for o in outs + handed_out], expected[:3], step)
    assert llm.step() == [], "handed out once only"


@pytest.mark.parametrize("step", SCHEDULED)
@pytest.mark.parametrize("fail_at", [1, 2, 5])
def test_a_failed_step_drops_its_requests(step, fail_at, monkeypatch):
    """Driving step() directly: the requests of a step that fails (forward call `fail_at`; with three prompts
    to prefill, call 2 falls in the middle of a step from step06 on) free their memory, and leave the queues. From
    step23 on (LLM._fail_step) the three, which all ran in that step, wait instead to be computed again, each alone
    until it gets a token: this one-off failure does not come again, and they end as the reference."""
    llm = engine(step)
    forward, calls = fail_forward_at(llm, fail_at, monkeypatch)
    ids = [llm.add_request(p, greedy(n)) for p, n in zip(PROMPTS[:3], (12, 12, 12))]
    finished = []
    with pytest.raises(InjectedFailure):
        for _ in range(100):
            finished += llm.step()
    assert not finished
    if has(step, "async_engine"):  # put back, holding nothing, each a suspect
        assert not llm.scheduler.running and {r.request_id for r in llm.scheduler.waiting} == set(ids)
        assert all(r.suspect and not r.block_table for r in llm.scheduler.waiting)
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "blocks leaked"
        outs = drain(llm)
        assert_same([outs[i].outputs[0] for i in ids], reference([greedy(12)] * 8)[:3], step)
        assert llm.stats["requeued_after_failure"] == 3 and llm.scheduler.num_suspects == 0
    assert_clean(llm, step)  # all three ran in the step that failed: dropped (or served since), nothing is held
    monkeypatch.setattr(llm.model, "forward", forward)
    again = llm.generate(PROMPTS[:3], [greedy(n) for n in (12, 12, 12)])
    assert [o.request_id for o in again] == [str(int(ids[-1]) + i) for i in (1, 2, 3)]
    assert_same([o.outputs[0] for o in again], reference([greedy(12)] * 8)[:3], step)


def status_enum(step):
    """The step's request states: sequence.py's SequenceStatus where the step has sequence.py, else RequestStatus,
    which the engine exports (the scheduler's)."""
    try:
        return step_module(step, "sequence").SequenceStatus
    except ModuleNotFoundError:
        return load_engine(step).RequestStatus


@pytest.mark.parametrize("step", SCHEDULED)
def test_request_status_follows_its_life(step):
    status = status_enum(step)
    llm = engine(step)
    rid = llm.add_request(PROMPTS[3], greedy(3))
    request = llm.scheduler.waiting[0]
    assert request.request_id == rid and request.status is status.WAITING
    assert llm.step() == []  # a 40-token prompt's first step: it runs, nothing finishes
    assert request.status is status.RUNNING
    outs = drain(llm)
    assert request.status is status.FINISHED
    completion = outs[rid].outputs[0]
    assert len(completion.token_ids) == 3 and completion.text == llm.tokenizer.decode(completion.token_ids)
    assert tuple(request.finish) == ("length", None, completion.text)  # why and where it ended: what the caller got


@pytest.mark.parametrize("step", having("preemption"))
def test_preempted_status(step):
    status = status_enum(step)
    options = {"block_size": 16} if has(step, "paged_kv") else {}
    llm = engine(step, max_num_seqs=8, max_kv_tokens=80, **options)
    seen = set()
    for p, n in zip(PROMPTS, MAX_TOKENS):
        llm.add_request(p, greedy(n))
    while llm.has_unfinished_requests():
        llm.step()
        seen |= {r.status for r in llm.scheduler.waiting}
    assert status.PREEMPTED in seen and llm.scheduler.num_preemptions > 0


@pytest.mark.parametrize("step", SCHEDULED)
def test_requests_by_id_are_the_queued_and_running_ones(step):
    """scheduler.requests (what abort_request looks up by id) holds exactly the waiting and running requests after
    every add, step and abort: a preempted request stays, a finished or aborted one leaves (no stale entry)."""
    options = {"max_kv_tokens": 80} if has(step, "preemption") else {}
    if has(step, "paged_kv"):
        options["block_size"] = 16
    llm = engine(step, max_num_seqs=4, **options)

    def check():
        queued = [*llm.scheduler.waiting, *llm.scheduler.running]
        assert len(llm.scheduler.requests) == len(queued)
        assert all(llm.scheduler.requests.get(r.request_id) is r for r in queued)

    ids = [llm.add_request(p, greedy(n)) for p, n in zip(PROMPTS, MAX_TOKENS)]
    check()
    llm.abort_request(ids[-1])  # still waiting
    check()
    aborted_running = None
    while llm.has_unfinished_requests():
        llm.step()
        if aborted_running is None and llm.scheduler.running:
            aborted_running = llm.scheduler.running[-1].request_id
            llm.abort_request(aborted_running)
        check()
    assert aborted_running is not None
    if has(step, "preemption"):
        assert llm.scheduler.num_preemptions > 0  # the preempted requests were checked while they waited again
    llm.abort_request(ids[0])  # finished already: nothing to drop
    llm.abort_request("no such request")
    assert_clean(llm, step)


@pytest.mark.parametrize("step", SCHEDULED)
def test_nan_temperature_is_refused_before_anything_is_queued(step):
    llm = engine(step)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(PROMPTS[:2], [greedy(4), SamplingParams(temperature=float("nan"), max_tokens=4)])
    assert_clean(llm, step)
    out = llm.generate([PROMPTS[0]], greedy(MAX_TOKENS[0]))  # the next good request is served
    assert_same([out[0].outputs[0]], reference([greedy(n) for n in MAX_TOKENS])[:1], step)


@pytest.mark.parametrize("step", SCHEDULED)
@pytest.mark.parametrize("fail_at", [1, 4])
def test_a_failure_mid_way_leaves_nothing_behind(step, fail_at, monkeypatch):
    llm = engine(step, max_num_seqs=3)
    bystander = llm.add_request(PROMPTS[7], greedy(MAX_TOKENS[7]))  # queued by someone else, before the failure
    forward, calls = fail_forward_at(llm, fail_at, monkeypatch)
    with pytest.raises(InjectedFailure):
        llm.generate(PROMPTS[:5], [greedy(n) for n in MAX_TOKENS[:5]])
    assert calls["n"] == fail_at
    # generate()'s own requests are gone; the bystander either failed with the step or is still served.
    left = [r.request_id for r in [*llm.scheduler.waiting, *llm.scheduler.running]]
    assert set(left) <= {bystander}, f"generate() left its requests behind: {left}"
    outs = drain(llm)
    outs.update({o.request_id: o for o in llm.step()})
    assert set(outs) <= {bystander}
    assert_clean(llm, step)
    monkeypatch.setattr(llm.model, "forward", forward)
    expected = reference([greedy(n) for n in MAX_TOKENS])
    if bystander in outs:
        assert_same([outs[bystander].outputs[0]], expected[7:8], step)
    again = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])  # the engine serves the next requests
    assert_same([o.outputs[0] for o in again], expected, step)
    assert_clean(llm, step)


@pytest.mark.parametrize("step", SCHEDULED)
def test_a_failing_sampler_releases_the_batch(step, monkeypatch):
    llm = engine(step)
    engine_module = load_engine(step)
    if has(step, "model_runner"):  # the model runner samples
        engine_module = importlib.import_module(f"steps.{step}.model_runner")

    def broken_sample(*args):
        raise InjectedFailure("sampler")

    name = "sample_batch" if has(step, "batched_sampler") else "sample"  # one sampler call per batch
    monkeypatch.setattr(engine_module, name, broken_sample)
    with pytest.raises(InjectedFailure):
        llm.generate(PROMPTS[:3], [greedy(4)] * 3)
    assert_clean(llm, step)
    monkeypatch.undo()
    assert len(llm.generate([PROMPTS[0]], greedy(2))[0].outputs[0].token_ids) == 2
