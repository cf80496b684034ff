"""Batch-1 decode at 32,768 tokens of context, per call, with the CPU's launch cost taken out by a CUDA graph.

bench_kernels.py times flash decoding two ways: per call (do_bench, the Python wrapper and two launches included)
and the kernels alone (CUDA profiler). At batch 1 the kernels take about 0.05 ms and the wrapper longer, so the
per-call figure measures the CPU. Here the same calls are also captured once in a CUDA graph and replayed: one
launch of the whole graph, no Python in between, the way step21 will run a decode step. In one process:
copy bandwidth, then step16's paged_decode_v2 and step17's flash_decode (the rule's split count) three ways each.

    python3 docs/data/bench_flash_decode_graph.py          on a GPU (about 10 s)
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "data"))

import torch  # noqa: E402
import triton  # noqa: E402

from bench_kernels import FULL, decode_bytes, decode_case  # noqa: E402
from steps.step17.kernels.decode import choose_num_splits, decode_reference, flash_decode, paged_decode_v2  # noqa: E402
from shared.anatomy import copy_gb_per_s, kernel_ms  # noqa: E402


def graphed(fn):
    """fn captured once in a CUDA graph (after a warm-up call on a side stream) -> a function that replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_flash_decode_graph.py needs a CUDA device (the point is a CUDA graph)")
    device, ctx, cfg = torch.device("cuda"), 32768, FULL
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(200):  # raise the clocks before the first measurement
        a @ a
    del a
    copy_gbs = copy_gb_per_s(device)  # a 1 GiB copy
    q, k_cache, v_cache, tables, lens = decode_case(cfg, 1, ctx, torch.bfloat16, device, seed=0)
    scale = cfg["head_dim"] ** -0.5
    splits = choose_num_splits(1, cfg["kv_heads"], ctx, num_sms=torch.cuda.get_device_properties(device).multi_processor_count)
    moved = decode_bytes(q, 1, ctx, cfg["kv_heads"], cfg["head_dim"])
    expected = decode_reference(q, k_cache, v_cache, tables, lens, scale).float()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bfloat16; batch 1, "
          f"context {ctx}, {cfg['heads']} query / {cfg['kv_heads']} KV heads, head_dim {cfg['head_dim']}, blocks of "
          f"{cfg['decode_block']}; copy {copy_gbs:.0f} GB/s (read + write, 1 GiB)")
    calls = {"step16 paged_decode_v2": lambda: paged_decode_v2(q, k_cache, v_cache, tables, lens, scale),
             f"step17 flash_decode, {splits} splits": lambda: flash_decode(q, k_cache, v_cache, tables, lens, scale,
                                                                          splits)}
    rows, base = [], {}
    for name, fn in calls.items():
        replay, out = graphed(fn)
        replay()
        torch.cuda.synchronize()
        diff = (out.float() - expected).abs().max().item()
        if diff > 2e-2:
            sys.exit(f"{name}: the graph's output differs from decode_reference by {diff:.2e}")
        times = {"per call": triton.testing.do_bench(fn), "graph replay": triton.testing.do_bench(replay),
                 "kernels alone": kernel_ms(fn, device)}
        for how, ms in times.items():
            base.setdefault(how, ms)
            rows.append((name, how, ms, moved / ms / 1e6, moved / ms / 1e6 / copy_gbs, base[how] / ms))
        print(f"  check {name}: graph output vs decode_reference max |difference| {diff:.2e}")
    print(f"\n{'kernel':36}  {'how':13}  {'ms':>7}  {'GB/s':>6}  {'% copy':>6}  {'vs v2':>6}")
    for name, how, ms, gbs, frac, speedup in rows:
        print(f"{name:36}  {how:13}  {ms:7.4f}  {gbs:6.0f}  {100 * frac:5.1f}%  {speedup:5.2f}x")


if __name__ == "__main__":
    main()
