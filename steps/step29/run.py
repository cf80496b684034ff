"""step29 demo: 4-bit weights, the checkpoint as shipped. The embedded model's projections stay the GGUF's Q4_1 blocks
(quant.py): on a CPU a torch path dequantises them for each matmul, on CUDA a GEMV reads the blocks and dequantises
in registers (kernels/gemv4.py); quantization="int4" rounds a float checkpoint's projections to the same blocks.
The outputs of the embedded model are step28's: the same weights. The lesson compares the two and their weights'
bytes.

step28's demo, below, for reference: one user's token in fewer, fuller kernels. Each projection takes the RMSNorm before it and the
residual add or SiLU * up after it; on CUDA a step of one row runs each as one GEMV kernel (kernels/gemv.py), the
q/k norm + RoPE kernel also writes the step's K and V into the cache, flash decoding merges inside its split kernel,
the draw runs a program per block, and on Hopper the kernels launch as programmatic dependents.

The lesson runs --requests requests (one by default: batch 1, where a decode's time is its kernels) through step27 and
this step, alternated, with the phases side by side and the outputs compared; on CUDA it then counts the kernels of
one decode step of each, and the GPU's busy time, with the profiler. On a CPU the projections stay torch's matmuls (the
engine's line says so): the same operations as step27, in the same order, so the outputs are equal bit for bit."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import torch

from shared import SamplingParams
from shared.anatomy import anatomy_arg_parser, before_after, busy_us, compared_options, demo_options, step_module
from shared.cli import answer_question, format_table, print_header, user_errors

from .engine import LLM


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    parser.set_defaults(requests=1, lesson_tokens=32)
    parser.add_argument("--quantization", choices=["int4"], default=None,
                        help="int4: round a float checkpoint's projections to 4-bit blocks on load (default: the "
                             "weights as the checkpoint ships them; the embedded model's are 4-bit already)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                  **demo_options(args))
        print_header("step29: 4-bit weights, the checkpoint as shipped", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    from .linear import method_of
    from .model import weight_bytes
    if getattr(args, "quantization", None):  # int4 on load: another model than step28's, so no equality to check
        floats = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))
        for name, engine in (("as shipped", floats), (args.quantization, llm)):
            linear, total = weight_bytes(engine.model.w)
            out = engine.generate([args.prompt or "The capital of France is"],
                                  SamplingParams(temperature=0, max_tokens=args.lesson_tokens))[0].outputs[0]
            print(f"{name:>10}: weights {total / 2**20:.0f} MiB (projections {linear / 2**20:.1f} MiB): {out.text!r}")
        floats.shutdown()
        return
    before_after("step28", "step29", llm, args)  # --requests at once (one by default), phases side by side
    linear, total = weight_bytes(llm.model.w)
    projections = method_of(llm.model.w["model.layers.0.self_attn.qkv_proj.weight"]).name  # their format
    step28 = step_module("step28", "model")
    # step28's weights as its loader builds them (the float checkpoint in this dtype, on the CPU), counted alike
    linear28, total28 = weight_bytes(step28.CausalLM.from_pretrained(llm.config.model_dir, torch.device("cpu"),
                                                                     llm.dtype).w)
    print(f"\nWeights as loaded: step29 {total / 2**20:.0f} MiB, the projections {linear / 2**20:.0f} MiB "
          f"({projections}); step28 {total28 / 2**20:.0f} MiB, the projections "
          f"{linear28 / 2**20:.0f} MiB: it holds every weight as {llm.dtype}"
          f" ({step28.__name__.split('.')[1]}: the float checkpoint).")
    if llm.device.type == "cuda":
        show_kernels(llm, args)


def decode_kernels(llm, decodes: int = 16) -> tuple[float, float]:
    """The kernels of one decode step and the GPU's busy microseconds: a profiled request of 1 + decodes tokens, less
    one of 1 token (its prefill and sampling), per decode. Busy time is the union of the kernels' intervals: a kernel
    launched as a programmatic dependent starts before the one it follows ends, so their durations overlap."""
    from torch.profiler import ProfilerActivity, profile

    prompt = list(range(100, 164))

    def run(tokens):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        return len(kernels), busy_us(kernels)
    run(2)  # warm-up
    (n1, t1), (n2, t2) = run(1), run(1 + decodes)
    return (n2 - n1) / decodes, (t2 - t1) / decodes


def show_kernels(llm, args) -> None:
    old = step_module("step27", "engine").LLM(args.model, device=args.device, dtype=args.dtype,
                                               **compared_options(args))
    rows = []
    for name, engine in (("step27", old), ("step28", llm)):
        kernels, gpu_us = decode_kernels(engine)
        rows.append([name, f"{kernels:.0f}", f"{gpu_us:.0f}"])
    print("\nOne decode step at batch 1 (the profiler's kernels on the device, and the time it was busy with them):")
    print(format_table(["step", "kernels", "GPU busy us"], rows))
    old.shutdown()


if __name__ == "__main__":
    main()
