"""An OpenAI-compatible HTTP server on top of the streaming engine (async_llm.py's AsyncLLM).

Its AsyncLLM runs the engine in a core process of its own (engine_core.py): this process
keeps HTTP, JSON, the tokenizer and the detokenizer, and imports neither torch nor the engine (what it reports of
the core, /stats, comes over the wire); the core keeps the scheduler and the model. A core that dies
(killed, or its loop failed) ends every open stream with an error event, answers a request it was serving with 500,
and every later request, /health included, with 503. A core that fails to start ends the server with its error on
one line. SIGINT or SIGTERM stops the server and the core, exit status 0.

    python steps/step27/serve.py --model smollm2-135m [--host 127.0.0.1] [--port 8000] [--api-key K] [engine options]

Endpoints (OpenAI's API, as vLLM serves it):

    GET  /health                 200 while the engine runs, 503 once it has stopped (shut down, or dead)
    GET  /v1/models              the one model served
    POST /v1/completions         a prompt (text or token ids) -> text; "stream": true for server-sent events
    POST /v1/chat/completions    messages -> the assistant's reply (the model's chat template); streams the same way
    GET  /stats                  this server's own: requests running and waiting, free KV blocks, steps
No other path or method is served (404, 405), nor API docs pages (/docs, /openapi.json).

A request's fields: model, prompt / messages, max_tokens (max_completion_tokens), temperature, top_p, top_k, min_p,
stop, seed, n (1), logprobs (and top_logprobs for chat), ignore_eos, stream, stream_options.include_usage. Without
max_tokens a completion makes 16 tokens (OpenAI's default) and a chat reply may run to the end of the context
(vLLM's), or of the KV pool where that is smaller. Fields this server does not know are ignored, as vLLM ignores
them, and named in the response's `x-ignored-fields` header; fields it knows but does not implement (n > 1, echo,
best_of, a penalty, logit_bias, ...) are refused with 400 rather than silently misread.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}, on every path: 400 for malformed JSON,
JSON nested deeper than any request (MAX_DEPTH), a string with a lone surrogate (no UTF-8 text), a field of the
wrong type, an invalid value (the engine's own ValueError text) or a prompt beyond the context; 404 for another
model or an unknown path, 405 for a wrong method; 401 without the key; 500 when the engine step serving the request
failed; 503 once the engine is dead (its step loop stopped on an error: every request then gets 503, and /health
too, so that a supervisor restarts the server). A client that goes away mid-request aborts it: its KV blocks are
free at once. SIGINT or SIGTERM stops the engine first: every open stream ends with an error event and [DONE].

The key (--api-key, or else the environment variable LLM_STEPS_API_KEY, which `ps` does not show) is needed on
every path but /health, /stats included, as 'Authorization: Bearer KEY', compared in constant time.

Streaming is server-sent events (SSE): each chunk is a line `data: {json}` and a blank line, the text in each
chunk is what is new since the one before (the engine's cumulative text, differenced), and the stream ends with
`data: [DONE]`.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import re
import signal
import time
import uuid

from contextlib import asynccontextmanager
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from shared import ContextLengthExceededError, SamplingParams, check_messages

from shared.threads import threads_cpu_s

from .async_llm import AsyncLLM, EngineDeadError, EngineShutDown, EngineStartError, EngineStepError
from .wire import check_transfer_params
from .engine_args import add_cli_args, from_cli_args

# OpenAI fields this server reads (each checked) or knows to be harmless (user: an end-user id, for their logs).
KNOWN = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
         "min_p", "stop", "seed", "n", "logprobs", "top_logprobs", "ignore_eos", "stream", "stream_options", "user",
         "kv_transfer_params"}  # prefill and decode apart (kv_connector.py): vLLM's field
# OpenAI fields with a meaning this server does not implement: refused unless they hold their default
UNSUPPORTED = {"echo": False, "best_of": 1, "suffix": None, "logit_bias": None, "presence_penalty": 0,
               "frequency_penalty": 0, "tools": None, "tool_choice": None, "response_format": None,
               "functions": None, "function_call": None, "parallel_tool_calls": None}
# Lists and objects in a request nest a few deep (messages[0].content); a value nested deeper is refused before
# anything recurses into it (json.loads, repr, the tokenizer would run out of Python's stack thousands deep)
MAX_DEPTH = 32
API_KEY_ENV = "LLM_STEPS_API_KEY"  # the key when --api-key is not given: the environment is not in `ps`


class APIError(Exception):
    """An error the client gets back, in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---- a request's body -> the engine's inputs ------------------------------------------------------------------
