"""step15 demo: prefill attention as one Triton kernel (flash attention over the paged KV cache) instead of a
loop over sequences. Which path ran is printed first. Then one prompt's attention three ways on the model's own
shapes: step14_7's loop, the kernel and torch SDPA (time, TFLOP/s and the memory of the score matrix), the kernel
checked against its torch reference; then the engine against step14_7 on the same requests."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import torch

from shared.anatomy import (before_after, demo_options, interpreter_off_cuda, kernel_arg_parser, kernel_ms,
                            kernels_cannot_run, time_ms)
from shared.cli import answer_question, format_table, print_header, user_errors

from .engine import LLM
from .model import causal_mask, grouped_attention


def main() -> None:
    parser = kernel_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        interpreter_off_cuda(args)  # before the model loads: loading it imports triton
        llm = LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                  **demo_options(args))
        print_header("step15: flash attention", llm)
        print_attention_backend(llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    show_kernel(llm)
    before_after("step14_7", "step15", llm, args)
    if llm.model.attention_backend.name != "triton":
        print("Both engines ran the same per-sequence loop here: what the kernels change needs a GPU (the chapter "
              "has the H200's figures).")


def print_attention_backend(llm) -> None:
    """Which attention path the engine runs: this step's kernels, or step14_7's loop (their reference math)."""
    if llm.model.attention_backend.name == "triton":
        path = "prefill chunks: one Triton kernel launch per layer (kernels/attention.py); decodes: the loop"
    else:
        path = "every sequence through step14_7's loop (the kernels' reference math); " + (
            "no CUDA device here" if llm.device.type != "cuda" else "as asked")
    print(f"attention backend: {llm.model.attention_backend.name} -> {path}")


def paged_prompt(llm, T: int, seed: int = 0):
    """One T-token prompt's q, and its K/V in a paged cache of the model's shapes with blocks in shuffled order."""
    c, block_size = llm.model.config, 16
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-T // block_size)
    shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
    k = torch.randn(shape, generator=gen).to(llm.device, llm.dtype)
    v = torch.randn(shape, generator=gen).to(llm.device, llm.dtype)
    q = torch.randn(T, c.num_heads, c.head_dim, generator=gen).to(llm.device, llm.dtype)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None].to(llm.device)  # [1, num_blocks]
    as_int = lambda x: torch.tensor(x, dtype=torch.int32, device=llm.device)  # noqa: E731
    return q, k, v, table, as_int([0, T]), as_int([T])


def show_kernel(llm) -> None:
    """One prompt's attention (one layer, the model's heads) through step14_7's loop, the kernel and SDPA."""
    c = llm.model.config
    on_gpu = llm.device.type == "cuda"
    if kernels_cannot_run(llm):
        print(f"\nthe kernels do not run here: {kernels_cannot_run(llm)}")
        return
    try:
        from .kernels.attention import attention_reference, paged_attention
    except ImportError as error:
        print(f"\nthe kernel cannot be loaded here ({error}); the engine ran the torch path")
        return
    scale = c.head_dim ** -0.5
    # The kernel against its torch reference (compiled on a GPU, in Triton's interpreter on a CPU).
    q, k, v, table, cu, lens = paged_prompt(llm, 40)
    diff = (paged_attention(q, k, v, table, cu, lens, scale, 40).float()
            - attention_reference(q, k, v, table, cu, lens, scale).float()).abs().max().item()
    where = "compiled for the GPU" if on_gpu else "in Triton's interpreter (TRITON_INTERPRET=1), on the CPU"
    print(f"\nThe kernel, {where}, against its torch reference on a 40-token prompt ({c.num_heads} query heads, "
          f"{c.num_kv_heads} KV heads, head_dim {c.head_dim}, blocks of 16 in shuffled order): max |difference| "
          f"{diff:.2e}")
    unit, per = ("TFLOP/s", 1e9) if on_gpu else ("GFLOP/s", 1e6)  # flops / ms / per
    rows = []
    for T in ((512, 2048, 8192) if on_gpu else (128, 512)):
        q, k, v, table, cu, lens = paged_prompt(llm, T)
        keys, values = k.reshape(-1, c.num_kv_heads, c.head_dim)[:T], v.reshape(-1, c.num_kv_heads, c.head_dim)[:T]
        mask = causal_mask(0, T, llm.device)
        flops = 4 * T * T * c.head_dim * c.num_heads / 2  # two matmuls, half of the square (causal)
        loop_ms = time_ms(lambda: grouped_attention(q, keys, values, mask), llm.device, repeat=5)
        scores_mib = c.num_heads * T * T * 4 / 2**20  # the fp32 softmax of [heads, T, T] that the loop stores
        rows.append([T, "step14_7 loop (gather + bmm + mask + softmax + bmm)", f"{loop_ms:.3f}",
                     f"{flops / loop_ms / per:.1f}", f"{scores_mib:.1f}"])
        if on_gpu:
            kernel = kernel_ms(lambda: paged_attention(q, k, v, table, cu, lens, scale, T), llm.device)
            qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, keys, values))  # [1, heads, T, D]
            if c.num_heads != c.num_kv_heads:
                ks = ks.repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)
                vs = vs.repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            sdpa_ms = kernel_ms(lambda: sdpa(qs, ks, vs, is_causal=True), llm.device)
            rows.append([T, "step15 kernel (paged, online softmax)", f"{kernel:.3f}",
                         f"{flops / kernel / per:.1f}", "0 (tiles in registers)"])
            rows.append([T, "torch SDPA (contiguous K/V, no paging)", f"{sdpa_ms:.3f}",
                         f"{flops / sdpa_ms / per:.1f}", "0"])
    print(f"\nOne prompt's attention in one layer, {c.num_heads} heads ({llm.device}; the loop: median ms per call as the "
          f"CPU sees it; the kernel and SDPA: their kernels' GPU time, CUDA profiler):")
    print(format_table(["prompt tokens", "how", "ms", unit, "score matrix MiB"], rows))
    if not on_gpu:
        print("On a CPU the kernel runs only in Triton's interpreter (correct, and far too slow to time), so only "
              "the loop is timed; its score matrix grows as T squared, the kernel's stays a tile.")


if __name__ == "__main__":
    main()
