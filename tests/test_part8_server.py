"""step24: the OpenAI-compatible server, on 127.0.0.1 and a free port, talked to by the official `openai` client.

- Completions and chat, streamed and not, give the offline engine's text (greedy) and the right usage; 16 clients
  streaming at once all get theirs.
- Each bad request gets its status and an OpenAI-shaped error body (JSON nested thousands deep, a seed beyond
  64 bits, stream_options of another type, a lone surrogate, a wrong method or path included), never a 5xx, and the
  server goes on serving; unknown fields are ignored and named; the API key is enforced on every path but /health.
- A client that disconnects (mid-stream, or while waiting for a whole answer) aborts its request: no block leaks.
- An injected step failure reaches the client (an error event, a 500) and the next request is served.
- serve.py as a command: it starts, answers, and stops cleanly on SIGINT; on SIGTERM its open streams end with an
  error event and [DONE]; it reads its key from the environment; bench_serve.py's metrics add up.
Every server here is stopped by its test or fixture; every call has a timeout.

Every test runs on step24 and on the newest step. From step26 on the engine is a core process of its own: a fault is
injected there (tests/core_faults.py, by the request's seed), and the engine's state is what the core reports.
"""
import asyncio
import inspect
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote

import pytest

from helpers import load_engine, step_module, stop_longer_than_the_first_text
from core_faults import DEATH_SEED, STEP_FAILURE_SEED, inject_faults
from registry import has, introducing, lesson_and_newest
from shared import SamplingParams

SERVERS = lesson_and_newest("openai_server")
MODEL, NAME = "random:tiny-llama", "tiny"
OPTIONS = dict(device="cpu", dtype="float32", max_kv_tokens=4096, max_num_seqs=16)
ROOT = Path(__file__).resolve().parents[1]
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
free_port = step_module(introducing("openai_server"), "parallel").free_port


def has_core(step: str) -> bool:
    """step26 on: the engine runs in a core process (no LLM in this process to look into)."""
    return has(step, "engine_core_process")


class RunningServer:
    """build_app(AsyncLLM) under uvicorn in a thread of this process: a real server on a real port, whose engine the
    test can look into."""

    def __init__(self, step, api_key=None, **options):
        import uvicorn

        self.step = step
        serve = step_module(step, "serve")
        faults = {"_core_setup": inject_faults} if has_core(step) else {}
        self.engine = step_module(step, "async_llm").AsyncLLM(MODEL, **{**OPTIONS, **options}, **faults)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(serve.build_app(self.engine, NAME, api_key), host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server did not stop"
        if has_core(self.step):
            assert not self.engine.process.is_alive(), "the server's shutdown did not stop the engine core"
        else:
            assert not self.engine._thread.is_alive(), "the server's shutdown did not stop the engine"

    def stats(self) -> dict:
        return httpx.get(f"{self.base}/stats", timeout=10).json()

    def wait_idle(self, timeout=15.0) -> dict:
        """Until no request runs or waits and every KV block is free (a leak never gets there)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s["running"] == s["waiting"] == 0 and s["free_blocks"] == s["num_blocks"]:
                return s
            assert time.monotonic() < deadline, f"not idle: {s}"
            time.sleep(0.05)


@pytest.fixture(scope="module", params=SERVERS)
def step(request):
    return request.param


@pytest.fixture(scope="module")
def server(step):
    s = RunningServer(step)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(step):
    return load_engine(step).LLM(MODEL, **OPTIONS)


@pytest.fixture(scope="module")
def small_server(step):
    """A server whose KV pool (256 tokens) is smaller than the model's context (2048)."""
    s = RunningServer(step, max_kv_tokens=256)
    yield s
    s.stop()


def client(server, **kwargs):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", timeout=60, max_retries=0, **kwargs)


def test_the_openai_client_gets_the_offline_engines_text(server, offline):
    c = client(server)
    prompt, sp = "The capital of France is", SamplingParams(temperature=0, max_tokens=12)
    want = offline.generate([prompt], sp)[0]
    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want.outputs[0].text and r.choices[0].finish_reason == want.outputs[0].finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids),
                                                                  len(want.outputs[0].token_ids))
    chunks = list(c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids) and not chunks[-1].choices
    # token ids as the prompt, and logprobs
    r = c.completions.create(model=NAME, prompt=want.prompt_token_ids, max_tokens=12, temperature=0, logprobs=2)
    assert r.choices[0].text == want.outputs[0].text and len(r.choices[0].logprobs.token_logprobs) == 12
    # chat, with a stop string
    messages = [{"role": "user", "content": "Name three primary colors."}]
    sp = SamplingParams(temperature=0, max_tokens=16, stop=["e"])
    want = offline.chat([messages], sp)[0].outputs[0]
    r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0, stop=["e"])
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0, stop=["e"],
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    models = c.models.list()
    assert [m.id for m in models.data] == [NAME]
    server.wait_idle()


