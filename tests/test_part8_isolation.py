"""step23 on: a request whose own inputs fail the engine step fails alone, and the logprobs a request may ask for are
bounded by the engine's max_logprobs (vLLM's option and default, 20), checked with the request.

On the CPU, tiny Llama:
- A request made to fail every step that serves it after its first token (core_faults.py's STEP_FAILURE_SEED: in the
  engine core from step26 on, in the step loop's LLM before) joins three running streams, one of them sampled with a
  seed. The step of four fails; none of its requests fails yet: each is put back and runs alone until it gets a
  token (LLM._fail_step), where the bad one fails alone. The good streams end with the tokens each gets alone,
  offline; the bad one ends with EngineStepError; two steps failed, four requests were put back
  (requeued_after_failure), no suspect is left and no KV block is held. On the lesson's step, step25 overlapped, the
  core's first step overlapped, and the newest step both ways.
- logprobs above max_logprobs: a ValueError offline (generate, add_request) that names both numbers, before anything
  is queued; at it, served. A max_logprobs that is no integer >= 1, or more than the model's vocabulary, is refused
  when the engine is built.
- Over HTTP (step24 and the newest, where the option travels to the core and back): a completion's logprobs or a
  chat's top_logprobs above it is a 400 naming both numbers, and the server serves on; serve.py's --max-logprobs
  reaches the engine's options.
"""
import asyncio
import functools
import inspect

import pytest

from core_faults import STEP_FAILURE_SEED, inject_faults, inject_step_faults
from conftest import ROOT
from helpers import load_engine, step_module
from registry import NEWEST, STEPS, TINY, has, introducing, lesson_and_newest
from shared import SamplingParams
from test_part9_faults import end_of  # a stream's last output, or the exception that ended it

ISOLATION = introducing("async_engine")
OPTIONS = dict(device="cpu", dtype="float32", max_kv_tokens=4096, max_num_seqs=8)
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    ", "Once upon a time", "Hello"]
BOUND_S = 60  # every stream of a test ends within this
# (step, async_scheduling): the lesson, the overlapped loop, the core, and the newest step without and with overlap
CASES = [(ISOLATION, None), (introducing("overlap_scheduling"), True), (introducing("engine_core_process"), True),
         (NEWEST, False), (NEWEST, True)]
GOOD = [SamplingParams(temperature=0, max_tokens=96, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=50, max_tokens=96, ignore_eos=True, seed=7),
        SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, logprobs=2)]
BAD = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, seed=STEP_FAILURE_SEED)


@functools.lru_cache(maxsize=None)
def alone(step: str) -> list:
    """The good requests' completions, each run alone on the step's offline engine."""
    offline = load_engine(step).LLM(TINY, **OPTIONS)
    return [offline.generate([p], sp)[0].outputs[0] for p, sp in zip(PROMPTS[1:], GOOD)]


def start(step: str, async_scheduling: bool | None):
    """The step's AsyncLLM on tiny Llama, its LLM armed with the step faults (in the core from step26 on)."""
    options = dict(OPTIONS, **({} if async_scheduling is None else {"async_scheduling": async_scheduling}))
    async_llm = step_module(step, "async_llm")
    if has(step, "engine_core_process"):
        return async_llm.AsyncLLM(TINY, _core_setup=inject_faults, **options)
    engine = async_llm.AsyncLLM(TINY, **options)
    inject_step_faults(engine.llm)  # before any request: the step loop reads runner.execute at each step
    return engine


def engine_state(step: str, engine) -> dict:
    """What the test checks of the engine once every stream has ended: the core's Stats, or the LLM's own."""
    if has(step, "engine_core_process"):
        s = asyncio.run(engine.get_stats())
        return dict(failed_steps=s["failed_steps"], requeued=s["engine"]["requeued_after_failure"],
                    queued=s["running"] + s["waiting"], free_blocks=s["free_blocks"], num_blocks=s["num_blocks"])
    llm = engine.llm
    assert llm.scheduler.num_suspects == 0, "a suspect was left"
    return dict(failed_steps=engine.stats["failed_steps"], requeued=llm.stats["requeued_after_failure"],
                queued=len(llm.scheduler.requests), free_blocks=llm.block_manager.num_free_blocks,
                num_blocks=llm.block_manager.num_blocks)


@pytest.mark.parametrize("step,async_scheduling", CASES, ids=[f"{s}-{'overlapped' if a else 'sync'}" for s, a in CASES])
def test_a_request_that_fails_its_steps_fails_alone(step, async_scheduling):
    mod, want = step_module(step, "async_llm"), alone(step)
    engine = start(step, async_scheduling)
    try:
        async def run():
            streams = [engine.generate(p, sp) for p, sp in zip(PROMPTS[1:], GOOD)]
            for stream in streams:  # each is running before the bad request comes: it joins their steps
                assert not (await stream.__anext__()).finished
            failing = asyncio.ensure_future(end_of(engine.generate(PROMPTS[0], BAD)))
            ends = await asyncio.wait_for(asyncio.gather(*map(end_of, streams)), BOUND_S)
            return await asyncio.wait_for(failing, BOUND_S), ends

        failed, ends = asyncio.run(run())
        assert isinstance(failed, mod.EngineStepError) and "injected failure" in str(failed), failed
        for i, (got, ref) in enumerate(zip(ends, want)):
            assert not isinstance(got, Exception), f"good stream {i} failed beside the bad one: {got!r}"
            got = got.outputs[0]
            assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, "length"), i
        assert [set(top) for top in ends[2].outputs[0].logprobs] == [set(top) for top in want[2].logprobs]
        state = engine_state(step, engine)
        # the step of four, then the bad request alone; the four put back once; nothing queued or held after
        assert (state["failed_steps"], state["requeued"], state["queued"]) == (2, 4, 0), state
        assert state["free_blocks"] == state["num_blocks"], state
    finally:
        engine.shutdown()


