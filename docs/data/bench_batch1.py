"""Batch-1 decode latency: one request alone, a 128-token prompt and 512 new tokens (greedy, EOS ignored), through
step20, step21 with enforce_eager=True and step21 with CUDA graphs, in one process, runs alternated; beside the
weights' read time at the copy bandwidth measured in the same call.

    python3 docs/data/bench_batch1.py --model random:qwen3-0.6b --out $OUT/batch1.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shared import SamplingParams  # noqa: E402
from shared.anatomy import copy_gb_per_s  # noqa: E402
from shared.bench import decode_weight_bytes  # noqa: E402

ENGINES = {"step20": ("step20", {}), "step21 eager": ("step21", {"enforce_eager": True}),
           "step21 graphs": ("step21", {})}


def ms_per_token(llm, prompt, new_tokens):
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
    m = out.metrics
    return 1000 * (m.finished_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen3-0.6b")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    engines = {name: importlib.import_module(f"steps.{step}.engine").LLM(args.model, max_kv_tokens=32768, **options)
               for name, (step, options) in ENGINES.items()}
    prompt = [random.Random(1).randrange(1, 5000) for _ in range(args.prompt_tokens)]
    runs = {name: [] for name in engines}
    for llm in engines.values():
        ms_per_token(llm, prompt, 8)  # warm-up
    for _ in range(args.repeats):  # alternated: a drift of the machine falls on every engine
        for name, llm in engines.items():
            runs[name].append(ms_per_token(llm, prompt, args.new_tokens))
    llm = engines["step21 graphs"]
    weights = decode_weight_bytes(args.model, llm.dtype.itemsize)
    bandwidth = copy_gb_per_s(llm.device)
    result = {"model": args.model, "device": str(llm.device), "dtype": str(llm.dtype).replace("torch.", ""),
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "runs_ms_per_token": runs,
              "median_ms_per_token": {k: statistics.median(v) for k, v in runs.items()},
              "weight_bytes": weights, "copy_gb_per_s": bandwidth,
              "weights_read_ms": weights / (bandwidth * 1e9) * 1000, "graph_backend": llm.backend}
    result["tokens_per_s"] = {k: 1000 / v for k, v in result["median_ms_per_token"].items()}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, ms in result["median_ms_per_token"].items():
        print(f"{name:15s} {ms:7.2f} ms/token  {1000 / ms:7.1f} tokens/s  runs {[round(x, 2) for x in runs[name]]}")
    print(f"weights' read time at {bandwidth:.0f} GB/s: {result['weights_read_ms']:.3f} ms")


if __name__ == "__main__":
    main()
