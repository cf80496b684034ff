"""A streaming engine. `AsyncLLM(model, **engine_options)` serves many callers of one event loop at once:
`async for out in engine.generate(prompt, params, request_id)` yields a RequestOutput each time the request gets a
token (cumulative text and token ids, vLLM's default; the last has finished=True), `await engine.abort(request_id)`
ends a request and frees its blocks, `engine.shutdown()` stops it. One background thread runs the step loop (the
LLM of engine.py, untouched by any other thread) and hands each step's outputs to the streams' queues, so the event
loop never waits for a step. A step that fails reaches the stream of the request that failed it as an exception;
the loop goes on. The LLM finds that request (engine.py's _fail_step): a step of several requests that fails puts
them all back, each to run alone until it gets a token, so a request beside the one that fails loses nothing but a
recompute. An error outside a step kills the loop: every open stream and every later call gets EngineDeadError.

This file is the engine's front end, as vLLM's async_llm.py is: the callers' side (an event loop) and the step
loop's (its thread). engine.py stays the offline engine, which the step loop drives.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import traceback

from shared import DEFAULT_MODEL, SamplingParams

from .engine import LLM


class EngineStepError(RuntimeError):
    """An engine step failed while it served this request: the request was dropped (its blocks freed)."""


class EngineShutDown(RuntimeError):
    """The AsyncLLM was shut down: no request runs any more."""


class EngineDeadError(RuntimeError):
    """The step loop stopped on an error outside a step (vLLM's name): no request runs, none is taken any more."""


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


class AsyncLLM:
    """An LLM served to many callers at once, streaming each request's outputs as its tokens arrive.

        engine = AsyncLLM("smollm2-135m", max_num_seqs=16)
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="a"):
            print(out.outputs[0].text)          # the text so far; out.finished on the last one

    One thread, the step loop, owns the LLM: it takes the callers' commands (add, abort) between steps, runs a step
    whenever a request is queued or running, and puts each output in its request's queue. The event loop only
    puts commands and reads queues, so it never waits for a step. A caller that stops reading (breaks out of the
    loop, is cancelled) aborts its request; a step that fails ends the stream of the request that failed it alone
    with EngineStepError (the others of a failed step run on: LLM._fail_step), and the loop serves on; shutdown()
    ends every stream with EngineShutDown. An error outside a step (in the loop's own code) kills the loop: every
    open stream, and every later call, gets EngineDeadError, and `errored` turns True.
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
            except Exception as e:  # the request that failed a step alone was dropped (LLM._fail_step): its stream
                # ends with the error; the requests of a step of several were put back, each to run alone
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
