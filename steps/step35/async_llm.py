"""The engine's front end: `AsyncLLM(model, **engine_options)` serves many callers of one event loop at once,
`async for out in engine.generate(prompt, params, request_id)` yields a RequestOutput each time the request gets a
token (cumulative text and token ids, vLLM's default; the last has finished=True), `await engine.abort(request_id)`
ends a request and frees its blocks, `engine.shutdown()` stops it. As vLLM V1's AsyncLLM, it runs the engine in a
process of its own, the engine core (engine_core.py: the scheduler and the model runner in a busy loop, the
tensor-parallel workers its children), and talks to it over two ZMQ sockets with wire.py's typed msgpack messages.

This process keeps what is the callers': the tokenizer and the checks of a request (against the limits the core
states in its Ready message), each request's incremental detokenizer and its stop strings (a stop string found here
aborts the request in the core), and the streams. It sends each checked request (its token ids and sampling
parameters) and each abort, receives outputs as deltas (the new token ids and logprobs of a step) and rebuilds the
RequestOutput each caller gets, equal to the offline engine's (output.py's stop check, the engine's own). It imports
wire.py, output.py, the tokenizer side (shared, detokenizer.py) and the standard library, never torch nor the
engine: the core process is started by its module's path, and a core that states another wire protocol version is
refused.

The core knows each request by a name of its own (core_id), never reused, so that a caller may reuse a request id
as soon as its request has ended: outputs the core still sends for the old one, and the abort that ends it there,
can never reach the new one. One thread of its own reads the core's socket (with a timeout, so it also sees the core
die): a core that dies (killed, or it could not serve on) ends every open stream and every later call with
EngineDeadError. A step that fails in the core ends the stream of the request that failed it with EngineStepError
(the others of a failed step run on, each alone for a while: engine.py's _fail_step), and the core serves on.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from types import SimpleNamespace

import msgspec
import zmq

from shared import (DEFAULT_MODEL, CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, Tokenizer,
                    check_fits_kv_pool, check_length, check_logprobs, normalize_prompts, normalize_sampling_params,
                    resolve_model)

from . import wire
from .detokenizer import IncrementalDetokenizer
from .output import Finish, check_stop


class EngineStepError(RuntimeError):
    """An engine step failed while it served this request: the request was dropped (its blocks freed)."""


class EngineShutDown(RuntimeError):
    """The AsyncLLM was shut down: no request runs any more."""


class EngineDeadError(RuntimeError):
    """The engine core died (vLLM's name): no request runs, none is taken any more."""


class EngineStartError(RuntimeError):
    """The engine core process failed to start (it died, did not say Ready in time, or speaks another protocol)."""


class _Stream:
    """One request's way back to its caller: an asyncio queue of the caller's event loop, fed from the reader
    thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item) -> None:  # from another thread: the item joins the queue in the event loop's own thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass


def _put_all(puts) -> None:  # run by the event loop: a message's outputs join their queues
    for queue_, item in puts:
        queue_.put_nowait(item)


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():  # its caller may have been cancelled meanwhile
        future.set_result(value)


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def kv_role_of(transfer) -> str | None:
    """kv_transfer_config's role (the core checks the rest): a dict's, or a parsed config's, or None."""
    return transfer.get("kv_role") if isinstance(transfer, dict) else getattr(transfer, "kv_role", None)


class _Request:
    """One request as the front end follows it: what the core sent so far, and the text it makes. request_id is its
    caller's name for it; core_id the core's (the front end's own count: no two requests get the same)."""

    def __init__(self, request_id: str, core_id: str, text, ids: list[int], sp: SamplingParams, stream: _Stream,
                 tokenizer):
        self.request_id, self.core_id = request_id, core_id
        self.prompt, self.prompt_ids, self.params, self.stream = text, ids, sp, stream
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.output_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if sp.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.metrics = RequestMetrics(time.perf_counter())
        self.finish: Finish | None = None
        self.kv_transfer_params: dict | None = None  # a kv_producer's answer, with its last delta

    def output(self) -> RequestOutput:
        """Its RequestOutput now, as the offline engine's Sequence makes it (partial_output, to_output)."""
        logprobs = list(self.logprobs) if self.logprobs is not None else None
        if self.finish is not None:
            completion = CompletionOutput(0, self.finish.text, list(self.output_ids), self.cumulative_logprob,
                                          logprobs, self.finish.reason, self.finish.stop_reason)
        else:  # a stop string completed later could still cut the last (longest stop - 1) characters
            hold = max(map(len, self.params.stop), default=1) - 1 if self.params.stop else 0
            text = self.detokenizer.text
            completion = CompletionOutput(0, text[:max(0, len(text) - hold)], list(self.output_ids),
                                          self.cumulative_logprob, logprobs, None)
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, [completion], self.finish is not None,
                             self.metrics, self.kv_transfer_params)


