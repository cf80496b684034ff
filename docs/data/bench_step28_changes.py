"""step28's changes one at a time, on the H200 at batch 1: the kernels of one decode step, the GPU's busy time (the
union of the kernels' intervals) and the time a token takes (a 128-token prompt, 256 new tokens, sampled at 0.6,
median of 3), for step27 and for step28's engine with its changes switched on one after another, each engine built
(and its CUDA graphs captured) with its switches set:

    A  step27
    B  step28 with its projections as step27's (cuBLAS, the norm and SiLU * up kernels: gemv_max_rows = 0), no
       programmatic dependent launch, flash decoding's merge as a kernel of its own: what is left is the K/V write
       inside the q/k norm + RoPE kernel, the residual added by cuBLAS (addmm) and the draw a program per block
    C  B + the GEMV kernel at one row (the norm, the residual and SiLU * up inside it)
    D  C + flash decoding's merge inside its split kernel
    E  D + programmatic dependent launch: step28 as it ships

    python3 docs/data/bench_step28_changes.py --out $OUT/h200_step28_changes.json > $OUT/h200_step28_changes.txt
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from shared import SamplingParams  # noqa: E402
from bench_step28 import count_kernels  # noqa: E402  (docs/data: one decode step's kernels, profiled)

ROWS = [("A", "step27", {}), ("B", "kv-write+addmm+draw", dict(gemv=False, merge=False, pdl=False)),
        ("C", "+gemv", dict(gemv=True, merge=False, pdl=False)), ("D", "+merge-in-split", dict(gemv=True, merge=True, pdl=False)),
        ("E", "+pdl (step28)", dict(gemv=True, merge=True, pdl=True))]


ORIGINAL = {}


def build(step, switches, model, device):
    """The step's engine with step28's switches set before it is built (its graphs capture what they decide)."""
    if step == "step28":
        fused = importlib.import_module("steps.step28.kernels.fused")
        gemv = importlib.import_module("steps.step28.kernels.gemv")
        attention = importlib.import_module("steps.step28.attention")
        fused.TritonLayerOps.gemv_max_rows = 1 if switches["gemv"] else 0
        attention.TritonAttention.merge_in_split = switches["merge"]
        supported = ORIGINAL.setdefault("pdl_supported", gemv.pdl_supported)
        gemv.pdl_supported = fused.pdl_supported = supported if switches["pdl"] else (lambda device: False)
    return importlib.import_module(f"steps.{step}.engine").LLM(model, device=device, max_kv_tokens=32768,
                                                                gpu_memory_utilization=0.3)


def ms_per_token(llm, prompt, new_tokens):
    m = llm.generate([prompt], SamplingParams(temperature=0.6, seed=7, max_tokens=new_tokens, ignore_eos=True))[0].metrics
    return 1000 * (m.finished_time - m.first_token_time) / (new_tokens - 1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen3-0.6b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    prompt = [random.Random(1).randrange(1, 5000) for _ in range(128)]
    result = {"model": args.model, "rows": []}
    for key, label, switches in ROWS:
        llm = build("step27" if key == "A" else "step28", switches, args.model, args.device)
        layers = llm.model.config.num_layers
        ms_per_token(llm, prompt, 16)  # warm-up
        # timed before the profiler has run: once it has, each launch costs the host more, for good
        runs = [ms_per_token(llm, prompt, args.new_tokens) for _ in range(args.repeats)]
        if args.device == "cuda":
            count_kernels(llm, prompt, 3, 0.6)  # warm-up
            found = count_kernels(llm, prompt, temperature=0.6)
            kernels, busy = found["kernels_per_decode_step"], found["gpu_busy_us_per_decode_step"]
        else:
            kernels, busy = float("nan"), float("nan")
        row = dict(key=key, label=label, switches=switches, kernels_per_decode_step=kernels,
                   kernels_per_layer=kernels / layers, gpu_busy_us_per_decode_step=busy, ms_per_token=runs,
                   backend=llm.backend)
        result["rows"].append(row)
        print(f"row {key} {label}: {kernels:.1f} kernels per decode step, {kernels / layers:.2f} a layer, GPU busy "
              f"{busy:.0f} us per decode step, {statistics.median(runs):.3f} ms/token at 0.6 "
              f"(runs {[round(r, 3) for r in runs]})", flush=True)
        llm.shutdown()
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
