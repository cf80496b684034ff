"""nano-vllm's benchmark as nano-vllm's bench.py runs it, through several steps in one process, runs alternated.

Each engine is built as nano-vllm's bench builds its own: LLM(model, max_num_seqs=256, max_num_batched_tokens=16384),
one warm-up request (`generate(["Benchmark: "], SamplingParams())`), then the clock around one `generate` call of
the whole workload (shared/bench.py's nano_vllm_workload: nano-vllm's draws, temperature 0.6, ignore_eos) and
tokens/s = the requests' max_tokens summed (133,966) over its seconds. The engines stay alive side by side (each
takes its share of the GPU's memory: gpu_memory_utilization counts what the earlier ones hold, so the k-th gets
k x --share), and the runs alternate: step A, step B, step C, step A, ... so a slow spell of the host weighs on
every step alike. Then, for every step: batch 1 (one prompt of 128 random ids, 512 new tokens, alternated too), one
run of the workload with the phase timers waiting for the GPU at each phase's end (ms per engine step by phase),
and on CUDA the GPU's busy share of engine steps 60-80 of the workload (every seat decoding), from the profiler.

    python docs/data/bench_host_path.py --steps step20 step21 step24 --repeats 3 --out $OUT/host_path.jsonl
    python docs/data/bench_host_path.py --model random:tiny-qwen3 --device cpu --requests 4 --steps step21 step24
    python docs/data/bench_host_path.py --steps step28 step29:quantization=int4 --share 0.3

A step may carry engine options after a colon (step29:quantization=int4,kv_cache_dtype=int8): the engine is built
with them, and its lines name it so.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "data"))

import torch  # noqa: E402

from shared import SamplingParams  # noqa: E402
from shared.anatomy import busy_us  # noqa: E402
from shared.bench import nano_vllm_workload  # noqa: E402


def emit(record: dict, out) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_generate(llm, prompts, params, device: str) -> float:
    """One timed generate from a cold prefix cache, as nano-vllm's bench.py times its one run: a repeat of the
    same prompts must not find their blocks cached by the run before (the prefill would be skipped)."""
    llm.block_manager.reset_prefix_cache()
    sync(device)
    start = time.perf_counter()
    llm.generate(prompts, params)
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", nargs="+", default=["step20", "step21", "step24"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--share", type=float, default=0.28, help="each engine's share of the GPU's memory")
    parser.add_argument("--requests", type=int, default=256, help="fewer for a dry run (the draws' first ones)")
    parser.add_argument("--batch1-tokens", type=int, default=512)
    parser.add_argument("--before", default=None, metavar="STEPS_ROOT",
                        help="also the newest step of this older tree of steps (git archive <commit> steps | tar -x), "
                             "as '<step>-before', in the same alternation")
    parser.add_argument("--busy-steps", nargs=2, type=int, default=[60, 80], metavar=("FIRST", "LAST"),
                        help="the engine steps of the sampled workload whose GPU-busy share is measured")
    parser.add_argument("--tree", default=None, help="what tree ran (a commit), recorded with every line")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    common = dict(device=args.device, command=" ".join(sys.argv), model=args.model, tree=args.tree,
                  gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    engines = {}
    names = list(args.steps) + ([f"{args.steps[-1]}-before"] if args.before else [])
    for k, step in enumerate(names, start=1):
        if step.endswith("-before"):
            from bench_hot_path import load_engine  # docs/data/bench_hot_path.py: a step of another tree

            LLM = load_engine(Path(args.before), args.steps[-1], "before_tree").LLM
        else:
            LLM = importlib.import_module(f"steps.{step.partition(':')[0]}.engine").LLM
        options = dict(max_num_seqs=256, max_num_batched_tokens=16384)
        options.update(kv.split("=", 1) for kv in step.partition(":")[2].split(",") if kv)  # step29:key=value
        if args.device == "cuda":
            options["gpu_memory_utilization"] = min(k * args.share, 0.95)
        else:
            options["max_kv_tokens"] = 65536
        start = time.perf_counter()
        llm = LLM(args.model, device=args.device, **options)
        llm.generate(["Benchmark: "], SamplingParams())  # nano-vllm's warm-up
        llm._bench_name = step
        engines[step] = llm
        print(f"[host_path] {step} built and warmed up in {time.perf_counter() - start:.1f} s", file=sys.stderr,
              flush=True)
    tokenizer = next(iter(engines.values())).tokenizer
    workloads = {}
    for name, temperature in (("nano-vllm", 0.6), ("nano-vllm-greedy", 0.0)):
        prompts, params = nano_vllm_workload(tokenizer, temperature=temperature)
        workloads[name] = (prompts[:args.requests], params[:args.requests])
    runs: dict[tuple, list] = {}
    for repeat in range(args.repeats):
        for name, (prompts, params) in workloads.items():
            for step, llm in rotated(engines, repeat):  # each step takes each place in the order in turn
                before = dict(llm.stats)
                seconds = timed_generate(llm, prompts, params, args.device)
                tokens = sum(sp.max_tokens for sp in params)
                runs.setdefault((name, step), []).append(tokens / seconds)
                counters = {key: llm.stats[key] - before.get(key, 0) for key in llm.stats
                            if isinstance(llm.stats[key], (int, float)) and key in ("forwards", "graph_replays",
                                                                                    "eager_forwards", "preemptions",
                                                                                    "syncs", "steps")}
                emit({**common, "kind": "run", "workload": name, "step": step, "repeat": repeat, "tokens": tokens,
                      "seconds": seconds, "tokens_per_s": tokens / seconds, "counters": counters}, args.out)
    for (name, step), values in runs.items():
        emit({**common, "kind": "median", "workload": name, "step": step, "repeats": len(values),
              "tokens_per_s": statistics.median(values), "all": values}, args.out)
    # batch 1: one prompt of 128 random ids (nano-vllm's id range), 512 new tokens, median of --repeats, alternated
    prompt = nano_vllm_workload(tokenizer)[0][0][:128]
    batch1_work = {f"batch1-{t}": ([prompt], [SamplingParams(temperature=t, max_tokens=args.batch1_tokens,
                                                             ignore_eos=True)]) for t in (0.6, 0.0)}
    for temperature in (0.6, 0.0):
        sp = batch1_work[f"batch1-{temperature}"][1][0]
        batch1: dict[str, list] = {}
        for repeat in range(args.repeats):
            for step, llm in rotated(engines, repeat):
                batch1.setdefault(step, []).append(args.batch1_tokens / timed_generate(llm, [prompt], sp, args.device))
        for step, values in batch1.items():
            emit({**common, "kind": "batch1", "step": step, "temperature": temperature, "prompt_tokens": len(prompt),
                  "new_tokens": args.batch1_tokens, "tokens_per_s": statistics.median(values), "all": values},
                 args.out)
    busy: dict[tuple, dict] = {}
    windows = {"nano-vllm": (workloads["nano-vllm"], args.busy_steps),
               "batch1-0.6": (batch1_work["batch1-0.6"], (20, 220))}  # batch 1: its decode steps (prefill: step 0)
    for step, llm in engines.items():
        # by phase: one run of each workload with the phase timers waiting for the GPU at each phase's end
        for name, (prompts, params) in {**workloads, **batch1_work}.items():
            # an overlapped engine (step25's async scheduling) is timed without the waits, which would undo the
            # overlap: its phases are host time, and the one wait for the device falls in "sample"
            overlapped = getattr(llm, "async_scheduling", False)
            llm.timers.reset()
            llm.timers.sync = not overlapped
            seconds = timed_generate(llm, prompts, params, args.device)
            llm.timers.sync = False
            steps = max(llm.timers.steps, 1)
            emit({**common, "kind": "phases", "step": step, "workload": name, "engine_steps": llm.timers.steps,
                  "phase_waits": not overlapped, "seconds": seconds,
                  "ms_per_step": {k: s * 1000 / steps for k, s in llm.timers.seconds.items()}}, args.out)
        if args.device == "cuda":  # the steps' time with nothing watching, for every engine before any profiler runs
            for name, ((prompts, params), window) in windows.items():
                busy[step, name] = timed_window(llm, prompts, params, window)
    if args.device == "cuda":  # then the same steps again with the profiler: the GPU's kernels in them
        for step, llm in engines.items():
            for name, ((prompts, params), window) in windows.items():
                record = {**busy[step, name], **kernel_window(llm, prompts, params, window)}
                record["gpu_busy_share"] = record["gpu_busy_ms_per_step"] / record["ms_per_step"]
                emit({**common, **record, "step": step, "workload": name}, args.out)


def rotated(engines: dict, shift: int) -> list:
    """The engines in their order, started `shift` places on: over as many repeats as engines, each step runs
    first, second, ... once, so a place in the order (after a slower engine, say) weighs on every step alike."""
    items = list(engines.items())
    shift %= len(items)
    return items[shift:] + items[:shift]


def step_window(llm, prompts, params, window: tuple[int, int], watch=contextlib.nullcontext) -> tuple[float, int]:
    """Add the workload's requests, run the engine's steps before `first`, time its own steps first..last (inside
    `watch()`, a context manager: nothing, or a profiler), then run the workload to its end.
    -> (ms per timed step, the rows running when the window began)."""
    first, last = window
    for prompt, sp in zip(prompts, params):
        llm.add_request(prompt, sp)
    for _ in range(first):
        llm.step()
    rows = len(llm.scheduler.running)
    torch.cuda.synchronize()
    with watch():
        start = time.perf_counter()
        for _ in range(last - first):
            llm.step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    while llm.has_unfinished_requests():
        llm.step()
    return seconds * 1000 / (last - first), rows


def timed_window(llm, prompts, params, window: tuple[int, int]) -> dict:
    """The engine's own steps first..last of a workload (for nano-vllm's, by then every seat decodes: 256 rows),
    timed on the host with nothing watching."""
    ms, rows = step_window(llm, prompts, params, window)
    return {"engine_steps": list(window), "running_rows": rows, "ms_per_step": ms}


def kernel_window(llm, prompts, params, window: tuple[int, int]) -> dict:
    """The same steps of the same workload run again, with the profiler recording the GPU's kernels (CUDA activity
    only). The time the GPU was busy is the union of their intervals (shared.anatomy.busy_us: step28's kernels
    launched as programmatic dependents overlap the one before). The busy share
    divides it by timed_window's unwatched time (-> a dict to merge with timed_window's): the profiler slows each
    launch on the host (a graph's launch takes tens of microseconds alone, hundreds recorded), which an engine that
    overlaps the host with the GPU would show as idle GPU time. The watched steps' own time is kept beside it."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    watched_ms, _ = step_window(llm, prompts, params, window, watch=lambda: prof)
    steps = window[1] - window[0]
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False) and e.name not in llm.timers.seconds]
    busy_ms = busy_us(kernels) / 1000 / steps
    return {"kind": "gpu_busy", "ms_per_step_profiled": watched_ms, "gpu_busy_ms_per_step": busy_ms,
            "kernels_per_step": len(kernels) / steps}


if __name__ == "__main__":
    main()
