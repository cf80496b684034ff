"""step26: the engine core in its own process. AsyncLLM starts an EngineCore process (engine_core.py) and talks to
it over ZMQ with msgpack messages; outputs come back as deltas, the front end rebuilds the text.

On the CPU, tiny Llama (one core process for the module, started once):
- streamed outputs equal the offline LLM's, token for token and text for text (greedy, a stop string, logprobs);
- abort() returns once the core has freed the request's blocks (the core's Stats says so);
- the core killed with SIGKILL mid-stream: every open stream ends with EngineDeadError within 5 s, later calls too.
"""
import asyncio
import os
import signal
import time

import pytest

from helpers import load_engine, step_module
from registry import TINY, introducing
from shared import SamplingParams

CORE = introducing("engine_core_process")
OPTIONS = dict(device="cpu", dtype="float32", max_kv_tokens=4096, max_num_seqs=8)
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    ", "Once upon a time", "Hello"]


@pytest.fixture(scope="module")
def offline():
    return load_engine(CORE).LLM(TINY, **OPTIONS)


@pytest.fixture(scope="module")
def engine():
    engine = step_module(CORE, "async_llm").AsyncLLM(TINY, **OPTIONS)
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, params):
    outs = [out async for out in engine.generate(prompt, params)]
    return outs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=16),
    SamplingParams(temperature=0, max_tokens=16, logprobs=2),
    SamplingParams(temperature=0.8, seed=7, max_tokens=12),
], ids=["greedy", "logprobs", "seeded"])
def test_streams_equal_offline(engine, offline, params):
    want = offline.generate(PROMPTS, params)

    async def run():
        return await asyncio.gather(*(_collect(engine, p, params) for p in PROMPTS))

    for outs, ref in zip(asyncio.run(run()), want):
        last = outs[-1]
        assert last.finished and all(not o.finished for o in outs[:-1])
        got, exp = last.outputs[0], ref.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (exp.text, exp.token_ids, exp.finish_reason)
        if params.logprobs is not None:
            assert len(got.logprobs) == len(exp.logprobs)
            for a, b in zip(got.logprobs, exp.logprobs):
                assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
        texts = [o.outputs[0].text for o in outs]
        assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # a stream's text only grows


def test_stop_string_from_the_front_end(engine, offline):
    """A stop string is found by the front end, which cuts the text as the offline engine does and aborts it."""
    ref = offline.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    exp = offline.generate([PROMPTS[0]], params)[0].outputs[0]
    got = asyncio.run(_collect(engine, PROMPTS[0], params))[-1].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
           (exp.text, exp.token_ids, exp.finish_reason, exp.stop_reason)
    stats = asyncio.run(engine.get_stats())
    assert stats["free_blocks"] == stats["num_blocks"] and stats["requests"] == 0


def test_abort_frees_blocks(engine):
    async def run():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        gen = engine.generate(PROMPTS[1], params, request_id="to-abort")
        first = await gen.__anext__()
        assert not first.finished
        busy = await engine.get_stats()
        assert busy["free_blocks"] < busy["num_blocks"]
        assert await engine.abort("to-abort") is True
        state = engine.snapshot()  # the Stats that answered the abort: sent after the blocks were freed
        last = [out async for out in gen][-1]
        return state, last

    state, last = asyncio.run(run())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert state["free_blocks"] == state["num_blocks"] and state["running"] == 0 and state["aborted"] >= 1


def test_sigkill_of_the_core_ends_open_streams():
    mod = step_module(CORE, "async_llm")
    engine = mod.AsyncLLM(TINY, **OPTIONS)
    try:
        async def run():
            params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)

            async def stream(i):
                try:
                    async for _ in engine.generate(PROMPTS[i], params):
                        pass
                except mod.EngineDeadError as e:
                    return e
                return None

            tasks = [asyncio.create_task(stream(i)) for i in range(3)]
            await asyncio.sleep(1.0)  # the streams are running
            killed = time.monotonic()
            os.kill(engine.process.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
            return results, time.monotonic() - killed

        results, took = asyncio.run(run())
        assert all(isinstance(r, mod.EngineDeadError) for r in results), results
        assert took < 5 and engine.errored and not engine.is_running

        async def later():
            async for _ in engine.generate("again", SamplingParams(max_tokens=2)):
                pass
        with pytest.raises(mod.EngineDeadError):
            asyncio.run(later())
    finally:
        engine.shutdown()
    assert not engine.process.is_alive()
