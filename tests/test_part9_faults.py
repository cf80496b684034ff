"""step26 on: an engine core that can no longer serve says so and exits, and a request id reused at once is never
taken for the request it named before.

On the CPU, tiny Llama, in every step with an engine core process (faults injected in the core: core_faults.py):
- an IO thread of the core that dies (the input thread as it receives, the output thread as it sends): every open
  stream ends with EngineDeadError within 10 s, the core process exits, later requests are refused as dead and the
  server's /health answers 503;
- a device error in a step (CUDA's illegal memory access) is fatal: the streams end with EngineDeadError, not
  EngineStepError, the core exits, later requests are refused; an ordinary step error fails only the request that
  failed it (here the one request of its step; beside others: test_part8_isolation.py), and the core serves on;
  what counts as a device error, on a torch with AcceleratorError and without;
- a step of the overlapped loop that fails at its launch or at its read leaves no step in flight;
- a stop string found by the front end aborts its request in the core: a new request that reuses the id before
  that Abort is sent runs to its normal end.
"""
import asyncio
import threading

import pytest
import torch

from core_faults import (DEVICE_ERROR_MESSAGE, DEVICE_ERROR_SEED, INPUT_THREAD_FAILURE, OUTPUT_THREAD_FAILURE_SEED,
                         STEP_FAILURE_SEED, device_error, inject_faults)
from helpers import copies_params, load_engine, step_module
from registry import TINY, having
from shared import SamplingParams

STEPS = having("engine_core_process")
OPTIONS = dict(device="cpu", dtype="float32", max_kv_tokens=4096, max_num_seqs=8)
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    ", "Once upon a time", "Hello"]
LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)  # runs until the test ends it
BOUND_S = 10  # a dead core ends every open stream within this, and exits


def start(step: str, **options):
    """The step's AsyncLLM on tiny Llama, its core armed with core_faults' faults."""
    return step_module(step, "async_llm").AsyncLLM(TINY, _core_setup=inject_faults, **{**OPTIONS, **options})


async def started(engine, prompts, params) -> list:
    """Streams that have each had their first output (so each is running in the core)."""
    streams = [engine.generate(p, params) for p in prompts]
    for stream in streams:
        assert not (await stream.__anext__()).finished
    return streams


async def end_of(stream):
    """-> a stream's last output, or the exception that ended it."""
    last = None
    try:
        async for last in stream:
            pass
    except Exception as e:  # noqa: BLE001 (the test looks at which one)
        return e
    return last


async def outcome(engine, prompt, params, request_id=None):
    return await end_of(engine.generate(prompt, params, request_id))


def assert_dead(step: str, engine) -> None:
    """The core has exited (with status 1: it died), later requests are refused as dead, /health answers 503."""
    import httpx

    mod = step_module(step, "async_llm")
    engine.process.join(BOUND_S)
    assert engine.process.exitcode == 1, engine.process.exitcode
    assert engine.errored and not engine.is_running
    later = asyncio.run(asyncio.wait_for(outcome(engine, "again", SamplingParams(max_tokens=2)), BOUND_S))
    assert isinstance(later, mod.EngineDeadError), later

    async def health() -> int:
        app = step_module(step, "serve").build_app(engine, "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://core") as client:
            return (await client.get("/health")).status_code

    assert asyncio.run(health()) == 503


