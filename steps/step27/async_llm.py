"""step23: a streaming engine. `AsyncLLM(model, **engine_options)` serves many callers of one event loop at once:
`async for out in engine.generate(prompt, params, request_id)` yields a RequestOutput each time the request gets a
token (cumulative text and token ids, vLLM's default; the last has finished=True), `await engine.abort(request_id)`
ends a request and frees its blocks, `engine.shutdown()` stops it. One background thread runs the step loop (the
LLM of engine.py, untouched by any other thread) and hands each step's outputs to the streams' queues, so the event
loop never waits for a step. A step that fails reaches every stream it served as an exception; the loop goes on. An
error outside a step kills the loop: every open stream and every later call gets EngineDeadError.

This file is the engine's front end, as vLLM's async_llm.py is: the callers' side (an event loop) and the step
loop's (its thread). engine.py stays the offline engine, which the step loop drives.

step26: the step loop leaves this process. AsyncLLM starts an engine core process (engine_core.py: the scheduler
and the model runner in a busy loop, the tensor-parallel workers its children) and talks to it over two ZMQ sockets
with typed msgpack messages: it sends each checked request (its token ids and sampling parameters) and each abort,
and receives outputs as deltas, the new token ids and logprobs of a step. This process keeps what is the callers':
the tokenizer and the checks, each request's incremental detokenizer and its stop strings (a stop string found here
aborts the request in the core), and the streams. It rebuilds the RequestOutput each caller gets, equal to the
offline engine's. The core knows each request by a name of its own (core_id), never reused, so that a caller may
reuse a request id as soon as its request has ended: outputs the core still sends for the old one, and the abort
that ends it there, can never reach the new one. One thread of its own reads the core's socket (with a timeout, so
it also sees the core die): a core that dies (killed, or it could not serve on) ends every open stream and every
later call with EngineDeadError.
step25's threaded AsyncLLM stays as InProcessAsyncLLM (the step loop in a thread of this process), to compare.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
import time
import traceback
import weakref
from types import SimpleNamespace

import msgspec
import zmq

from shared import (DEFAULT_MODEL, CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, Tokenizer,
                    check_length, normalize_prompts, normalize_sampling_params, resolve_model)

from . import engine_core as wire
from .detokenizer import IncrementalDetokenizer
from .engine import LLM
from .sequence import Finish


class EngineStepError(RuntimeError):
    """An engine step failed while it served this request: the request was dropped (its blocks freed)."""


class EngineShutDown(RuntimeError):
    """The AsyncLLM was shut down: no request runs any more."""


class EngineDeadError(RuntimeError):
    """The step loop stopped on an error outside a step (vLLM's name): no request runs, none is taken any more."""


class EngineStartError(RuntimeError):
    """step26: the engine core process failed to start (it died, or did not say Ready in time)."""


class _Stream:
    """One request's way back to its caller: an asyncio queue of the caller's event loop, fed from the step thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item) -> None:  # from the step thread: the item joins the queue in the event loop's own thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass


def _put_all(puts) -> None:  # run by the event loop: a step's outputs join their queues
    for queue_, item in puts:
        queue_.put_nowait(item)


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():  # its caller may have been cancelled meanwhile
        future.set_result(value)


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


class InProcessAsyncLLM:
    """step25's AsyncLLM (the step loop a thread of this process). An LLM served to many callers at once, streaming
    each request's outputs as its tokens arrive.

        engine = AsyncLLM("smollm2-135m", max_num_seqs=16)
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="a"):
            print(out.outputs[0].text)          # the text so far; out.finished on the last one

    One thread, the step loop, owns the LLM: it takes the callers' commands (add, abort) between steps, runs a step
    whenever a request is queued or running, and puts each output in its request's queue. The event loop only
    puts commands and reads queues, so it never waits for a step. A caller that stops reading (breaks out of the
    loop, is cancelled) aborts its request; a step that fails ends every stream it served with EngineStepError,
    and the loop serves the next requests; shutdown() ends every stream with EngineShutDown. An error outside a
    step (in the loop's own code) kills the loop: every open stream, and every later call, gets EngineDeadError,
    and `errored` turns True.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_options):
        self.llm = LLM(model, **engine_options)
        self.tokenizer = self.llm.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _streams (the event loop adds and removes, the step thread reads)
        # and _state, the step thread's copy of the LLM's state (snapshot())
        self._streams: dict[str, _Stream] = {}
        self._submitted: set[str] = set()  # the step thread's: requests it gave the LLM, not yet finished or aborted
        self._ids = itertools.count()
        self._stopped = False
        self._dead: BaseException | None = None  # why the step loop died (an error outside a step), None while it runs
        self.stats = {"steps": 0, "failed_steps": 0, "aborted": 0, "coalesced": 0, "step_thread_cpu_s": 0.0}
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="AsyncLLM step loop", daemon=True)
        self._thread.start()

    @property
    def errored(self) -> bool:
        """True once the step loop has died of an error outside a step (vLLM's name): nothing is served any more."""
        return self._dead is not None

    @property
    def is_running(self) -> bool:
        """The step loop is alive: not shut down, not dead."""
        return self._thread.is_alive() and not self._stopped and self._dead is None

    @property
    def dead_error(self) -> EngineDeadError:
        """A new EngineDeadError that says why the step loop died (once `errored`)."""
        return EngineDeadError(f"the engine's step loop died: {type(self._dead).__name__}: {self._dead}")

    # ---- the callers' side: the event loop ----------------------------------------------------------------
    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None):
        """Submit one request and yield its RequestOutputs as its tokens arrive: cumulative (each holds the text and
        tokens so far), the last with finished=True. One output per token while the caller keeps up; a caller that
        falls behind gets the newest output only (stats["coalesced"] counts the ones passed over). A bad request
        raises ValueError before anything is queued; stopping the iteration early aborts the request."""
        if self._stopped:
            raise EngineShutDown("AsyncLLM.generate(): the engine is shut down")
        text, ids, sp = self.llm.check_request(prompt, sampling_params)
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:  # the loop marks itself dead under this lock: a stream added here is one it will end
            if self._dead is not None:
                raise self.dead_error
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already running")
            self._streams[request_id] = stream
        self._send("add", request_id, (text, ids, sp))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                # Outputs are cumulative: when several wait (the caller fell behind the steps), the newest holds all
                # the others do, so they are passed over and the caller gets one output with every new token.
                while not isinstance(item, BaseException) and not item.finished and not stream.queue.empty():
                    item = stream.queue.get_nowait()
                    self.stats["coalesced"] += 1
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:  # the caller stopped early (break, cancel, an error): the request must not run on
                self._send("abort", request_id, None)

    async def abort(self, request_id: str) -> bool:
        """End a request now: its blocks are free when this returns, and its stream ends with one last output
        (finished=True, finish_reason "abort"). -> whether it was queued or running."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:  # as in generate(): a dead loop answers no command, so none is sent to it
            if self._dead is not None:
                raise self.dead_error
            self._send("abort", request_id, loop, done)
        return await done

    def shutdown(self) -> None:
        """Stop the step loop (after the step it is in), end every open stream with EngineShutDown, and shut the LLM
        down (its tensor-parallel workers, if any). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._send("stop", None, None)
        self._thread.join(timeout=60)
        with self._lock:
            streams, self._streams = dict(self._streams), {}
        for stream in streams.values():
            stream.put(EngineShutDown("the engine was shut down while this request ran"))
        self.llm.shutdown()

    def snapshot(self) -> dict:
        """The engine's state for another thread to read (a server's /stats): requests running and waiting, free KV
        blocks, time per phase, the counters. The step thread alone changes the LLM, so it copies that state between
        two steps, and this reads the copy, both under the lock: never a dict the step thread is changing, nor a
        state halfway through a step."""
        with self._lock:
            return {**self._state, "streams": len(self._streams), "coalesced": self.stats["coalesced"]}

    def _send(self, kind: str, request_id, payload, done=None) -> None:
        self._commands.put((kind, request_id, payload, done))
        self._wake.set()

    # ---- the step loop's side: its own thread ---------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # outside a step (a command, a delivery): the loop cannot go on, so it says so
            self._die(e)

    def _die(self, error: BaseException) -> None:
        """The loop is dead: mark it, end every open stream and every waiting abort() with EngineDeadError."""
        with self._lock:
            self._dead = error
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(self.dead_error)
        while True:  # commands sent before the mark: an abort() waits for its answer
            try:
                kind, _, payload, done = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "abort" and done is not None:
                try:
                    payload.call_soon_threadsafe(_fail, done, self.dead_error)
                except RuntimeError:  # its event loop is closed: nobody waits
                    pass
        traceback.print_exception(error)  # the server's log gets the cause

    def _publish(self) -> None:
        """Copy the LLM's state for snapshot(): run by the step thread, between two steps."""
        llm = self.llm
        state = {"running": len(llm.scheduler.running), "waiting": len(llm.scheduler.waiting),
                 "free_blocks": llm.block_manager.num_free_blocks, "num_blocks": llm.block_manager.num_blocks,
                 **{k: v for k, v in self.stats.items() if k != "coalesced"},  # coalesced: the event loop's count
                 "phase_s": dict(llm.timers.seconds)}  # the engine's time by phase so far (timers.py), in seconds
        with self._lock:
            self._state = state

    def _serve(self) -> None:
        llm = self.llm
        while True:
            if not self._run_commands():
                return
            self._publish()
            if not llm.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = llm.step(partial=True)
            except Exception as e:  # the step's requests were dropped (LLM._step): their streams end with the error
                self.stats["failed_steps"] += 1
                dropped = [request_id for request_id in self._submitted if request_id not in llm.scheduler.requests]
                self._submitted.difference_update(dropped)
                self._publish()
                for request_id in dropped:
                    self._deliver(request_id, EngineStepError(f"the engine step failed: {type(e).__name__}: {e}"))
                continue
            self.stats["steps"] += 1
            self.stats["step_thread_cpu_s"] = time.thread_time()  # this thread's CPU time so far
            self._submitted.difference_update(out.request_id for out in outputs if out.finished)
            self._publish()  # before the outputs go: a caller that has its last output sees the state after it
            self._deliver_all([(out.request_id, out) for out in outputs])

    def _run_commands(self) -> bool:
        """Everything the callers sent since the last step, in order. -> False once told to stop."""
        while True:
            try:
                kind, request_id, payload, done = self._commands.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":
                return False
            if kind == "add":
                with self._lock:
                    wanted = request_id in self._streams  # its caller may have gone already
                if wanted:
                    try:
                        self.llm._add(*payload, request_id=request_id)
                        self._submitted.add(request_id)
                    except ValueError as e:  # queued twice: the first one runs on
                        self._deliver(request_id, e)
            elif kind == "abort":
                seq = self.llm.abort_request(request_id)
                self._submitted.discard(request_id)
                if seq is not None:
                    self.stats["aborted"] += 1
                    out = seq.partial_output()
                    out.finished, out.outputs[0].finish_reason = True, "abort"
                    self._deliver(request_id, out)
                if done is not None:  # abort() waits for this: its caller's loop learns it in its own thread
                    try:
                        payload.call_soon_threadsafe(_resolve, done, seq is not None)
                    except RuntimeError:  # that event loop is closed: nobody waits for the answer
                        pass

    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items) -> None:
        """A step's outputs to their streams: one wake-up of each caller's event loop for all of them, not one per
        output (each wake-up is a write to the loop's self-pipe, and a turn of the loop)."""
        by_loop = {}
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass


