"""step23: the streaming engine. AsyncLLM runs the steps in its own thread and streams each request's outputs.

- Streamed text == offline text (greedy), stop strings and logprobs included, with 16 streams at once; every
  stream's texts only grow, one output per token while the caller keeps up; a caller that falls behind gets the
  newest output, and the ones passed over are counted.
- abort() frees the request's blocks before it returns; a consumer that breaks or is cancelled aborts its request.
- A step that fails beside other requests ends none of their streams: each request runs again, alone until it gets a
  token (LLM._fail_step), so a one-off failure costs a recompute and every stream ends as offline; the engine serves
  the next requests. (A request that fails a step alone ends with EngineStepError: test_part8_isolation.py.)
- Steps run on the engine's thread only, never on the event loop's; a step's outputs wake the event loop once.
- Bad requests, a request id in use, a shut-down engine: errors that name the problem.
"""
import asyncio
import threading
import time

import pytest

from helpers import load_engine, step_module, stop_longer_than_the_first_text
from registry import introducing
from shared import SamplingParams

ASYNC = introducing("async_engine")
MODEL = "random:tiny-llama"
OPTIONS = dict(device="cpu", dtype="float32", max_kv_tokens=4096, max_num_seqs=16)


def async_llm_module():
    """async_llm.py: AsyncLLM, its errors, its step loop's helpers."""
    return step_module(ASYNC, "async_llm")


@pytest.fixture(scope="module")
def offline():
    return load_engine(ASYNC).LLM(MODEL, **OPTIONS)


@pytest.fixture
def engine():
    engine = async_llm_module().AsyncLLM(MODEL, **OPTIONS)
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id)]


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_sixteen_streams_equal_the_offline_engine(engine, offline):
    prompts = [f"Request {i}: tell me about the number {i * 7}" for i in range(16)]
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=i % 2 == 0, logprobs=1 if i % 3 == 0 else None,
                             stop=[" the", "e"] if i % 4 == 1 else None) for i in range(16)]
    ref = offline.generate(prompts, params)

    async def main():
        return await asyncio.gather(*(collect(engine, p, sp, f"s{i}") for i, (p, sp) in enumerate(zip(prompts, params))))

    coalesced = engine.stats["coalesced"]
    streams = asyncio.run(main())
    assert any(r.outputs[0].finish_reason == "stop" and r.outputs[0].stop_reason is not None for r in ref)
    for i, (outs, r) in enumerate(zip(streams, ref)):
        last, want = outs[-1].outputs[0], r.outputs[0]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1]), i
        assert (last.text, last.token_ids, last.finish_reason) == (want.text, want.token_ids, want.finish_reason), i
        # the same tokens, and logprobs equal to float32 rounding: the streams join the batch at other steps than
        # the offline run's, so a row meets other batch shapes in the matmuls
        assert (last.logprobs is None) == (want.logprobs is None) and len(last.logprobs or []) == len(want.logprobs or []), i
        for got, ref_lp in zip(last.logprobs or [], want.logprobs or []):
            assert got.keys() == ref_lp.keys() and all(abs(got[t] - ref_lp[t]) <= 1e-4 for t in got), i
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), f"stream {i}: a text shrank: {texts}"
        counts = [len(o.outputs[0].token_ids) for o in outs]
        assert counts == sorted(set(counts)) and counts[0] >= 1, f"stream {i}: token counts {counts}"
        assert all(o.prompt_token_ids == r.prompt_token_ids for o in outs), i
    # one output per token, except those passed over for a newer one (none while every caller keeps up)
    outputs, tokens = sum(map(len, streams)), sum(len(r.outputs[0].token_ids) for r in ref)
    assert outputs + engine.stats["coalesced"] - coalesced == tokens
    assert not engine._submitted  # the step loop's record of what it gave the LLM keeps no finished request