@pytest.mark.parametrize("thread", ["input", "output"])
@pytest.mark.parametrize("step", STEPS)
def test_an_io_thread_that_dies_ends_every_open_stream_and_the_core(step, thread):
    mod = step_module(step, "async_llm")
    engine = start(step)
    try:
        async def run():
            streams = await started(engine, PROMPTS[:3], LONG)
            if thread == "input":
                with engine._send_lock:
                    engine._to_core.send(INPUT_THREAD_FAILURE)
            else:  # the first output of this request fails to send
                params = SamplingParams(temperature=0, max_tokens=8, seed=OUTPUT_THREAD_FAILURE_SEED)
                streams.append(engine.generate(PROMPTS[3], params))
            return await asyncio.wait_for(asyncio.gather(*map(end_of, streams)), BOUND_S)

        results = asyncio.run(run())
        assert all(isinstance(r, mod.EngineDeadError) for r in results), results
        assert all(f"{thread} thread failed" in str(r) for r in results), results[0]
        assert_dead(step, engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("step", STEPS)
def test_a_device_error_in_a_step_is_fatal(step, async_scheduling):
    """CUDA's errors are sticky (every later launch fails too): the core does not serve on, it dies."""
    mod = step_module(step, "async_llm")
    engine = start(step, async_scheduling=async_scheduling)
    try:
        async def run():
            streams = await started(engine, PROMPTS[:2], LONG)
            params = SamplingParams(temperature=0, max_tokens=50, seed=DEVICE_ERROR_SEED)
            streams.append(engine.generate(PROMPTS[2], params))
            return await asyncio.wait_for(asyncio.gather(*map(end_of, streams)), BOUND_S)

        results = asyncio.run(run())
        assert all(isinstance(r, mod.EngineDeadError) for r in results), results
        assert all(DEVICE_ERROR_MESSAGE in str(r) for r in results), results[0]
        assert_dead(step, engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("step", copies_params(STEPS, "engine_core"))
def test_what_counts_as_a_device_error(step, monkeypatch):
    is_device_error = step_module(step, "engine_core").is_device_error
    assert is_device_error(device_error())
    assert is_device_error(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"))
    for ordinary in (RuntimeError("injected failure"), ValueError(DEVICE_ERROR_MESSAGE),
                     torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")):
        assert not is_device_error(ordinary), ordinary
    monkeypatch.delattr(torch, "AcceleratorError", raising=False)  # a torch before 2.8: the message tells
    assert is_device_error(RuntimeError(DEVICE_ERROR_MESSAGE))
    assert not is_device_error(RuntimeError("injected failure"))


@pytest.mark.parametrize("step", STEPS)
def test_an_ordinary_step_error_fails_only_the_requests_of_that_step(step):
    """One seat (max_num_seqs=1): the request that waits for it is in no step that fails, and runs to its end; the
    core serves on."""
    mod = step_module(step, "async_llm")
    engine = start(step, max_num_seqs=1)
    try:
        async def run():
            failing = SamplingParams(temperature=0, max_tokens=50, seed=STEP_FAILURE_SEED)
            waiting = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            return await asyncio.wait_for(asyncio.gather(outcome(engine, PROMPTS[0], failing),
                                                         outcome(engine, PROMPTS[1], waiting)), BOUND_S)

        failed, served = asyncio.run(run())
        assert isinstance(failed, mod.EngineStepError) and "injected failure" in str(failed), failed
        assert served.finished and len(served.outputs[0].token_ids) == 8, served
        state = asyncio.run(engine.get_stats())
        assert state["failed_steps"] == 1 and state["free_blocks"] == state["num_blocks"], state
        assert engine.is_running and engine.process.is_alive()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("where", ["launch", "read"])
@pytest.mark.parametrize("step", STEPS)
def test_a_failed_step_leaves_no_step_in_flight(step, where):
    """The EngineCore (core.py, which the core process runs) in the overlapped loop, driven here through the offline
    LLM over it: a step whose launch (the forward) or read (the sampled tokens of the step before) raises drops every
    request it served and leaves no step in flight, whose results a later step would read; the next request is
    served as on a fresh engine."""
    llm = load_engine(step).LLM(TINY, async_scheduling=True, **OPTIONS)
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        llm.add_request(PROMPTS[0], params)
        for _ in range(3):
            llm.step()
        assert llm.in_flight is not None
        name = {"launch": "execute", "read": "read_sampled"}[where]
        works = getattr(llm.runner, name)

        def fails(*args, **kwargs):
            raise device_error()

        setattr(llm.runner, name, fails)
        with pytest.raises(RuntimeError, match="CUDA error"):
            llm.step()
        setattr(llm.runner, name, works)
        assert llm.in_flight is None and not llm.has_unfinished_requests()
        got = llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids
        assert got == load_engine(step).LLM(TINY, **OPTIONS).generate([PROMPTS[1]], params)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


@pytest.mark.parametrize("step", STEPS)
def test_a_request_id_reused_before_the_stop_strings_abort_is_sent_runs_normally(step):
    """The front end finds a stop string and aborts the request in the core. The Abort is held back (an injected
    delay in the reader thread) until a new request with the same id has been sent: the new request must run to
    its normal end, and the first one end at its stop string."""
    wire = step_module(step, "wire")
    offline = load_engine(step).LLM(TINY, **OPTIONS)
    plain = SamplingParams(temperature=0, max_tokens=24)
    text = offline.generate([PROMPTS[0]], plain)[0].outputs[0].text
    stopped = SamplingParams(temperature=0, max_tokens=24, stop=[text[len(text) // 2:len(text) // 2 + 3]])
    want_stopped = offline.generate([PROMPTS[0]], stopped)[0].outputs[0]
    want_new = offline.generate([PROMPTS[1]], plain)[0].outputs[0]
    assert want_stopped.finish_reason == "stop" and len(want_stopped.token_ids) < 24
    engine = step_module(step, "async_llm").AsyncLLM(TINY, **OPTIONS)
    window, new_request_sent = threading.Event(), threading.Event()
    send = engine._send

    def send_the_stop_strings_abort_late(msg):
        if isinstance(msg, wire.Abort) and threading.current_thread() is engine._reader and not window.is_set():
            window.set()  # the front end has ended the request; its Abort waits
            new_request_sent.wait(BOUND_S)
        send(msg)
        if isinstance(msg, wire.Add) and window.is_set():
            new_request_sent.set()

    engine._send = send_the_stop_strings_abort_late
    try:
        async def run():
            first = asyncio.create_task(outcome(engine, PROMPTS[0], stopped, "reused"))
            assert await asyncio.to_thread(window.wait, BOUND_S), "no Abort was sent for the stop string"
            second = await asyncio.wait_for(outcome(engine, PROMPTS[1], plain, "reused"), BOUND_S)
            return await first, second

        first, second = asyncio.run(run())
        assert not isinstance(second, Exception), second
        got = second.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want_new.text, want_new.token_ids, "length")
        got = first.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == \
               (want_stopped.text, want_stopped.token_ids, want_stopped.finish_reason)
        state = asyncio.run(engine.get_stats())
        assert engine.is_running and state["requests"] == 0 and state["free_blocks"] == state["num_blocks"], state
    finally:
        engine.shutdown()
