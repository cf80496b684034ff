"""The serving tables of step24's and step26's chapters: a step's serve.py (--step, default step24) started
on a free loopback port, bench_serve.py's requests at
several rates against it, then saturation (every request at once) alternated with as many requests through the
offline engine, in one call. Every run sends prompts of its own (random ids, another seed), so no run finds the
prompts of an earlier one in a prefix cache; untimed warm-ups of the same lengths run first, on both.

    python docs/data/bench_serving.py --model smollm2-135m --rates 1 2 4 --repeats 3 --num-prompts 32 \\
        --input-len 64 --output-len 32 --out docs/data/raw/cpu_step24_serving.jsonl

The offline engine (LLM.generate, all the requests at once) lives in this process beside the server's, each with
its share of a GPU. The two take turns --repeats times, so a slow spell of the machine falls on both, and the
medians are compared. In --out: one JSON line per run of bench_serve.py (rate "inf": saturation, with "repeat"),
each with the server engine's steps, phases and CPU seconds (by process and by thread) from /stats, then one line
{"offline": ...}. --client-processes spreads the benchmark's client over processes (bench_serve.py's). On a GPU,
every process gets one torch host thread (OMP_NUM_THREADS=1, unless it is set): step26's core does the same.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# the newest client for every step: the same measuring instrument (it can spread its streams over processes)
from steps.step26.bench_serve import bench, random_prompts, rate_arg, warm_up  # noqa: E402
from steps.step24.run import free_port, start_server  # noqa: E402

# step26 on, the engine is a core process of its own: /stats adds its CPU seconds to the front end's
PHASES_KEY, CORE_CPU_KEY = "phase_s", "core_cpu_s"


def served(base: str, args, rate: float, prompts) -> dict:
    """One bench_serve.py run, with what the server's engine did meanwhile (from /stats before and after)."""
    import httpx

    before = httpx.get(f"{base}/stats", timeout=10).json()
    # client_cpu_s in the result: the benchmark's client, all its processes together
    result = asyncio.run(bench(base, args.model, rate, prompts, args.output_len, procs=args.client_processes))
    after = httpx.get(f"{base}/stats", timeout=10).json()
    result["server_steps"] = after["steps"] - before["steps"]
    result["server_phase_s"] = {k: v - before[PHASES_KEY].get(k, 0.0) for k, v in after[PHASES_KEY].items()}
    result["server_coalesced"] = after["coalesced"] - before["coalesced"]  # outputs a slow stream passed over
    # CPU seconds of the server process (with a core: the front end's), and of the step loop's: its thread's in
    # step24 (the rest: the event loop, HTTP), the core process's from step26 on
    result["server_cpu_s"] = after["process_cpu_s"] - before["process_cpu_s"]
    loop_key = CORE_CPU_KEY if CORE_CPU_KEY in after else "step_thread_cpu_s"
    result["server_step_thread_cpu_s"] = after[loop_key] - before[loop_key]
    result["server_step_loop_cpu_key"] = loop_key
    for key, name in (("threads_cpu_s", "core_threads_cpu_s"), ("front_end_threads_cpu_s", "front_end_threads_cpu_s")):
        if key in after:  # CPU seconds by thread: the core's, the front end's
            result[name] = {k: v - before[key].get(k, 0.0) for k, v in after[key].items()}
    result["command"] = " ".join(sys.argv)
    print(f"rate {result['request_rate']}: {result['completed']} of {len(prompts)} requests done in "
          f"{result['duration_s']:.1f} s ({result['output_throughput']:.1f} output tokens/s)", flush=True)
    return result


