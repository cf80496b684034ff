"""The machine instructions of the attention kernels' loop over the keys, per byte of K and V they read, for a cache
in bf16, step20's int8 (a scale per token and KV head) and step30's fp8 (a scale per layer), without a GPU.

Triton compiles step30's mixed kernel (what a step of decodes and chunks runs; at nano-vllm's workload most of the
GPU's time) and flash decoding's split kernel for the H200 (sm_90) here, at Qwen3-0.6B's attention shape (16 query
heads, 8 KV heads, head_dim 128), with the tiles their callers choose for a step of decodes; nvdisasm lists the
machine code and sass_step29.py's loop finder counts the instructions of the loop over the key tiles, by opcode.
Dividing by the K and V bytes one trip loads gives the instructions per byte: at the H200's copy bandwidth a
multiprocessor receives about 16 bytes per clock (cpu_step29_sass.txt) and issues 128 lanes a clock, so a loop
that spends more than about 8 lane-instructions per byte it loads cannot stream at the bandwidth.

    python docs/data/sass_step30.py > docs/data/raw/cpu_step30_sass.txt
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402

from sass_step29 import LANES, compile_sm90, loop_opcodes  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
CACHES = {"bf16": ("*bf16", 2), "int8": ("*i8", 1), "fp8": ("*fp8e4nv", 1)}


def typed(kernel, cache_type: str) -> dict:
    """Pointer types: q and the output bf16, the caches of cache_type, the scales fp32, the rest int32."""
    types = {}
    for a in kernel.arg_names:
        if a in ("k_ptr", "v_ptr"):
            types[a] = cache_type
        elif a in ("q_ptr", "o_ptr", "out_ptr"):
            types[a] = "*bf16"
        elif a.endswith("scale_ptr") or a.startswith("part_") and a.endswith("_ptr"):
            types[a] = "*fp32"
        elif a.endswith("_ptr"):
            types[a] = "*i32"
        elif a in ("qk_scale", "out_scale"):
            types[a] = "fp32"
    return types


def main():
    from steps.step30.kernels import attention, decode

    print(f"Triton {triton.__version__}, compiled for sm_90 (H200); Qwen3-0.6B's attention ({HEADS} query heads, "
          f"{KV_HEADS} KV heads, head_dim {HEAD_DIM}); the loop over the key tiles, per byte of K and V one trip loads")
    group = HEADS // KV_HEADS
    for cache, (ptr, size) in CACHES.items():
        int8, fp8 = cache == "int8", cache == "fp8"
        # the mixed kernel at a step of decodes: 16 rows, key tiles of 64 (128 on int8 and fp8: attention.py's choice)
        block_n = 128 if int8 or fp8 else 64
        mixed = dict(GROUP=group, HEAD_DIM=HEAD_DIM, BLOCK_M=16, BLOCK_Q=16 // group, BLOCK_N=block_n,
                     BLOCK_SIZE=BLOCK_SIZE, QUANTIZED=int8, FP8=fp8)
        split = dict(GROUP=group, BLOCK_G=16, HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=64,
                     DOT_PRECISION="tf32", DIRECT=False, QUANTIZED=int8, MERGE_LAST=True, BLOCK_P=4, GROUP_P=2,
                     PDL=True, FP8=fp8)
        for name, kernel, consts, warps, stages in (("mixed", attention._mixed_attention_kernel, mixed, 4,
                                                      3 if int8 or fp8 else 2),
                                                     ("flash decoding", decode._flash_decode_split_kernel, split, 4, 3)):
            ops = loop_opcodes(compile_sm90(kernel, consts, warps, typed(kernel, ptr), num_stages=stages))
            total = sum(ops.values())
            kv_bytes = 2 * consts["BLOCK_N"] * HEAD_DIM * size + (2 * consts["BLOCK_N"] * 4 if int8 else 0)
            per_byte = total * 32 / kv_bytes  # lane-instructions: each warp instruction is 32 lanes' work
            print(f"{name:15s} {cache:5s} key tile {consts['BLOCK_N']:3d}: {total:5d} instructions a warp a trip, "
                  f"{kv_bytes:6d} bytes of K and V (scales included) a trip, {warps} warps: "
                  f"{per_byte * warps:5.2f} lane-instructions per byte  ({', '.join(f'{o} {c}' for o, c in ops.most_common(10))})",
                  flush=True)
    print(f"at {LANES} lanes a clock and about 16 bytes a clock a multiprocessor: at most {LANES / 16:.0f} "
          f"lane-instructions per byte to stream at the copy bandwidth")


if __name__ == "__main__":
    main()
