"""step31 on a GPU: one mixture-of-experts layer at Qwen3-30B-A3B's shape (hidden 2048, 128 experts of width 768, 8 a
token), bf16, at 1, 16, 256 and 4,096 tokens, in one process: the loop over the experts (model.py's expert_loop,
eager: it asks the host which experts were hit) against the two grouped GEMMs (kernels/moe.py, align included,
timed in a CUDA graph), both after the same router; and the fused layer against its roofline, the larger of its
bytes over the copy bandwidth and its FLOPs over the bf16 matmul rate, both measured in the same run.

The bytes: every expert hit, its three matrices once (what the layer cannot avoid reading), plus x in, the output out
and the two temporaries. The FLOPs: 2 x tokens x k x 3 x width x hidden. A few tiles are tried for the fused path at
each size and the best is kept (its tile is printed).

    python3 docs/data/bench_step31.py --out $OUT/h200_step31_moe.json > $OUT/h200_step31_moe.txt
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_step28 import graph_us  # noqa: E402
from moe_step31 import EXPERTS, HIDDEN, TOP_K, WIDTH, layer_bytes_flops  # noqa: E402
from shared.anatomy import copy_gb_per_s, time_ms  # noqa: E402

TILES = [dict(block_n=64, block_k=64, num_warps=4), dict(block_n=128, block_k=64, num_warps=4),
         dict(block_n=128, block_k=64, num_warps=8), dict(block_n=64, block_k=128, num_warps=4)]


def matmul_tflops() -> float:
    """The bf16 tensor-core rate this GPU reaches on a large square matmul (8192^3), TFLOP/s."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in "ab")
    us = graph_us([lambda: a @ b], reps=10)
    return 2 * 8192 ** 3 / us / 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from steps.step31.kernels.moe import fused_moe
    from steps.step31.model import TorchLayerOps, route

    gbs, tflops = copy_gb_per_s(torch.device("cuda")), matmul_tflops()
    print(f"copy bandwidth {gbs:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s (8192^3)", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=g, device="cuda") / HIDDEN ** 0.5).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, WIDTH, generator=g, device="cuda") / WIDTH ** 0.5).bfloat16()
    router = (torch.randn(EXPERTS, HIDDEN, generator=g, device="cuda") / HIDDEN ** 0.5).bfloat16()
    result = {"copy_gb_per_s": gbs, "matmul_tflops": tflops, "rows": []}
    for n in args.tokens:
        h = torch.randn(n, HIDDEN, generator=g, device="cuda").bfloat16()
        weights, experts = route(h, router, TOP_K, True)
        hit = experts.unique().numel()
        loop = TorchLayerOps()
        # eager: the loop asks the host which experts were hit
        loop_us = 1000 * time_ms(lambda: loop.expert_loop(h, weights, experts, gate_up, down), h.device, repeat=10)
        best = None
        for tile in TILES:
            us = graph_us([lambda: fused_moe(h, weights, experts, gate_up, down, **tile)], reps=20)
            best = min(best or (us, tile), (us, tile), key=lambda t: t[0])
        fused_us, tile = best
        reference = loop.expert_loop(h, weights, experts, gate_up, down).float()
        err = ((fused_moe(h, weights, experts, gate_up, down, **tile).float() - reference).abs().max()
               / reference.abs().max()).item()
        weight_bytes, other_bytes, flops = layer_bytes_flops(n, hit)
        floor_us = max((weight_bytes + other_bytes) / (gbs * 1e3), flops / (tflops * 1e6))
        row = dict(tokens=n, experts_hit=hit, loop_us=loop_us, fused_us=fused_us, tile=tile,
                   speedup=loop_us / fused_us, floor_us=floor_us, roofline_share=floor_us / fused_us,
                   weight_bytes=weight_bytes, flops=flops, rel_err=err)
        result["rows"].append(row)
        print(f"tokens {n:5d}: experts hit {hit:3d}; loop {loop_us:9.1f} us, fused {fused_us:8.1f} us "
              f"({loop_us / fused_us:5.2f}x the loop) best tile {tile}; roofline floor {floor_us:7.1f} us "
              f"({100 * floor_us / fused_us:4.1f}% of it reached; {weight_bytes / 2**20:.0f} MiB of experts, "
              f"{flops / 1e9:.1f} GFLOP); rel err {err:.1e}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
