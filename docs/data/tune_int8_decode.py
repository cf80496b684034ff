"""Tile sizes of step20's decode attention on an int8 cache against a bf16 one: batch 64, context 8192, Qwen3-0.6B's
heads (16 query, 8 KV, head_dim 128), the mixed kernel (what the engine runs for such a step) and flash decoding,
each kernel's own GPU time (CUDA profiler) over a grid of (block_n, num_warps, num_stages).

    python3 docs/data/tune_int8_decode.py > OUT.txt      (on a GPU)
"""
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shared.anatomy import copy_gb_per_s, kernel_ms  # noqa: E402
from steps.step20.kernels.attention import mixed_attention  # noqa: E402
from steps.step20.kernels.decode import flash_decode  # noqa: E402
from steps.step20.model import quantize_kv  # noqa: E402


def main() -> None:
    dev, batch, context, heads, kv_heads, head_dim, block_size = torch.device("cuda"), 64, 8192, 16, 8, 128, 16
    gen = torch.Generator().manual_seed(0)
    per_seq = context // block_size
    shape = (batch * per_seq, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(shape, generator=gen).to(dev, torch.bfloat16)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dev, torch.bfloat16)
    tables = torch.randperm(batch * per_seq, generator=gen).to(torch.int32).view(batch, per_seq).to(dev)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    scale = head_dim ** -0.5
    nbytes = {"bf16": 2 * k.numel() * 2, "int8": 2 * (k8.numel() + ks.numel() * 4)}
    print(f"copy bandwidth now: {copy_gb_per_s(dev):.0f} GB/s; K/V bytes: bf16 {nbytes['bf16'] / 2**20:.0f} MiB, int8 "
          f"{nbytes['int8'] / 2**20:.0f} MiB")
    print(f"{'kernel':<15} {'cache':<5} {'block_n':>7} {'warps':>5} {'stages':>6} {'ms':>8} {'GB/s':>6}")
    best = {}
    for block_n, warps, stages in itertools.product((64, 128), (4,), (2, 3, 4)):
        for cache, args in (("bf16", (k, v, None, None)), ("int8", (k8, v8, ks, vs))):
            kk, vv, s_k, s_v = args
            for name, fn in (
                    ("mixed", lambda: mixed_attention(q, kk, vv, tables, cu, lens, scale, 1, block_n=block_n,
                                                      num_warps=warps, num_stages=stages, k_scale=s_k, v_scale=s_v)),
                    ("flash_decode", lambda: flash_decode(q, kk, vv, tables, lens, scale, 2, block_n=block_n,
                                                          num_warps=warps, num_stages=stages, k_scale=s_k,
                                                          v_scale=s_v))):
                try:
                    ms = kernel_ms(fn, dev, calls=10)
                except Exception as error:  # a config the compiler refuses (too many registers / shared memory)
                    print(f"{name:<15} {cache:<5} {block_n:>7} {warps:>5} {stages:>6}  failed: {type(error).__name__}")
                    continue
                print(f"{name:<15} {cache:<5} {block_n:>7} {warps:>5} {stages:>6} {ms:8.4f} "
                      f"{nbytes[cache] / ms / 1e6:6.0f}", flush=True)
                if ms < best.get((name, cache), (1e9,))[0]:
                    best[(name, cache)] = (ms, block_n, warps, stages)
    for (name, cache), (ms, *config) in sorted(best.items()):
        print(f"BEST {name} {cache}: {ms:.4f} ms at block_n, warps, stages = {tuple(config)}")


if __name__ == "__main__":
    main()
