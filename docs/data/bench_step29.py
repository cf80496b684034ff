"""step29 on a GPU, in one process: (1) each decode projection of the model with its weight as 4-bit blocks
(groups of 32, quant.quantize_int4) at 1, 2, 4 and 8 rows: the 4-bit GEMV, the 4-bit blocks dequantised then
cuBLAS, step28's bf16 GEMV and bf16 cuBLAS, beside the copy floor of the blocks' bytes, with a sweep of the 4-bit
GEMV's tiles at one row and the exponent trick in place of the kernel's integer-to-float conversion. Timed as
bench_step28.py times them: in a CUDA graph over enough copies of the weight (300 MB) that none is in the L2 cache,
each launch a programmatic dependent of the one before; (2) the 28 layers' projections in a row at one row, 4-bit
against bf16; (3) the weights' bytes and the KV pool each engine sizes from the same share of the GPU's memory;
(4) batch 1 (a 128-token prompt, 512 new tokens, at 0.6 and greedy, alternated): step28 bf16, step29 bf16 and
step29 int4; (5) the kernels of one decode step and the GPU's busy time of step29 int4 (CUDA graphs).

    python3 docs/data/bench_step29.py --out $OUT/h200_step29.json > $OUT/h200_step29.txt
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_step28 import count_kernels, graph_us, ms_per_token, projections  # noqa: E402
from shared.anatomy import copy_gb_per_s  # noqa: E402
from shared.models import resolve_model  # noqa: E402

SWEEP = [dict(BLOCK_N=n, BLOCK_G=g, num_warps=w) for n in (2, 4, 8, 16) for g in (8, 16, 32) for w in (4, 8)]


def copies(w, count):
    """count distinct copies of a Q4Weight (the same values in other memory)."""
    from steps.step29.quant import Q4Weight

    return [w] + [Q4Weight(w.packed.clone(), w.scale.clone(), w.minimum.clone()) for _ in range(count - 1)]


def bench_gemv4(cfg, copy_gbs):
    from steps.step29.kernels import gemv as g
    from steps.step29.kernels import gemv4 as g4
    from steps.step29.quant import quantize_int4

    rows = []
    for name, n_rows, k, flags in projections(cfg):
        w16 = torch.randn(n_rows, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        w4 = quantize_int4(w16)
        moved4, moved16 = w4.nbytes, n_rows * k * 2
        ws4 = copies(w4, max(2, -(-300_000_000 // moved4)))
        ws16 = [w16] + [w16.clone() for _ in range(max(2, -(-300_000_000 // moved16)) - 1)]
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5 if flags.get("norm") else None
        silu = flags.get("silu_mul", False)
        n_out = n_rows // 2 if silu else n_rows
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16) if flags.get("residual") else None
            launch = lambda w, config=None: g4.gemv4(x, w, nw, 1e-6, res, silu, config, pdl=True)  # noqa: E731
            ref = g.gemv_reference(x, w4.dequantize(torch.bfloat16), nw, 1e-6, res, silu).float()
            err = ((launch(w4).float() - ref).abs().max() / ref.abs().max()).item()
            row = dict(name=name, m=m, n=n_rows, k=k, bytes_int4=moved4, bytes_bf16=moved16, rel_err=err,
                       copy_floor_us=moved4 / copy_gbs / 1e3, copy_floor_bf16_us=moved16 / copy_gbs / 1e3,
                       gemv4_us=graph_us([lambda w=w: launch(w) for w in ws4]),
                       dequant_cublas_us=graph_us([lambda w=w: x @ g4.dequantize4(w, torch.bfloat16).T for w in ws4]),
                       gemv_bf16_us=graph_us([lambda w=w: g.gemv(x, w, nw, 1e-6, res, silu, pdl=True) for w in ws16]),
                       cublas_bf16_us=graph_us([lambda w=w: x @ w.T for w in ws16]),
                       config=g4.choose_config4(m, n_out, k, silu))
            if m == 1:
                row["exponent_trick_us"] = graph_us([lambda w=w: launch(w, dict(row["config"], EXPONENT_TRICK=True))
                                                     for w in ws4])
                best = None
                for c in SWEEP:
                    c = dict(c, BLOCK_M=1)
                    us = graph_us([lambda w=w: launch(w, c) for w in ws4])
                    if best is None or us < best[0]:
                        best = (us, c)
                row.update(best_us=best[0], best_config=best[1])
            row["gemv4_gb_per_s"] = moved4 / row["gemv4_us"] / 1e3
            rows.append(row)
            print(f"{name:24s} M={m}  4-bit {moved4 / 1e6:5.2f} MB, copy floor {row['copy_floor_us']:5.2f} us | "
                  f"4-bit GEMV {row['gemv4_us']:6.2f} us ({row['gemv4_gb_per_s']:5.0f} GB/s, "
                  f"{100 * row['copy_floor_us'] / row['gemv4_us']:3.0f}% of copy) | dequantise + cuBLAS "
                  f"{row['dequant_cublas_us']:6.2f} us | bf16 GEMV {row['gemv_bf16_us']:6.2f} us | bf16 cuBLAS "
                  f"{row['cublas_bf16_us']:6.2f} us"
                  + (f" | the exponent trick instead of the conversion {row['exponent_trick_us']:6.2f} us | best tile "
                     f"{row['best_us']:6.2f} us {row['best_config']}" if m == 1 else "")
                  + f" | rel err {err:.1e}", flush=True)
        del ws4, ws16
    return rows


def bench_chain(cfg, layers):
    """The four projections of every layer in a row at one row, as the engine's decode runs them, in one graph:
    4-bit GEMV against step28's bf16 GEMV, both with PDL."""
    from steps.step29.kernels import gemv as g
    from steps.step29.kernels import gemv4 as g4
    from steps.step29.quant import quantize_int4

    h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv, i = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16) / shape[-1] ** 0.5  # noqa: E731
    w16 = [dict(qkv=rand(q + 2 * kv, h), o=rand(h, q), gu=rand(2 * i, h), down=rand(h, i),
                n1=torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5,
                n2=torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5) for _ in range(layers)]
    w4 = [{k: (quantize_int4(v) if v.dim() == 2 else v) for k, v in w.items()} for w in w16]
    x0 = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)

    def run(weights, f):
        x = x0
        for w in weights:
            a = f(x, w["qkv"], w["n1"], pdl=True)[:, :q]
            x = f(a, w["o"], residual=x, pdl=True)
            x = f(f(x, w["gu"], w["n2"], silu_mul=True, pdl=True), w["down"], residual=x, pdl=True)
        return x
    out = {"bf16 GEMV": graph_us([lambda: run(w16, g.gemv)], reps=10),
           "4-bit GEMV": graph_us([lambda: run(w4, g4.gemv4)], reps=10)}
    for path, us in out.items():
        print(f"{layers} layers' projections at one row, {path}, PDL: {us:.0f} us ({us / layers:.2f} us a layer)",
              flush=True)
    print(f"{layers} layers' projections at one row: 4-bit GEMV / bf16 GEMV = {out['bf16 GEMV'] / out['4-bit GEMV']:.2f}x "
          f"faster", flush=True)
    return out


