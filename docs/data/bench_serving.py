"""The serving table of step24's chapter: serve.py started on a free loopback port, bench_serve.py's requests at
several rates against it, then the same requests through the offline engine, in one call.

    python docs/data/bench_serving.py --model smollm2-135m --rates 1 2 4 inf --num-prompts 32 --input-len 64 \\
        --output-len 32 --out docs/data/raw/cpu_step24_serving.jsonl

One JSON line per rate in --out (bench_serve.py's), then one line {"offline": ...}: the offline engine's output tokens/s on
the same requests (LLM.generate, all at once, after a warm-up), and the server at saturation (the last rate) over it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from steps.step24.bench_serve import bench, random_prompts, rate_arg  # noqa: E402
from steps.step24.run import free_port  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default=None)
    p.add_argument("--rates", type=rate_arg, nargs="+", default=[1.0, 2.0, 4.0, math.inf])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45, help="each engine's share on a GPU")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    import httpx

    port = free_port()
    cmd = [sys.executable, str(ROOT / "steps/step24/serve.py"), "--model", args.model, "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.device:
        cmd += ["--device", args.device]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"serve.py exited: {server.stdout.read()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("serve.py did not start within 600 s")
            time.sleep(0.2)
        prompts = random_prompts(args.num_prompts, args.input_len)
        asyncio.run(bench(f"http://127.0.0.1:{port}", args.model, math.inf, prompts[:2], 4))  # warm-up
        for rate in args.rates:
            before = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=10).json()
            result = asyncio.run(bench(f"http://127.0.0.1:{port}", args.model, rate, prompts, args.output_len))
            after = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=10).json()
            # the server's engine during this rate: its steps and its time by phase (the rest of the wall time is
            # spent outside the engine's steps: waiting for requests, or on the event loop's side of the GIL)
            result["server_steps"] = after["steps"] - before["steps"]
            result["server_coalesced"] = after["coalesced"] - before["coalesced"]  # outputs a slow stream passed over
            # CPU seconds of the server process, and of its step-loop thread alone (the rest: the event loop, HTTP)
            result["server_cpu_s"] = after["process_cpu_s"] - before["process_cpu_s"]
            result["server_step_thread_cpu_s"] = after["step_thread_cpu_s"] - before["step_thread_cpu_s"]
            result["server_phase_s"] = {k: v - before["phase_s"][k] for k, v in after["phase_s"].items()}
            result["command"] = " ".join(sys.argv)
            lines.append(result)
            print(f"rate {result['request_rate']}: {result['completed']} of {len(prompts)} requests done in "
                  f"{result['duration_s']:.1f} s", flush=True)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    from shared import SamplingParams
    from steps.step24.engine import LLM

    llm = LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs,
              gpu_memory_utilization=args.gpu_memory_utilization)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    steps, llm.timers.seconds = llm.timers.steps, dict.fromkeys(llm.timers.seconds, 0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True))
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    offline = {"offline": {"output_throughput": tokens / wall, "output_tokens": tokens, "wall_s": wall,
                           "steps": llm.timers.steps - steps, "phase_s": dict(llm.timers.seconds),
                           "device": str(llm.device), "backend": llm.backend},
               "server_at_saturation_over_offline": lines[-1]["output_throughput"] / (tokens / wall)}
    lines.append(offline)
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    from shared.cli import format_table

    num = lambda v: f"{v:.1f}" if v < 100 else f"{v:.0f}"  # noqa: E731
    ms = lambda m: " / ".join(num(m[k]) for k in ("mean", "p50", "p99"))  # noqa: E731
    rows = [[r["request_rate"], r["completed"], f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
             ms(r["ttft_ms"]), ms(r["tpot_ms"]), ms(r["itl_ms"]), ms(r["e2e_ms"])] for r in lines[:-1]]
    print(f"\n{args.model} on {llm.device}: {args.num_prompts} requests, {args.input_len} prompt tokens and "
          f"{args.output_len} new tokens each; latencies in ms, mean / p50 / p99")
    print(format_table(["rate, req/s", "done", "requests/s", "output tokens/s", "TTFT", "TPOT", "ITL", "E2E"], rows))
    print(f"offline engine, the same requests: {tokens / wall:.1f} output tokens/s; the server at saturation: "
          f"{lines[-2]['output_throughput']:.1f}, {offline['server_at_saturation_over_offline']:.2f}x the offline")
    sat, off = lines[-2], offline["offline"]
    print(f"at saturation the server's engine ran {sat['server_steps']} steps in {sat['duration_s']:.2f} s, "
          f"{sum(sat['server_phase_s'].values()):.2f} s of them in its phases; offline: {off['steps']} steps in "
          f"{off['wall_s']:.2f} s, {sum(off['phase_s'].values()):.2f} s in phases")
    for k in off["phase_s"]:
        print(f"  {k:<16} server {1000 * sat['server_phase_s'][k] / max(sat['server_steps'], 1):8.2f} ms/step   "
              f"offline {1000 * off['phase_s'][k] / max(off['steps'], 1):8.2f} ms/step")
    print(f"CPU seconds of the server process at saturation: {sat['server_cpu_s']:.2f} in {sat['duration_s']:.2f} s, "
          f"{sat['server_step_thread_cpu_s']:.2f} of them in the step loop's thread")
    print("outputs passed over for a newer one (the server fell behind a stream), by rate: "
          + ", ".join(f"{r['request_rate']}: {r['server_coalesced']}" for r in lines[:-1]))


if __name__ == "__main__":
    main()
