"""The engine core in its own process. vLLM V1's split: the front end (async_llm.py's AsyncLLM, and the
server around it) keeps the tokenizer, the incremental detokenizer, stop strings and the callers' streams; the
EngineCore (core.py: the scheduler, the block manager and the model runner, with the overlapped order and the
tensor-parallel workers as this process's children) runs here in nothing but a busy loop (EngineCoreProc):

    pull inputs (adds, aborts) -> one step -> push outputs

Two IO threads sit around the loop so that neither sockets nor (de)serialisation touch it: the input thread reads
the front end's ZMQ socket, decodes each message (msgpack, msgspec) and puts it in a queue the loop drains between
steps; the output thread takes what the loop puts in its queue, encodes it and sends it. (Encoding and decoding in
msgspec release no GIL, but they run while the loop waits for the device, and off its code path.)

The messages it reads and sends are wire.py's (typed msgspec Structs, never a pickle): Add, Abort and GetStats
in; Ready once it is built (wire.py's PROTOCOL_VERSION and the limits the front end checks a request against),
Outputs (each step's deltas: a request's new tokens only), Stats and Error out. The core checks EOS, stop token ids
and max_tokens (no text needed: output.check_stop without a detokenizer); stop strings are the front end's, which
decodes the text and aborts the request when one appears. The core's sequences have no detokenizer: no text is
decoded in this process.
A delta carries the cumulative logprob after each of its tokens (wire.py says why): each of the core's sequences
keeps them (Sequence.cumulative_logprobs), and a delta takes those after the tokens already sent.

A message that fails to decode is an Error named in the core's log (stderr), and the core serves on. An ordinary
error in a step fails the request that failed it alone (EngineCore._fail_step: the requests of a step of several
are put back, each to run alone until it gets a token, so that a request whose own inputs fail a step fails alone),
and the core serves on. The core dies when it can no longer serve:
an IO thread died (it no longer hears the front end, or can no longer answer it), a step raised a device error
(CUDA's errors are sticky: every later step would fail too) or a WorkerError (a worker, a pipeline stage's or a
tensor-parallel rank's, is gone: no step can run without it), or its loop failed outside a step. It then sends a
fatal Error (if its output thread still can) and exits with status 1; the front end ends every open stream. The
core watches its parent: when the front end dies (its parent pid changes) the core exits, and with it its workers.
run_engine_core() is the process's entry point (multiprocessing, spawn method).
"""
from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback

import msgspec
import torch
import zmq

from shared import Tokenizer
from shared.threads import threads_cpu_s

from .config import EngineConfig
from .core import EngineCore
from .parallel import WorkerError
from .wire import PROTOCOL_VERSION, Abort, Add, Delta, Error, GetStats, Outputs, Ready, Stats, ToCore


# ---- the core -------------------------------------------------------------------------------------------------
class CoreFatalError(RuntimeError):
    """The core cannot serve on: an IO thread died, or a step raised a device error. The busy loop raises it (an IO
    thread puts it in the inputs queue), and the core dies."""


DEVICE_ERROR_MARKERS = ("CUDA error", "Triton Error [CUDA]")  # torch's and Triton's messages for a CUDA failure


