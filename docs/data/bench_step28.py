"""step28 on a GPU, in one process: (1) each decode projection of the model as step28's GEMV kernel (norm, SiLU * up
or residual fused) against cuBLAS's matmul alone on the same shape, at 1, 2, 4 and 8 rows, beside the copy bandwidth
measured now (triton.testing.do_bench: the L2 cache cleared before each call, as a decode meets the weights), with a
sweep of tile configs at 1, 4 and 8 rows; (2) batch 1 (a 128-token prompt, 512 new tokens, sampled at 0.6 and greedy,
runs alternated) through step27 and step28; (3) the kernels of one decode step and their GPU time, counted with the
profiler on eager engines (a graph replays the same kernels); (4) greedy tokens of step27 and step28 side by side.

    python3 docs/data/bench_step28.py --out $OUT/h200_step28_gemv.json > $OUT/h200_step28_gemv.txt
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

import torch  # noqa: E402
import triton  # noqa: E402

from shared import SamplingParams  # noqa: E402
from shared.anatomy import copy_gb_per_s  # noqa: E402
from shared.models import resolve_model  # noqa: E402

SWEEP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w) for n in (1, 2, 4, 8, 16) for k in (512, 1024) for w in (4, 8)]


def projections(cfg: dict) -> list[tuple]:
    h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv, i = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    return [("qkv (norm)", q + 2 * kv, h, dict(norm=True)), ("o (residual)", h, q, dict(residual=True)),
            ("gate_up (norm, silu*up)", 2 * i, h, dict(norm=True, silu_mul=True)),
            ("down (residual)", h, i, dict(residual=True)), ("lm_head (norm)", cfg["vocab_size"], h, dict(norm=True))]


def bench_gemv(cfg, copy_gbs):
    from steps.step28.kernels import gemv as g

    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")  # noqa: E731
    rows = []
    for name, n_rows, k, flags in projections(cfg):
        w = torch.randn(n_rows, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5 if flags.get("norm") else None
        n_out = n_rows // 2 if flags.get("silu_mul") else n_rows
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16) if flags.get("residual") else None
            call = lambda config=None: g.gemv(x, w, nw, 1e-6, res, flags.get("silu_mul", False), config)  # noqa: E731
            ref = g.gemv_reference(x, w, nw, 1e-6, res, flags.get("silu_mul", False)).float()
            err = ((call().float() - ref).abs().max() / ref.abs().max()).item()
            moved = w.numel() * 2
            row = dict(name=name, m=m, n=n_rows, k=k, weight_bytes=moved, rel_err=err,
                       cublas_ms=bench(lambda: x @ w.T), gemv_ms=bench(call),
                       config=g.choose_config(m, n_out, k, flags.get("silu_mul", False)))
            if m in (1, 4, 8):
                best = None
                for c in SWEEP:
                    c = dict(c, BLOCK_M=triton.next_power_of_2(m))
                    ms = bench(lambda: call(c))
                    if best is None or ms < best[0]:
                        best = (ms, c)
                row.update(best_ms=best[0], best_config=best[1])
            for key in ("cublas", "gemv", "best"):
                if f"{key}_ms" in row:
                    row[f"{key}_frac_copy"] = moved / (row[f"{key}_ms"] / 1e3) / 1e9 / copy_gbs
            rows.append(row)
            print(f"{name:24s} M={m}  cuBLAS {row['cublas_ms'] * 1e3:7.1f} us ({100 * row['cublas_frac_copy']:4.0f}%)"
                  f"  GEMV {row['gemv_ms'] * 1e3:7.1f} us ({100 * row['gemv_frac_copy']:4.0f}%)"
                  + (f"  best {row['best_ms'] * 1e3:7.1f} us ({100 * row['best_frac_copy']:4.0f}%) {row['best_config']}"
                     if "best_ms" in row else "") + f"  rel err {err:.1e}", flush=True)
    return rows


def ms_per_token(llm, prompt, new_tokens, temperature):
    sp = SamplingParams(temperature=temperature, seed=7 if temperature else None, max_tokens=new_tokens,
                        ignore_eos=True)
    m = llm.generate([prompt], sp)[0].metrics
    return 1000 * (m.finished_time - m.first_token_time) / (new_tokens - 1)


def count_kernels(llm, prompt, decodes=32):
    """Kernels (and their GPU time) of one decode step: a profiled request of 1 + decodes tokens minus one of 1."""
    from torch.profiler import ProfilerActivity, profile

    def run(tokens):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        return len(kernels), sum(e.device_time for e in kernels)
    n1, t1 = run(1)
    n2, t2 = run(1 + decodes)
    return {"kernels_per_decode_step": (n2 - n1) / decodes, "gpu_us_per_decode_step": (t2 - t1) / decodes}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen3-0.6b")
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], choices=["gemv", "batch1", "kernels", "equal"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = json.loads((resolve_model(args.model) / "config.json").read_text())
    result = {"model": args.model, "copy_gb_per_s": copy_gb_per_s(torch.device("cuda"))}
    print(f"copy bandwidth {result['copy_gb_per_s']:.0f} GB/s", flush=True)
    if "gemv" not in args.skip:
        result["gemv"] = bench_gemv(cfg, result["copy_gb_per_s"])
    prompt = [random.Random(1).randrange(1, 5000) for _ in range(128)]
    steps = ("step27", "step28")
    if "batch1" not in args.skip or "equal" not in args.skip:
        engines = {s: importlib.import_module(f"steps.{s}.engine").LLM(args.model, max_kv_tokens=32768,
                                                                        gpu_memory_utilization=0.3) for s in steps}
        for s, llm in engines.items():
            print(s, llm.backend, flush=True)
            ms_per_token(llm, prompt, 16, 0.6)  # warm-up
        if "batch1" not in args.skip:
            runs = {f"{s} {t}": [] for t in (0.6, 0.0) for s in steps}
            for _ in range(args.repeats):
                for t in (0.6, 0.0):
                    for s, llm in engines.items():
                        runs[f"{s} {t}"].append(ms_per_token(llm, prompt, args.new_tokens, t))
            result["batch1_ms_per_token"] = runs
            for key, v in runs.items():
                print(f"batch 1, {key}: {statistics.median(v):.3f} ms/token, {1000 / statistics.median(v):.1f} tokens/s "
                      f"(runs {[round(x, 3) for x in v]})", flush=True)
            for t in (0.6, 0.0):
                print(f"batch 1 at {t}: step28 / step27 = "
                      f"{statistics.median(runs[f'step27 {t}']) / statistics.median(runs[f'step28 {t}']):.2f}x")
        if "equal" not in args.skip:
            rng = random.Random(2)
            prompts = [[rng.randrange(1, 5000) for _ in range(rng.randrange(8, 200))] for _ in range(8)]
            sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            toks = {s: [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] for s, llm in engines.items()}
            same = [a == b for a, b in zip(toks["step27"], toks["step28"])]
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                     for a, b in zip(toks["step27"], toks["step28"])]
            result["greedy_equal"] = {"equal": sum(same), "of": len(same), "first_difference": first}
            print(f"greedy, 8 requests of 64 tokens, batched: {sum(same)} of 8 equal to step27's; first differences "
                  f"{first}", flush=True)
        for llm in engines.values():
            llm.shutdown()
    if "kernels" not in args.skip:
        for s in steps:
            llm = importlib.import_module(f"steps.{s}.engine").LLM(args.model, max_kv_tokens=32768,
                                                                   gpu_memory_utilization=0.3, enforce_eager=True)
            count_kernels(llm, prompt, 4)  # warm-up
            result[f"{s}_decode_kernels"] = count_kernels(llm, prompt)
            print(f"{s}: {result[f'{s}_decode_kernels']['kernels_per_decode_step']:.1f} kernels per decode step, "
                  f"{result[f'{s}_decode_kernels']['gpu_us_per_decode_step']:.0f} GPU us per decode step", flush=True)
            llm.shutdown()
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
