"""Faults injected into an engine core process (step26 on): AsyncLLM(..., _core_setup=inject_faults) calls this in
the core once its EngineCore (core.py) is built; the step faults alone (inject_step_faults) go into any engine with
a model runner, an LLM or an EngineCore (steps 23-25: inject_step_faults(engine.llm), an AsyncLLM's without a core). A module of its own, so that the core process (spawned: it
imports what it runs) can import it by name. Requests ask for a fault by their seed:

- STEP_FAILURE_SEED: every engine step that serves the request after its first token raises (inside the step: a
  request that fails a step alone gets the error; the requests of a step of several are put back to run alone, so
  the request with the seed fails alone and the others run on; the core serves on);
- DEVICE_ERROR_SEED: that step raises a device error instead, as CUDA reports an illegal memory access
  (torch.AcceleratorError; a RuntimeError naming "CUDA error" on a torch without it);
- DEATH_SEED: adding the request raises a RuntimeError (outside a step: the core's loop dies).

The core's IO threads get sockets that fail on a mark:

- INPUT_THREAD_FAILURE: a frame (sent as it is, not a message) whose receipt raises in the input thread;
- OUTPUT_THREAD_FAILURE_SEED: a request whose first output raises in the output thread as it is sent.

speak_another_protocol, another setup hook, makes the core state a wire protocol version its front end does not
speak (in its Ready message).
"""
import importlib
import sys

import msgspec
import torch

STEP_FAILURE_SEED = 4242
DEATH_SEED = 4343
DEVICE_ERROR_SEED = 4444
INPUT_THREAD_FAILURE = b"\xc1 the input thread fails"  # 0xc1: no msgpack message starts so
OUTPUT_THREAD_FAILURE_SEED = 4545
DEVICE_ERROR_MESSAGE = "CUDA error: an illegal memory access was encountered"


def device_error() -> RuntimeError:
    """The exception a CUDA fault raises: torch.AcceleratorError where torch has it (2.8 on)."""
    return getattr(torch, "AcceleratorError", RuntimeError)(DEVICE_ERROR_MESSAGE)


def inject_step_faults(engine) -> None:
    """STEP_FAILURE_SEED and DEVICE_ERROR_SEED: the model runner's execute raises for a step that serves such a
    request after its first token. execute takes the step's plan from step26 on (a SchedulerOutput, which names its
    rows' requests by id: the engine's scheduler holds them), the rows [(sequence, n)] themselves before."""
    execute = engine.runner.execute

    def failing_execute(plan, *args, **kwargs):
        if hasattr(plan, "request_ids"):
            seqs = [engine.scheduler.requests[request_id] for request_id in plan.request_ids]
        else:
            seqs = [seq for seq, _ in plan]
        if any(seq.params.seed == STEP_FAILURE_SEED and seq.output_ids for seq in seqs):
            raise RuntimeError("injected failure")
        if any(seq.params.seed == DEVICE_ERROR_SEED and seq.output_ids for seq in seqs):
            raise device_error()
        return execute(plan, *args, **kwargs)

    engine.runner.execute = failing_execute


def _engine_core_module(core):
    """The step's engine_core module, whose run_engine_core built this EngineCore (core.py, in the same package)."""
    return sys.modules[type(core).__module__.rsplit(".", 1)[0] + ".engine_core"]


def inject_faults(core) -> None:
    inject_step_faults(core)
    add = core.add_request
    engine_core = _engine_core_module(core)
    failing_outputs: set[str] = set()  # the requests (as the core names them) of OUTPUT_THREAD_FAILURE_SEED

    def failing_add(request_id, text, ids, params, *args, **kwargs):
        if params.seed == DEATH_SEED:
            raise RuntimeError("injected failure outside a step")
        seq = add(request_id, text, ids, params, *args, **kwargs)
        if params.seed == OUTPUT_THREAD_FAILURE_SEED:
            failing_outputs.add(request_id)
        return seq

    core.add_request = failing_add
    _inject_io_faults(engine_core, failing_outputs)


def speak_another_protocol(core) -> None:
    """The core's Ready states a protocol version 1000 past its own (engine_core sends its PROTOCOL_VERSION)."""
    engine_core = _engine_core_module(core)
    engine_core.PROTOCOL_VERSION += 1000


class _FailingSocket:
    """An IO thread's socket that raises on a marked frame, and passes every other one on."""

    def __init__(self, sock, engine_core, failing_outputs: set[str]):
        self.sock, self.failing_outputs = sock, failing_outputs
        self.wire = importlib.import_module(f"{engine_core.__package__}.wire")  # the step's messages
        self.decoder = msgspec.msgpack.Decoder(self.wire.FromCore)

    def recv(self, *args, **kwargs):
        frame = self.sock.recv(*args, **kwargs)
        if frame == INPUT_THREAD_FAILURE:
            raise RuntimeError("injected failure in the input thread")
        return frame

    def send(self, frame, *args, **kwargs):
        msg = self.decoder.decode(frame)
        if isinstance(msg, self.wire.Outputs) and any(d.request_id in self.failing_outputs for d in msg.deltas):
            raise RuntimeError("injected failure in the output thread")
        return self.sock.send(frame, *args, **kwargs)


def _inject_io_faults(engine_core, failing_outputs: set[str]) -> None:
    """The core's IO threads get failing sockets: run_engine_core starts them after the setup hook has run."""
    input_thread, output_thread = engine_core._input_thread, engine_core._output_thread
    engine_core._input_thread = lambda sock, core: input_thread(_FailingSocket(sock, engine_core, set()), core)
    engine_core._output_thread = lambda sock, core: output_thread(_FailingSocket(sock, engine_core, failing_outputs),
                                                                  core)