def is_device_error(error: BaseException) -> bool:
    """Is this the device failing (an illegal memory access, a launch failure), not the step's own code? torch
    raises torch.AcceleratorError for it (2.8 on); an older torch, and Triton, a RuntimeError naming CUDA's error.
    An out-of-memory error is neither: it is not sticky, the next step may fit."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in DEVICE_ERROR_MARKERS)


class EngineCoreProc:
    """The busy loop over an EngineCore, fed and drained by queues (the IO threads own the sockets)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.inputs: queue.SimpleQueue = queue.SimpleQueue()  # decoded messages, from the input thread
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()  # messages to encode and send, to the output thread
        self.sent: dict[str, int] = {}  # request_id -> output tokens already sent (a delta starts there)
        self.cumulative: dict[str, list[float]] = {}  # request_id -> its cumulative logprob after each output token
        self.stats = {"steps": 0, "failed_steps": 0, "aborted": 0, "bad_messages": 0}

    def state(self) -> dict:
        """What a Stats message carries: the queues, the KV pool, the requests in a step launched and not read yet
        (in_flight: async_scheduling), this process's CPU seconds (by thread too), its torch host threads, the time
        by phase, the engine's own counters (engine: EngineCore.stats), and the core's counters."""
        core = self.core
        return {"running": len(core.scheduler.running), "waiting": len(core.scheduler.waiting),
                "free_blocks": core.block_manager.num_free_blocks, "num_blocks": core.block_manager.num_blocks,
                "requests": len(self.sent), "core_cpu_s": time.process_time(), "core_pid": os.getpid(),
                "in_flight": len(core.in_flight.seqs) if core.in_flight is not None else 0,
                "phase_s": dict(core.timers.seconds), "threads_cpu_s": threads_cpu_s(),
                "torch_threads": torch.get_num_threads(), "engine": dict(core.stats), **self.stats}

    def run_busy_loop(self) -> None:
        """Pull, step, push, until the process ends. Raises CoreFatalError when the core cannot serve on."""
        core = self.core
        while True:
            # pull: block only when there is nothing to step
            block = not core.has_unfinished_requests()
            while True:
                try:
                    msg = self.inputs.get(block=block, timeout=0.5 if block else None)  # a signal can still land
                except queue.Empty:
                    break
                if isinstance(msg, CoreFatalError):  # an IO thread died
                    raise msg
                self._handle(msg)
                block = False
            core.poll_transfers()  # a producer's leases expire while it idles too
            if not core.has_unfinished_requests():
                continue
            try:
                finished = {out.request_id: out for out in core.step()}  # only finished outputs
            except Exception as e:  # a request that failed a step alone was dropped (EngineCore._fail_step): it
                # gets the error; the requests of a step of several were put back, each to run alone
                if is_device_error(e):  # every later step would fail too
                    raise CoreFatalError(f"a device error in a step: {type(e).__name__}: {e}") from e
                if isinstance(e, WorkerError):  # a rank (a stage's, or a tensor-parallel one) is gone: so is the engine
                    raise CoreFatalError(f"a worker failed: {e}") from e
                self.stats["failed_steps"] += 1
                dropped = [rid for rid in self.sent if rid not in core.scheduler.requests]
                message = f"the engine step failed: {type(e).__name__}: {e}"
                for rid in dropped:
                    del self.sent[rid]
                    self.cumulative.pop(rid, None)
                self.outputs.put(Outputs([Delta(rid, 0, [], None, [], "error", None, message) for rid in dropped]))
                continue
            self.stats["steps"] += 1
            deltas = self.deltas(finished)
            if deltas:
                self.outputs.put(Outputs(deltas))

    def deltas(self, finished: dict) -> list[Delta]:
        """What each request got since the last message: read from its sequence (the tokens after those sent), so
        no request's whole output is copied per step, in this process or on the wire."""
        deltas, requests, cumulative = [], self.core.scheduler.requests, self.cumulative
        for rid, sent in list(self.sent.items()):
            out = finished.get(rid)
            if out is not None:  # finished in this step: its last tokens, and why it ended
                c = out.outputs[0]
                del self.sent[rid]
                stop_reason = c.stop_reason if isinstance(c.stop_reason, int) else None
                logprobs = c.logprobs[sent:] if c.logprobs is not None else None
                error = self.core.load_errors.pop(rid, None) if c.finish_reason == "error" else None
                deltas.append(Delta(rid, sent, c.token_ids[sent:], logprobs, cumulative.pop(rid)[sent:],
                                    c.finish_reason, stop_reason, error, out.kv_transfer_params))
                continue
            seq = requests.get(rid)
            known = seq.num_known_outputs if seq is not None else sent
            if known > sent:  # running, with tokens read since the last message (PENDING places are not read)
                self.sent[rid] = known
                logprobs = seq.logprobs[sent:known] if seq.logprobs is not None else None
                deltas.append(Delta(rid, sent, seq.output_ids[sent:known], logprobs, cumulative[rid][sent:known]))
        return deltas

    def _handle(self, msg) -> None:
        core = self.core
        if isinstance(msg, Add):
            try:  # no detokenizer: its stop checks read its tokens only (stop strings are the front end's)
                seq = core.add_request(msg.request_id, None, msg.prompt_ids, msg.params.sampling_params(),
                                       kv_transfer_params=msg.kv_transfer_params)
                # the core appends to it (a decode engine's request starts with the producer's token(s): the
                # producer's cumulative logprob after them)
                self.cumulative[msg.request_id] = seq.cumulative_logprobs = [seq.cumulative_logprob] * len(seq.output_ids)
                self.sent[msg.request_id] = 0
            except ValueError as e:
                self.outputs.put(Outputs([Delta(msg.request_id, 0, [], None, [], "error", None, str(e))]))
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                if core.abort_request(rid) is not None:
                    self.stats["aborted"] += 1
                self.sent.pop(rid, None)
                self.cumulative.pop(rid, None)
            if msg.reply:  # after the blocks are free
                self.outputs.put(Stats(msg.reply, self.state()))
        elif isinstance(msg, GetStats):
            self.outputs.put(Stats(msg.reply, self.state()))


def host_threads_for(device: torch.device) -> int | None:
    """The torch (OpenMP) threads the core's host ops get: on a GPU, 1. Those ops are small (a step's inputs, built
    on the host and copied over), and a pool of one thread per core spins after each of them: measured on the H200
    at saturation, 16 threads burned 114 CPU seconds in 15 s, slowing the busy loop they run in. On the CPU the
    pool does the model's work: it stays. OMP_NUM_THREADS, if set, is the user's choice. None: leave it."""
    if device.type == "cpu" or "OMP_NUM_THREADS" in os.environ:
        return None
    return 1