def offline_run(llm, prompts, output_len: int) -> dict:
    from shared import SamplingParams

    steps, llm.timers.seconds = llm.timers.steps, dict.fromkeys(llm.timers.seconds, 0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"offline: {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} output tokens/s)", flush=True)
    return {"output_throughput": tokens / wall, "output_tokens": tokens, "wall_s": wall,
            "steps": llm.timers.steps - steps, "phase_s": dict(llm.timers.seconds)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--step", default="step24", help="whose serve.py and offline LLM (default: %(default)s)")
    p.add_argument("--device", default=None)
    p.add_argument("--rates", type=rate_arg, nargs="+", default=[1.0, 2.0, 4.0], help="finite rates (saturation: always)")
    p.add_argument("--repeats", type=int, default=3, help="saturation and offline runs, alternated")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45, help="each engine's share on a GPU")
    p.add_argument("--client-processes", type=int, default=1, help="the benchmark client's processes")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from shared import SamplingParams
    from shared.cli import format_table
    import importlib

    LLM = importlib.import_module(f"steps.{args.step}.engine").LLM
    import torch

    if args.device != "cpu" and torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # On a GPU every process here (the server's, the offline engine's) gets one torch host thread: a pool of one
        # per core spins after each small host op and slows the loop that made it (step26's core does this itself)
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    print(f"torch host threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}", flush=True)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    options = ["--max-num-seqs", str(args.max_num_seqs), "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    server = start_server(args.model, port, *options, *(["--device", args.device] if args.device else []),
                          serve_py=ROOT / "steps" / args.step / "serve.py")
    try:
        llm = LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs,
                  gpu_memory_utilization=args.gpu_memory_utilization)
        # Each run, measured or not, sends prompts of its own (another seed): nothing it sends is in a prefix cache
        # from an earlier run, so every run prefills as a first visit does. The warm-ups, untimed, run the measured
        # lengths once, so the shapes they need are compiled before any clock runs.
        seeds = itertools.count(1)
        prompts = lambda: random_prompts(args.num_prompts, args.input_len, next(seeds))  # noqa: E731
        asyncio.run(warm_up(base, args.model, prompts(), args.output_len, procs=args.client_processes))
        llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True))
        lines = [served(base, args, rate, prompts()) for rate in args.rates if math.isfinite(rate)]
        saturated, offline = [], []
        for repeat in range(args.repeats):
            saturated.append(dict(served(base, args, math.inf, prompts()), repeat=repeat))
            offline.append(offline_run(llm, prompts(), args.output_len))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    med_server = statistics.median(r["output_throughput"] for r in saturated)
    med_offline = statistics.median(r["output_throughput"] for r in offline)
    summary = {"step": args.step, "offline": {"runs": offline, "median_output_throughput": med_offline, "device": str(llm.device),
                           "backend": llm.backend},
               "server_at_saturation_median_output_throughput": med_server,
               "server_at_saturation_over_offline": med_server / med_offline}
    args.out.write_text("".join(json.dumps(line) + "\n" for line in [*lines, *saturated, summary]))

    num = lambda v: f"{v:.1f}" if v < 100 else f"{v:.0f}"  # noqa: E731
    ms = lambda m: " / ".join(num(m[k]) for k in ("mean", "p50", "p99"))  # noqa: E731
    rows = [[r["request_rate"], r["completed"], f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
             ms(r["ttft_ms"]), ms(r["tpot_ms"]), ms(r["itl_ms"]), ms(r["e2e_ms"])] for r in [*lines, *saturated]]
    print(f"\n{args.step}, {args.model} on {llm.device}: {args.num_prompts} requests, {args.input_len} prompt tokens and "
          f"{args.output_len} new tokens each; latencies in ms, mean / p50 / p99")
    print(format_table(["rate, req/s", "done", "requests/s", "output tokens/s", "TTFT", "TPOT", "ITL", "E2E"], rows))
    runs = ", ".join(f"{r['output_throughput']:.1f}" for r in offline)
    print(f"offline engine, as many requests (prompts of their own), alternated with the inf runs: {runs} output tokens/s")
    print(f"medians: the server at saturation {med_server:.1f}, offline {med_offline:.1f}: the server made "
          f"{med_server / med_offline:.2f}x the offline")
    # Where the time went, summed over the alternated runs: per engine step, by phase
    s_steps, o_steps = sum(r["server_steps"] for r in saturated), sum(r["steps"] for r in offline)
    s_wall, o_wall = sum(r["duration_s"] for r in saturated), sum(r["wall_s"] for r in offline)
    print(f"at saturation the server's engine ran {s_steps} steps in {s_wall:.2f} s, "
          f"{sum(sum(r['server_phase_s'].values()) for r in saturated):.2f} s of them in its phases; offline: "
          f"{o_steps} steps in {o_wall:.2f} s, {sum(sum(r['phase_s'].values()) for r in offline):.2f} s in phases")
    for k in offline[0]["phase_s"]:
        print(f"  {k:<16} server {1000 * sum(r['server_phase_s'].get(k, 0) for r in saturated) / max(s_steps, 1):8.2f} "
              f"ms/step   offline {1000 * sum(r['phase_s'][k] for r in offline) / max(o_steps, 1):8.2f} ms/step")
    print(f"CPU seconds at saturation: the server's process {sum(r['server_cpu_s'] for r in saturated):.2f} in "
          f"{s_wall:.2f} s (its step loop's, {saturated[0]['server_step_loop_cpu_key']}: "
          f"{sum(r['server_step_thread_cpu_s'] for r in saturated):.2f}), "
          f"the benchmark's client {sum(r['client_cpu_s'] for r in saturated):.2f} "
          f"({saturated[0]['client_processes']} process{'es' if saturated[0]['client_processes'] > 1 else ''})")
    for key, whose in (("core_threads_cpu_s", "the core's"), ("front_end_threads_cpu_s", "the front end's")):
        if key in saturated[0]:
            threads = {k: sum(r[key].get(k, 0.0) for r in saturated) for k in saturated[0][key]}
            print(f"{whose} CPU seconds at saturation, by thread: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v >= 0.01))
    print("ITL gaps of 0.0 (events read together), by rate: "
          + ", ".join(f"{r['request_rate']}: {100 * (r['itl_zero_fraction'] or 0):.0f}%" for r in [*lines, *saturated]))
    print("outputs passed over for a newer one (the server fell behind a stream), by rate: "
          + ", ".join(f"{r['request_rate']}: {r['server_coalesced']}" for r in [*lines, *saturated]))


if __name__ == "__main__":
    main()