def parse_body(raw: bytes) -> tuple[dict, list[str]]:
    """The JSON object of a request -> (the object, the fields ignored). APIError(400) for anything else, and for a
    value nested too deep or a string with a lone surrogate (check_values)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON in the request body: {e}") from None
    except RecursionError:  # nested thousands deep: json.loads ran out of stack; find the field in the text
        too_deep(deepest_field(raw.decode(json.detect_encoding(raw), "replace")))
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_values(body)
    for name, default in UNSUPPORTED.items():
        value = body.get(name, default)
        if value not in (default, None) and value != [] and value != {}:  # only a default (or empty) value passes
            raise APIError(400, f"{name}={value!r} is not supported by this server", param=name)
    if body.get("n", 1) != 1:
        raise APIError(400, f"n={body['n']!r}: this server returns one choice per request (n=1)", param="n")
    ignored = sorted(set(body) - KNOWN - set(UNSUPPORTED))
    return body, ignored


def too_deep(field: str | None):
    """The error for a value nested more than MAX_DEPTH deep, in `field` (None: the body itself)."""
    raise APIError(400, f"{field or 'the request body'} is nested more than {MAX_DEPTH} deep (lists and objects)",
                   param=field)


def deepest_field(text: str) -> str | None:
    """The top-level field of a JSON text where lists and objects first nest more than MAX_DEPTH deep (None: the
    body itself, or nowhere), read token by token: what names the field when json.loads ran out of stack."""
    depth, field, key_next = -1, None, False  # depth 0: the body; 1: a field's value
    for token in re.finditer(r'"(?:[^"\\]|\\.)*"|[][{},]', text):
        t = token.group()
        if t in ("[", "{"):
            depth += 1
            if depth > MAX_DEPTH:
                return field
            key_next = depth == 0 and t == "{"
        elif t in ("]", "}"):
            depth -= 1
        elif t == ",":
            key_next = depth == 0
        elif key_next:  # a string where the body's next key comes
            field, key_next = printable(json.loads(t)), False
    return None


def printable(text: str) -> str:
    """A string the client may get back in a message: a lone surrogate (no UTF-8 text) as its escape, \\ud800."""
    return text.encode("utf-8", "backslashreplace").decode()


def check_values(body: dict) -> None:
    """Every value in the body, walked with a stack (no recursion): APIError(400) for one nested more than MAX_DEPTH
    deep, naming its field, and for a string that holds a lone surrogate (JSON's "\\ud800" decodes to one, and no
    text encoding takes it, the tokenizer's included), naming where it is: prompt, messages[0].content."""
    stack = [(value, printable(name), printable(name), 1) for name, value in body.items()]
    while stack:
        value, field, where, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError as e:
                raise APIError(400, f"{where} is not valid UTF-8 text: it holds a lone surrogate "
                                    f"(U+{ord(value[e.start]):04X} at index {e.start})", param=where) from None
        elif isinstance(value, (list, dict)):
            if depth > MAX_DEPTH:
                too_deep(field)
            is_dict = isinstance(value, dict)
            for k, v in value.items() if is_dict else enumerate(value):
                if isinstance(v, (str, list, dict)):  # a number, a bool, null: nothing to check
                    stack.append((v, field, f"{where}.{printable(k)}" if is_dict else f"{where}[{k}]", depth + 1))


def streaming(body: dict) -> tuple[bool, bool]:
    """A request's stream and stream_options -> (stream, include_usage). APIError(400) naming a field of another
    type: the string "false" is no false, and stream_options is an object."""
    stream, options = body.get("stream"), body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, f"stream_options must be an object or null, got {type(options).__name__}",
                       param="stream_options")
    usage = (options or {}).get("include_usage")
    for name, value in (("stream", stream), ("stream_options.include_usage", usage)):
        if value is not None and not isinstance(value, bool):
            raise APIError(400, f"{name} must be true, false or null, got {value!r:.40}", param=name)
    return bool(stream), bool(usage)


