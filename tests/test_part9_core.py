"""step26: the engine core in its own process. AsyncLLM starts an EngineCore process (engine_core.py) and talks to
it over ZMQ with msgpack messages; outputs come back as deltas, the front end rebuilds the text.

On the CPU, tiny Llama (one core process for the module, started once):
- streamed outputs equal the offline LLM's, token for token and text for text (greedy, a stop string, logprobs);
- abort() returns once the core has freed the request's blocks (the core's Stats says so);
- the core killed with SIGKILL mid-stream: every open stream ends with EngineDeadError within 5 s, later calls too;
- with speculative decoding (step27 on), a stop string inside a verify's run: the returned cumulative logprob,
  streamed and offline, is the sum of the returned tokens' logprobs (the core's delta held the tokens past it); a
  core that drafts streams the offline tokens, and its Stats show drafts accepted (the engine's counters);
- a core with async_scheduling=True streams what the offline engine makes, and an abort of a request whose step is
  in flight ends it as aborted with every block free;
- the wire (wire.py): every SamplingParams field the core reads survives an Add's encoding and decoding; a core
  that states another protocol version is refused, naming both; the front end's modules, and a front end serving a
  request, import no torch;
- the core's torch host threads are the ones OMP_NUM_THREADS sets, on the CPU.
"""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from core_faults import speak_another_protocol
from helpers import alive, children_of, copies_params, load_engine, step_module
from registry import TINY, having, introducing
from shared import SamplingParams

CORE = introducing("engine_core_process")
STEPS = having("engine_core_process")
OPTIONS = dict(device="cpu", dtype="float32", max_kv_tokens=4096, max_num_seqs=8)
ROOT = Path(__file__).resolve().parents[1]
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


SPECULATION = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
               "disable_by_batch_size": None}  # every step may draft


def _stop_inside_a_run(llm, prompt: str, params: SamplingParams) -> tuple[str, int]:
    """Run `prompt` and find the first step that gave it several tokens (a verify's run): -> a stop string that
    first appears with the first token of that run, and the number of tokens up to it."""
    llm.add_request(prompt, params, request_id="find")
    seen, ids, runs = 0, [], []
    while llm.has_unfinished_requests():
        for out in llm.step(partial=True):
            ids = out.outputs[0].token_ids
            if len(ids) - seen >= 2:
                runs.append(seen)
            seen = len(ids)
    assert runs, "no step gave the request 2 tokens or more: the prompt no longer makes drafts"
    text, before = llm.tokenizer.decode(ids[:runs[0] + 1]), llm.tokenizer.decode(ids[:runs[0]])
    return next(text[-n:] for n in range(1, len(text) + 1) if text[-n:] not in before), runs[0] + 1


@pytest.mark.parametrize("step", having("engine_core_process", "speculative_decoding"))
def test_cumulative_logprob_counts_no_token_past_a_stop_string_inside_a_speculative_run(step):
    """A stop string ends the request at the first token of a verify's run. The core knows no stop strings: its
    delta holds the whole run, and the front end keeps the tokens up to the stop. The cumulative logprob it returns
    is the sum of the chosen logprobs of the tokens it returns, as the offline engine's is."""
    options = dict(OPTIONS, speculative_config=SPECULATION)
    offline = load_engine(step).LLM(TINY, **options)
    prompt = "the the the the the the"
    stop, length = _stop_inside_a_run(offline, prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1, stop=[stop])
    cut_before = offline.stats["spec_cut"]
    want = offline.generate([prompt], params)[0].outputs[0]
    assert (len(want.token_ids), want.finish_reason) == (length, "stop")
    assert offline.stats["spec_cut"] == cut_before + 1 and offline.stats["spec_accepted"] > 0, offline.stats
    engine = step_module(step, "async_llm").AsyncLLM(TINY, **options)
    try:
        got = asyncio.run(_collect(engine, prompt, params))[-1].outputs[0]
    finally:
        engine.shutdown()
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    for out in (want, got):
        chosen = sum(top[token] for top, token in zip(out.logprobs, out.token_ids))
        assert abs(out.cumulative_logprob - chosen) < 1e-4, (out.cumulative_logprob, chosen)


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
            asyncio.run(asyncio.wait_for(later(), timeout=5))
    finally:
        engine.shutdown()
    assert not engine.process.is_alive()