# ---- max_logprobs ---------------------------------------------------------------------------------------------
def option_default(step: str, name: str):
    """An option's default: in the step's LLM signature, or in its engine_args.py where the LLM takes **options."""
    if (ROOT / "steps" / step / "engine_args.py").exists():
        return getattr(step_module(step, "engine_args").EngineArgs(), name)
    return inspect.signature(load_engine(step).LLM).parameters[name].default


LOGPROBS_STEPS = sorted({ISOLATION, introducing("overlap_scheduling"), NEWEST}, key=STEPS.index)  # its two homes


@pytest.mark.parametrize("step", LOGPROBS_STEPS)
def test_logprobs_above_max_logprobs_are_refused_with_the_request(step):
    """engine.py checks it (step23, step24), config.py from step25 on; the default is vLLM's, 20."""
    LLM = load_engine(step).LLM
    assert option_default(step, "max_logprobs") == 20
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 1, got 0"):
        LLM("no-such-model", device="cpu", max_logprobs=0)  # before the model is looked for
    with pytest.raises(ValueError, match=r"max_logprobs=49153 is more than the model's vocabulary \(49152 tokens\)"):
        LLM(TINY, **OPTIONS, max_logprobs=49153)
    llm = LLM(TINY, **OPTIONS)
    with pytest.raises(ValueError, match=r"prompts\[1\]: logprobs=100000 is more than max_logprobs=20"):
        llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2, logprobs=20),
                                   SamplingParams(max_tokens=2, logprobs=100000)])
    with pytest.raises(ValueError, match="logprobs=21 is more than max_logprobs=20"):
        llm.add_request(PROMPTS[0], SamplingParams(max_tokens=2, logprobs=21))
    assert not llm.has_unfinished_requests()  # nothing was queued
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2, logprobs=20))[0].outputs[0]
    assert [len(top) >= 20 for top in out.logprobs] == [True, True]
    few = LLM(TINY, **OPTIONS, max_logprobs=3)
    with pytest.raises(ValueError, match=r"prompts\[0\]: logprobs=4 is more than max_logprobs=3"):
        few.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logprobs=4))


@pytest.mark.parametrize("step", lesson_and_newest("openai_server"))
def test_logprobs_above_max_logprobs_are_a_400_over_http(step):
    import httpx

    from test_part8_server import NAME, RunningServer

    serve = step_module(step, "serve")
    assert serve.engine_options(serve.engine_arg_parser("x").parse_args(["--max-logprobs", "5"]))["max_logprobs"] == 5
    server = RunningServer(step, max_logprobs=5)  # from step26 on, it travels to the core and back (Ready)
    try:
        asks = [("completions", {"prompt": "x", "logprobs": 100000}),
                ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                      "top_logprobs": 100000})]
        for path, body in asks:
            r = httpx.post(f"{server.base}/v1/{path}", timeout=30, json={"model": NAME, "max_tokens": 2, **body})
            assert r.status_code == 400, (path, r.text)
            assert "logprobs=100000 is more than max_logprobs=5" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{server.base}/v1/completions", timeout=30,
                       json={"model": NAME, "prompt": "x", "max_tokens": 2, "logprobs": 5, "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"]) == 2, r.text
        server.wait_idle()
    finally:
        server.stop()


@pytest.mark.parametrize("step", lesson_and_newest("speculative_decoding"))
def test_a_verify_step_that_fails_puts_its_requests_back_without_their_drafts(step, monkeypatch):
    """step27: the drafts of a step join its sequences' tokens until the verdict takes them out. A verify step of
    three requests that fails before its verdict puts the three back without their drafts (drafts are no tokens),
    and they end with the tokens they get without the failure."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
            "disable_by_batch_size": None}
    prompts = ["the the the the the the", "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3",
               "The cat sat on the mat. The cat sat on the"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = load_engine(step).LLM("random:tiny-qwen3", speculative_config=spec, **OPTIONS)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    verify, calls = llm.runner.verify, []

    def fails_once(*args, **kwargs):
        calls.append(len(args[2]))  # the requests with drafts in the step
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return verify(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "verify", fails_once)
    ids = [llm.add_request(p, params) for p in prompts]
    with pytest.raises(RuntimeError, match="injected failure"):
        while llm.has_unfinished_requests():
            llm.step()
    back = list(llm.scheduler.waiting)
    assert calls[0] >= 1 and {r.request_id for r in back} == set(ids) and not llm.scheduler.running
    assert all(r.suspect and r.token_ids == r.prompt_ids + r.output_ids for r in back), "a draft stayed a token"
    outs = {}
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step()})
    assert [outs[i].outputs[0].token_ids for i in ids] == want
    assert llm.stats["requeued_after_failure"] == 3 and llm.scheduler.num_suspects == 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
