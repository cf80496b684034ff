"""step28 on a GPU, in one process: (1) each decode projection of the model as step28's GEMV kernel (norm, SiLU * up
or residual fused) against cuBLAS's matmul alone on the same shape, at 1, 2, 4 and 8 rows, beside the copy bandwidth
measured now, with a sweep of tile configs at 1 row. Each is timed as a decode meets it: a CUDA graph launches it
on enough distinct copies of the weight (300 MB) that none is in the L2 cache, each launch a programmatic dependent of
the one before (as the engine launches them); (2) the 28 layers' four projections in a row, in one graph, with and
without programmatic dependent launch, and as cuBLAS with torch's elementwise operators; (3) batch 1 (a 128-token
prompt, 512 new tokens, sampled at 0.6 and greedy, runs alternated) through step27 and step28; (4) the kernels of one
decode step and the GPU's busy time, counted with the profiler on the engines as they run (CUDA graphs), eager as
well; (5) greedy tokens of step27 and step28 side by side.

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

from shared import SamplingParams  # noqa: E402
from shared.anatomy import busy_us, copy_gb_per_s  # noqa: E402
from shared.models import resolve_model  # noqa: E402

SWEEP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w) for n in (1, 2, 4, 8, 16) for k in (512, 1024, 2048) for w in (2, 4, 8)]


def projections(cfg: dict) -> list[tuple]:
    h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv, i = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    return [("qkv (norm)", q + 2 * kv, h, dict(norm=True)), ("o (residual)", h, q, dict(residual=True)),
            ("gate_up (norm, silu*up)", 2 * i, h, dict(norm=True, silu_mul=True)),
            ("down (residual)", h, i, dict(residual=True)), ("lm_head (norm)", cfg["vocab_size"], h, dict(norm=True))]


def graph_us(fns, reps=20):
    """Microseconds per function: each launched once, in order, in one CUDA graph, replayed reps times (median of 5)."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up (compiles) off the capture
        for f in fns:
            f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps / len(fns))
    return statistics.median(times)


