"""step33's latent decode kernel (kernels/latent.py) against the bytes it must read and against the decompressed path.

For DeepSeek-V2-Lite's attention (16 heads) and DeepSeek-V3's (128 heads), a row of 512 + 64 bf16 values a token,
contexts of 1k to 32k tokens and batches of 1 to 256 sequences (a decode step: one query each):
  - the kernel's time (CUDA events, the median of --repeats), the best of a few split counts, and the rows' bytes it
    must read, as a share of the device's copy bandwidth measured in the same call (a 1 GiB device-to-device copy);
  - the decompressed path's time for the same step where its keys and values fit (kv_b_proj over every context
    token, then attention with a key and a value per head: what a decode would cost without absorbing).

    python3 docs/data/bench_step33.py --out h100_step33_latent.json > h100_step33_latent.txt    (CUDA)
    TRITON_INTERPRET=1 python3 docs/data/bench_step33.py --dry-run                            (CPU: tiny shapes,
                                                                                                 checks it runs)
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from steps.step33.kernels.latent import latent_decode, latent_decode_reference  # noqa: E402

C, R, NOPE, V, BLOCK = 512, 64, 128, 128, 16  # DeepSeek's row, a query head's dims, a value's, the cache's block


def timed(fn, repeats: int, device) -> float:
    """The median time of fn() in ms: CUDA events on a GPU, the wall clock on a CPU (a dry run)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device, repeats: int) -> float:
    """GB/s of a device-to-device copy of 1 GiB (read + write counted), the bar the kernel's reads are held to."""
    n = 2**30 if device.type == "cuda" else 2**20
    a, b = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    ms = timed(lambda: b.copy_(a), repeats, device)
    return 2 * n / ms / 1e6


def case(heads: int, batch: int, context: int, device, dtype, repeats: int, splits_tried, c=C, r=R) -> dict:
    g = torch.Generator().manual_seed(heads + batch + context)
    blocks_per_seq = -(-context // BLOCK)
    cache = (torch.randn(batch * blocks_per_seq, BLOCK, 1, c + r, generator=g) * 0.5).to(device, dtype)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq).to(device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q_latent = (torch.randn(batch, heads, c, generator=g) * 0.05).to(device, dtype)
    q_rope = (torch.randn(batch, heads, r, generator=g) * 0.05).to(device, dtype)
    scale = (NOPE + r) ** -0.5
    times = {s: timed(lambda s=s: latent_decode(q_latent, q_rope, cache, tables, lens, scale, num_splits=s),
                      repeats, device) for s in splits_tried}
    best = min(times, key=times.get)
    got = latent_decode(q_latent, q_rope, cache, tables, lens, scale, num_splits=best)
    want = latent_decode_reference(q_latent[:2].float(), q_rope[:2].float(), cache.float(), tables[:2], lens[:2], scale)
    error = (got[:2].float() - want).abs().max().item()
    row = dict(heads=heads, batch=batch, context=context, splits=best, kernel_ms=times[best],
               rows_bytes=batch * context * (c + r) * cache.element_size(), max_abs_error=error)
    tokens = batch * context
    if tokens * heads * (NOPE + r + V) * cache.element_size() <= (2**33 if device.type == "cuda" else 2**26):
        kv_b = (torch.randn(heads * (NOPE + V), c, generator=g) * 0.02).to(device, dtype)
        q = torch.cat([(torch.randn(batch, heads, NOPE, generator=g) * 0.05).to(device, dtype), q_rope], -1)

        def decompressed():  # every context token's keys and values per head, then one query each
            latents = cache.view(batch, -1, c + r)[:, :context]
            kv = (latents[..., :c] @ kv_b.T).view(batch, context, heads, NOPE + V)
            keys = torch.cat([kv[..., :NOPE], latents[:, :, None, c:].expand(-1, -1, heads, -1)], -1)
            scores = torch.einsum("bhd,bshd->bhs", q, keys) * scale
            return torch.einsum("bhs,bshv->bhv", scores.softmax(-1), kv[..., NOPE:])
        row["decompressed_ms"] = timed(decompressed, repeats, device)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on any device (the CPU: interpreter)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.dry_run:
        shapes, splits_tried, dims = [(16, 2, 40), (20, 1, 70)], (1, 2), dict(c=32, r=8)
        args.repeats = min(args.repeats, 2)
    else:
        shapes = [(h, b, s) for h in (16, 128) for b in (1, 8, 64, 256) for s in (1024, 4096, 16384, 32768)
                  if b * s * (C + R) * 2 <= 2**34]  # at most 16 GiB of rows
        splits_tried, dims = (1, 2, 4, 8, 16), {}
    bandwidth = copy_bandwidth(device, args.repeats)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}: copy bandwidth {bandwidth:.0f} GB/s (read + write), {dtype}")
    print(f"{'heads':>5} {'batch':>5} {'context':>7} {'splits':>6} {'kernel ms':>10} {'share of copy bw':>16} "
          f"{'decompressed ms':>15} {'kernel faster':>13}")
    rows = []
    for heads, batch, context in shapes:
        row = case(heads, batch, context, device, dtype, args.repeats, splits_tried, **dims)
        row["share_of_copy_bandwidth"] = row["rows_bytes"] / row["kernel_ms"] / 1e6 / bandwidth
        rows.append(row)
        dec = row.get("decompressed_ms")
        dec_ms = "" if dec is None else f"{dec:.3f}"
        faster = "" if dec is None else f"{dec / row['kernel_ms']:.1f}x"
        print(f"{heads:>5} {batch:>5} {context:>7} {row['splits']:>6} {row['kernel_ms']:>10.3f} "
              f"{row['share_of_copy_bandwidth']:>16.0%} {dec_ms:>15} {faster:>13}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=name, dtype=str(dtype), copy_gb_per_s=bandwidth,
                                                  command=" ".join(sys.argv), rows=rows), indent=1))


if __name__ == "__main__":
    main()
