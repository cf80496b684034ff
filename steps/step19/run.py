"""step19 demo: fused kernels, fewer launches. A layer's small operators (residual add + RMSNorm, SiLU * up, q/k
RMSNorm + RoPE) run as one Triton kernel each. Which path ran is printed first. Then each fused kernel checked
against the torch operators it replaces at the model's shapes; the kernels launched by one decode forward and by one
of its layers, counted, step18 beside step19; on a GPU each kernel's bandwidth next to the device's copy bandwidth and
the decode step time at 64 seats; then the engine against step18 on the same requests."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import time

import torch

from shared import SamplingParams
from shared.anatomy import (before_after, copy_gb_per_s, decode_forward_inputs, demo_options, gpu_kernels,
                            interpreter_off_cuda, kernel_arg_parser, kernel_ms, kernels_cannot_run, layer_launches,
                            step_module)
from shared.cli import answer_question, format_table, print_header, user_errors

from .engine import LLM


def main() -> None:
    parser = kernel_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        interpreter_off_cuda(args)  # before the model loads: loading it imports triton
        llm = LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                  **demo_options(args))
        print_header("step19: fused kernels, fewer launches", llm)
        print_paths(llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    show_fused_kernels(llm)
    show_launches(llm)
    show_bandwidth(llm)
    show_decode_step(llm)
    before_after("step18", "step19", llm, args, attention_backend=llm.model.attention_backend.name)  # the same path
    if llm.model.ops.name != "triton":
        print("Both engines ran the same torch operators here: what fusing saves needs a GPU (the chapter has the "
              "H200's figures).")


def print_paths(llm) -> None:
    """Which path the engine runs: the fused kernels (with the attention kernels), or the torch operators."""
    if llm.model.ops.name == "triton":
        path = ("residual add + RMSNorm, SiLU * up and q/k norm + RoPE: one Triton kernel each (kernels/fused.py); "
                "attention: step18's kernels")
    else:
        path = "every operator in torch (model.py's TorchLayerOps, the kernels' reference); " + (
            "no CUDA device here" if llm.device.type != "cuda" else "as asked")
    print(f"kernels: {llm.model.attention_backend.name} -> {path}")


def show_fused_kernels(llm) -> None:
    """Each kernel against the torch operators it replaces, at this model's shapes."""
    if kernels_cannot_run(llm):
        print(f"\nthe kernels do not run here: {kernels_cannot_run(llm)}")
        return
    from .kernels import fused
    from .model import TorchLayerOps, rope_cos_sin

    c, dev = llm.model.config, llm.device
    dtype = llm.dtype if dev.type == "cuda" else torch.float32
    n = 300 if dev.type == "cuda" else 5
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(shape, generator=gen).to(dtype).to(dev)  # noqa: E731
    ref, eps = TorchLayerOps(), c.rms_norm_eps
    x, res, w = rand(n, c.hidden_size), rand(n, c.hidden_size), rand(c.hidden_size)
    gate_up = rand(n, 2 * c.intermediate_size)
    qkv = rand(n, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
    cos, sin = rope_cos_sin(torch.arange(n, device=dev) * 7, c.head_dim, c.rope_theta, dtype)
    norms = (rand(c.head_dim), rand(c.head_dim)) if c.qk_norm else (None, None)
    shape = (c.num_heads, c.num_kv_heads, c.head_dim)

    def max_diff(got, want):
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        return max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))

    rows = [["add_rms_norm", f"[{n}, {c.hidden_size}] + residual",
             max_diff(fused.add_rms_norm(x, res, w, eps), ref.add_rms_norm(x, res, w, eps))],
            ["silu_mul", f"[{n}, 2 x {c.intermediate_size}]", max_diff(fused.silu_mul(gate_up), ref.silu_mul(gate_up))],
            ["qk_norm_rope", f"[{n}, {c.num_heads} + {c.num_kv_heads}, {c.head_dim}]"
             + (" with q/k norms" if c.qk_norm else ""),
             max_diff(fused.qk_norm_rope(qkv, cos, sin, *norms, eps, *shape), ref.qk_norm_rope(qkv, cos, sin, *norms,
                                                                                              eps, *shape))]]
    where = "compiled for the GPU" if dev.type == "cuda" else "in Triton's interpreter (TRITON_INTERPRET=1), on the CPU"
    print(f"\nThe fused kernels, {where}, {dtype}, against the torch operators they replace:")
    print(format_table(["kernel", "input", "max |difference|"], [[a, b, f"{d:.1e}"] for a, b, d in rows]))


def show_launches(llm) -> None:
    """Kernels launched by one decode forward and by one of its layers, step18 and step19 on the same inputs: torch
    operators and Triton launches counted on any device (shared/anatomy.py's LaunchCounter); on a GPU also the kernels
    the CUDA profiler saw. On a CPU the kernels run in the interpreter, too slow for the real model's 30 layers: a tiny
    model of the same code counts (a layer's count is the same for every Llama)."""
    if kernels_cannot_run(llm):
        return
    on_gpu = llm.device.type == "cuda"
    model = llm.model_name if on_gpu else f"random:tiny-{llm.model.config.model_type}"
    rows = []
    for step in ("step18", "step19"):
        engine = step_module(step, "engine").LLM(model, device=llm.device, dtype=llm.dtype if on_gpu else None,
                                                 attention_backend="triton", max_num_seqs=4, max_kv_tokens=4096)
        args, layers = decode_forward_inputs(engine), engine.model.config.num_layers
        full, layer = layer_launches(engine, args)
        row = [step, full.ops, full.triton, full.launches, layer.launches]
        if on_gpu:
            row.append(gpu_kernels(lambda: engine.model.forward(*args), llm.device))
        rows.append(row)
    drop = 1 - rows[1][3] / rows[0][3]
    print(f"\nKernels launched by one decode forward of 2 requests ({model}, {layers} layers, "
          f"{llm.dtype if on_gpu else torch.float32}), counted; a layer's count is the forward's minus the same forward "
          "run with one layer fewer:")
    print(format_table(["step", "torch operators", "Triton launches", "launches per forward", "per layer"]
                       + (["CUDA kernels (profiler)"] if on_gpu else []), rows))
    print(f"step19 launches {drop:.0%} fewer kernels per decode forward than step18.")