class AsyncLLM:
    """An LLM served to many callers at once, streaming each request's outputs as its tokens arrive; the engine
    runs in a core process of its own (engine_core.py).

        engine = AsyncLLM("smollm2-135m", max_num_seqs=16)
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="a"):
            print(out.outputs[0].text)          # the text so far; out.finished on the last one

    The constructor starts the core and waits until it is built (a core that fails to start raises its error
    here). generate() checks the request here, sends it, and rebuilds its outputs from the core's deltas; a caller
    that stops reading aborts its request; abort() returns once the core has freed the request's blocks. A core
    that dies ends every open stream, and every later call, with EngineDeadError (`errored` turns True).
    shutdown() stops the core and ends every open stream with EngineShutDown."""

    POLL_MS = 100  # how often the reader thread, idle, checks that the core is alive

    def __init__(self, model: str = DEFAULT_MODEL, startup_timeout_s: float = 600.0, _core_setup=None,
                 **engine_options):
        self.model_name = str(model)
        self._dir = tempfile.mkdtemp(prefix="llm-core-")
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # a closed socket drops what it could not send: nothing waits for a dead core
        self._to_core, self._from_core = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # no limit on queued requests: a burst is never refused
        self._to_core.bind(f"ipc://{self._dir}/input")
        self._from_core.bind(f"ipc://{self._dir}/output")
        self._send_lock = threading.Lock()  # a ZMQ socket is not thread-safe: callers' loops and the reader send
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(wire.FromCore)
        self._lock = threading.Lock()  # guards _requests, _by_request_id and _replies
        self._requests: dict[str, _Request] = {}  # the open requests by core_id (the core's deltas name them so)
        self._by_request_id: dict[str, _Request] = {}  # the same requests by their callers' request ids
        self._replies: dict[int, tuple] = {}  # reply id -> (event loop, future, value to answer)
        self._ids, self._core_ids, self._reply_ids = itertools.count(), itertools.count(), itertools.count(1)
        self._stopped = False
        self._dead: BaseException | None = None
        self._state: dict = {}
        self.stats = {"coalesced": 0, "deltas": 0, "bytes_in": 0}
        ctx = multiprocessing.get_context("spawn")  # the child imports what it runs: _run_core, then the core
        self.process = ctx.Process(target=_run_core, name="EngineCore",
                                   args=(f"{__package__}.engine_core", model, engine_options,
                                         f"ipc://{self._dir}/input", f"ipc://{self._dir}/output", os.getpid(),
                                         _core_setup))
        self.process.start()
        self._finalizer = weakref.finalize(self, _stop_core, self.process, self._dir)
        ready = self._wait_ready(startup_timeout_s)
        try:  # the core has resolved the model (built it, if it is a random one): its folder is there to read
            self.tokenizer = Tokenizer(resolve_model(model))
        except BaseException:
            self._finalizer()
            raise
        self.llm = SimpleNamespace(  # what a server reads of the engine: its limits, the checks of a request
            max_model_len=ready.max_model_len, vocab_size=ready.vocab_size, tokenizer=self.tokenizer,
            block_manager=SimpleNamespace(num_blocks=ready.num_blocks, block_size=ready.block_size),
            backend="engine core process", check_request=self.check_request,
            kv_role=kv_role_of(engine_options.get("kv_transfer_config")))
        self._ready = ready
        self._reader = threading.Thread(target=self._read_loop, name="AsyncLLM core reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float) -> wire.Ready:
        """The core's first message: Ready (its protocol version checked before the rest is decoded), or the Error
        that stopped its start."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._from_core.poll(self.POLL_MS):
                frame = self._from_core.recv()
                version = wire.ready_version(frame)
                if version is not None and version != wire.PROTOCOL_VERSION:
                    self._finalizer()
                    raise EngineStartError(f"the engine core speaks wire protocol version {version!r}, this front "
                                           f"end version {wire.PROTOCOL_VERSION}: they come from different versions "
                                           "of the code")
                msg = self._decoder.decode(frame)
                if isinstance(msg, wire.Ready):
                    return msg
                if isinstance(msg, wire.Error):  # the core's own error: ValueError for a bad model or option
                    self._finalizer()
                    raise (ValueError if msg.kind == "ValueError" else EngineStartError)(msg.message)
            elif not self.process.is_alive():
                self._finalizer()
                raise EngineStartError(f"the engine core exited while it started (exit code "
                                       f"{self.process.exitcode})")
        self._finalizer()
        raise EngineStartError(f"the engine core did not start within {timeout_s:g} s")

    # ---- state -----------------------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def is_running(self) -> bool:
        return not self._stopped and self._dead is None and self.process.is_alive()

    @property
    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine core died: {self._dead}")

    def snapshot(self) -> dict:
        """The core's state as its last Stats message said (abort() and get_stats() ask for one)."""
        with self._lock:
            return {**self._state, "streams": len(self._requests), **self.stats}

    async def get_stats(self) -> dict:
        """Ask the core for its state now: requests running and waiting, free blocks, its CPU time (by thread too),
        its torch host threads, its time by phase, and the engine's own counters ("engine": LLM.stats)."""
        return await self._ask(lambda reply: wire.GetStats(reply))

    # ---- the callers' side -----------------------------------------------------------------------------------
    def check_request(self, prompt, sampling_params: SamplingParams | None = None):
        """As LLM.check_request, on the core's limits (Ready): -> (text, token ids, SamplingParams)."""
        (text, ids), = normalize_prompts([prompt], self.tokenizer, self._ready.vocab_size, one=True)
        sp = normalize_sampling_params(sampling_params, 1, SamplingParams(temperature=0))[0]
        check_length(0, len(ids), sp, self._ready.max_model_len)
        check_logprobs(0, sp, self._ready.max_logprobs)
        check_fits_kv_pool(0, len(ids), sp, self._ready.num_blocks, self._ready.block_size)
        return text, ids, sp

    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                       kv_transfer_params: dict | None = None):
        """As step23's: cumulative RequestOutputs, the last with finished=True; stopping early aborts.
        kv_transfer_params: prefill and decode apart (kv_connector.py), checked by the core (a bad one ends the stream
        with its ValueError's message)."""
        if self._stopped:
            raise EngineShutDown("AsyncLLM.generate(): the engine is shut down")
        text, ids, sp = self.check_request(prompt, sampling_params)
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:  # the reader marks the core dead under this lock: a request added here is one it ends
            if self._dead is not None:
                raise self.dead_error
            if request_id in self._by_request_id:
                raise ValueError(f"request_id {request_id!r} is already running")
            req = _Request(request_id, str(next(self._core_ids)), text, ids, sp, stream, self.tokenizer)
            self._requests[req.core_id] = self._by_request_id[request_id] = req
        finished = False
        try:
            self._send(wire.Add(req.core_id, ids, wire.Params.of(sp), kv_transfer_params))
            while not finished:
                item = await stream.queue.get()
                while not isinstance(item, BaseException) and not item.finished and not stream.queue.empty():
                    item = stream.queue.get_nowait()
                    self.stats["coalesced"] += 1
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                open_ = self._close(req)
            if not finished and open_ and self._dead is None and not self._stopped:
                with contextlib.suppress(EngineDeadError, EngineShutDown):  # a core that is gone runs nothing on
                    self._send(wire.Abort([req.core_id]))

    async def abort(self, request_id: str) -> bool:
        """End a request now: its blocks are free in the core when this returns, and its stream ends with one last
        output (finished=True, finish_reason "abort"). -> whether it was open."""
        with self._lock:
            req = self._by_request_id.get(request_id)
            if req is not None:
                self._close(req)
        if req is not None:
            req.finish = Finish("abort", None, req.detokenizer.text)
            req.stream.put(req.output())
        await self._ask(lambda reply: wire.Abort([req.core_id] if req is not None else [], reply))
        return req is not None

    def _close(self, req: _Request) -> bool:
        """Forget an open request (under the lock): its request id is free again. -> whether it was open."""
        if self._requests.pop(req.core_id, None) is None:
            return False
        del self._by_request_id[req.request_id]
        return True

    async def _ask(self, make) -> dict:
        """Send a message that the core answers with Stats(reply=...); -> the state it holds."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            if self._dead is not None:
                raise self.dead_error
            reply = next(self._reply_ids)
            self._replies[reply] = (loop, done)
        try:
            self._send(make(reply))
        except BaseException:
            with self._lock:
                self._replies.pop(reply, None)
            raise
        return await done

    def shutdown(self) -> None:
        """Stop the core process (and its workers) and end every open stream with EngineShutDown. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with self._lock:
            requests, self._requests, self._by_request_id = list(self._requests.values()), {}, {}
        for req in requests:
            req.stream.put(EngineShutDown("the engine was shut down while this request ran"))
        self._finalizer()
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(timeout=5)  # it sees _stopped within POLL_MS: then nothing uses the sockets
        with self._send_lock:
            self._to_core.close()
            self._from_core.close()
        self._ctx.term()

    def _send(self, msg) -> None:
        frame = self._encoder.encode(msg)
        with self._send_lock:
            if self._to_core.closed:
                raise EngineShutDown("the engine is shut down")
            try:  # never blocks: the queue has no limit, so only a core that is gone refuses (no peer to send to)
                self._to_core.send(frame, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise EngineDeadError("the engine core takes no messages: its process is gone") from None

    # ---- the reader thread: the core's messages, and its death -------------------------------------------------
    def _read_loop(self) -> None:
        try:
            while not self._stopped:
                if not self._from_core.poll(self.POLL_MS):
                    if not self.process.is_alive():
                        raise RuntimeError(f"its process exited (exit code {self.process.exitcode})")
                    continue
                frame = self._from_core.recv()
                self.stats["bytes_in"] += len(frame)
                try:
                    msg = self._decoder.decode(frame)
                except msgspec.DecodeError as e:  # its outputs may be lost: no stream could trust the rest
                    raise RuntimeError(f"a message from the core failed to decode: {e}") from e
                if isinstance(msg, wire.Outputs):
                    self._on_outputs(msg.deltas)
                elif isinstance(msg, wire.Stats):
                    self._on_stats(msg)
                elif isinstance(msg, wire.Error):
                    if msg.fatal:
                        raise RuntimeError(msg.message)
                    print(f"engine core error: {msg.message}", flush=True)  # logged, serving goes on
        except BaseException as e:
            if not self._stopped:
                self._die(e)

    def _die(self, error: BaseException) -> None:
        with self._lock:
            self._dead = error
            requests, self._requests, self._by_request_id = list(self._requests.values()), {}, {}
            replies, self._replies = list(self._replies.values()), {}
        for req in requests:
            req.stream.put(self.dead_error)
        for loop, done in replies:
            try:
                loop.call_soon_threadsafe(_fail, done, self.dead_error)
            except RuntimeError:
                pass
        print(f"AsyncLLM: {self.dead_error}", flush=True)

    def _on_stats(self, msg: wire.Stats) -> None:
        with self._lock:
            self._state = dict(msg.state)
            waiter = self._replies.pop(msg.reply, None)
        if waiter is not None:
            loop, done = waiter
            try:
                loop.call_soon_threadsafe(_resolve, done, dict(msg.state))
            except RuntimeError:
                pass

    def _on_outputs(self, deltas) -> None:
        """A step's deltas: each request's new tokens go through its detokenizer and the offline engine's stop checks
        (output.check_stop, on the text decoded here), then its caller gets the RequestOutput so far."""
        self.stats["deltas"] += len(deltas)
        eos = self.tokenizer.eos_token_ids
        now = time.perf_counter()
        by_loop, aborts = {}, []
        with self._lock:
            for d in deltas:
                req = self._requests.get(d.request_id)
                if req is None or req.finish is not None:
                    continue
                if d.error is not None:
                    self._close(req)
                    item = EngineStepError(d.error) if d.finish_reason == "error" else RuntimeError(d.error)
                    by_loop.setdefault(req.stream.loop, []).append((req.stream.queue, item))
                    continue
                if d.kv_transfer_params is not None:
                    req.kv_transfer_params = d.kv_transfer_params
                skip = len(req.output_ids) - d.start  # tokens of this delta the request has already
                if skip < 0:
                    raise RuntimeError(f"request {req.request_id}: the core sent tokens from output index {d.start}, "
                                       f"the front end has {len(req.output_ids)}: a message was lost")
                for i in range(skip, len(d.token_ids)):
                    token = d.token_ids[i]
                    req.output_ids.append(token)
                    if req.logprobs is not None:
                        req.logprobs.append(d.logprobs[i])
                    req.cumulative_logprob = d.cumulative_logprobs[i]  # after this token, none past a stop
                    req.metrics.token_times.append(now)
                    req.metrics.first_token_time = req.metrics.first_token_time or now
                    req.finish = check_stop(req.params, token, len(req.output_ids), eos, req.detokenizer)
                    if req.finish is not None:
                        req.metrics.finished_time = now
                        break
                if req.finish is not None:
                    self._close(req)
                    if d.finish_reason is None:  # a stop string ended it here: the core runs it still
                        aborts.append(req.core_id)
                elif d.finish_reason is not None:  # the core ended it (it should not, before the front end)
                    req.finish = Finish(d.finish_reason, d.stop_reason, req.detokenizer.final_text())
                    self._close(req)
                by_loop.setdefault(req.stream.loop, []).append((req.stream.queue, req.output()))
        if aborts:
            self._send(wire.Abort(aborts))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:
                pass


def _run_core(module: str, *args) -> None:
    """The core process's entry point, in the child: spawn imports this module (no torch) to find it, and it imports
    the core's module by its path (engine_core.py, with torch and the engine) and runs it."""
    importlib.import_module(module).run_engine_core(*args)


def _stop_core(process, path: str) -> None:
    """Stop the core process (terminate, then kill) and remove its sockets' folder."""
    if process.is_alive():
        process.terminate()
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    shutil.rmtree(path, ignore_errors=True)