def sampling_params(body: dict, chat: bool, room: int) -> SamplingParams:
    """The request's sampling fields -> SamplingParams (OpenAI's defaults: temperature 1, 16 tokens for a completion;
    a chat reply may run to the end of the context, as vLLM's does: `room` tokens, what its prompt leaves). A
    temperature above 2, outside OpenAI's range, is an APIError naming it; ValueError names any other bad value."""
    if chat:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = room if max_tokens is None else max_tokens
        logprobs = body.get("top_logprobs", 0) if body.get("logprobs") else None
        if body.get("logprobs") not in (None, True, False):
            raise ValueError(f"logprobs must be true or false for a chat completion, got {body['logprobs']!r}")
    else:
        max_tokens = body.get("max_tokens", 16)
        logprobs = body.get("logprobs")
    options = dict(temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
                   top_k=body.get("top_k", -1), min_p=body.get("min_p", 0.0), stop=body.get("stop"),
                   seed=body.get("seed"), logprobs=logprobs, ignore_eos=body.get("ignore_eos", False))
    for name in ("temperature", "top_p", "top_k", "min_p", "ignore_eos"):
        if options[name] is None:  # JSON null: the default
            options.pop(name)
    temperature = options.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 2:
        raise APIError(400, f"temperature must be in [0, 2] (OpenAI's range), got {temperature!r}", param="temperature")
    return SamplingParams(**options, **({"max_tokens": max_tokens} if max_tokens is not None else {}))