def test_outputs_cross_the_wire_as_deltas(engine, offline):
    """The bytes the front end receives grow with a request's tokens, not with their square: per token, a
    200-token answer costs no more than twice what a 20-token one does (cumulative outputs would cost ~10x)."""
    per_token = {}
    for n in (20, 200):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        before = engine.stats["bytes_in"]
        got = asyncio.run(_collect(engine, PROMPTS[2], params))[-1].outputs[0]
        per_token[n] = (engine.stats["bytes_in"] - before) / n
        assert got.token_ids == offline.generate([PROMPTS[2]], params)[0].outputs[0].token_ids
    print(f"bytes received per token: {per_token}")
    assert per_token[200] <= 2 * per_token[20], per_token


def test_a_message_that_fails_to_decode_is_named_and_the_core_serves_on(engine, offline, capsys):
    before = asyncio.run(engine.get_stats())["bad_messages"]
    with engine._send_lock:
        engine._to_core.send(b"\xc1 not msgpack")  # 0xc1: a byte msgpack never uses
    params = SamplingParams(temperature=0, max_tokens=8)
    got = asyncio.run(_collect(engine, PROMPTS[0], params))[-1].outputs[0]
    assert got.token_ids == offline.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    assert asyncio.run(engine.get_stats())["bad_messages"] == before + 1
    assert "engine core error: a message failed to decode" in capsys.readouterr().out  # the core's Error, logged


def test_32_concurrent_streams_all_equal_offline(engine, offline):
    prompts = [f"Stream {i} tells of {i * 7}" for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0] for o in offline.generate(prompts, params)]

    async def run():
        return await asyncio.gather(*(_collect(engine, p, params) for p in prompts))

    got = [outs[-1].outputs[0] for outs in asyncio.run(run())]
    assert [(g.text, g.token_ids) for g in got] == [(w.text, w.token_ids) for w in want]
    state = asyncio.run(engine.get_stats())
    assert state["free_blocks"] == state["num_blocks"] and state["requests"] == 0


# ---- serve.py as processes: the front end and its core ------------------------------------------------------------
def _start_server():
    """serve.py of this step in its own process (step24's run.start_server): -> (the process, its base URL)."""
    port = step_module(CORE, "parallel").free_port()
    start_server = step_module(introducing("openai_server"), "run").start_server
    proc = start_server(TINY, port, "--device", "cpu", "--max-kv-tokens", "2048",
                        serve_py=ROOT / "steps" / CORE / "serve.py")
    return proc, f"http://127.0.0.1:{port}"


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a child of this process stays a zombie until reaped
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


