"""Run every step in order.

    python run_all.py            each step's run.py, then a table: step, title, ok, seconds
    python run_all.py --bench    one fixed workload through every step's LLM: tokens/s, time to first
                                 token, peak memory, relative to step01 and to the previous step

    python run_all.py --bench --hf    the same, plus HF transformers on the same workload, weights, device and
                                 dtype: `--hf` or `--hf generate` its padded `generate` (one left-padded batch),
                                 `--hf cb` its continuous batching (a request added per request, each with its
                                 own max_new_tokens), `--hf both` the two. HF's rows come first, and every row
                                 gets one "vs HF ..." ratio per baseline

Both take --model/--device/--dtype (passed to every step) and --steps to pick some steps
(`--steps step03 step09` or `--steps step03,step09`). Each step's progress is printed as it runs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from shared.cli import format_table  # noqa: E402


def step_key(name: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", name)] + [0]


def all_steps() -> list[str]:
    found = [p.name for p in (ROOT / "steps").iterdir() if p.is_dir() and re.fullmatch(r"step\d+(_\d+)?", p.name)]
    return sorted(found, key=step_key)


def step_title(step: str) -> str:
    first = (ROOT / "steps" / step / "README.md").read_text().splitlines()[0]
    return first.lstrip("# ").split(":", 1)[-1].strip()


def passthrough_args(args) -> list[str]:
    extra = []
    for flag in ("model", "device", "dtype"):
        if getattr(args, flag):
            extra += [f"--{flag}", getattr(args, flag)]
    return extra


def run_scripts(steps: list[str], args) -> int:
    rows, failures = [], 0
    extra = passthrough_args(args) + (["--lesson-tokens", str(args.lesson_tokens)] if args.lesson_tokens else [])
    for i, step in enumerate(steps, 1):
        print(f"\n[{i}/{len(steps)}] python steps/{step}/run.py {' '.join(extra)}", flush=True)
        start = time.perf_counter()
        # The step's output (and its stderr: model conversion, errors) is shown line by line as it comes.
        proc = subprocess.Popen([sys.executable, str(ROOT / "steps" / step / "run.py"), *extra], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in proc.stdout:
            print("    " + line.rstrip("\n"), flush=True)
        returncode = proc.wait()
        seconds = time.perf_counter() - start
        if returncode != 0:
            failures += 1
        print(f"    -> {step}: {'ok' if returncode == 0 else f'FAILED (exit status {returncode})'} "
              f"in {seconds:.1f} s", flush=True)
        rows.append([step, step_title(step), "ok" if returncode == 0 else "FAILED", f"{seconds:.1f}"])
    print("\n" + format_table(["step", "title", "ok", "seconds"], rows))
    return 1 if failures else 0


def bench_one(what: list[str], label: str, args) -> dict | None:
    """One `python -m shared.bench` process (`--step stepNN` or `--hf generate|cb`) -> its result, or None if it failed."""
    cmd = [sys.executable, "-m", "shared.bench", *what, "--workload", args.workload,
           "--max-tokens", str(args.max_tokens), *passthrough_args(args)]
    if args.repeat:
        cmd += ["--repeat", str(args.repeat)]
    start = time.perf_counter()
    # stdout carries the result line; stderr (the bench's progress, any error) goes straight to the terminal.
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = next((l for l in proc.stdout.splitlines() if l.startswith("BENCH_JSON ")), None)
    if proc.returncode != 0 or line is None:
        print(f"    -> {label}: FAILED (exit status {proc.returncode}); its error is printed above", flush=True)
        return None
    r = json.loads(line[len("BENCH_JSON "):])
    print(f"    -> {label}: {r['tokens_per_s']:.1f} tokens/s, TTFT median {r['ttft_median_ms']:.0f} ms, "
          f"peak {r['peak_memory_mb']:.0f} MiB ({r['peak_memory_kind']}); {time.perf_counter() - start:.1f} s "
          "with loading and warm-up", flush=True)
    return r


HF_CHOICES = {"generate": ["generate"], "cb": ["cb"], "both": ["generate", "cb"]}  # --hf X -> shared.bench --hf ...
HF_COLUMNS = {"hf": "vs HF generate", "hf-cb": "vs HF cb"}  # a baseline's "step" key -> its ratio column


def vs_key(hf: dict) -> str:
    """The key of the ratio to one HF baseline in every row: "vs_hf" (generate), "vs_hf_cb" (continuous batching)."""
    return "vs_" + hf["step"].replace("-", "_")


def run_bench(steps: list[str], args) -> int:
    jobs = [(["--step", step], step) for step in steps]
    # HF first: the baselines every step is compared with
    jobs[:0] = [(["--hf", which], f"HF transformers {which}") for which in HF_CHOICES.get(args.hf, [])]
    hfs, results = [], []
    for i, (what, label) in enumerate(jobs, 1):
        print(f"[{i}/{len(jobs)}] benchmarking {label} ({args.workload} workload) ...", flush=True)
        r = bench_one(what, label, args)
        if r is None:
            return 1
        (hfs if r["step"] in HF_COLUMNS else results).append(r)
    for hf in hfs:
        for r in hfs + results:  # this row's tokens/s over the baseline's, same workload
            r[vs_key(hf)] = r["tokens_per_s"] / hf["tokens_per_s"]
    first = results[0]
    shape = {"standard": f"{first['requests']} requests x {args.max_tokens} new tokens",
             "single": f"1 request (batch 1) x {args.max_tokens} new tokens",
             "mixed": f"{first['requests']} requests, prompts of 8-192 tokens, 8-{args.max_tokens} new tokens each (seeded)",
             "shared-prefix": f"{first['requests']} requests sharing a ~410-token system prompt, 32 new tokens each",
             "nano-vllm": f"{first['requests']} requests, prompts of 100-1024 tokens, 100-1024 new tokens each "
                          "(nano-vllm's bench.py draws), temperature 0.6",
             "nano-vllm-greedy": f"{first['requests']} requests, nano-vllm's draws",
             }[args.workload]
    mode = "sampled" if args.workload == "nano-vllm" else "greedy"
    print(f"\nworkload: {args.workload}, {shape}, {mode}; "
          f"model {first['model']}, device {first['device']}, dtype {first['dtype']}; "
          f"median of {first['repeat']} run(s)")
    for hf in hfs:
        if hf["step"] == "hf":
            print(f"{hf['label']}: {hf['backend']}; max_new_tokens={hf['max_new_tokens']}, counting only the tokens "
                  f"each request asked for ({hf['generated_tokens']} of {hf['padded_generated_tokens']} generated); "
                  "TTFT = first token of the whole batch")
        else:
            print(f"{hf['label']}: {hf['backend']}; each request its own max_new_tokens ({hf['generated_tokens']} "
                  "tokens); TTFT = each request's first token, median")
    headers = (["step", "tokens/s", f"vs {first['step']}", "vs prev"] + [HF_COLUMNS[hf["step"]] for hf in hfs]
               + ["TTFT median ms", f"peak MiB ({first['peak_memory_kind']})"])
    rows, prev = [], None
    for hf in hfs:
        rows.append([hf["label"], f"{hf['tokens_per_s']:.1f}", "-", "-"]
                    + [f"{hf[vs_key(base)]:.2f}x" for base in hfs]
                    + [f"{hf['ttft_median_ms']:.0f}", f"{hf['peak_memory_mb']:.0f}"])
    for r in results:
        rows.append([r["step"], f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / first['tokens_per_s']:.2f}x",
                     f"{r['tokens_per_s'] / prev['tokens_per_s']:.2f}x" if prev else "-"]
                    + [f"{r[vs_key(hf)]:.2f}x" for hf in hfs]
                    + [f"{r['ttft_median_ms']:.0f}", f"{r['peak_memory_mb']:.0f}"])
        prev = r
    print(format_table(headers, rows))
    if "roofline_tokens_per_s_batch1" in first:
        print(f"roofline for batch-1 decode: {first['roofline_tokens_per_s_batch1']:.0f} tokens/s "
              f"({first['weight_mb']:.0f} MiB of weights read per token at {first['bandwidth_gbs']:.0f} GB/s measured)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(hfs + results, indent=2))
        print(f"results written to {args.json}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options; args.steps becomes the list of steps to run, in step order."""
    parser = argparse.ArgumentParser(prog="run_all.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", action="store_true", help="run the benchmark instead of the demos")
    parser.add_argument("--steps", nargs="+", default=None, metavar="STEP",
                        help="steps to run, e.g. `--steps step03 step09` or `--steps step03,step09` (default: all)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--workload", default="standard", choices=["standard", "single", "mixed", "shared-prefix", "nano-vllm",
                                                                "nano-vllm-greedy"],
                        help="benchmark workload: standard (4 chat questions), single (the first of them alone: batch 1), "
                             "mixed (64 requests of mixed lengths) "
                             "shared-prefix (32 requests sharing a long system prompt) "
                             "nano-vllm (nano-vllm's bench: 256 requests of 100-1024 tokens in and out, temperature 0.6) "
                             "or nano-vllm-greedy (the same draws, greedy)")
    parser.add_argument("--lesson-tokens", type=int, default=None,
                        help="demos: passed to every run.py (new tokens per request in each lesson's figure)")
    parser.add_argument("--max-tokens", type=int, default=128, help="benchmark: new tokens per request")
    parser.add_argument("--repeat", type=int, default=None, help="benchmark: runs per step (default: 3 on cuda, 1 on cpu)")
    parser.add_argument("--json", default=None, help="benchmark: also write the results to this JSON file")
    parser.add_argument("--hf", nargs="?", const="generate", default=None, choices=sorted(HF_CHOICES),
                        help="benchmark: also run the workload through HF transformers and report every step as a "
                             "ratio to it: generate (the default of a bare --hf: one left-padded batch through "
                             "model.generate), cb (its continuous batching manager, each request added with its own "
                             "max_new_tokens) or both (two baselines, one \"vs HF\" column each)")
    args = parser.parse_args(argv)
    if args.hf and not args.bench:
        parser.error("argument --hf: only with --bench (it adds HF transformers to the benchmark table)")
    for flag, value in (("--max-tokens", args.max_tokens), ("--repeat", args.repeat)):
        if value is not None and value < 1:
            parser.error(f"argument {flag}: must be at least 1, got {value}")
    known = all_steps()
    if args.steps is None:
        args.steps = known
    else:
        wanted = [s.strip() for arg in args.steps for s in arg.split(",") if s.strip()]
        unknown = [s for s in wanted if s not in known]
        if unknown or not wanted:
            what = f"unknown step(s) {', '.join(unknown)}" if unknown else "no step given"
            parser.error(f"argument --steps: {what}; known: {', '.join(known)}")
        args.steps = [s for s in known if s in wanted]  # in step order, each once
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_bench(args.steps, args) if args.bench else run_scripts(args.steps, args)


if __name__ == "__main__":
    sys.exit(main())
