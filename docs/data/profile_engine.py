"""Where an engine step's time goes, on the mixed workload: Python on the CPU, or kernels on the GPU.

For each step given, one fresh engine runs the mixed workload once to warm up, then once more under
torch.profiler (CPU and CUDA activities). Printed per engine step: wall time, the kernels launched, the GPU's busy
time (the kernels' own durations added up), the engine's phase timers, the operators called most, and the kernels
that took the most GPU time. When the GPU is busy for a small share of the wall time, the step is bound by Python launching
kernels one by one, not by the kernels.

    python3 docs/data/profile_engine.py --model random:qwen3-0.6b --max-num-seqs 64 step16 step17
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from shared.bench import WORKLOADS  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def profile_step(step: str, model: str, max_num_seqs: int | None, workload: str) -> dict:
    engine = importlib.import_module(f"steps.{step}.engine")
    llm = engine.LLM(model, **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}))
    prompts, params = WORKLOADS[workload](llm.tokenizer, 128)
    llm.generate(prompts, params)  # warm-up: every kernel compiled, the allocator's pools grown
    torch.cuda.synchronize()
    llm.timers.reset()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    steps = max(llm.timers.steps, 1)
    launches, by_op, kernels, kernel_us = 0, collections.Counter(), collections.Counter(), collections.Counter()
    phases = set(llm.timers.seconds)  # the engine's phase ranges also show on the GPU's timeline: not kernels
    for e in prof.events():
        if e.name in LAUNCHES:
            launches += 1
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in phases:
            kernels[e.name[:90]] += 1
            kernel_us[e.name[:90]] += e.time_range.elapsed_us()  # as shared.anatomy.kernel_ms counts it
    gpu_us = sum(kernel_us.values())
    for row in prof.key_averages():
        if row.key.startswith("aten::"):
            by_op[row.key] = row.count
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = dict(step=step, model=model, max_num_seqs=llm.scheduler.max_num_seqs, steps=llm.timers.steps,
                  tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, ms_per_step=1000 * wall / steps,
                  launches_per_step=launches / steps, gpu_busy_ms_per_step=gpu_us / 1000 / steps,
                  gpu_busy_share=gpu_us / 1e6 / wall,
                  phases_ms_per_step={k: 1000 * v / steps for k, v in llm.timers.seconds.items()},
                  aten_calls_per_step={k: round(v / steps, 1) for k, v in by_op.most_common(25)},
                  kernel_ms_per_step={k: (round(v / 1000 / steps, 3), round(kernels[k] / steps, 1))
                                      for k, v in kernel_us.most_common(15)})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("steps", nargs="+")
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this profile measures GPU busy time against Python's: it needs a CUDA device")
    for step in args.steps:
        r = profile_step(step, args.model, args.max_num_seqs, args.workload)
        print(f"== {step} on {args.model}, {r['max_num_seqs']} seats: {r['steps']} steps, {r['tokens']} tokens in "
              f"{r['wall_s']:.2f} s ({r['tokens_per_s']:.1f} tokens/s)")
        print(f"   per step: {r['ms_per_step']:.2f} ms wall, {r['launches_per_step']:.0f} kernel launches, GPU busy "
              f"{r['gpu_busy_ms_per_step']:.2f} ms ({100 * r['gpu_busy_share']:.0f}% of the wall time)")
        print("   phases, ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases_ms_per_step"].items()))
        print("   operator calls per step: " + ", ".join(f"{k} {v}" for k, v in r["aten_calls_per_step"].items()))
        print("   kernels by GPU time, ms per step (launches per step):")
        for k, (ms, n) in r["kernel_ms_per_step"].items():
            print(f"     {ms:8.3f} ({n:6.1f})  {k}")
        print("PROFILE_JSON " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
