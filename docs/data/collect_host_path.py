"""docs/data/raw/h200_host_path/*.jsonl (docs/data/bench_host_path.py's lines, HF's BENCH_JSON line) -> one summary,
docs/data/raw/h200_host_path/summary.json: per call, the medians by (workload, step), batch 1, the phases, and HF's run.

    python docs/data/collect_host_path.py
"""
from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
RAW = HERE / "raw" / "h200_host_path"


def main() -> None:
    calls = {}
    for path in sorted(RAW.glob("host_path_*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        call = calls[path.stem] = {"command": records[0]["command"], "device": records[0]["gpu"],
                                   "model": records[0]["model"], "medians": {}, "batch1": {}, "phases": None}
        for r in records:
            if r["kind"] == "median":
                call["medians"].setdefault(r["workload"], {})[r["step"]] = {"tokens_per_s": r["tokens_per_s"],
                                                                            "runs": r["all"]}
            elif r["kind"] == "batch1":
                call["batch1"][f"temperature {r['temperature']}"] = {"tokens_per_s": r["tokens_per_s"],
                                                                     "runs": r["all"], "new_tokens": r["new_tokens"]}
            elif r["kind"] == "phases":
                call["phases"] = {"engine_steps": r["engine_steps"], "ms_per_step": r["ms_per_step"]}
    # hf_cb.txt holds the BENCH_JSON line's first 700 characters (the call cut it): its fields are read by name
    line = next(line for line in (RAW / "hf_cb.txt").read_text().splitlines() if line.startswith("BENCH_JSON"))
    hf = {"tokens_per_s": float(re.search(r'"tokens_per_s": ([0-9.]+)', line).group(1)),
          "backend": re.search(r'"backend": "([^"]*)"', line).group(1)}
    calls["host_path_b"]["hf_cb"] = {"command": "python -m shared.bench --hf cb --model random:qwen3-0.6b "
                                                "--device cuda --workload nano-vllm --repeat 1",
                                     "tokens_per_s": hf["tokens_per_s"], "backend": hf["backend"]}
    env = (RAW / "env.txt").read_text().split()
    summary = {"about": "nano-vllm's workload as its bench.py runs it (temperature 0.6, ignore_eos, 133,966 new "
                        "tokens; nano-vllm-greedy: the same draws, greedy), engines as its bench builds them; "
                        "host_path_a: step20, step21, step24 alternated, median of 3; host_path_b: step24 and "
                        "step24 before the keyed sampler (commit 1f7a7d6) in one call, one run each, with HF "
                        "transformers' continuous batching on the same workload in that call",
               "env": " ".join(env), "calls": calls}
    (RAW / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v["medians"] for k, v in calls.items()}, indent=1))


if __name__ == "__main__":
    main()