def test_a_chat_streamed_equals_the_chat_not_streamed_when_the_stop_string_is_longer_than_the_text(server, offline):
    """The stop string begins the reply and is longer than the reply's first pieces: the answer is empty, and the
    streamed deltas must add up to the same empty text (none sent and then taken back)."""
    messages = [{"role": "user", "content": "Say something short."}]
    free = offline.chat([messages], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop = stop_longer_than_the_first_text(offline.tokenizer, free.token_ids)
    c, options = client(server), dict(model=NAME, messages=messages, max_tokens=12, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**options).choices[0]
    assert (whole.message.content, whole.finish_reason) == ("", "stop")
    chunks = list(c.chat.completions.create(**options, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    server.wait_idle()

def test_sixteen_clients_streaming_at_once_all_get_their_text(server, offline):
    prompts = [f"Client {i} asks about {i * 11}" for i in range(16)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].text for o in offline.generate(prompts, sp)]

    async def one(c, prompt):
        stream = await c.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def main():
        c = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="none", timeout=120, max_retries=0)
        return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(main()) == want
    server.wait_idle()


BAD = [  # (body or raw bytes, status, code, a fragment of the message)
    (b"{not json", 400, None, "malformed JSON"),
    (b"[1, 2]", 400, None, "must be a JSON object"),
    ({"model": NAME, "prompt": "x", "temperature": -1}, 400, None, "temperature must be a finite number >= 0"),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, 400, None, "max_tokens must be an integer >= 1"),
    ({"model": NAME, "prompt": "x", "max_tokens": 5000}, 400, "context_length_exceeded", "exceeds the model's context"),
    ({"model": NAME, "prompt": "word " * 3000}, 400, "context_length_exceeded", "exceeds the model's context"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model_not_found", "does not exist"),
    ({"prompt": "x"}, 400, None, "model is required"),
    ({"model": NAME}, 400, None, "prompt is required"),
    ({"model": NAME, "prompt": "x", "n": 2}, 400, None, "n=2"),
    ({"model": NAME, "prompt": "x", "echo": True}, 400, None, "echo=True is not supported"),
    ({"model": NAME, "prompt": "x", "frequency_penalty": 0.5}, 400, None, "frequency_penalty=0.5 is not supported"),
    ({"model": NAME, "prompt": ["a", "b"]}, 400, None, "one prompt per request"),
    ({"model": NAME, "prompt": [[1, 2], [3]]}, 400, None, "one prompt per request"),
    ({"model": NAME, "prompt": 12}, 400, None, "prompt must be a string or a list of token ids, got int"),
    ({"model": NAME, "prompt": [12, True]}, 400, None, "token id True: expected an int, got bool"),
    ({"model": NAME, "prompt": "x", "temperature": 2.5}, 400, None, "temperature must be in [0, 2]"),
    ({"model": NAME, "prompt": "x", "stop": 5}, 400, None, "stop must be"),
    ({"model": NAME, "prompt": "x", "logprobs": -1}, 400, None, "logprobs must be"),
    # nested too deep for json.loads (its RecursionError), or for anything that recurses into the value
    (b"[" * 100_000 + b"]" * 100_000, 400, None, "the request body is nested more than"),
    (b'{"model": "tiny", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, None, "prompt is nested more than"),
    ({"model": NAME, "prompt": "x", "user": json.loads("[" * 200 + "]" * 200)}, 400, None, "user is nested more than"),
    # a seed beyond 64 bits (msgpack and torch.Generator take no more); a top_k beyond int64
    ({"model": NAME, "prompt": "x", "seed": 2**64}, 400, None, "seed must be None or an integer in [-2**63, 2**64 -"),
    ({"model": NAME, "prompt": "x", "seed": -2**63 - 1}, 400, None, "seed must be None or an integer in [-2**63,"),
    ({"model": NAME, "prompt": "x", "top_k": 2**64}, 400, None, "top_k must be"),
    # stream and stream_options of another type
    ({"model": NAME, "prompt": "x", "stream": True, "stream_options": "usage"}, 400, None,
     "stream_options must be an object or null, got str"),
    ({"model": NAME, "prompt": "x", "stream": True, "stream_options": [True]}, 400, None,
     "stream_options must be an object or null, got list"),
    ({"model": NAME, "prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, 400, None,
     "stream_options.include_usage must be true, false or null"),
    ({"model": NAME, "prompt": "x", "stream": "false"}, 400, None, "stream must be true, false or null"),
    # a lone surrogate (JSON's escape of half a UTF-16 pair): no text the tokenizer takes
    (b'{"model": "tiny", "prompt": "hi \\ud800"}', 400, None, "prompt is not valid UTF-8 text: it holds a lone"),
    (b'{"model": "tiny", "prompt": "x", "stop": ["a", "\\udc00"]}', 400, None, "stop[1] is not valid UTF-8 text"),
]

NAMED = {"prompt must be a string or a list of token ids, got int": "prompt",  # fragment -> the error's param
         "temperature must be in [0, 2]": "temperature", "one prompt per request": "prompt", "n=2": "n",
         "the request body is nested more than": None, "prompt is nested more than": "prompt",
         "user is nested more than": "user", "stream_options must be an object or null, got str": "stream_options",
         "stream_options must be an object or null, got list": "stream_options",
         "stream_options.include_usage must be true, false or null": "stream_options.include_usage",
         "stream must be true, false or null": "stream",
         "prompt is not valid UTF-8 text: it holds a lone": "prompt", "stop[1] is not valid UTF-8 text": "stop[1]"}


@pytest.mark.parametrize("body,status,code,fragment", BAD)
def test_a_bad_request_gets_its_status_and_an_openai_error_body(server, body, status, code, fragment):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.base}/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert fragment in error["message"], error
    assert error["param"] == NAMED.get(fragment, error["param"]), error  # the server's own checks name the field
    assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200  # and the server goes on
    r = httpx.post(f"{server.base}/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text


def test_bad_input_from_the_openai_client_is_a_400_streamed_or_not(server, offline):
    """The official client sends these as given. Each is refused before anything is queued, so a stream gets the 400
    too (not a 200 whose stream breaks off); the offline engine refuses the same seed."""
    c = client(server)
    for options, fragment, param in (
            (dict(seed=2**64), "seed must be None or an integer in [-2**63, 2**64 - 1]", None),
            (dict(seed=-2**63 - 1), "seed must be None or an integer in [-2**63, 2**64 - 1]", None),
            (dict(stream_options="include_usage"), "stream_options must be an object or null", "stream_options"),
            (dict(stream_options=["include_usage"]), "stream_options must be an object or null", "stream_options")):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                list(c.completions.create(model=NAME, prompt="x", max_tokens=2, stream=stream, **options))
            assert fragment in e.value.message and e.value.param == param, (options, stream, e.value.body)
    sp = SamplingParams(temperature=0, max_tokens=2)
    sp.seed = 2**64  # set after construction: the engine checks the params again with the request
    with pytest.raises(ValueError, match=r"seed must be None or an integer in \[-2\*\*63, 2\*\*64 - 1\]"):
        offline.generate(["x"], sp)
    for seed in (2**64 - 1, -2**63):  # the ends of the range are seeds
        assert c.completions.create(model=NAME, prompt="x", max_tokens=2, seed=seed).usage.completion_tokens == 2
    server.wait_idle()


def test_a_wrong_method_or_path_gets_an_openai_error_body(server):
    """starlette's own errors (no such path, a method the path does not take) in OpenAI's shape too; and no API docs
    pages are served."""
    for method, path, status in (("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405),
                                 ("GET", "/v1/nothing", 404), ("GET", "/docs", 404), ("GET", "/redoc", 404),
                                 ("GET", "/openapi.json", 404)):
        r = httpx.request(method, f"{server.base}{path}", timeout=30)
        assert r.status_code == status, (method, path, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and f"{method} {path}" in error["message"], error
        if status == 405:
            assert r.headers["allow"] in ("GET", "POST"), r.headers
    r = httpx.post(f"{server.base}/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("pool", ["context", "kv pool"])
def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context(server, small_server, pool):
    """As vLLM's: a chat reply without max_tokens may take what its prompt leaves of the context (or of the KV pool,
    where that is smaller: 256 tokens of small_server's against a context of 2048); a completion keeps OpenAI's 16."""
    s = server if pool == "context" else small_server
    room = 2048 if pool == "context" else 256
    c = client(s)
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Go on."}], temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == room - r.usage.prompt_tokens > 16
    r = c.completions.create(model=NAME, prompt="Go on.", temperature=0, extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 16)
    s.wait_idle()

def test_a_request_too_large_for_the_kv_pool_is_not_called_a_context_overflow(small_server):
    """The engine's errors have types, and the code follows the type: a request that fits the context but never
    the KV pool is a plain invalid request, not context_length_exceeded."""
    r = httpx.post(f"{small_server.base}/v1/completions", timeout=30,
                   json={"model": NAME, "prompt": "x", "max_tokens": 300})
    assert r.status_code == 400 and "it could never fit in the KV pool" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] is None
    r = httpx.post(f"{small_server.base}/v1/completions", timeout=30,
                   json={"model": NAME, "prompt": "x", "max_tokens": 3000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_bad_chat_requests_and_unknown_fields(server, offline):
    for messages, fragment in (([], "messages: a conversation is a non-empty list of messages"),
                               ([{"role": "robot", "content": "hi"}], "messages: unknown role 'robot'"),
                               ([{"content": "hi"}], "messages: each message needs 'role'"),
                               ("hi", "messages: a conversation is a non-empty list")):
        r = httpx.post(f"{server.base}/v1/chat/completions", json={"model": NAME, "messages": messages}, timeout=30)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "messages"
    # a field this server does not know is ignored (vLLM's way), and named in a header
    r = httpx.post(f"{server.base}/v1/completions", timeout=30,
                   json={"model": NAME, "prompt": "hi", "max_tokens": 3, "temperature": 0, "my_field": 1, "user": "u"})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "my_field"
    assert r.json()["choices"][0]["text"] == offline.generate(["hi"], SamplingParams(temperature=0, max_tokens=3))[
        0].outputs[0].text
    # a lone surrogate in a message: named where it is, not the tokenizer's words
    r = httpx.post(f"{server.base}/v1/chat/completions", headers={"content-type": "application/json"}, timeout=30,
                   content=b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    assert "messages[0].content is not valid UTF-8 text: it holds a lone surrogate" in r.json()["error"]["message"]
    # unknown fields of any name, named in the header as sent, percent-encoded where a header could not hold them
    names = ["a b", " lead", "line\nbreak", "\u00e9t\u00e9", "\u4e2d\u6587", "my_field"]
    r = httpx.post(f"{server.base}/v1/completions", timeout=30,
                   json={"model": NAME, "prompt": "hi", "max_tokens": 1, **dict.fromkeys(names, 1)})
    assert r.status_code == 200 and unquote(r.headers["x-ignored-fields"]).split(",") == sorted(names), r.headers
    r = httpx.post(f"{server.base}/v1/completions", headers={"content-type": "application/json"}, timeout=30,
                   content=b'{"model": "tiny", "prompt": "hi", "max_tokens": 1, "\\ud800": 1}')
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "%5Cud800", r.headers


def test_the_api_key_is_required_when_set(step, offline):
    s = RunningServer(step, api_key="sekret")
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer sekre"},
                        {"Authorization": "sekret"}):
            r = httpx.post(f"{s.base}/v1/completions", json={"model": NAME, "prompt": "x"}, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            # every path but /health: /stats (the engine's state) and what does not exist as much as /v1/*
            for path in ("/v1/models", "/stats", "/docs", "/openapi.json", "/redoc", "/nowhere"):
                r = httpx.get(f"{s.base}{path}", headers=headers, timeout=30)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert httpx.get(f"{s.base}/health", timeout=30).status_code == 200  # health needs no key
        key = {"Authorization": "Bearer sekret"}
        assert "free_blocks" in httpx.get(f"{s.base}/stats", headers=key, timeout=30).json()
        for path in ("/docs", "/openapi.json", "/redoc"):  # no API docs pages, key or not
            assert httpx.get(f"{s.base}{path}", headers=key, timeout=30).status_code == 404
        c = openai.OpenAI(base_url=f"{s.base}/v1", api_key="sekret", timeout=60, max_retries=0)
        want = offline.generate(["x"], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].text
        assert c.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=0).choices[0].text == want
    finally:
        s.stop()


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    before = server.stats()["aborted"]
    body = {"model": NAME, "prompt": "go on and on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # three events (and their blank lines), then the client goes away
    assert sum(line.startswith("data: ") for line in got) == 3
    s = server.wait_idle()
    assert s["aborted"] == before + 1


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_blocks(server):
    before = server.stats()["aborted"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base}/v1/completions", timeout=1.0,
                   json={"model": NAME, "prompt": "a long answer", "max_tokens": 2000, "ignore_eos": True})
    s = server.wait_idle()
    assert s["aborted"] == before + 1


@contextlib.contextmanager
def step_failures(server):
    """-> the request fields that make the engine step serving a request fail after its first token. In-process
    (step24) the model runner is patched: its second call from now on fails, and each call of the returned
    function re-arms it; with a core (step26 on) the core's injected fault (core_faults.py) fails on the seed."""
    if has_core(server.step):
        yield {"seed": STEP_FAILURE_SEED}, lambda: None
        return
    runner = server.engine.llm.runner
    execute, calls = runner.execute, []

    def failing(work):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return execute(work)

    runner.execute = failing
    try:
        yield {}, calls.clear
    finally:
        runner.execute = execute


def test_an_injected_step_failure_reaches_the_client_and_the_server_goes_on(server, offline):
    with step_failures(server) as (fault, rearm):
        with httpx.stream("POST", f"{server.base}/v1/completions", timeout=30, json={
                "model": NAME, "prompt": "x", "max_tokens": 20, "ignore_eos": True, "stream": True, **fault}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "injected failure" in events[-2], events
        assert json.loads(events[-2][len("data: "):])["error"]["type"] == "server_error"
        rearm()
        r = httpx.post(f"{server.base}/v1/completions", timeout=30,
                       json={"model": NAME, "prompt": "x", "max_tokens": 20, "ignore_eos": True, **fault})
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base}/v1/completions", timeout=30,
                   json={"model": NAME, "prompt": "x", "max_tokens": 5, "temperature": 0})
    assert r.json()["choices"][0]["text"] == offline.generate(["x"], SamplingParams(temperature=0, max_tokens=5))[
        0].outputs[0].text
    server.wait_idle()


def test_a_dead_engine_ends_every_stream_and_answers_503(step):
    """An error outside an engine step (here: adding a request raises) kills the engine's step loop (step24) or
    the core's busy loop (step26 on). The stream that was running ends with an error event, the request that hit
    the failure and every later one get an error in OpenAI's shape (503; with a core, the request it was serving
    when it died gets 500), and /health says 503: a dead engine does not look healthy."""
    s = RunningServer(step)
    broken, fields = [], {"seed": DEATH_SEED} if has_core(step) else {}
    if not has_core(step):
        add = s.engine.llm._add

        def failing_add(*args, **kwargs):
            if broken:
                raise RuntimeError("injected failure outside a step")
            return add(*args, **kwargs)

        s.engine.llm._add = failing_add
    try:
        body = {"model": NAME, "prompt": "go on and on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.base}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")  # running
            broken.append(True)
            r2 = httpx.post(f"{s.base}/v1/completions", timeout=30,
                            json={"model": NAME, "prompt": "x", "max_tokens": 2, **fields})
            events = [line for line in lines if line.startswith("data: ")]
        assert r2.status_code == (500 if has_core(step) else 503), r2.text
        assert "injected failure outside a step" in r2.json()["error"]["message"], r2.text
        assert events[-1] == "data: [DONE]" and "injected failure outside a step" in events[-2], events[-3:]
        assert json.loads(events[-2][len("data: "):])["error"]["type"] == "server_error"
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/health")):
            r = httpx.request(method, f"{s.base}{path}", timeout=30, json={
                "model": NAME, "prompt": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            error = r.json()["error"]
            assert r.status_code == 503 and set(error) == {"message", "type", "param", "code"}, (path, r.text)
            assert "RuntimeError: injected failure outside a step" in error["message"], error
    finally:
        s.stop()


def test_stats_shows_the_engine_between_two_steps_never_halfway_through_one(server):
    """/stats never shows an engine halfway through a step. step24: /stats runs in the event loop's thread while
    the step thread changes the LLM, so it reads the copy the step thread made between two steps; here a step is
    held inside its forward, after the scheduler has taken the new request into the batch and given it blocks:
    /stats still shows the request waiting and every block free. step26 on: the core answers /stats between two
    of its steps, from its own process: a request that streams shows as running, with its blocks taken."""
    if has_core(server.step):
        idle = server.wait_idle()
        body = {"model": NAME, "prompt": "go on and on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            mid = server.stats()
        assert (mid["running"], mid["waiting"], mid["streams"]) == (1, 0, 1), mid
        assert mid["free_blocks"] < idle["num_blocks"] and mid["steps"] > idle["steps"], mid
        after = server.wait_idle()
        assert after["aborted"] == idle["aborted"] + 1
        return
    runner, idle = server.engine.llm.runner, server.wait_idle()
    execute, inside, go_on = runner.execute, threading.Event(), threading.Event()

    def held(work):
        inside.set()
        assert go_on.wait(30)
        return execute(work)

    runner.execute = held
    try:
        request = threading.Thread(target=httpx.post, args=(f"{server.base}/v1/completions",), daemon=True,
                                   kwargs=dict(json={"model": NAME, "prompt": "x", "max_tokens": 2}, timeout=60))
        request.start()
        assert inside.wait(30)
        mid = server.stats()
        assert server.engine.llm.scheduler.running  # the live LLM: the request runs and holds blocks
    finally:
        go_on.set()
        runner.execute = execute
    request.join(60)
    assert (mid["running"], mid["waiting"], mid["free_blocks"], mid["steps"]) == (0, 1, idle["num_blocks"],
                                                                                  idle["steps"]), mid
    assert mid["streams"] == 1
    after = server.wait_idle()
    assert after["steps"] == idle["steps"] + 2


def test_bench_serve_measures_what_the_server_served(server):
    bench = step_module(server.step, "bench_serve")
    prompts = bench.random_prompts(6, 16, seed=3)
    r = asyncio.run(bench.bench(server.base, NAME, float("inf"), prompts, 5))
    assert (r["completed"], r["failed"], r["output_tokens"]) == (6, 0, 30)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        m = r[key]
        assert 0 < m["p50"] <= m["p90"] <= m["p99"] and m["mean"] > 0, (key, m)
    assert r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
    assert r["output_throughput"] == pytest.approx(30 / r["duration_s"])
    bad = asyncio.run(bench.bench(server.base, "not-served", float("inf"), prompts[:2], 5))
    assert bad["failed"] == 2 and "HTTP 404" in bad["errors"][0]


def test_bench_serve_can_spread_its_client_over_processes(server):
    """step26's client (bench_serve.py --client-processes): the requests split over processes that start from one
    moment, their results put back together: every request counted once, the latencies on one clock (no request's
    E2E is longer than the run), and the CPU seconds of all the client's processes."""
    bench = step_module(server.step, "bench_serve")
    if "procs" not in inspect.signature(bench.bench).parameters:
        pytest.skip(f"{server.step}'s bench_serve.py has one client process")
    prompts = bench.random_prompts(5, 12, seed=4)
    r = asyncio.run(bench.bench(server.base, NAME, float("inf"), prompts, 4, procs=2))
    assert (r["completed"], r["failed"], r["output_tokens"], r["client_processes"]) == (5, 0, 20, 2)
    assert 0 < r["ttft_ms"]["p50"] <= r["e2e_ms"]["p99"] <= 1000 * r["duration_s"]
    assert r["client_cpu_s"] > 0 and 0 <= r["itl_zero_fraction"] <= 1
    assert r["total_token_throughput"] == pytest.approx((20 + 5 * 12) / r["duration_s"])


def test_bench_serve_warms_up_before_the_first_measured_rate(server, monkeypatch, capsys):
    """bench_serve.py as a command: an untimed warm-up (one request, then all of them at once, of the measured
    prompts' lengths but other token ids, so the measured ones are not in the prefix cache) before the first rate,
    then one JSON line per rate and nothing for the warm-up; --no-warmup goes straight to the rates."""
    mod = step_module(server.step, "bench_serve")
    calls, real = [], mod.bench

    async def recording(base, model, rate, prompts, output_len, *args, **kwargs):
        calls.append((rate, prompts))
        return await real(base, model, rate, prompts, output_len, *args, **kwargs)

    monkeypatch.setattr(mod, "bench", recording)
    argv = ["bench_serve.py", "--base-url", server.base, "--model", NAME, "--request-rates", "inf",
            "--num-prompts", "3", "--input-len", "8", "--output-len", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    mod.main()
    measured = mod.random_prompts(3, 8, 0)
    assert [len(prompts) for _, prompts in calls] == [1, 3, 3] and calls[-1][1] == measured
    warm = calls[1][1]
    assert calls[0][1] == warm[:1] and [len(p) for p in warm] == [8, 8, 8]
    assert not set(map(tuple, warm)) & set(map(tuple, measured))
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["completed"] == 3
    calls.clear()
    monkeypatch.setattr(sys, "argv", argv + ["--no-warmup"])
    mod.main()
    assert [len(prompts) for _, prompts in calls] == [3]


@contextlib.contextmanager
def serve_py(step, *options, env=None):
    """serve.py run as a command on a free port, once it answers /health: -> (the process, its base URL). Its stdout
    and stderr are pipes; it is killed at the end if it still runs."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, f"steps/{step}/serve.py", "--model", MODEL, "--port", str(port),
                             "--device", "cpu", *options], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve.py did not start"
            time.sleep(0.2)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_py_starts_answers_and_stops_on_sigint(step):
    with serve_py(step, "--max-kv-tokens", "1024") as (proc, base):
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    assert f"serving {MODEL} on {base}/v1" in proc.communicate()[0]


def test_serve_py_takes_its_key_from_the_environment_and_ends_open_streams_on_sigterm(step):
    """The key in LLM_STEPS_API_KEY, not on the command line (where `ps` shows it): a request without it gets 401,
    /health needs none. SIGTERM with a stream open: the engine stops first, so the stream ends at once with an error
    event and [DONE] instead of being cut off after uvicorn's grace period; no traceback. The exit status is 0 from
    step26 on, which makes SIGTERM exit as SIGINT does; step24 keeps the signal's own."""
    env = {**os.environ, "LLM_STEPS_API_KEY": "sekret"}
    with serve_py(step, "--max-kv-tokens", "4096", env=env) as (proc, base):
        assert httpx.get(f"{base}/stats", timeout=30).status_code == 401
        key = {"Authorization": "Bearer sekret"}
        assert httpx.get(f"{base}/stats", headers=key, timeout=30).status_code == 200
        body = {"model": MODEL, "prompt": "go on and on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=key, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")  # running
            proc.send_signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", events[-2:]
        error = json.loads(events[-2][len("data: "):])["error"]
        assert error["type"] == "server_error" and "shut down" in error["message"], error
        assert proc.wait(timeout=60) == (0 if has_core(step) else -signal.SIGTERM)
    out, err = proc.communicate()
    assert "Traceback" not in out + err, err[-3000:]


def test_serve_py_refuses_bad_options_in_one_line(step):
    proc = subprocess.run([sys.executable, f"steps/{step}/serve.py", "--model", MODEL, "--device", "cpu",
                           "--max-num-seqs", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "max_num_seqs must be" in errors[0], proc.stderr[-2000:]
