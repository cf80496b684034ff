"""Part 6's attention kernels against the device's limits, all in one process so the ratios sit side by side.

    python3 docs/data/bench_kernels.py --out $OUT/kernels_h200.json      on the GPU (about 30 s on an H200)
    TRITON_INTERPRET=1 python3 docs/data/bench_kernels.py --smoke --out /tmp/k.json   tiny sizes, CPU, a test

Sections (each prints a plain-text table as it goes; the JSON holds the same rows):
    copy            dst.copy_(src) of a 1 GiB tensor: bytes read + written per second, the memory roofline
    prefill         torch SDPA (causal, GQA) against step15's paged_attention on the same data, TFLOP/s
    decode          step16's paged_decode_v1 and _v2 at batch 64 over contexts 256..8192, GB/s of K/V read
    flash_decoding  batch 1, contexts 1K..32K: paged_decode_v2 against step17's flash_decode, GB/s and speed-up
    splits          flash_decode at context 32K for 1..64 splits, next to the count choose_num_splits picks
Kernel modules are loaded from their files (--prefill-module, --decode-module, --flash-module); a section whose file
does not exist is skipped, says so, and is null in the JSON (its reason under "skipped").

Timing, two numbers per measurement (class Timer): *_ms, triton.testing.do_bench's median (it clears the L2 cache
before each call), the time per call as the GPU's stream sees it, launches included; and *_gpu_ms, the durations of the
kernels alone (CUDA profiler). They agree for long kernels; for kernels of tens of microseconds (decode at batch 1) the
CPU's launches take longer than the kernels, and only *_gpu_ms measures the kernel.
Byte counts are the bytes a kernel must move at least (each K/V element read once, q read, out written); a kernel that
reads more (v1 reads each K/V head once per query head of its group) is still credited with these bytes only.
Every kernel's output is checked once against a reference before it is timed; a check that fails stops the run,
exit status 1 (the JSON is still written, with "failed").
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODULES = {"prefill": "steps/step15/kernels/attention.py", "decode": "steps/step16/kernels/decode.py",
                   "flash": "steps/step17/kernels/decode.py"}

# The shapes: 16 query heads sharing 8 KV heads (GQA group 2), head_dim 128, bf16. --smoke shrinks them.
FULL = dict(heads=16, kv_heads=8, head_dim=128, prefill_lens=[512, 1024, 2048, 4096, 8192], prefill_block=16,
            prefill_extra_block=(4096, 64), decode_batch=64, decode_block=16,
            decode_contexts=[256, 512, 1024, 2048, 4096, 8192], decode_check_context=2048,
            flash_contexts=[1024, 2048, 4096, 8192, 16384, 32768], split_context=32768,
            split_counts=[1, 2, 4, 8, 16, 32, 64], copy_bytes=1 << 30)
SMOKE = dict(heads=4, kv_heads=2, head_dim=64, prefill_lens=[64, 128], prefill_block=16,
             prefill_extra_block=(128, 64), decode_batch=2, decode_block=16, decode_contexts=[32, 64],
             decode_check_context=64, flash_contexts=[64, 128], split_context=128, split_counts=[1, 2, 4],
             copy_bytes=1 << 20)
WARMUP_MS, REP_MS = 25, 200  # do_bench's warm-up and measuring time per measurement
KERNEL_CALLS = 20            # calls profiled for the kernels-only time
PREFILL_TOL = 5e-2           # max |kernel - SDPA| allowed (bf16 outputs of O(1))
DECODE_TOL = 2e-2            # max |kernel - reference| for the decode kernels (outputs are averages: smaller)


class CheckFailed(RuntimeError):
    pass


# ---------------------------------------------------------------- helpers

def load_module(path: str | None, label: str):
    """The module at `path` (relative to the repository root or absolute), or None with the reason printed."""
    if path is None:
        return None, f"{label}: no module given"
    file = Path(path) if Path(path).is_absolute() else ROOT / path
    if not file.is_file():
        return None, f"{label}: skipped, the module file {file} does not exist"
    spec = importlib.util.spec_from_file_location(f"bench_kernels_{label}", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module, str(file.relative_to(ROOT) if file.is_relative_to(ROOT) else file)


class Timer:
    """timer(fn) -> (ms, gpu_ms), both in milliseconds per call.

    ms:     triton.testing.do_bench's median (it clears the L2 cache before each call): the time between two events
            on the GPU's stream, so it includes any time the GPU waits for the CPU to launch the next kernel.
    gpu_ms: the durations of the kernels fn launches (CUDA profiler), summed and averaged over KERNEL_CALLS calls,
            the L2 cache cleared before each call as do_bench does. For a kernel of some microseconds the Python
            wrapper and the launches can take longer than the kernel itself: then ms measures them, gpu_ms does not.
    On a CPU (--smoke) both are one perf_counter-timed call (in Triton's interpreter: meaningless)."""

    def __init__(self, device: str):
        self.device = device
        if device == "cuda":
            import torch

            self.flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # 256 MiB: more than the L2 cache
            self.flush_names = {e.name for e in self._kernels(lambda: None, 2)}  # flush.zero_()'s: not counted

    def _kernels(self, fn, calls: int) -> list:
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                self.flush.zero_()
                fn()
            torch.cuda.synchronize()
        return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    def __call__(self, fn) -> tuple[float, float]:
        if self.device != "cuda":
            start = time.perf_counter()
            fn()
            ms = (time.perf_counter() - start) * 1e3
            return ms, ms
        import triton.testing

        ms = triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
        events = [e for e in self._kernels(fn, KERNEL_CALLS) if e.name not in self.flush_names]
        return ms, sum(e.time_range.elapsed_us() for e in events) / KERNEL_CALLS / 1e3


def max_diff(got, want) -> float:
    return (got.float() - want.float()).abs().max().item()


def check(what: str, got, want, tol: float) -> float:
    diff = max_diff(got, want)
    ok = math.isfinite(diff) and diff <= tol
    print(f"  check {what}: max |difference| {diff:.2e} ({'ok' if ok else 'FAILED'}, tolerance {tol:g})")
    if not ok:
        raise CheckFailed(f"{what}: max |difference| {diff:.3e} > {tol:g}")
    return diff


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for n, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))
    sys.stdout.flush()