def _stop(proc) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def test_a_server_whose_core_is_killed_fails_fast_and_a_new_one_serves():
    """SIGKILL of the core mid-stream: each open stream ends with an error event within 5 s, the request waiting for
    a whole answer gets 500, /health and new requests 503; SIGTERM then stops the front end with exit 0, no process
    is left, and a new server serves again."""
    import httpx

    proc, base = _start_server()
    try:
        core_pid = httpx.get(f"{base}/stats", timeout=10).json()["core_pid"]
        body = {"model": TINY, "prompt": "go on", "max_tokens": 1500, "ignore_eos": True}
        events, whole = [[] for _ in range(3)], []

        def stream(i):
            with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
                events[i].extend(line for line in r.iter_lines() if line.startswith("data: "))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        threads.append(threading.Thread(target=lambda: whole.append(
            httpx.post(f"{base}/v1/completions", json=body, timeout=30))))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not all(events) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(events), "the streams did not start"
        killed = time.monotonic()
        os.kill(core_pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=5)
        took = time.monotonic() - killed
        assert not any(t.is_alive() for t in threads) and took < 5, took
        for e in events:
            assert e[-1] == "data: [DONE]" and "engine core died" in e[-2], e[-2:]
            assert json.loads(e[-2][len("data: "):])["error"]["type"] == "server_error"
        assert whole[0].status_code == 500 and "engine core died" in whole[0].json()["error"]["message"]
        assert httpx.get(f"{base}/health", timeout=10).status_code == 503
        r = httpx.post(f"{base}/v1/completions", json={"model": TINY, "prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    finally:
        code = _stop(proc)
    assert code == 0 and _gone(core_pid, 5)
    proc, base = _start_server()
    try:
        r = httpx.post(f"{base}/v1/completions", json={"model": TINY, "prompt": "x", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        core_pid = httpx.get(f"{base}/stats", timeout=10).json()["core_pid"]
    finally:
        code = _stop(proc)
    assert code == 0 and _gone(core_pid, 10), "SIGTERM left the core running"


def test_the_core_exits_when_its_front_end_dies():
    import httpx

    proc, base = _start_server()
    try:
        core_pid = httpx.get(f"{base}/stats", timeout=10).json()["core_pid"]
        proc.kill()  # SIGKILL: the front end runs no cleanup at all
        proc.wait()
        assert _gone(core_pid, 5), "the core outlived its front end"
    finally:
        _stop(proc)


def test_a_core_that_fails_to_start_ends_the_server_in_one_line():
    proc = subprocess.run([sys.executable, f"steps/{CORE}/serve.py", "--model", "no-such-model", "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode in (1, 2) and len(errors) == 1 and "no-such-model" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_the_core_reports_its_cpu_by_thread_and_its_host_threads(engine, monkeypatch):
    """The core's Stats: CPU seconds by thread (the busy loop is MainThread, its IO threads by name) and the torch
    host threads it runs with. On a GPU it takes one (the pool spins after every small host op); on the CPU the pool
    does the model's work and stays; OMP_NUM_THREADS, when set, wins."""
    asyncio.run(_collect(engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=4)))
    state = asyncio.run(engine.get_stats())
    threads = state["threads_cpu_s"]
    assert threads["MainThread"] > 0 and {"core input", "core output"} <= set(threads), threads
    # on the CPU the core leaves torch's pool as OMP_NUM_THREADS sets it (torch takes at most one per core): a core
    # started with another count than this one's reports that count
    setting = 2 if state["torch_threads"] == 1 else 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(setting))
    other = step_module(CORE, "async_llm").AsyncLLM(TINY, **OPTIONS)
    try:
        assert asyncio.run(other.get_stats())["torch_threads"] == min(setting, os.cpu_count() or 1)
    finally:
        other.shutdown()
    import torch

    host_threads_for = step_module(CORE, "engine_core").host_threads_for
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert host_threads_for(torch.device("cuda", 0)) == 1
    assert host_threads_for(torch.device("cpu")) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert host_threads_for(torch.device("cuda", 0)) is None


@pytest.mark.gpu
def test_gpu_core_runs_one_host_thread_and_streams_what_offline_makes(monkeypatch):
    """On the GPU, with OMP_NUM_THREADS unset, the core takes one torch host thread, and its streams still equal the
    offline engine's tokens."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    options = dict(device="cuda", max_kv_tokens=8192, max_num_seqs=8)
    engine = step_module(CORE, "async_llm").AsyncLLM("random:qwen3-0.6b", **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        streamed = [asyncio.run(_collect(engine, p, params))[-1].outputs[0].token_ids for p in PROMPTS]
        state = asyncio.run(engine.get_stats())
    finally:
        engine.shutdown()
    assert state["torch_threads"] == 1
    offline = load_engine(CORE).LLM("random:qwen3-0.6b", **options)
    try:
        assert streamed == [o.outputs[0].token_ids for o in offline.generate(PROMPTS, params)]
    finally:
        offline.shutdown()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc (Linux)")
def test_the_cores_tensor_parallel_workers_do_not_outlive_it():
    """A core with a tensor-parallel worker (two gloo ranks on the CPU) killed with SIGKILL: its worker, a child of
    the core, sees its pipe to rank 0 close and exits too."""
    engine = step_module(CORE, "async_llm").AsyncLLM(TINY, tensor_parallel_size=2, **OPTIONS)
    try:
        outs = asyncio.run(_collect(engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=4)))
        assert outs[-1].finished
        workers = children_of(engine.process.pid)
        assert workers, "the core has no worker process"
        os.kill(engine.process.pid, signal.SIGKILL)
        deadline = time.time() + 15
        while time.time() < deadline and any(map(alive, workers)):
            time.sleep(0.1)
        assert not any(map(alive, workers)), f"workers left: {[w for w in workers if alive(w)]}"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("step", having("engine_core_process", "speculative_decoding"))
def test_a_core_that_drafts_streams_the_offline_tokens_and_reports_drafts_accepted(step):
    """The core's Stats carry the engine's own counters (LLM.stats, under "engine"): a request that repeats itself
    streams the offline engine's tokens through a core with n-gram speculation on, and the core reports the drafts
    it accepted."""
    options = dict(OPTIONS, speculative_config=SPECULATION)
    prompt, params = "the the the the the the", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = load_engine(step).LLM(TINY, **options).generate([prompt], params)[0].outputs[0].token_ids
    engine = step_module(step, "async_llm").AsyncLLM(TINY, **options)
    try:
        got = asyncio.run(_collect(engine, prompt, params))[-1].outputs[0].token_ids
        counters = asyncio.run(engine.get_stats())["engine"]
    finally:
        engine.shutdown()
    assert got == want
    assert counters["spec_accepted"] > 0 and counters["spec_verified"] > 0, counters


@pytest.mark.parametrize("step", STEPS)
def test_an_overlapped_core_streams_what_offline_makes_and_an_abort_in_flight_frees_its_blocks(step):
    """async_scheduling=True on the CPU: the core's loop launches step N + 1 before it reads step N, so between two
    steps (when it reads the front end's messages) a running request always has a step in flight. Its streams equal
    the offline engine's; an abort then ends the request as aborted, and the Stats that answer it show every block
    free; the token its step in flight computed is read later and thrown away."""
    offline = load_engine(step).LLM(TINY, **OPTIONS)
    engine = step_module(step, "async_llm").AsyncLLM(TINY, async_scheduling=True, **OPTIONS)
    try:
        for params in (SamplingParams(temperature=0, max_tokens=16, logprobs=2),
                       SamplingParams(temperature=0.8, seed=7, max_tokens=12)):
            want = [o.outputs[0] for o in offline.generate(PROMPTS, params)]

            async def run():
                return await asyncio.gather(*(_collect(engine, p, params) for p in PROMPTS))

            got = [outs[-1].outputs[0] for outs in asyncio.run(run())]
            assert [(g.text, g.token_ids, g.finish_reason) for g in got] == \
                   [(w.text, w.token_ids, w.finish_reason) for w in want]

        async def abort_in_flight():
            gen = engine.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                  request_id="in flight")
            for _ in range(3):
                assert not (await gen.__anext__()).finished
            busy = await engine.get_stats()
            assert await engine.abort("in flight") is True
            freed = engine.snapshot()  # the Stats that answered the abort
            return busy, freed, [out async for out in gen][-1]

        busy, freed, last = asyncio.run(abort_in_flight())
        assert busy["in_flight"] == 1 and busy["running"] == 1 and busy["free_blocks"] < busy["num_blocks"], busy
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert (freed["free_blocks"], freed["running"], freed["requests"]) == (freed["num_blocks"], 0, 0), freed
        deadline = time.monotonic() + 10
        while (state := asyncio.run(engine.get_stats()))["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state["engine"]["discarded_tokens"] > busy["engine"]["discarded_tokens"], state["engine"]
        assert (state["in_flight"], state["free_blocks"]) == (0, state["num_blocks"]), state
    finally:
        engine.shutdown()


# ---- the wire ------------------------------------------------------------------------------------------------------
KEPT_BY_THE_FRONT_END = {"stop"}  # the SamplingParams fields that never cross the wire (stop strings need the text)
NOT_DEFAULT = dict(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, max_tokens=33, stop=["###"],
                   stop_token_ids=[7, 11], ignore_eos=True, seed=1234, logprobs=3)


@pytest.mark.parametrize("step", copies_params(STEPS, "wire"))
def test_every_sampling_field_crosses_the_wire(step):
    """An Add with every SamplingParams field set away from its default, encoded and decoded as the core decodes
    it: each field the core reads comes back equal. A field dropped from wire.Params comes back as its default."""
    import dataclasses

    import msgspec

    wire = step_module(step, "wire")
    fields = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert set(NOT_DEFAULT) == set(fields), "a SamplingParams field this test does not set: add it here"
    assert all(NOT_DEFAULT[name] != default for name, default in fields.items())
    sp = SamplingParams(**NOT_DEFAULT)
    frame = msgspec.msgpack.Encoder().encode(wire.Add("0", [1, 2, 3], wire.Params.of(sp)))
    msg = msgspec.msgpack.Decoder(wire.ToCore).decode(frame)
    assert isinstance(msg, wire.Add) and (msg.request_id, msg.prompt_ids) == ("0", [1, 2, 3])
    back = msg.params.sampling_params()
    for name in fields:
        if name in KEPT_BY_THE_FRONT_END:
            assert getattr(back, name) == [], name
        else:
            assert getattr(back, name) == getattr(sp, name), name


@pytest.mark.parametrize("step", STEPS)
def test_the_front_end_imports_no_torch(step):
    """A fresh process imports the front end's modules (the server, AsyncLLM, the wire, the benchmark client),
    starts a core and serves a request through it: torch is never imported in it (the core has it)."""
    code = f"""
import asyncio, sys
import steps.{step}.serve, steps.{step}.bench_serve
from steps.{step}.async_llm import AsyncLLM
from shared import SamplingParams
assert "torch" not in sys.modules, "importing the front end imported torch"
engine = AsyncLLM({TINY!r}, device="cpu", dtype="float32", max_kv_tokens=1024)

async def run():
    return [out async for out in engine.generate("Hello", SamplingParams(temperature=0, max_tokens=3))]

try:
    assert len(asyncio.run(run())[-1].outputs[0].token_ids) == 3
    engine.tokenizer.apply_chat_template([{{"role": "user", "content": "hi"}}])
finally:
    engine.shutdown()
assert "torch" not in sys.modules, "serving a request imported torch in the front end"
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("step", copies_params(STEPS, "engine_args", "kv_spec"))
def test_the_front_ends_kv_cache_dtypes_are_the_engines_one_table(step):
    """serve.py's --kv-cache-dtype offers engine_args.py's choices (it imports no torch): the names of kv_spec.py's
    one table of formats (torch-free), not a copy of it; the engine's check takes each of them and refuses any
    other."""
    args, kv = step_module(step, "engine_args"), step_module(step, "kv_spec")
    choices = next(f.metadata["choices"] for f in args.option_fields() if f.name == "kv_cache_dtype")
    assert choices is kv.KV_CACHE_DTYPES and list(kv.KV_CACHE_DTYPES) == list(kv.FORMATS)
    assert step_module(step, "model").KV_CACHE_DTYPES is kv.KV_CACHE_DTYPES
    for name in choices:
        assert kv.check_kv_cache_dtype(name) == name
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv.check_kv_cache_dtype("fp4")


def test_a_core_that_speaks_another_protocol_is_refused():
    """The core states its wire protocol version in Ready; a front end of another version refuses it at start,
    naming both versions, and stops it."""
    import multiprocessing

    mod, wire = step_module(CORE, "async_llm"), step_module(CORE, "wire")
    theirs = wire.PROTOCOL_VERSION + 1000  # speak_another_protocol's
    before = set(multiprocessing.active_children())
    with pytest.raises(mod.EngineStartError, match=f"protocol version {theirs}, this front end version "
                                                   f"{wire.PROTOCOL_VERSION}"):
        mod.AsyncLLM(TINY, _core_setup=speak_another_protocol, **OPTIONS)
    assert not set(multiprocessing.active_children()) - before, "the refused core still runs"
