"""step31's grouped GEMMs compiled for the H200 (sm_90) on a machine without a GPU: Triton compiles them to SASS here,
so a kernel that would not compile is found before any GPU run. For each tile: the instructions of the K loop of
kernels/moe.py's gate_up and down kernels, how many of them are tensor-core matrix instructions (HGMMA: Hopper's
warpgroup MMA; HMMA: the older warp MMA), and the shared memory each launch asks for.

    python docs/data/sass_step31.py > docs/data/raw/cpu_step31_sass.txt
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sass_step29 import compile_sm90, loop_opcodes  # noqa: E402
from steps.step31.kernels import moe  # noqa: E402

TYPES = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "pairs_ptr": "*i32", "block_expert_ptr": "*i32",
         "a_ptr": "*bf16", "weights_ptr": "*bf16"}
TILES = [(16, 64, 64, 4), (16, 128, 64, 8), (64, 64, 64, 4), (64, 128, 64, 8)]  # BLOCK_M, BLOCK_N, BLOCK_K, warps


def main() -> None:
    import triton

    print(f"Triton {triton.__version__}, compiled for sm_90, bf16")
    for bm, bn, bk, warps in TILES:
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION="tf32")
        parts = []
        for name, fn, types in (("gate_up", moe._gate_up_kernel, TYPES), ("down", moe._down_kernel,
                                                                           {**TYPES, "out_ptr": "*fp32"})):
            kernel = compile_sm90(fn, consts, warps, types)
            ops = loop_opcodes(kernel)
            mma = ops.get("HGMMA", 0) + ops.get("HMMA", 0)
            kind = "HGMMA" if ops.get("HGMMA") else "HMMA"
            parts.append(f"{name} loop {sum(ops.values())} instructions, {mma} {kind}, shared {kernel.metadata.shared} B")
        print(f"BLOCK_M {bm:2d} BLOCK_N {bn:3d} BLOCK_K {bk} warps {warps}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
