"""What a mixture-of-experts layer must move and compute, counted on a CPU: Qwen3-30B-A3B's layer shape (hidden 2048,
128 experts of width 768, 8 per token), no timing.

(1) For 1, 16, 256 and 4,096 tokens routed by a router of random weights (step31's route, seeded): the experts hit,
the loop's matmuls (two per expert hit, model.py's expert_loop) against the fused path's two launches, the rows align
sorts them into (kernels/moe.py: each expert's run padded to whole blocks) and the share of them that is padding, the
bytes of expert weights the layer must read (bf16) and the FLOPs it must do, and their ratio against the ridge point
of the H200's roofline (the copy bandwidth measured in docs/data/raw/h200_step29_gemv.txt, the dense bf16 tensor-core
rate of the H200's data sheet, 989 TFLOP/s): below the ridge the layer is bound by its weight bytes, above it by its
FLOPs. (2) Expert parallelism over R ranks, bytes each rank sends per token per layer: the all-reduce this engine uses
(every rank already holds every token, because attention before it is tensor-parallel or replicated) against
all-to-all dispatch + combine (tokens held by one rank each, sent to the ranks of their k experts and back).

    python docs/data/moe_step31.py > docs/data/raw/cpu_step31_moe.txt
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from steps.step31.kernels.moe import align, choose_block_m  # noqa: E402
from steps.step31.model import route  # noqa: E402

HIDDEN, EXPERTS, WIDTH, TOP_K = 2048, 128, 768, 8  # Qwen3-30B-A3B's config.json
BF16 = 2
H200_BF16_TFLOPS = 989.0  # dense bf16 tensor-core rate, NVIDIA's H200 data sheet
RAW = Path(__file__).resolve().parent / "raw"


def copy_bandwidth_gb_s() -> float:
    text = (RAW / "h200_step29_gemv.txt").read_text()
    return float(re.search(r"copy bandwidth ([0-9.]+) GB/s", text).group(1))


def layer_bytes_flops(tokens: int, experts_hit: int) -> tuple[int, int, int]:
    """What the layer must move and do at `tokens` tokens: (bytes of the hit experts' weights, bf16, each read once;
    the other bytes: x in, the output out and the two temporaries; FLOPs, 2 x tokens x k x 3 x width x hidden)."""
    weight_bytes = experts_hit * 3 * WIDTH * HIDDEN * BF16
    other_bytes = tokens * HIDDEN * BF16 * 2 + tokens * TOP_K * (WIDTH + HIDDEN) * BF16 * 2
    return weight_bytes, other_bytes, 2 * tokens * TOP_K * 3 * WIDTH * HIDDEN


def layer_counts(copy_gb_s: float) -> None:
    g = torch.Generator().manual_seed(0)
    router = torch.randn(EXPERTS, HIDDEN, generator=g) / HIDDEN ** 0.5
    ridge = H200_BF16_TFLOPS * 1e12 / (copy_gb_s * 1e9)
    print(f"Qwen3-30B-A3B layer: hidden {HIDDEN}, {EXPERTS} experts of width {WIDTH}, {TOP_K} per token; "
          f"one expert's weights {3 * WIDTH * HIDDEN * BF16 / 2**20:.1f} MiB bf16")
    print(f"H200 roofline: copy bandwidth {copy_gb_s:.0f} GB/s (h200_step29_gemv.txt), bf16 {H200_BF16_TFLOPS:.0f} "
          f"TFLOP/s (data sheet): ridge at {ridge:.0f} FLOP per byte")
    for n in (1, 16, 256, 4096):
        h = torch.randn(n, HIDDEN, generator=g)
        _, experts = route(h, router, TOP_K, True)
        hit = experts.unique().numel()
        block_m = choose_block_m(n * TOP_K, EXPERTS)
        sorted_pairs, block_expert = align(experts, EXPERTS, block_m)
        used = int((block_expert >= 0).sum()) * block_m  # the rows of blocks that compute
        weight_bytes, act_bytes, flops = layer_bytes_flops(n, hit)
        intensity = flops / (weight_bytes + act_bytes)
        floor_us = max((weight_bytes + act_bytes) / (copy_gb_s * 1e3), flops / (H200_BF16_TFLOPS * 1e6))
        print(f"tokens {n:5d}: experts hit {hit:3d}, loop matmuls {2 * hit:3d}, fused launches 2; block_m {block_m}, "
              f"sorted rows {used} for {n * TOP_K} pairs ({100 * (used - n * TOP_K) / used:.0f}% padding); "
              f"weights read {weight_bytes / 2**20:.0f} MiB, FLOPs {flops / 1e9:.2f} G, {intensity:.0f} FLOP per "
              f"byte ({'above' if intensity > ridge else 'below'} the ridge); roofline floor {floor_us:.1f} us")


def communication() -> None:
    """Bytes one rank sends per token per layer, bf16 hidden states."""
    token = HIDDEN * BF16
    for ranks in (2, 4, 8):
        all_reduce = 2 * (ranks - 1) / ranks * token  # a ring all-reduce: reduce-scatter + all-gather
        # all-to-all: a token goes to each other rank that holds one of its k experts (uniform routing: each of the
        # other R - 1 ranks holds one with probability 1 - (1 - 1/R)^k), and its outputs come back the same way
        others = (ranks - 1) * (1 - (1 - 1 / ranks) ** TOP_K)
        all_to_all = 2 * others * token
        print(f"ranks {ranks}: all-reduce {all_reduce / token:.2f} hidden states per token per layer; all-to-all "
              f"dispatch + combine {all_to_all / token:.2f} ({others:.2f} other ranks hold one of a token's "
              f"{TOP_K} experts)")


if __name__ == "__main__":
    layer_counts(copy_bandwidth_gb_s())
    communication()