def show_bandwidth(llm) -> None:
    """On a GPU: each fused kernel's time on a large input, its bytes moved per second beside the device's copy
    bandwidth measured now, and the torch operators it replaces on the same input."""
    if llm.device.type != "cuda" or llm.model.ops.name != "triton":
        print("\nKernel bandwidth: measured on a GPU only (here the kernels run in an interpreter).")
        return
    from .kernels import fused
    from .model import TorchLayerOps, rope_cos_sin

    c, dev, dtype, n = llm.model.config, llm.device, llm.dtype, 16384
    ref, eps, el = TorchLayerOps(), c.rms_norm_eps, torch.empty((), dtype=dtype).element_size()
    x, res = torch.randn(n, c.hidden_size, device=dev, dtype=dtype), torch.randn(n, c.hidden_size, device=dev, dtype=dtype)
    w = torch.randn(c.hidden_size, device=dev, dtype=dtype)
    gate_up = torch.randn(n, 2 * c.intermediate_size, device=dev, dtype=dtype)
    qkv = torch.randn(n, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, device=dev, dtype=dtype)
    cos, sin = rope_cos_sin(torch.arange(n, device=dev), c.head_dim, c.rope_theta, dtype)
    norms = (w.new_ones(c.head_dim), w.new_ones(c.head_dim)) if c.qk_norm else (None, None)
    shape = (c.num_heads, c.num_kv_heads, c.head_dim)
    qk = (c.num_heads + c.num_kv_heads) * c.head_dim
    cases = [  # name, input, fused call, torch call, bytes the fused kernel must move (read + write)
        ("add_rms_norm", f"[{n}, {c.hidden_size}]", lambda: fused.add_rms_norm(x, res, w, eps),
         lambda: ref.add_rms_norm(x, res, w, eps), 4 * n * c.hidden_size * el),
        ("silu_mul", f"[{n}, 2 x {c.intermediate_size}]", lambda: fused.silu_mul(gate_up),
         lambda: ref.silu_mul(gate_up), 3 * n * c.intermediate_size * el),
        ("qk_norm_rope", f"[{n}, {c.num_heads} + {c.num_kv_heads}, {c.head_dim}]",
         lambda: fused.qk_norm_rope(qkv, cos, sin, *norms, eps, *shape),
         lambda: ref.qk_norm_rope(qkv, cos, sin, *norms, eps, *shape), 2 * n * qk * el + n * c.head_dim * 2 * el)]
    copy = copy_gb_per_s(dev)
    rows = []
    for name, shape_text, fused_call, torch_call, nbytes in cases:
        ms_fused, ms_torch = kernel_ms(fused_call, dev), kernel_ms(torch_call, dev)
        gbs = nbytes / (ms_fused / 1000) / 1e9
        rows.append([name, shape_text, f"{nbytes / 1e6:.1f}", f"{ms_fused:.4f}", f"{gbs:.0f}", f"{gbs / copy:.0%}",
                     f"{ms_torch:.4f}", f"{ms_torch / ms_fused:.1f}x"])
    print(f"\nThe fused kernels on large inputs ({dtype}), GPU time of their kernels alone; the device's copy "
          f"bandwidth measured now: {copy:.0f} GB/s")
    print(format_table(["kernel", "input", "MB moved", "fused ms", "GB/s", "of copy", "torch ops ms",
                        "torch / fused"], rows))


def show_decode_step(llm, seats: int = 64, steps: int = 30) -> None:
    """On a GPU: the time of one engine step while `seats` requests decode, step18 beside step19 (alternated)."""
    if llm.device.type != "cuda":
        print("Decode step time at 64 seats: measured on a GPU only.")
        return
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(128)] for i in range(seats)]
    results = {}
    engines = {step: step_module(step, "engine").LLM(llm.model_name, device=llm.device, dtype=llm.dtype,
                                                       max_num_seqs=seats, max_num_batched_tokens=seats * 128,
                                                       max_kv_tokens=seats * 192)
               for step in ("step18", "step19")}
    for _ in range(3):
        for step, engine in engines.items():
            sp = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
            for p in prompts:
                engine.add_request(p, sp)
            engine.step()  # every prompt in one step
            engine.step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
            results.setdefault(step, []).append(1000 * (time.perf_counter() - start) / steps)
            while engine.has_unfinished_requests():
                engine.step()
    rows = [[s, f"{sorted(v)[1]:.2f}", " ".join(f"{t:.2f}" for t in v)] for s, v in results.items()]
    print(f"\nOne engine step while {seats} requests decode (context about 130 tokens), median of 3 runs of {steps} "
          "steps, alternated:")
    print(format_table(["step", "ms per step", "the 3 runs"], rows))
    print(f"step19 is {sorted(results['step18'])[1] / sorted(results['step19'])[1]:.2f}x faster than step18")


if __name__ == "__main__":
    main()
