"""The machine instructions of step29's 4-bit GEMV and step28's bf16 GEMV, per weight, without a GPU.

Triton compiles each kernel for the H200 (sm_90) here, with the tile the engine chooses for each projection of
Qwen3-0.6B at one row; nvdisasm (shipped with Triton) lists the machine code (SASS), and the instructions of the
loop over K are counted, by opcode, and divided by the weights one thread handles in one trip. At one row a GEMV
must move its weights at the memory's pace. At the H200's copy bandwidth (about 4.1 TB/s in h200_step29_gemv.txt)
each of its 132 multiprocessors receives about 16 bytes per clock (1.98 GHz): 25 weights as 4-bit blocks, 8 as
bf16. A multiprocessor issues 128 lanes of instructions per clock, so a 4-bit GEMV that spends more than about 5
instructions per weight is bound by issuing them, not by the bytes; a bf16 one has 16.

    python docs/data/sass_step29.py > docs/data/raw/cpu_step29_sass.txt
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SHAPES = [("qkv", 4096, 1024, dict(HAS_NORM=True)), ("o", 1024, 2048, dict(HAS_RESIDUAL=True)),
          ("gate_up", 3072, 1024, dict(HAS_NORM=True, SILU_MUL=True)), ("down", 1024, 3072, dict(HAS_RESIDUAL=True)),
          ("lm_head", 151936, 1024, dict(HAS_NORM=True))]
TYPES = {"x_ptr": "*bf16", "w_ptr": "*bf16", "packed_ptr": "*u8", "scale_ptr": "*fp16", "min_ptr": "*fp16",
         "out_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "eps": "fp32"}


def compile_sm90(fn, consts: dict, num_warps: int, types: dict | None = None, **options):
    """fn compiled for sm_90 with these constexprs; pointers and strides marked 16-aligned, as the launch finds them.
    types: argument types where they differ from TYPES (int32 for any argument neither names)."""
    names = fn.arg_names
    types = {**TYPES, **(types or {})}
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    signature = {a: ("constexpr" if a in consts else types.get(a, "i32")) for a in names}
    aligned = [a for a in names if a.endswith("_ptr") or a.startswith("stride") or a == "K"]
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})


def loop_opcodes(kernel) -> Counter:
    """Opcodes of the longest loop (a backward branch to a label) in the kernel's SASS."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    labels, code = {}, []
    for line in text.splitlines():
        label = re.match(r"^\s*\.L_x_(\d+):", line)
        if label:
            labels[label.group(1)] = len(code)
        elif re.search(r"/\*[0-9a-f]{4}\*/", line):
            code.append(re.sub(r"^.*?\*/\s*", "", line).strip())
    body = []
    for i, ins in enumerate(code):
        target = re.search(r"BRA\s+`?\(?\.L_x_(\d+)", ins)
        if target and labels.get(target.group(1), i + 1) <= i and i + 1 - labels[target.group(1)] > len(body):
            body = code[labels[target.group(1)]:i + 1]
    return Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0].rstrip(";") for ins in body)


SMS, CLOCK_GHZ, LANES = 132, 1.98, 128  # the H200's multiprocessors, their boost clock, the lanes each issues a clock


def limits():
    """What the memory delivers per multiprocessor per clock at the copy bandwidth measured on the H200
    (h200_step29_gemv.json), in weights, and so how many instructions a weight may take before issuing them is slower
    than reading it."""
    measured = Path(__file__).parent / "raw" / "h200_step29_gemv.json"
    gbs = json.loads(measured.read_text())["copy_gb_per_s"]
    per_clock = gbs / SMS / CLOCK_GHZ  # bytes per multiprocessor per clock
    for name, weights_per_byte in (("4-bit blocks", 32 / 20), ("bf16", 0.5)):
        w = per_clock * weights_per_byte
        print(f"{name}: at the copy bandwidth ({gbs:.0f} GB/s, {SMS} multiprocessors, {CLOCK_GHZ} GHz) a multiprocessor "
              f"receives {per_clock:.1f} bytes = {w:.1f} weights per clock; at {LANES} lanes a clock, "
              f"{LANES / w:.1f} instructions per weight")
    print(f"4-bit blocks / bf16 bytes: {20 / 64:.4f}")


def main():
    from steps.step28.kernels import gemv as g16
    from steps.step29.kernels import gemv4 as g4

    print(f"Triton {triton.__version__}, compiled for sm_90 (H200); loop instructions per weight a thread handles, "
          f"at one row, with the tile each kernel chooses")
    limits()
    rows = []
    for name, n_rows, k, flags in SHAPES:
        silu = flags.get("SILU_MUL", False)
        base = {**dict(HAS_NORM=False, SILU_MUL=False, HAS_RESIDUAL=False, PDL=True), **flags}
        c4 = g4.choose_config4(1, n_rows, k, silu)
        c16 = g16.choose_config(1, n_rows, k, silu)
        runs = [("4-bit GEMV", g4._gemv4_kernel, dict(base, **c4), c4["BLOCK_N"] * c4["BLOCK_G"] * 32),
                ("4-bit GEMV with the exponent trick", g4._gemv4_kernel, dict(base, **c4, EXPONENT_TRICK=True),
                 c4["BLOCK_N"] * c4["BLOCK_G"] * 32),
                ("bf16 GEMV (step28)", g16._gemv_kernel, dict(base, **c16), c16["BLOCK_N"] * c16["BLOCK_K"])]
        for label, fn, cfg, weights in runs:
            warps = cfg.pop("num_warps")
            ops = loop_opcodes(compile_sm90(fn, cfg, warps))
            per_thread = weights * (2 if silu else 1) / (32 * warps)
            total = sum(ops.values())
            row = dict(projection=name, kernel=label, tile={k: v for k, v in cfg.items() if k.startswith("BLOCK")},
                       warps=warps, loop_instructions=total, weights_per_thread=per_thread,
                       per_weight=total / per_thread, opcodes=dict(ops.most_common()))
            rows.append(row)
            print(f"{name:8s} {label:40s} {total:5d} instructions a trip for {per_thread:4.0f} weights a thread: "
                  f"{total / per_thread:5.2f} per weight  ({', '.join(f'{o} {c}' for o, c in ops.most_common(8))})",
                  flush=True)
    if os.environ.get("SASS_JSON"):
        Path(os.environ["SASS_JSON"]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