class Server:
    """The app's state: the engine, the model's name, the key; and the handlers, one per endpoint."""

    def __init__(self, engine: AsyncLLM, model_name: str, api_key: str | None = None):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.created = int(time.time())

    def check_key(self, authorization: bytes | None) -> None:
        """401 unless the Authorization header's bytes are `Bearer <key>`, compared in constant time: how long the
        check takes tells nothing of how much of a guess was right."""
        if self.api_key is not None and not hmac.compare_digest(authorization or b"",
                                                                b"Bearer " + self.api_key.encode()):
            raise APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None:
            raise APIError(400, "model is required", param="model")
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist: this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "llm-steps", "max_model_len": self.engine.llm.max_model_len}]}

    async def stats(self) -> dict:
        # the core's state (wire.py's Stats, which it sends between two of its steps when asked: its
        # counters, CPU seconds, torch threads, and the engine's counters under "engine"), and this process's own
        core = await self.engine.get_stats()
        return {**self.engine.snapshot(), **core, "process_cpu_s": time.process_time(),  # this process's CPU time
                "front_end_threads_cpu_s": threads_cpu_s()}  # ... by thread: the event loop, the core's reader

    def room(self, prompt_len: int) -> int:
        """The tokens a reply may take after a prompt of prompt_len tokens: the rest of the model's context, or of the
        KV pool where that is smaller (a request must fit in it alone). At least 1: a prompt that fills the context
        gets the engine's own error."""
        llm = self.engine.llm
        pool = llm.block_manager.num_blocks * llm.block_manager.block_size
        return max(1, min(llm.max_model_len, pool) - prompt_len)

    def prompt(self, body: dict, chat: bool):
        """The prompt the engine runs: text or token ids (a completion), the chat template's ids (a chat)."""
        tokenizer = self.engine.tokenizer
        if chat:
            if "messages" not in body:
                raise APIError(400, "messages is required", param="messages")
            try:
                messages = check_messages(body["messages"], "messages")
                return tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages])
            except ValueError as e:  # a bad message, or a model without a chat template
                raise APIError(400, str(e), param="messages") from None
        if "prompt" not in body:
            raise APIError(400, "prompt is required", param="prompt")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if not isinstance(prompt, (str, list)):  # a bare number is no prompt (the engine would read it as [id])
            raise APIError(400, f"prompt must be a string or a list of token ids, got {type(prompt).__name__} "
                                f"({prompt!r:.40})", param="prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise APIError(400, f"this server takes one prompt per request, got {len(prompt)}", param="prompt")
        return prompt

    # ---- one completion ---------------------------------------------------------------------------------
    def check_running(self) -> None:
        if not self.engine.is_running:
            why = str(self.engine.dead_error) if self.engine.errored else "the engine is shut down"
            raise APIError(503, why, kind="server_error")

    def start(self, body: dict, chat: bool):
        """Check everything, then submit: -> (request id, its output stream, the prompt's token count)."""
        self.check_running()
        prompt = self.prompt(body, chat)
        try:
            params = sampling_params(body, chat, self.room(len(prompt)) if chat else 0)
            text, ids, sp = self.engine.llm.check_request(prompt, params)
        except (ValueError, TypeError) as e:  # the engine's error type says which code it is
            code = "context_length_exceeded" if isinstance(e, ContextLengthExceededError) else None
            raise APIError(400, str(e), code=code) from None
        transfer = body.get("kv_transfer_params")
        if transfer is not None:  # prefill and decode apart: checked against this engine's role
            try:
                check_transfer_params(transfer, self.engine.llm.kv_role, len(ids), self.engine.llm.block_manager.block_size)
            except ValueError as e:
                raise APIError(400, str(e), param="kv_transfer_params") from None
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        return request_id, self.engine.generate(ids, sp, request_id, kv_transfer_params=transfer), len(ids), sp

    def choice_logprobs(self, out, sp, chat: bool, first: int = 0):
        """The logprobs of tokens first.. of the output, in the endpoint's shape (None when not asked for)."""
        c = out.outputs[0]
        if c.logprobs is None:
            return None
        name = lambda t: self.engine.tokenizer.decode([t])  # noqa: E731  (a token's own text)
        ids, dicts = c.token_ids[first:], c.logprobs[first:]
        if chat:
            return {"content": [{"token": name(t), "logprob": d[t], "bytes": list(name(t).encode()),
                                 "top_logprobs": [{"token": name(k), "logprob": v, "bytes": list(name(k).encode())}
                                                  for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:sp.logprobs]]}
                                for t, d in zip(ids, dicts)]}
        return {"tokens": [name(t) for t in ids], "token_logprobs": [d[t] for t, d in zip(ids, dicts)],
                "top_logprobs": [{name(k): v for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:sp.logprobs]}
                                 for d in dicts], "text_offset": None}

    def response(self, request_id: str, out, prompt_tokens: int, sp, chat: bool) -> dict:
        c = out.outputs[0]
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(c.token_ids),
                 "total_tokens": prompt_tokens + len(c.token_ids)}
        logprobs = self.choice_logprobs(out, sp, chat)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                      "finish_reason": c.finish_reason}
        else:
            choice = {"index": 0, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}
        answer = {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                  "created": int(time.time()), "model": self.model_name, "choices": [choice], "usage": usage}
        if out.kv_transfer_params is not None:  # a kv_producer's: what the decode engine pulls the blocks with
            answer["kv_transfer_params"] = out.kv_transfer_params
        return answer

    async def complete(self, stream, is_disconnected):
        """Read a request's stream to its end -> its last output; the client going away aborts it."""
        async def consume():
            last = None
            async for out in stream:
                last = out
            return last

        task = asyncio.ensure_future(consume())
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=0.25)
                if done:
                    return task.result()
                if await is_disconnected():
                    return None
        finally:
            if not task.done():  # cancelled in generate(): its finally aborts the request
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def sse(self, request_id: str, stream, prompt_tokens: int, sp, chat: bool, include_usage: bool):
        """The stream as server-sent events: a chunk per output with the new text, then usage (if asked), [DONE]."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(choice: dict | None, usage: dict | None = None) -> str:
            body = {"id": request_id, "object": kind, "created": created, "model": self.model_name,
                    "choices": [choice] if choice is not None else []}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        sent_text, sent_tokens, out = "", 0, None
        try:
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            async for out in stream:
                c = out.outputs[0]
                new = c.text[len(sent_text):]
                if not new and not out.finished and len(c.token_ids) == sent_tokens:
                    continue
                logprobs = self.choice_logprobs(out, sp, chat, first=sent_tokens)
                reason = c.finish_reason if out.finished else None
                if chat:
                    choice = {"index": 0, "delta": {"content": new} if new else {}, "logprobs": logprobs,
                              "finish_reason": reason}
                else:
                    choice = {"index": 0, "text": new, "logprobs": logprobs, "finish_reason": reason}
                yield chunk(choice)
                sent_text, sent_tokens = c.text, len(c.token_ids)
            if include_usage and out is not None:
                n = len(out.outputs[0].token_ids)
                yield chunk(None, {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                   "total_tokens": prompt_tokens + n})
        except (EngineStepError, EngineShutDown, EngineDeadError) as e:  # the headers are sent: an error event
            yield f"data: {json.dumps(APIError(500, str(e), kind='server_error').body())}\n\n"
        finally:
            await stream.aclose()  # a client gone mid-stream: generate()'s finally aborts the request
        yield "data: [DONE]\n\n"

    async def handle(self, request: Request, chat: bool):
        """One request to /v1/completions or /v1/chat/completions: its response, streamed (SSE) or whole."""
        body, ignored = parse_body(await request.body())
        self.check_model(body)
        streamed, include_usage = streaming(body)
        request_id, stream, prompt_tokens, sp = self.start(body, chat)
        # the names as sent, but a header holds printable ASCII only: the rest percent-encoded
        names = quote(",".join(ignored), safe=",", errors="backslashreplace")
        headers = {"x-ignored-fields": names} if ignored else {}
        if streamed:
            return StreamingResponse(self.sse(request_id, stream, prompt_tokens, sp, chat, include_usage),
                                     media_type="text/event-stream", headers=headers)
        try:
            out = await self.complete(stream, request.is_disconnected)
        except EngineDeadError as e:  # the core died while it served this request (later ones get 503)
            raise APIError(500, str(e), kind="server_error") from e
        if out is None or out.outputs[0].finish_reason == "abort":  # the client went away: nobody reads this
            raise APIError(499, "the client closed the request", kind="client_closed")
        return JSONResponse(self.response(request_id, out, prompt_tokens, sp, chat), headers=headers)


class RequireKey:
    """ASGI middleware: with a key set, every request but /health needs it (401, in OpenAI's shape), before any route
    is looked up: /stats and a path that does not exist as much as /v1/*."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            try:
                self.server.check_key(dict(scope["headers"]).get(b"authorization"))
            except APIError as e:
                return await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, model_name: str, api_key: str | None = None):
    """The FastAPI app serving `engine` under `model_name`. Its shutdown stops the engine."""
    server = Server(engine, model_name, api_key)

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()  # the server stops (SIGINT, SIGTERM): so does the engine, its workers with it

    # no API docs pages (/docs, /redoc, /openapi.json): the handlers read their bodies themselves, so the schema
    # would show no field, and with a key set it would be one more page to guard
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, title="llm-steps", lifespan=lifespan)
    app.state.server = server

    # Every handler raises its errors; these turn them into OpenAI's shape, in one place.
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # starlette's own: no such path (404), method (405)
        error = APIError(e.status_code, f"{e.detail} ({request.method} {request.url.path})")
        return JSONResponse(error.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(EngineStepError)
    @app.exception_handler(EngineShutDown)
    @app.exception_handler(EngineDeadError)
    async def engine_error(request: Request, e: Exception):  # the engine failed while it served the request
        status = 503 if isinstance(e, EngineDeadError) else 500  # dead: so is every request after this one
        return JSONResponse(APIError(status, str(e), kind="server_error").body(), status_code=status)

    app.add_middleware(RequireKey, server=server)

    @app.get("/health")
    async def health():
        server.check_running()  # 503 once the engine's step loop is gone
        return JSONResponse({"status": "ok"})

    @app.get("/stats")
    async def stats():
        return JSONResponse(await server.stats())

    @app.get("/v1/models")
    async def models():
        return JSONResponse(server.models())

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.handle(request, chat=True)

    return app


def engine_arg_parser(description: str) -> argparse.ArgumentParser:
    """The server's flags for the engine: one per option of engine_args.py's EngineArgs (add_cli_args), with the
    server's own defaults for the model (a small real one, also its name in the API) and its batch."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_cli_args(parser, model="smollm2-135m", max_num_seqs=64)


def engine_options(args) -> dict:
    """The parsed flags -> the engine's options, as AsyncLLM(model, **options) takes them (the model apart)."""
    options = from_cli_args(args)
    del options["model"]
    return options


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def run(app, engine: AsyncLLM, host: str, port: int) -> None:
    """Serve `app` with uvicorn until SIGINT or SIGTERM. The shutdown stops the engine first: every open stream then
    ends with an error event and [DONE], and a request waiting for its whole answer gets its error, before uvicorn
    waits for the connections to close (a stream still running after its grace period would be cut off mid-way)."""
    import uvicorn

    class EngineFirst(uvicorn.Server):  # its shutdown stops the engine, then the connections
        async def shutdown(self, sockets=None):
            engine.shutdown()
            await super().shutdown(sockets)

    with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises SIGINT again once stopped (as uvicorn.run does)
        EngineFirst(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)).run()


def main() -> None:
    parser = engine_arg_parser(__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every path but /health (default: the environment "
                             f"variable {API_KEY_ENV}, which `ps` does not show, as vLLM reads VLLM_API_KEY)")
    args = parser.parse_args()
    if not 0 <= args.port < 65536:
        parser.error(f"argument --port: must be in 0..65535, got {args.port}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None  # an empty key is none
    # SIGTERM ends the process as SIGINT does, with exit status 0: uvicorn stops on either, then raises the
    # signal again to the handler it found, this one (whose default would kill the process, status -15); one that
    # arrives while the core starts ends the start the same way (the core is stopped at exit)
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        engine = AsyncLLM(args.model, **engine_options(args))
    except ValueError as e:  # bad input: one `error:` line, exit status 2
        parser.error(str(e))
    except EngineStartError as e:  # the core process failed to start: its error on one line, exit status 1
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1 ({engine.llm.backend})", flush=True)
    run(build_app(engine, args.model, api_key), engine, args.host, args.port)


if __name__ == "__main__":
    main()