def test_one_wake_up_of_the_event_loop_per_step(engine):
    """The step loop hands a step's outputs to the event loop together: one call_soon_threadsafe per step, however
    many streams got a token in it."""
    module, wakeups = async_llm_module(), []
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def main():
        loop = asyncio.get_running_loop()
        call = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            wakeups.append((callback, args))
            return call(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        return await asyncio.gather(*(collect(engine, f"wake {i}", params) for i in range(6)))

    streams = asyncio.run(main())
    # what each wake-up carried: one (queue, output) pair per stream that got a token in that step. Counted as
    # handed over, not as read: a reader that falls behind is given only the newest output (stats["coalesced"])
    deliveries = [len(args[0]) for callback, args in wakeups if callback is module._put_all]
    assert all(len(outs[-1].outputs[0].token_ids) == 10 for outs in streams)
    assert sum(deliveries) == 6 * 10, deliveries  # every token of every stream went through a wake-up
    assert 0 < len(deliveries) <= engine.stats["steps"] and max(deliveries) == 6, deliveries


def test_a_caller_that_falls_behind_gets_the_newest_output(engine, offline):
    """A slow reader is not served a backlog: the outputs that piled up while it was busy are passed over for the
    newest, which holds all their tokens, so it catches up at once and its text is the offline one."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    want = offline.generate(["a slow reader"], params)[0].outputs[0]

    async def slow():
        outs = []
        async for out in engine.generate("a slow reader", params):
            outs.append(out)
            if len(outs) == 1:  # busy (the event loop blocked, as by a slow handler) while 15 more steps run
                seen = engine.stats["steps"]
                wait_until(lambda: engine.stats["steps"] >= seen + 15)
        return outs

    outs = asyncio.run(slow())
    counts = [len(o.outputs[0].token_ids) for o in outs]
    # The first output may already hold more than one token (a loaded host: two steps ran before the reader woke);
    # the next one holds every token of the 15 steps the reader missed, not just one more.
    assert counts[1] >= min(counts[0] + 15, 40) and counts == sorted(set(counts)), counts
    assert len(outs) + engine.stats["coalesced"] == len(want.token_ids)
    assert (outs[-1].outputs[0].text, outs[-1].outputs[0].logprobs) == (want.text, want.logprobs)


def test_a_stop_string_across_two_tokens_never_takes_back_text_already_streamed(engine, offline):
    """The stop string is the end of one token's text and the start of the next's: after the first token a stream
    without the hold-back would have sent half the stop string, which the final text then cuts."""
    prompt, free = "the hold-back", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = offline.generate([prompt], free)[0].outputs[0].token_ids
    pieces = [offline.tokenizer.decode(tokens[:k]) for k in range(len(tokens) + 1)]
    k = next(k for k in range(2, len(tokens)) if len(pieces[k]) - len(pieces[k - 1]) >= 2
             and len(pieces[k + 1]) - len(pieces[k]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][len(pieces[k]):len(pieces[k]) + 2]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    want = offline.generate([prompt], params)[0].outputs[0]
    assert want.stop_reason == stop
    outs = asyncio.run(collect(engine, prompt, params))
    texts = [o.outputs[0].text for o in outs]
    assert texts[-1] == want.text
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), f"a streamed text was taken back: {texts}"


def test_steps_run_on_the_engines_thread_never_on_the_event_loop(engine):
    threads = set()
    step = engine.llm.step

    def recording_step(*args, **kwargs):
        threads.add(threading.current_thread())
        return step(*args, **kwargs)

    engine.llm.step = recording_step

    async def main():
        loop_thread = threading.current_thread()
        await asyncio.gather(*(collect(engine, f"hello {i}", SamplingParams(max_tokens=5)) for i in range(4)))
        return loop_thread

    loop_thread = asyncio.run(main())
    assert threads == {engine._thread} and loop_thread not in threads


def test_abort_frees_the_blocks_before_it_returns(engine):
    blocks = engine.llm.block_manager
    free = blocks.num_free_blocks

    async def main():
        outs = []
        async for out in engine.generate("a long one", SamplingParams(max_tokens=1000, ignore_eos=True), "long"):
            outs.append(out)
            if len(outs) == 3:
                held = blocks.num_free_blocks
                assert await engine.abort("long") is True
                assert blocks.num_free_blocks == free  # at once: the loop thread freed them before answering
        assert await engine.abort("long") is False  # gone already
        return held, outs

    held, outs = asyncio.run(main())
    assert held < free
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert not engine.llm.has_unfinished_requests() and engine.stats["aborted"] == 1
    assert not engine._submitted and not engine.llm.scheduler.requests


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_a_consumer_that_stops_early_aborts_its_request(engine, how):
    blocks = engine.llm.block_manager
    free = blocks.num_free_blocks
    got = []

    async def consume():
        async for out in engine.generate("stop reading me", SamplingParams(max_tokens=1000, ignore_eos=True)):
            got.append(out)
            if how == "break" and len(got) == 3:
                break

    async def main():
        if how == "break":
            await consume()
        else:
            task = asyncio.create_task(consume())
            while len(got) < 3:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    wait_until(lambda: not engine.llm.has_unfinished_requests())
    assert blocks.num_free_blocks == free and engine.stats["aborted"] == 1
    assert len(got[-1].outputs[0].token_ids) < 1000


def test_a_failed_step_of_several_streams_is_run_again_and_the_engine_goes_on(engine, offline):
    """A one-off failure, tied to no request, in the third step, which serves all 4 streams. Which request failed it is
    not known, so none fails: each is put back and runs alone until it gets a token (it does not fail again), then
    with the others. Every stream ends with the offline text, the failure and the 4 requests put back are counted,
    nothing is held, and the engine serves the next request."""
    execute, calls = engine.llm.runner.execute, []

    def failing(work):
        calls.append(len(work))
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return execute(work)

    engine.llm.runner.execute = failing
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(engine, f"stream {i}", params) for i in range(4)), return_exceptions=True)

    results = asyncio.run(main())
    want = offline.generate([f"stream {i}" for i in range(4)], params)
    assert calls[2] == 4, calls  # the step that failed served every stream
    assert [r[-1].outputs[0].token_ids for r in results] == [w.outputs[0].token_ids for w in want], results
    assert [r[-1].outputs[0].text for r in results] == [w.outputs[0].text for w in want]
    assert engine.stats["failed_steps"] == 1 and engine.llm.stats["requeued_after_failure"] == 4
    assert not engine.llm.has_unfinished_requests() and engine.llm.scheduler.num_suspects == 0
    assert not engine._submitted and not engine.llm.scheduler.requests  # the finished requests left both records
    assert engine.llm.block_manager.num_free_blocks == engine.llm.block_manager.num_blocks
    again = asyncio.run(collect(engine, "stream 0", params))  # the engine serves the next request
    assert again[-1].outputs[0].text == offline.generate(["stream 0"], params)[0].outputs[0].text


def test_bad_requests_and_a_shut_down_engine(engine):
    module = async_llm_module()

    async def main():
        bad = SamplingParams(max_tokens=2)
        bad.temperature = -1  # changed after construction: checked again when submitted
        with pytest.raises(ValueError, match="temperature must be"):
            await collect(engine, "x", bad)
        long = engine.generate("x", SamplingParams(max_tokens=1000, ignore_eos=True), "same")
        await long.__anext__()
        with pytest.raises(ValueError, match="request_id 'same' is already running"):
            await collect(engine, "y", SamplingParams(max_tokens=2), "same")
        with pytest.raises(ValueError, match="exceeds the model's context"):
            await collect(engine, "x", SamplingParams(max_tokens=10_000))
        # shutdown ends the open stream with EngineShutDown, and nothing is served after it
        threading.Thread(target=engine.shutdown).start()
        with pytest.raises(module.EngineShutDown):
            async for _ in long:
                pass
        with pytest.raises(module.EngineShutDown):
            await collect(engine, "z", SamplingParams(max_tokens=2))

    asyncio.run(main())
    assert not engine._thread.is_alive()


def test_a_text_shorter_than_the_hold_back_streams_nothing_it_takes_back(engine, offline):
    """Until the text is longer than the hold-back, a partial output shows no text at all: here the stop string
    turns out to begin the answer, so the final text is empty and every streamed text must be too."""
    prompt, free = "a short text", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    stop = stop_longer_than_the_first_text(offline.tokenizer, offline.generate([prompt], free)[0].outputs[0].token_ids)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    want = offline.generate([prompt], params)[0].outputs[0]
    assert (want.text, want.stop_reason) == ("", stop)
    texts = [o.outputs[0].text for o in asyncio.run(collect(engine, prompt, params))]
    assert texts[-1] == want.text
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), f"a streamed text was taken back: {texts}"


def test_an_error_outside_a_step_kills_the_engine_and_every_stream_hears_of_it(engine):
    """A failure in the step loop's own code (here: adding a request raises something other than ValueError) stops
    the loop. The stream that was running, the request that failed, every later request and every later abort get
    EngineDeadError at once (none waits forever), and the engine says it is dead."""
    module, add = async_llm_module(), engine.llm._add

    def failing_add(*args, request_id=None, **kwargs):
        if request_id == "second":
            raise RuntimeError("injected failure outside a step")
        return add(*args, request_id=request_id, **kwargs)

    engine.llm._add = failing_add

    async def read_to_the_end(stream):
        async for _ in stream:
            pass

    async def main():
        first = engine.generate("a long one", SamplingParams(max_tokens=1000, ignore_eos=True), "first")
        await first.__anext__()  # running
        assert engine.is_running and not engine.errored
        with pytest.raises(module.EngineDeadError, match="RuntimeError: injected failure outside a step"):
            await asyncio.wait_for(collect(engine, "x", SamplingParams(max_tokens=2), "second"), 30)
        with pytest.raises(module.EngineDeadError, match="injected failure outside a step"):
            await asyncio.wait_for(read_to_the_end(first), 30)
        with pytest.raises(module.EngineDeadError):
            await asyncio.wait_for(collect(engine, "z", SamplingParams(max_tokens=2)), 30)
        with pytest.raises(module.EngineDeadError):
            await asyncio.wait_for(engine.abort("first"), 30)

    asyncio.run(main())
    wait_until(lambda: not engine._thread.is_alive())
    assert engine.errored and not engine.is_running


def test_an_abort_whose_event_loop_closed_before_the_answer_does_not_kill_the_engine(engine, offline):
    """abort() waits for the step loop's answer in its caller's event loop; a loop closed meanwhile (its caller gone)
    has nobody to answer, and the step loop goes on serving."""
    loop = asyncio.new_event_loop()
    done = loop.create_future()
    loop.close()
    engine._send("abort", "nobody", loop, done)  # as abort() sends it, from a loop that then closed
    params = SamplingParams(temperature=0, max_tokens=4)
    outs = asyncio.run(collect(engine, "still here", params))
    assert outs[-1].outputs[0].text == offline.generate(["still here"], params)[0].outputs[0].text
    assert engine.is_running and not engine.errored
