"""Where an engine step's time goes: one stopwatch per phase, summed over steps.

    schedule         the scheduler picks requests and chunks; blocks are allocated, cached and freed
    prepare inputs   Python lists become the tensors the model reads (token ids, positions, block tables)
    forward          the model (on CUDA with sync on, the stopwatch waits for the GPU, so the time is the GPU's)
    sample           log-softmax, the sampler, the chosen tokens' logprobs
    detokenize       text grows, stop conditions are checked, finished requests become outputs

GPU work is asynchronous: on CUDA a phase's stopwatch stops when the CPU has queued its work, and the GPU's time
is billed to the phase that next waits for it (sample, which reads the chosen tokens). Exact phase times need a
wait for the GPU at every phase's end, about ten per step, which slows the engine: `timers.sync = True` asks
for it (a phase table or a profile does), the engine's normal path leaves it off.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

PHASES = ("schedule", "prepare inputs", "forward", "sample", "detokenize")


class PhaseTimers:
    def __init__(self, device: torch.device, sync: bool = False):
        self.on_gpu = device.type == "cuda"
        self.sync = sync  # wait for the GPU at each phase's end (CUDA only): exact phase times, a slower engine
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            if torch._C._autograd._profiler_enabled():  # a profiler records: the phase shows by name in its trace
                with torch.profiler.record_function(name):
                    yield
            else:  # no profiler: no range to open (opening one costs about 10 us, a dozen times a step)
                yield
        finally:
            if self.sync and self.on_gpu:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - start

    def rows(self) -> list[list]:
        """[phase, total ms, ms per step, share of the total] for a table."""
        total = sum(self.seconds.values()) or 1.0
        steps = max(self.steps, 1)
        return [[name, f"{s * 1000:.1f}", f"{s * 1000 / steps:.3f}", f"{100 * s / total:.1f}%"]
                for name, s in self.seconds.items()]