def paged_cache(k, v, block_size: int, gen, device):
    """K/V of sequences laid out in a paged cache, blocks in shuffled order.

    k, v [B, T, kv_heads, D] -> k_cache, v_cache [B * blocks_per_seq, block_size, kv_heads, D], block_tables
    int32 [B, blocks_per_seq]: sequence b's token t is in block block_tables[b, t // block_size], slot t % block_size."""
    import torch

    batch, length, kv_heads, head_dim = k.shape
    per_seq = -(-length // block_size)
    order = torch.randperm(batch * per_seq, generator=gen).to(device)
    tables = order.view(batch, per_seq).to(torch.int32)
    pos = torch.arange(length, device=device)
    slots = (tables[:, pos // block_size].long() * block_size + pos % block_size).reshape(-1)  # [B * T]
    caches = []
    for x in (k, v):
        cache = torch.zeros(batch * per_seq, block_size, kv_heads, head_dim, dtype=x.dtype, device=device)
        cache.view(-1, kv_heads, head_dim)[slots] = x.reshape(-1, kv_heads, head_dim)
        caches.append(cache)
    return caches[0], caches[1], tables


# ---------------------------------------------------------------- sections

def gbs(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def bench_copy(cfg, dtype, device, timer) -> dict:
    import torch

    numel = cfg["copy_bytes"] // torch.tensor([], dtype=dtype).element_size()
    src = torch.randn(numel, device=device).to(dtype)
    dst = torch.empty_like(src)
    ms, gpu_ms = timer(lambda: dst.copy_(src))
    size = src.numel() * src.element_size()
    moved = 2 * size  # read + write
    row = dict(size_bytes=size, bytes=moved, ms=ms, gb_per_s=gbs(moved, ms), tb_per_s=gbs(moved, ms) / 1e3,
               gpu_ms=gpu_ms, gpu_gb_per_s=gbs(moved, gpu_ms))
    size_text = f"{size / 2**30:g} GiB" if size >= 2**30 else f"{size / 2**20:g} MiB"
    print_table(f"copy: dst.copy_(src), {size_text} {str(dtype).removeprefix('torch.')}; bytes = read + write",
                ["MiB moved", "ms", "GB/s", "TB/s", "GPU-only ms"],
                [[f"{moved / 2**20:.0f}", f"{ms:.3f}", f"{row['gb_per_s']:.0f}", f"{row['tb_per_s']:.2f}",
                  f"{gpu_ms:.3f}"]])
    del src, dst
    return row


def sdpa_fn(torch):
    """(call, how): SDPA with K/V of fewer heads; enable_gqa if this torch has it, else K/V repeated first."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    probe = torch.zeros(1, 2, 4, 8)
    try:
        sdpa(probe, probe[:, :1], probe[:, :1], is_causal=True, enable_gqa=True)
        return (lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True)), "enable_gqa"
    except TypeError:
        return None, "repeat_interleave"


def sdpa_kernel_names(run) -> list[str]:
    """The CUDA kernels one SDPA call launches (which backend torch picked), or [] if the profiler fails."""
    import torch

    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    except Exception as error:  # the profiler is a nicety here, not part of the measurement
        print(f"  (profiler failed: {error})")
        return []


def bench_prefill(mod, cfg, dtype, device, timer, meta) -> list[dict]:
    import torch

    H, KV, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    scale = D ** -0.5
    call, how = sdpa_fn(torch)
    meta["sdpa_gqa"] = how
    if call is None:
        print("  SDPA: this torch has no enable_gqa: K/V are repeated to the query heads first (repeat_interleave, "
              "outside the timed call)")
    gen = torch.Generator().manual_seed(0)
    sizes = [(S, cfg["prefill_block"]) for S in cfg["prefill_lens"]]
    extra = tuple(cfg["prefill_extra_block"])
    if extra[0] in cfg["prefill_lens"]:
        sizes.insert(sizes.index((extra[0], cfg["prefill_block"])) + 1, extra)
    rows, sdpa_ms = [], {}
    for S, block_size in sizes:
        q = torch.randn(S, H, D, generator=gen).to(device, dtype)  # the flat batch: one sequence, S new tokens
        k = torch.randn(1, S, KV, D, generator=gen).to(device, dtype)
        v = torch.randn(1, S, KV, D, generator=gen).to(device, dtype)
        # SDPA's layout [1, heads, S, D], as views of the same data (last dim contiguous, as its kernels want).
        qs, ks, vs = q.unsqueeze(0).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if call is None:
            ks, vs = ks.repeat_interleave(H // KV, dim=1), vs.repeat_interleave(H // KV, dim=1)
            run_sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)  # noqa
        else:
            run_sdpa = lambda: call(qs, ks, vs)  # noqa: E731
        k_cache, v_cache, tables = paged_cache(k, v, block_size, gen, device)
        cu = torch.tensor([0, S], dtype=torch.int32, device=device)
        lens = torch.tensor([S], dtype=torch.int32, device=device)
        run_kernel = lambda: mod.paged_attention(q, k_cache, v_cache, tables, cu, lens, scale, S)  # noqa: E731
        ref = run_sdpa().transpose(1, 2)[0]  # [S, heads, D]
        diff = check(f"prefill S={S} block {block_size}: kernel vs SDPA", run_kernel(), ref, PREFILL_TOL)
        if device == "cuda" and "sdpa_kernels" not in meta:
            meta["sdpa_kernels"] = sdpa_kernel_names(run_sdpa)
            print(f"  SDPA launches: {', '.join(meta['sdpa_kernels']) or '(unknown)'}")
        if S not in sdpa_ms:
            sdpa_ms[S] = timer(run_sdpa)
        (s_ms, s_gpu), (k_ms, k_gpu) = sdpa_ms[S], timer(run_kernel)
        flops = 2 * 2 * S * S * D * H / 2  # two matmuls (QK^T, PV) of 2*S*S*D per head, causal: half the square
        tile = None  # the kernel's own choice (its wrapper picks the tiles from the sizes)
        rows.append(dict(seq_len=S, block_size=block_size, heads=H, kv_heads=KV, head_dim=D, flops=flops,
                         sdpa_ms=s_ms, kernel_ms=k_ms, sdpa_tflops=flops / s_ms / 1e9, kernel_tflops=flops / k_ms / 1e9,
                         ratio=s_ms / k_ms, sdpa_gpu_ms=s_gpu, kernel_gpu_ms=k_gpu,
                         sdpa_gpu_tflops=flops / s_gpu / 1e9, kernel_gpu_tflops=flops / k_gpu / 1e9,
                         gpu_ratio=s_gpu / k_gpu, max_abs_diff=diff, tile=tile))
        del q, k, v, qs, ks, vs, k_cache, v_cache, ref
    print_table(f"prefill: one sequence of S new tokens, causal, {H} query / {KV} KV heads, head_dim {D}, "
                f"{str(dtype).removeprefix('torch.')}; FLOPs = 2 * S^2 * D * heads; GPU-only: kernel durations",
                ["S", "block", "SDPA ms", "kernel ms", "SDPA TFLOP/s", "kernel TFLOP/s", "kernel/SDPA",
                 "GPU-only: SDPA ms", "kernel ms", "kernel/SDPA"],
                [[r["seq_len"], r["block_size"], f"{r['sdpa_ms']:.3f}", f"{r['kernel_ms']:.3f}",
                  f"{r['sdpa_tflops']:.1f}", f"{r['kernel_tflops']:.1f}", f"{r['ratio']:.2f}x",
                  f"{r['sdpa_gpu_ms']:.3f}", f"{r['kernel_gpu_ms']:.3f}", f"{r['gpu_ratio']:.2f}x"] for r in rows])
    return rows


def decode_case(cfg, batch: int, ctx: int, dtype, device, seed: int):
    """q [batch, heads, D] and the paged K/V of `batch` sequences of `ctx` tokens each (shuffled blocks)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    H, KV, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    k = torch.randn(batch, ctx, KV, D, generator=gen, device=device, dtype=dtype)
    v = torch.randn(batch, ctx, KV, D, generator=gen, device=device, dtype=dtype)
    q = torch.randn(batch, H, D, generator=gen, device=device, dtype=dtype)
    k_cache, v_cache, tables = paged_cache(k, v, cfg["decode_block"], torch.Generator().manual_seed(seed), device)
    del k, v
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, lens


def decode_bytes(q, batch: int, ctx: int, kv_heads: int, head_dim: int) -> int:
    """The least a decode step moves: K and V of every context token once, q in, out back."""
    e = q.element_size()
    return batch * ctx * kv_heads * head_dim * e * 2 + 2 * q.numel() * e


def bench_decode(mod, cfg, dtype, device, timer, copy_gbs) -> list[dict]:
    H, KV, D, B = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["decode_batch"]
    scale = D ** -0.5
    rows = []
    for ctx in cfg["decode_contexts"]:
        args = decode_case(cfg, B, ctx, dtype, device, seed=ctx)
        if ctx == cfg["decode_check_context"]:
            want = mod.decode_reference(*args, scale)
            check(f"decode v2 batch {B} context {ctx} vs decode_reference", mod.paged_decode_v2(*args, scale), want,
                  DECODE_TOL)
            check(f"decode v1 batch {B} context {ctx} vs decode_reference", mod.paged_decode_v1(*args, scale), want,
                  DECODE_TOL)
        v1, v1_gpu = timer(lambda: mod.paged_decode_v1(*args, scale))
        v2, v2_gpu = timer(lambda: mod.paged_decode_v2(*args, scale))
        moved = decode_bytes(args[0], B, ctx, KV, D)
        row = dict(batch=B, context=ctx, block_size=cfg["decode_block"], heads=H, kv_heads=KV, head_dim=D,
                   bytes=moved)
        for name, ms, gpu_ms in (("v1", v1, v1_gpu), ("v2", v2, v2_gpu)):
            row.update({f"{name}_ms": ms, f"{name}_gb_per_s": gbs(moved, ms), f"{name}_frac_copy": gbs(moved, ms) / copy_gbs,
                        f"{name}_gpu_ms": gpu_ms, f"{name}_gpu_gb_per_s": gbs(moved, gpu_ms),
                        f"{name}_gpu_frac_copy": gbs(moved, gpu_ms) / copy_gbs})
        row.update(v2_speedup_over_v1=v1 / v2, gpu_v2_speedup_over_v1=v1_gpu / v2_gpu)
        rows.append(row)
        del args
    print_table(f"decode: batch {B}, one query per sequence, {H} query / {KV} KV heads, head_dim {D}, block "
                f"{cfg['decode_block']}; GB/s of K/V + q + out (each once); copy = {copy_gbs:.0f} GB/s measured",
                ["context", "MiB", "v1 ms", "v2 ms", "v1 GB/s", "v2 GB/s", "v1 % copy", "v2 % copy", "v2/v1",
                 "GPU-only: v1 ms", "v2 ms", "v2 % copy"],
                [[r["context"], f"{r['bytes'] / 2**20:.0f}", f"{r['v1_ms']:.3f}", f"{r['v2_ms']:.3f}",
                  f"{r['v1_gb_per_s']:.0f}", f"{r['v2_gb_per_s']:.0f}", f"{100 * r['v1_frac_copy']:.0f}%",
                  f"{100 * r['v2_frac_copy']:.0f}%", f"{r['v2_speedup_over_v1']:.2f}x", f"{r['v1_gpu_ms']:.3f}",
                  f"{r['v2_gpu_ms']:.3f}", f"{100 * r['v2_gpu_frac_copy']:.0f}%"] for r in rows])
    return rows


def bench_flash(mod, v2_mod, ref_mod, cfg, dtype, device, timer, copy_gbs, num_sms) -> tuple[list, list]:
    H, KV, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    scale = D ** -0.5
    sms = {} if num_sms is None else {"num_sms": num_sms}
    rows, split_rows = [], []
    for n, ctx in enumerate(cfg["flash_contexts"]):
        args = decode_case(cfg, 1, ctx, dtype, device, seed=ctx)
        splits = mod.choose_num_splits(1, KV, ctx, **sms)
        # Checked at the first context and, for every split count of the sweep, at the sweep's context.
        counts = [splits] + (cfg["split_counts"] if ctx == cfg["split_context"] else [])
        if n == 0 or ctx == cfg["split_context"]:
            want = ref_mod.decode_reference(*args, scale) if hasattr(ref_mod, "decode_reference") else \
                v2_mod.paged_decode_v2(*args, scale)
            for s in dict.fromkeys(counts):
                check(f"flash_decode context {ctx}, {s} splits vs "
                      f"{'decode_reference' if hasattr(ref_mod, 'decode_reference') else 'paged_decode_v2'}",
                      mod.flash_decode(*args, scale, s), want, DECODE_TOL)
        v2, v2_gpu = timer(lambda: v2_mod.paged_decode_v2(*args, scale))
        flash, flash_gpu = timer(lambda: mod.flash_decode(*args, scale, splits))
        moved = decode_bytes(args[0], 1, ctx, KV, D)
        row = dict(batch=1, context=ctx, num_splits=splits, bytes=moved)
        for name, ms, gpu_ms in (("v2", v2, v2_gpu), ("flash", flash, flash_gpu)):
            row.update({f"{name}_ms": ms, f"{name}_gb_per_s": gbs(moved, ms), f"{name}_frac_copy": gbs(moved, ms) / copy_gbs,
                        f"{name}_gpu_ms": gpu_ms, f"{name}_gpu_gb_per_s": gbs(moved, gpu_ms),
                        f"{name}_gpu_frac_copy": gbs(moved, gpu_ms) / copy_gbs})
        row.update(speedup=v2 / flash, gpu_speedup=v2_gpu / flash_gpu)
        rows.append(row)
        if ctx == cfg["split_context"]:
            for s in sorted(set(counts)):  # the sweep, and the rule's pick if it is not one of the sweep's counts
                ms, gpu_ms = (flash, flash_gpu) if s == splits else timer(lambda: mod.flash_decode(*args, scale, s))
                split_rows.append(dict(batch=1, context=ctx, num_splits=s, chosen=s == splits, programs=KV * s,
                                       ms=ms, gb_per_s=gbs(moved, ms), frac_copy=gbs(moved, ms) / copy_gbs,
                                       speedup_over_v2=v2 / ms, gpu_ms=gpu_ms, gpu_gb_per_s=gbs(moved, gpu_ms),
                                       gpu_frac_copy=gbs(moved, gpu_ms) / copy_gbs, gpu_speedup_over_v2=v2_gpu / gpu_ms))
        del args
    print_table(f"flash decoding: batch 1, {H} query / {KV} KV heads, head_dim {D}, block {cfg['decode_block']}; "
                f"splits = choose_num_splits({'num_sms=' + str(num_sms) if num_sms else 'default num_sms'}); "
                f"copy = {copy_gbs:.0f} GB/s",
                ["context", "splits", "v2 ms", "flash ms", "v2 GB/s", "flash GB/s", "v2 % copy", "flash % copy",
                 "speed-up", "GPU-only: v2 ms", "flash ms", "flash % copy", "speed-up"],
                [[r["context"], r["num_splits"], f"{r['v2_ms']:.4f}", f"{r['flash_ms']:.4f}",
                  f"{r['v2_gb_per_s']:.0f}", f"{r['flash_gb_per_s']:.0f}", f"{100 * r['v2_frac_copy']:.1f}%",
                  f"{100 * r['flash_frac_copy']:.1f}%", f"{r['speedup']:.2f}x", f"{r['v2_gpu_ms']:.4f}",
                  f"{r['flash_gpu_ms']:.4f}", f"{100 * r['flash_gpu_frac_copy']:.1f}%", f"{r['gpu_speedup']:.2f}x"]
                 for r in rows])
    if split_rows:
        print_table(f"split counts at context {cfg['split_context']}, batch 1 ({KV} KV heads: programs = {KV} x "
                    "splits; * = choose_num_splits' pick)",
                    ["splits", "programs", "ms", "GB/s", "% copy", "vs v2", "GPU-only: ms", "% copy", "vs v2"],
                    [[f"{r['num_splits']}{'*' if r['chosen'] else ''}", r["programs"], f"{r['ms']:.4f}",
                      f"{r['gb_per_s']:.0f}", f"{100 * r['frac_copy']:.1f}%", f"{r['speedup_over_v2']:.2f}x",
                      f"{r['gpu_ms']:.4f}", f"{100 * r['gpu_frac_copy']:.1f}%", f"{r['gpu_speedup_over_v2']:.2f}x"]
                     for r in split_rows])
    return rows, split_rows


# ---------------------------------------------------------------- main

def git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; runs on a CPU under TRITON_INTERPRET=1")
    parser.add_argument("--prefill-module", default=DEFAULT_MODULES["prefill"], help="has paged_attention")
    parser.add_argument("--decode-module", default=DEFAULT_MODULES["decode"],
                        help="has paged_decode_v1, paged_decode_v2, decode_reference")
    parser.add_argument("--flash-module", default=DEFAULT_MODULES["flash"],
                        help="has flash_decode, choose_num_splits (and paged_decode_v2)")
    args = parser.parse_args(argv)

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if not args.smoke:
            parser.error("no CUDA device: only --smoke runs here (in Triton's interpreter)")
        # The interpreter is chosen when a kernel is defined: before the kernel modules are loaded.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    warnings.filterwarnings("ignore", module="torch.profiler")  # "Profiler clears events at the end of each cycle"
    cfg = SMOKE if args.smoke else FULL
    # Triton's interpreter computes bf16 poorly (numpy has no bf16): the CPU smoke run is fp32.
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else None
    timer = Timer(device)
    if device == "cuda":  # an idle GPU runs at low clocks: raise them before the first measurement
        import torch

        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(200):
            a @ a
        torch.cuda.synchronize()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "triton": triton.__version__, "date": datetime.date.today().isoformat(),
              "git_commit": git("rev-parse", "HEAD") or None,
              "git_dirty": None if git("rev-parse", "HEAD") is None else bool(git("status", "--porcelain")),
              "smoke": args.smoke, "dtype": str(dtype).removeprefix("torch."), "num_sms": num_sms,
              "timing": (f"*_ms: triton.testing.do_bench median (warmup {WARMUP_MS} ms, rep {REP_MS} ms); *gpu_ms: "
                         f"CUDA-profiler kernel durations, mean of {KERNEL_CALLS} calls, L2 cleared before each"
                         if device == "cuda" else "one call, perf_counter (Triton interpreter: meaningless)"),
              "command": "python3 docs/data/bench_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "shapes": {k: cfg[k] for k in ("heads", "kv_heads", "head_dim")},
              "modules": {}, "skipped": {}, "copy": None, "prefill": None, "decode": None, "flash_decoding": None,
              "splits": None}
    print(f"{result['device']}, torch {result['torch']}, triton {result['triton']}, {result['dtype']}, "
          f"git {result['git_commit']}" + (", SMOKE RUN (tiny sizes; timings meaningless)" if args.smoke else ""))

    modules = {}
    for label, path in (("prefill", args.prefill_module), ("decode", args.decode_module),
                        ("flash", args.flash_module)):
        modules[label], where = load_module(path, label)
        if modules[label] is None:
            print(where)
            result["skipped"][label] = where
        else:
            result["modules"][label] = where
    start = time.perf_counter()
    status = 0
    try:
        result["copy"] = bench_copy(cfg, dtype, device, timer)
        copy_gbs = result["copy"]["gb_per_s"]
        if modules["prefill"]:
            result["prefill"] = bench_prefill(modules["prefill"], cfg, dtype, device, timer, result)
        if modules["decode"]:
            result["decode"] = bench_decode(modules["decode"], cfg, dtype, device, timer, copy_gbs)
        if modules["flash"]:
            # v2 from the flash module (step17 carries a copy) or else from the decode module.
            v2_mod = modules["flash"] if hasattr(modules["flash"], "paged_decode_v2") else modules["decode"]
            if v2_mod is None:
                print("flash_decoding: skipped, neither the flash nor the decode module has paged_decode_v2")
                result["skipped"]["flash"] = "no paged_decode_v2 to compare with"
            else:
                ref_mod = modules["flash"] if hasattr(modules["flash"], "decode_reference") else (modules["decode"]
                                                                                                 or v2_mod)
                result["flash_decoding"], result["splits"] = bench_flash(
                    modules["flash"], v2_mod, ref_mod, cfg, dtype, device, timer, copy_gbs, num_sms)
    except CheckFailed as error:
        result["failed"] = str(error)
        print(f"\nFAILED: {error}", file=sys.stderr)
        status = 1
    result["seconds"] = time.perf_counter() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['seconds']:.0f} s; wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