# ---- step26: the front end of an engine core in its own process ------------------------------------------------
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
                             self.metrics)


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
        self.tokenizer = Tokenizer(resolve_model(model))
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
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=wire.run_engine_core, name="EngineCore",
                                   args=(model, engine_options, f"ipc://{self._dir}/input",
                                         f"ipc://{self._dir}/output", os.getpid(), _core_setup))
        self.process.start()
        self._finalizer = weakref.finalize(self, _stop_core, self.process, self._dir)
        ready = self._wait_ready(startup_timeout_s)
        self.llm = SimpleNamespace(  # what a server reads of the engine: its limits, the checks of a request
            max_model_len=ready.max_model_len, vocab_size=ready.vocab_size, tokenizer=self.tokenizer,
            block_manager=SimpleNamespace(num_blocks=ready.num_blocks, block_size=ready.block_size),
            backend="engine core process", check_request=self.check_request)
        self._ready = ready
        self._reader = threading.Thread(target=self._read_loop, name="AsyncLLM core reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float) -> wire.Ready:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._from_core.poll(self.POLL_MS):
                msg = self._decoder.decode(self._from_core.recv())
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
        """Ask the core for its state now (running, waiting, free blocks, its CPU time)."""
        return await self._ask(lambda reply: wire.GetStats(reply))

    # ---- the callers' side -----------------------------------------------------------------------------------
    def check_request(self, prompt, sampling_params: SamplingParams | None = None):
        """As LLM.check_request, on the core's limits (Ready): -> (text, token ids, SamplingParams)."""
        (text, ids), = normalize_prompts([prompt], self.tokenizer, self._ready.vocab_size, one=True)
        sp = normalize_sampling_params(sampling_params, 1, SamplingParams(temperature=0))[0]
        check_length(0, len(ids), sp, self._ready.max_model_len)
        blocks = -(-(len(ids) + sp.max_tokens) // self._ready.block_size)
        if blocks > self._ready.num_blocks:
            pool = self._ready.num_blocks * self._ready.block_size
            raise ValueError(f"prompts[0]: prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) = "
                             f"{len(ids) + sp.max_tokens} exceeds max_kv_tokens ({pool}): it could never fit in the "
                             "KV pool")
        return text, ids, sp

    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None):
        """As step23's: cumulative RequestOutputs, the last with finished=True; stopping early aborts."""
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
            self._send(wire.Add(req.core_id, ids, wire.Params.of(sp)))
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
        (LLM._check_stop), then its caller gets the RequestOutput so far."""
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
                skip = len(req.output_ids) - d.start  # tokens of this delta the request has already
                if skip < 0:
                    raise RuntimeError(f"request {req.request_id}: the core sent tokens from output index {d.start}, "
                                       f"the front end has {len(req.output_ids)}: a message was lost")
                for i in range(skip, len(d.token_ids)):
                    token = d.token_ids[i]
                    req.output_ids.append(token)
                    if req.logprobs is not None:
                        req.logprobs.append(d.logprobs[i])
                    req.cumulative_logprob = d.cumulative_logprobs[i]  # step27: after this token, none past a stop
                    req.metrics.token_times.append(now)
                    req.metrics.first_token_time = req.metrics.first_token_time or now
                    req.finish = _check_stop(req, token, len(req.output_ids), eos)
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


def _check_stop(req: _Request, last: int, num_outputs: int, eos) -> Finish | None:
    """LLM._check_stop, in the front end: EOS, stop token ids, stop strings (on the text), max_tokens."""
    sp, detok = req.params, req.detokenizer
    if last in eos and not sp.ignore_eos:
        return Finish("stop", None, detok.final_text())
    if last in sp.stop_token_ids:
        return Finish("stop", last, detok.final_text())
    new = detok.add(last)
    if new and sp.stop:
        text = detok.text
        window_start = max(0, len(text) - len(new) - max(len(s) for s in sp.stop) + 1)
        window = text[window_start:]
        hits = [(window.find(s), s) for s in sp.stop if s in window]
        if hits:
            cut, stop = min(hits)
            return Finish("stop", stop, text[:window_start + cut])
    if num_outputs >= sp.max_tokens:
        return Finish("length", None, detok.final_text())
    return None


def _stop_core(process, path: str) -> None:
    """Stop the core process (terminate, then kill) and remove its sockets' folder."""
    if process.is_alive():
        process.terminate()
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    shutil.rmtree(path, ignore_errors=True)