ENGINES = {"step28 bf16": ("step28", {}), "step29 bf16": ("step29", {}),
           "step29 int4": ("step29", {"quantization": "int4"})}


def build(name, **options):
    step, extra = ENGINES[name]
    return importlib.import_module(f"steps.{step}.engine").LLM(options.pop("model"), **extra, **options)


def bench_memory(model):
    """Each engine alone, its KV pool sized from 0.5 of the GPU's memory: the weights' bytes and the pool's blocks."""
    out = {}
    for name in ("step28 bf16", "step29 int4"):
        llm = build(name, model=model, gpu_memory_utilization=0.5)
        from steps.step29.model import weight_bytes

        linear, total = weight_bytes(llm.model.w)
        out[name] = dict(weight_bytes=total, projection_bytes=linear, kv_blocks=llm.memory["num_blocks"],
                         block_size=llm.config.block_size)
        print(f"{name}: weights {total / 2**20:.0f} MiB (projections {linear / 2**20:.0f} MiB), KV pool "
              f"{llm.memory['num_blocks']} blocks of {llm.config.block_size} tokens at gpu_memory_utilization 0.5",
              flush=True)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    a, b = out["step28 bf16"], out["step29 int4"]
    print(f"weights: step29 int4 / step28 bf16 = {b['weight_bytes'] / a['weight_bytes']:.3f}x (projections "
          f"{b['projection_bytes'] / a['projection_bytes']:.4f}x); KV pool: {b['kv_blocks'] / a['kv_blocks']:.3f}x the "
          f"blocks", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen3-0.6b")
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], choices=["gemv", "chain", "memory", "batch1", "kernels"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = json.loads((resolve_model(args.model) / "config.json").read_text())
    result = {"model": args.model, "copy_gb_per_s": copy_gb_per_s(torch.device("cuda"))}
    print(f"copy bandwidth {result['copy_gb_per_s']:.0f} GB/s", flush=True)
    if "gemv" not in args.skip:
        result["gemv"] = bench_gemv4(cfg, result["copy_gb_per_s"])
    if "chain" not in args.skip:
        result["chain_us"] = bench_chain(cfg, cfg["num_hidden_layers"])
    if "memory" not in args.skip:
        result["memory"] = bench_memory(args.model)
    prompt = [random.Random(1).randrange(1, 5000) for _ in range(128)]
    if "batch1" not in args.skip:
        engines = {name: build(name, model=args.model, max_kv_tokens=32768, gpu_memory_utilization=0.3)
                   for name in ENGINES}
        for name, llm in engines.items():
            print(name, llm.backend, flush=True)
            ms_per_token(llm, prompt, 16, 0.6)  # warm-up
        runs = {f"{name} {t}": [] for t in (0.6, 0.0) for name in engines}
        for _ in range(args.repeats):
            for t in (0.6, 0.0):
                for name, llm in engines.items():
                    runs[f"{name} {t}"].append(ms_per_token(llm, prompt, args.new_tokens, t))
        result["batch1_ms_per_token"] = runs
        for key, v in runs.items():
            print(f"batch 1, {key}: {statistics.median(v):.3f} ms/token, {1000 / statistics.median(v):.1f} tokens/s "
                  f"(runs {[round(x, 3) for x in v]})", flush=True)
        for t in (0.6, 0.0):
            base = statistics.median(runs[f"step28 bf16 {t}"])
            print(f"batch 1 at {t}: step29 int4 / step28 bf16 = {base / statistics.median(runs[f'step29 int4 {t}']):.2f}x, "
                  f"step29 bf16 / step28 bf16 = {base / statistics.median(runs[f'step29 bf16 {t}']):.2f}x", flush=True)
        for llm in engines.values():
            llm.shutdown()
    if "kernels" not in args.skip:
        for name in ("step28 bf16", "step29 int4"):
            llm = build(name, model=args.model, max_kv_tokens=32768, gpu_memory_utilization=0.3)
            count_kernels(llm, prompt, 4)  # warm-up
            key = f"{name} decode kernels"
            result[key] = count_kernels(llm, prompt)
            print(f"{name} (CUDA graphs): {result[key]['kernels_per_decode_step']:.1f} kernels per decode step, GPU busy "
                  f"{result[key]['gpu_busy_us_per_decode_step']:.0f} us per decode step", flush=True)
            for kname, (n, us) in sorted(result[key]["by_kernel"].items(), key=lambda kv: -kv[1][1]):
                print(f"    {kname:48s} {n:6.1f} {us:8.1f} us", flush=True)
            llm.shutdown()
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
