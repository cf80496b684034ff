"""step30 on a GPU: the attention kernels of one decode step at nano-vllm's scale, on a bf16, an int8 and an fp8 KV
cache, in one process: each kernel's time, the K and V bytes it reads (int8's scales included) and their rate
against the copy bandwidth measured in the same run.

The step: 256 sequences of Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128), one new token
each, contexts drawn uniformly from 200 to 2,000 tokens (nano-vllm's requests: 100-1,024 prompt tokens and as many
new ones), blocks of 16 scattered over the pool. Timed in a CUDA graph replayed 20 times (median of 5); each
layer's cache is its own (28 copies, as the model's 28 layers read 28 caches: none is in the L2 cache).

    python3 docs/data/bench_step30.py --out $OUT/h200_step30_attention.json > $OUT/h200_step30_attention.txt
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_step28 import graph_us  # noqa: E402
from shared.anatomy import copy_gb_per_s  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16


def decode_step(seqs: int, layers: int, seed: int = 0):
    """Block tables, context lengths and q of one decode step, and the pool's size in blocks."""
    rng = random.Random(seed)
    lens = [rng.randint(200, 2000) for _ in range(seqs)]
    blocks = [-(-n // BLOCK) for n in lens]
    order = list(range(sum(blocks)))
    rng.shuffle(order)
    tables = torch.zeros(seqs, max(blocks), dtype=torch.int32)
    used = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = torch.tensor(order[used:used + b])
        used += b
    q = torch.randn(seqs, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return q, tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda"), used


def caches(kind: str, num_blocks: int, layers: int):
    """`layers` caches of one kind: (k, v, k_scale, v_scale) each; values ~ N(0, 1)."""
    from steps.step30.model import quantize_fp8, quantize_kv

    out = []
    for _ in range(layers):
        k, v = (torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        if kind == "int8":
            (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
            out.append((k, v, ks, vs))
        elif kind == "fp8":
            out.append((quantize_fp8(k, 1.0), quantize_fp8(v, 1.0), 1.0, 1.0))
        else:
            out.append((k, v, None, None))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from steps.step30.kernels.attention import mixed_attention, tile_map
    from steps.step30.kernels.decode import choose_num_splits, decode_counters, flash_decode

    gbs = copy_gb_per_s(torch.device("cuda"))
    print(f"copy bandwidth {gbs:.0f} GB/s", flush=True)
    q, tables, lens, num_blocks = decode_step(args.seqs, args.layers)
    cu = torch.arange(args.seqs + 1, dtype=torch.int32, device="cuda")
    tokens = int(lens.sum())
    result = {"copy_gb_per_s": gbs, "seqs": args.seqs, "context_tokens": tokens, "rows": []}
    for kind in ("bf16", "int8", "fp8"):
        layers = caches(kind, num_blocks, args.layers)
        element = 2 if kind == "bf16" else 1
        read = tokens * KV_HEADS * HEAD_DIM * 2 * element + (tokens * KV_HEADS * 2 * 4 if kind == "int8" else 0)
        tiles = tile_map(cu[1:] - cu[:-1], 16 // (HEADS // KV_HEADS))
        splits = choose_num_splits(args.seqs, KV_HEADS, int(lens.max()))
        counters = decode_counters(args.seqs, KV_HEADS, "cuda")
        runs = {
            "mixed": [lambda c=c: mixed_attention(q, c[0], c[1], tables, cu, lens, HEAD_DIM ** -0.5, 1, tiles=tiles,
                                                  k_scale=c[2], v_scale=c[3]) for c in layers],
            "flash decoding": [lambda c=c: flash_decode(q, c[0], c[1], tables, lens, HEAD_DIM ** -0.5, splits,
                                                        k_scale=c[2], v_scale=c[3], counters=counters)
                               for c in layers],
        }
        for name, fns in runs.items():
            us = graph_us(fns)
            row = dict(cache=kind, kernel=name, us=us, bytes=read, gb_per_s=read / us / 1e3,
                       share_of_copy=read / us / 1e3 / gbs)
            result["rows"].append(row)
            print(f"{name:15s} {kind:5s}: {us:8.1f} us a layer, {read / 1e6:7.1f} MB of K and V, "
                  f"{row['gb_per_s']:6.0f} GB/s, {100 * row['share_of_copy']:3.0f}% of the copy bandwidth", flush=True)
        del layers
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
