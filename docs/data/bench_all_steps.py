"""Every step and HF transformers on one workload, in one call of at most ten minutes on one GPU.

    python3 docs/data/bench_all_steps.py --model random:smollm2-135m --workload mixed --out $OUT/all_mixed.jsonl

Each measurement is `python -m shared.bench` in a fresh process, as `run_all.py --bench` runs it. Run one after
another, the steps that serve requests slowly (steps 01-14_6 on the mixed workload take 30 s to 3 min each) would
need more than half an hour. So the call has three parts, each line of the output saying which part it was in:

  1. "alone": HF transformers (generate, continuous batching), step04 and the steps from --alone-from on, one at a
     time with nothing else running: the fast engines, whose comparison is the point of the table.
  2. "calibration": each step of --calibrate alone; part 3 measures it again in lanes.
  3. "lanes": the other steps, --lanes processes at a time (one step each, the longest first). They share the GPU
     and the host's cores: the GPU is nearly idle under each (these steps are bound by Python launching kernels),
     so they disturb one another little; a calibrated step's tokens/s in lanes over alone says how little, in
     the same call.

Every engine gets the same options: --max-num-seqs seats and a KV pool of --max-kv-tokens tokens (a step that has
no such option runs without it: steps 01-04 have no seats). A fixed pool matters in lanes: a CUDA step that sizes
its pool from free memory would take 90% of the GPU and leave nothing to the others.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from run_all import all_steps, step_key  # noqa: E402
from shared.bench import step_engine_options  # noqa: E402


def one(what: list[str], args, part: str, log) -> dict | None:
    """One `python -m shared.bench` process -> its result (with the part it ran in), or None (failed, timed out)."""
    cmd = [sys.executable, "-m", "shared.bench", *what, "--model", args.model, "--workload", args.workload,
           "--max-tokens", str(args.max_tokens), "--repeat", str(args.repeat)]
    if what[0] == "--step":
        taken = step_engine_options(what[1])
        for option in ("max_num_seqs", "max_num_batched_tokens", "max_kv_tokens", "kv_cache_dtype"):
            value = getattr(args, option)
            if value is not None and option in taken:
                cmd += [f"--{option.replace('_', '-')}", str(value)]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        log(f"{' '.join(what)} ({part}): over {args.timeout_s} s, stopped")
        return None
    log(f"{' '.join(what)} ({part}): exit {proc.returncode} in {time.time() - start:.0f} s\n{proc.stderr[-1500:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH_JSON ")]
    if proc.returncode or not lines:
        return None
    result = json.loads(lines[-1][len("BENCH_JSON "):])
    result.update(part=part, lanes=args.lanes if part == "lanes" else 1, command=" ".join(cmd[1:]))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", default="mixed")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-kv-tokens", type=lambda v: None if v == "none" else int(v), default=32768,
                   help="the KV pool of every engine, in tokens; none: each step's own (on CUDA: sized from memory)")
    p.add_argument("--kv-cache-dtype", default=None, help="for the steps that take it (step20 on): auto or int8")
    p.add_argument("--steps", nargs="*", default=None, help="default: every step")
    p.add_argument("--hf", nargs="*", default=["generate", "cb"], help="HF baselines to run first")
    p.add_argument("--hf-last", action="store_true", help="run the HF baselines after the steps run alone")
    p.add_argument("--alone-from", default="step14_7", help="this step and the later ones run alone")
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--calibrate", nargs="*", default=["step09"])
    p.add_argument("--budget-s", type=float, default=540, help="start nothing after this many seconds")
    p.add_argument("--timeout-s", type=float, default=300, help="one process at most")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    steps = args.steps or all_steps()
    alone = ["step04"] + [s for s in steps if step_key(s) >= step_key(args.alone_from)]
    alone = [s for s in steps if s in alone]
    laned = [s for s in steps if s not in alone]
    # The longest first: steps without seats serve one request at a time (steps 01-03).
    laned.sort(key=lambda s: "max_num_seqs" in step_engine_options(s))
    t0 = time.time()
    lock = threading.Lock()
    log_path = args.out.with_suffix(".log")

    def log(msg: str) -> None:
        with lock, log_path.open("a") as f:
            f.write(f"[{time.time() - t0:6.0f} s] {msg}\n")

    def keep(result: dict | None) -> None:
        if result is not None:
            with lock, args.out.open("a") as f:
                f.write(json.dumps(result) + "\n")
            print(f"{result['step']:>9} {result['part']:>11}: {result['tokens_per_s']:8.1f} tokens/s", flush=True)

    def in_time(what: str) -> bool:
        if time.time() - t0 < args.budget_s:
            return True
        log(f"{what}: not started, out of time")
        print(f"{what}: not measured (out of time)", flush=True)
        return False

    def baselines() -> None:
        for baseline in args.hf:
            if in_time(f"hf {baseline}"):
                keep(one(["--hf", baseline], args, "alone", log))

    if not args.hf_last:
        baselines()
    for step in alone:
        if in_time(step):
            keep(one(["--step", step], args, "alone", log))
    if args.hf_last:
        baselines()
    for step in args.calibrate:
        if step in laned and in_time(f"{step} calibration"):
            keep(one(["--step", step], args, "calibration", log))
    queue = list(laned)

    def lane() -> None:
        while True:
            with lock:
                if not queue:
                    return
                step = queue.pop(0)
            if in_time(step):
                keep(one(["--step", step], args, "lanes", log))

    threads = [threading.Thread(target=lane) for _ in range(args.lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