def _input_thread(sock: zmq.Socket, core: EngineCoreProc) -> None:
    """Receive and decode the front end's messages into the inputs queue. If this thread dies, the core hears
    nothing more (no request, no abort): it tells the busy loop, which dies."""
    decoder = msgspec.msgpack.Decoder(ToCore)
    try:
        while True:
            frame = sock.recv()
            try:
                msg = decoder.decode(frame)
            except msgspec.DecodeError as e:  # named in the log; the core serves on
                core.stats["bad_messages"] += 1
                print(f"engine core: a message failed to decode ({len(frame)} bytes): {e}", file=sys.stderr,
                      flush=True)
                core.outputs.put(Error(f"a message failed to decode: {e}"))
                continue
            core.inputs.put(msg)
    except BaseException as e:
        core.inputs.put(_io_failure("input", e))


def _output_thread(sock: zmq.Socket, core: EngineCoreProc) -> None:
    """Encode and send what the busy loop puts in the outputs queue, until it puts None. If this thread dies, no
    output reaches the front end any more: it sends the fatal Error itself (if the socket still takes one) and tells
    the busy loop, which dies."""
    encoder = msgspec.msgpack.Encoder()
    try:
        while True:
            msg = core.outputs.get()
            if msg is None:
                return
            sock.send(encoder.encode(msg), copy=False)
    except BaseException as e:
        failure = _io_failure("output", e)
        try:
            sock.send(encoder.encode(Error(str(failure), fatal=True)))
        except Exception:  # noqa: BLE001 (the socket may be what failed: the front end sees the process exit)
            pass
        core.inputs.put(failure)


def _io_failure(thread: str, error: BaseException) -> CoreFatalError:
    failure = CoreFatalError(f"its {thread} thread failed: {type(error).__name__}: {error}")
    failure.__cause__ = error  # the core's log shows where it failed
    return failure


def _watch_parent(parent_pid: int) -> None:
    """The front end died (this process was re-parented): exit now, which stops the workers too."""
    while True:
        if os.getppid() != parent_pid:
            print("engine core: the front end died; exiting", file=sys.stderr, flush=True)
            os._exit(1)
        time.sleep(0.2)


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)  # in the main thread (the busy loop): its finally shuts the core and its workers down


def run_engine_core(model: str, engine_options: dict, input_addr: str, output_addr: str, parent_pid: int,
                    setup=None) -> None:
    """The core process's entry point: connect the sockets, build the EngineCore (its options checked as the offline
    LLM checks them: EngineConfig), say Ready (or the Error that stopped the build), then run the busy loop until the
    process ends. A loop that dies sends a fatal Error first, and the process exits with status 1. `setup`, if given,
    is a module-level function called with the EngineCore once it is built (the tests inject faults with it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the front end decides
    signal.signal(signal.SIGTERM, _exit_cleanly)  # the front end's stop: the loop ends, the core shuts down
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent watch", daemon=True).start()
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inp.connect(input_addr)
    out.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        config = EngineConfig(model=model, **engine_options)
        core = EngineCore(config, Tokenizer(config.model_dir))
        threads = host_threads_for(core.device)
        if threads is not None:
            torch.set_num_threads(threads)
        if setup is not None:
            setup(core)
    except BaseException as e:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # exiting already: a stop now must not raise in the exit's cleanup
        kind = "ValueError" if isinstance(e, ValueError) else type(e).__name__
        out.send(encoder.encode(Error(f"the engine core failed to start: {e}" if kind == "ValueError" else
                                      f"the engine core failed to start: {type(e).__name__}: {e}", True, kind)))
        out.close(linger=2000)
        return
    proc = EngineCoreProc(core)
    bm = core.block_manager
    out.send(encoder.encode(Ready(PROTOCOL_VERSION, core.model.config.vocab_size, config.max_model_len, bm.num_blocks,
                                  bm.block_size, config.max_logprobs)))
    threading.Thread(target=_input_thread, args=(inp, proc), name="core input", daemon=True).start()
    writer = threading.Thread(target=_output_thread, args=(out, proc), name="core output", daemon=True)
    writer.start()
    died = False
    try:
        proc.run_busy_loop()
    except SystemExit:  # SIGTERM: stopped, not dead
        pass
    except BaseException as e:
        died = True
        traceback.print_exc()
        why = str(e) if isinstance(e, CoreFatalError) else f"its loop failed: {type(e).__name__}: {e}"
        proc.outputs.put(Error(why, fatal=True))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # exiting already: a stop now must not raise in the shutdown
        proc.outputs.put(None)
        writer.join(timeout=5)
        try:
            core.shutdown()
        except Exception:  # noqa: BLE001 (after a device error, waiting for the device fails too)
            traceback.print_exc()
        out.close(linger=2000)
    if died:
        sys.exit(1)
