"""One sampling step of the model runner, alone: the time of `ModelRunner.sample` for a batch of logits, by step.

For each step (and, with --before, the newest step of an older tree of steps), the runner's sample (log-softmax,
sample_batch, the chosen tokens' logprobs, the read-back to the host; on CUDA also the runner's other path where it
has one, the draw as one kernel: kernels/sampling.py) runs on random fp32 logits [rows, vocab]
for rows in --rows, at temperature 0.6 (nano-vllm's benchmark) and greedy. Per case: the wall time of one call
(median of --repeats, the call ends with its wait for the GPU), the GPU's busy time in it (the kernels' summed time
from the torch profiler over the same calls), and the kernels launched per call. The device's limit is measured
in the same run: the copy bandwidth of a 1 GiB buffer, and from it the floor of one read of the logits.

    python docs/data/bench_sampler.py --steps step21 step24 --before /tmp/before/steps --out $OUT/sampler.jsonl
    python docs/data/bench_sampler.py --device cpu --vocab 4096 --rows 1 8 --repeats 3
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "data"))

import torch  # noqa: E402

from shared import SamplingParams  # noqa: E402


PHASE_NAMES = ("schedule", "prepare inputs", "forward", "sample", "detokenize")  # timers.py's ranges, not kernels


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write counted), median of 5."""
    x = torch.empty(2**28, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        y.copy_(x)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * x.numel() * 4 / statistics.median(times[1:])


def runner_modules(step: str, before: Path | None):
    if before is None:
        return importlib.import_module(f"steps.{step}.model_runner"), importlib.import_module(f"steps.{step}.timers")
    from bench_hot_path import load_engine  # docs/data/bench_hot_path.py: a step of another tree

    load_engine(before, step, "before_tree")
    return importlib.import_module("before_tree.model_runner"), importlib.import_module("before_tree.timers")


def measure(model_runner, timers, device: torch.device, rows: int, vocab: int, temperature: float,
            repeats: int, fused: bool) -> dict:
    runner = model_runner.ModelRunner(None, device, torch.float32, timers.PhaseTimers(device), {"syncs": 0})
    if hasattr(runner, "fused_sampler"):
        runner.fused_sampler = fused  # the draw as one kernel (kernels/sampling.py), or sampler.py's operators
    params = SamplingParams(temperature=temperature, max_tokens=1024, ignore_eos=True)
    seqs = [SimpleNamespace(params=params, seed=1000 + i, output_ids=[0] * (i % 37)) for i in range(rows)]
    logits = torch.randn(rows, vocab, device=device) * 4
    for _ in range(3):  # warm-up: the allocator's pools, the kernels' first launches
        runner.sample(seqs, logits)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        runner.sample(seqs, logits)
        times.append(time.perf_counter() - start)
    record = {"rows": rows, "vocab": vocab, "temperature": temperature, "ms": statistics.median(times) * 1000,
              "ms_all": [t * 1000 for t in times]}
    if device.type == "cuda":
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(repeats):
                runner.sample(seqs, logits)
            sync(device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False) and e.name not in PHASE_NAMES]
        busy_us = sum(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) for e in kernels)
        names: dict[str, float] = {}
        for e in kernels:
            names[e.name] = names.get(e.name, 0.0) + (getattr(e, "device_time", None) or getattr(e, "cuda_time", 0))
        record.update(gpu_busy_ms=busy_us / repeats / 1000, kernels_per_call=len(kernels) / repeats,
                      top_kernels_ms={k[:80]: v / repeats / 1000 for k, v in
                                      sorted(names.items(), key=lambda kv: -kv[1])[:8]})
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", nargs="+", default=["step21", "step24"])
    parser.add_argument("--before", default=None, metavar="STEPS_ROOT",
                        help="also the newest step of this older tree of steps, as '<step>-before'")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 256])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    common = {"device": args.device, "command": " ".join(sys.argv),
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    records = []
    if device.type == "cuda":
        bandwidth = copy_bandwidth(device)
        records.append({**common, "kind": "limit", "copy_bytes_per_s": bandwidth,
                        "one_read_ms": {r: r * args.vocab * 4 / bandwidth * 1000 for r in args.rows}})
    names = [(s, None) for s in args.steps] + ([(args.steps[-1], Path(args.before))] if args.before else [])
    for step, before in names:
        model_runner, timers = runner_modules(step, before)
        has_kernel = device.type == "cuda" and hasattr(model_runner, "fused_draw")
        for fused in ((False, True) if has_kernel else (False,)):
            for rows in args.rows:
                for temperature in (0.6, 0.0):
                    record = measure(model_runner, timers, device, rows, args.vocab, temperature, args.repeats, fused)
                    records.append({**common, "kind": "sample", "path": "kernel" if fused else "torch",
                                    "step": step + ("-before" if before else ""), **record})
    for record in records:
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