def bench_gemv(cfg, copy_gbs):
    from steps.step28.kernels import gemv as g

    rows = []
    for name, n_rows, k, flags in projections(cfg):
        moved = n_rows * k * 2
        ws = [torch.randn(n_rows, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
              for _ in range(max(2, -(-300_000_000 // moved)))]
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5 if flags.get("norm") else None
        silu = flags.get("silu_mul", False)
        n_out = n_rows // 2 if silu else n_rows
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16) if flags.get("residual") else None
            launch = lambda w, config=None: g.gemv(x, w, nw, 1e-6, res, silu, config, pdl=True)  # noqa: E731
            ref = g.gemv_reference(x, ws[0], nw, 1e-6, res, silu).float()
            err = ((launch(ws[0]).float() - ref).abs().max() / ref.abs().max()).item()
            row = dict(name=name, m=m, n=n_rows, k=k, weight_bytes=moved, rel_err=err, copy_floor_us=moved / copy_gbs / 1e3,
                       cublas_us=graph_us([lambda w=w: x @ w.T for w in ws]),
                       gemv_us=graph_us([lambda w=w: launch(w) for w in ws]), config=g.choose_config(m, n_out, k, silu))
            if m == 1:
                best = None
                for c in SWEEP:
                    c = dict(c, BLOCK_M=1)
                    us = graph_us([lambda w=w: launch(w, c) for w in ws])
                    if best is None or us < best[0]:
                        best = (us, c)
                row.update(best_us=best[0], best_config=best[1])
            for key in ("cublas", "gemv", "best"):
                if f"{key}_us" in row:
                    row[f"{key}_frac_copy"] = row["copy_floor_us"] / row[f"{key}_us"]
            rows.append(row)
            print(f"{name:24s} M={m}  copy floor {row['copy_floor_us']:5.1f} us  cuBLAS {row['cublas_us']:6.1f} us "
                  f"({100 * row['cublas_frac_copy']:3.0f}%)  GEMV {row['gemv_us']:6.1f} us ({100 * row['gemv_frac_copy']:3.0f}%)"
                  + (f"  best {row['best_us']:6.1f} us ({100 * row['best_frac_copy']:3.0f}%) {row['best_config']}"
                     if "best_us" in row else "") + f"  rel err {err:.1e}", flush=True)
        del ws
    return rows


def bench_chain(cfg, layers=28):
    """The four projections of every layer in a row, at one row, as the engine's decode runs them (the norm, the
    residual and SiLU * up fused), in one graph: without PDL, with it, and as cuBLAS + torch's operators."""
    from steps.step28.kernels import gemv as g

    h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv, i = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16) / shape[-1] ** 0.5  # noqa: E731
    weights = [dict(qkv=rand(q + 2 * kv, h), o=rand(h, q), gu=rand(2 * i, h), down=rand(h, i),
                    n1=torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5,
                    n2=torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5) for _ in range(layers)]
    x0 = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)

    def run(path):
        x = x0
        for w in weights:
            if path == "cublas":
                a = g.gemv_reference(x, w["qkv"], w["n1"])[:, :q]
                x = torch.addmm(x, a, w["o"].T)
                x = torch.addmm(x, g.gemv_reference(x, w["gu"], w["n2"], silu_mul=True), w["down"].T)
            else:
                pdl = path == "gemv, PDL"
                a = g.gemv(x, w["qkv"], w["n1"], pdl=pdl)[:, :q]
                x = g.gemv(a, w["o"], residual=x, pdl=pdl)
                x = g.gemv(g.gemv(x, w["gu"], w["n2"], silu_mul=True, pdl=pdl), w["down"], residual=x, pdl=pdl)
        return x
    out = {}
    for path in ("cublas", "gemv", "gemv, PDL"):
        out[path] = graph_us([lambda: run(path)], reps=10)
        print(f"{layers} layers' projections at one row, {path}: {out[path]:.0f} us ({out[path] / layers:.2f} us a layer)",
              flush=True)
    return out


def ms_per_token(llm, prompt, new_tokens, temperature):
    sp = SamplingParams(temperature=temperature, seed=7 if temperature else None, max_tokens=new_tokens,
                        ignore_eos=True)
    m = llm.generate([prompt], sp)[0].metrics
    return 1000 * (m.finished_time - m.first_token_time) / (new_tokens - 1)


def count_kernels(llm, prompt, decodes=32, temperature=0.0):
    """Kernels (and the GPU's busy time) of one decode step: a profiled request of 1 + decodes tokens minus one of 1,
    greedy or sampled at `temperature` (seeded)."""
    from torch.profiler import ProfilerActivity, profile

    def run(tokens):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], SamplingParams(temperature=temperature, seed=3 if temperature else None,
                                                  max_tokens=tokens, ignore_eos=True))
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        busy = busy_us(kernels)  # the union of the kernels' intervals (PDL overlaps them)
        names = {}
        for e in kernels:
            names.setdefault(e.name[:48], [0, 0.0])
            names[e.name[:48]][0] += 1
            names[e.name[:48]][1] += e.device_time
        return len(kernels), busy, names
    n1, t1, k1 = run(1)
    n2, t2, k2 = run(1 + decodes)
    by_name = {k: [(v[0] - k1.get(k, [0, 0])[0]) / decodes, (v[1] - k1.get(k, [0, 0])[1]) / decodes]
               for k, v in k2.items()}
    return {"kernels_per_decode_step": (n2 - n1) / decodes, "gpu_busy_us_per_decode_step": (t2 - t1) / decodes,
            "by_kernel": {k: v for k, v in by_name.items() if v[0] > 0}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen3-0.6b")
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], choices=["gemv", "chain", "batch1", "kernels", "equal"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = json.loads((resolve_model(args.model) / "config.json").read_text())
    result = {"model": args.model, "copy_gb_per_s": copy_gb_per_s(torch.device("cuda"))}
    print(f"copy bandwidth {result['copy_gb_per_s']:.0f} GB/s", flush=True)
    if "gemv" not in args.skip:
        result["gemv"] = bench_gemv(cfg, result["copy_gb_per_s"])
    if "chain" not in args.skip:
        result["chain_us"] = bench_chain(cfg, cfg["num_hidden_layers"])
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
            for eager in (False, True):
                llm = importlib.import_module(f"steps.{s}.engine").LLM(args.model, max_kv_tokens=32768,
                                                                       gpu_memory_utilization=0.3, enforce_eager=eager)
                count_kernels(llm, prompt, 4)  # warm-up
                key = f"{s}_decode_kernels" + ("_eager" if eager else "")
                result[key] = count_kernels(llm, prompt)
                print(f"{s} ({'eager' if eager else 'CUDA graphs'}): {result[key]['kernels_per_decode_step']:.1f} kernels "
                      f"per decode step, GPU busy {result[key]['gpu_busy_us_per_decode_step']:.0f} us per decode step",
                      flush=True)
                for name, (n, us) in sorted(result[key]["by_kernel"].items(), key=lambda kv: -kv[1][1]):
                    print(f"    {name:48s} {n:6.1f} {us:8.1f} us", flush=True)
                llm.shutdown()
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
