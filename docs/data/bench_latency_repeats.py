"""The inter-token latency of running decodes while long prompts arrive (step18's run.py, show_latency), repeated:
step17 and step18 alternated, `--repeats` runs each, in one process, so that the run-to-run spread of the GPU
machine's host is seen next to the difference between the two steps.

    python3 docs/data/bench_latency_repeats.py --model random:qwen3-0.6b --repeats 3 > OUT.txt

Prints one table (each run's p50 and p99 ITL and the long prompts' median TTFT, then the median over the runs) and
one JSON line per run, prefixed LATENCY_JSON."""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shared.cli import format_table  # noqa: E402
from steps.step18.engine import LLM  # noqa: E402
from shared.stats import percentile  # noqa: E402
from steps.step18.run import latency_run  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen3-0.6b")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", nargs="+", default=["step17", "step18"])
    args = p.parse_args()
    llm = LLM(args.model, max_num_seqs=4, max_kv_tokens=4096)  # what latency_run copies its options from
    on_gpu = llm.device.type == "cuda"
    decoders, decode_tokens, long_lens, budget = (32, 96, (2000, 3000, 4000), 512) if on_gpu else (4, 40, (300,), 64)
    for step in args.steps:  # warm-up: every kernel compiled before anything is timed
        latency_run(step, llm, 2, 8, (64,), budget)
    rows, runs = [], {s: [] for s in args.steps}
    for i in range(args.repeats):
        for step in args.steps:
            r = latency_run(step, llm, decoders, decode_tokens, long_lens, budget)
            result = {"step": step, "run": i + 1, "itl_p50_ms": percentile(r["gaps"], 0.5),
                      "itl_p99_ms": percentile(r["gaps"], 0.99), "ttft_median_ms": statistics.median(r["ttft"]),
                      "gaps": len(r["gaps"]), "model": args.model, "device": str(llm.device),
                      "decoders": decoders, "long_prompts": list(long_lens), "budget": budget}
            runs[step].append(result)
            print("LATENCY_JSON " + json.dumps(result), flush=True)
            rows.append([step, i + 1, result["gaps"], f"{result['itl_p50_ms']:.1f}", f"{result['itl_p99_ms']:.1f}",
                         f"{result['ttft_median_ms']:.0f}"])
    for step, rs in runs.items():
        rows.append([step, "median", "", f"{statistics.median(r['itl_p50_ms'] for r in rs):.1f}",
                     f"{statistics.median(r['itl_p99_ms'] for r in rs):.1f}",
                     f"{statistics.median(r['ttft_median_ms'] for r in rs):.0f}"])
    print(f"{decoders} requests decode; then prompts of {', '.join(map(str, long_lens))} tokens arrive (budget {budget} "
          f"tokens per step, {args.model}, {llm.device}); {args.repeats} runs of each step, alternated:")
    print(format_table(["step", "run", "gaps measured", "ITL p50 ms", "ITL p99 ms", "TTFT of the long, median ms"], rows))


if __name__ == "__main__":
    main()
