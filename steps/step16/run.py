"""step16 demo: decode attention as one Triton kernel (paged attention) instead of a loop over sequences. Which path
ran is printed first. Then a batch of decodes on the model's own shapes three ways: step15's loop, the v1 kernel
(whole context per program, exact softmax over stored scores) and the v2 kernel (online softmax, one pass), in
ms and GB/s against the copy bandwidth measured in the same run; the kernels checked against their torch
reference; then the engine against step15 on the same requests."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import torch

from shared.anatomy import (before_after, copy_gb_per_s, demo_options, interpreter_off_cuda, kernel_arg_parser,
                            kernel_ms, kernels_cannot_run, time_ms)
from shared.cli import answer_question, format_table, print_header, user_errors

from .engine import LLM
from .model import grouped_attention


def main() -> None:
    parser = kernel_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        interpreter_off_cuda(args)  # before the model loads: loading it imports triton
        llm = LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                  **demo_options(args))
        print_header("step16: paged attention", llm)
        print_attention_backend(llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    show_decode_kernels(llm)
    before_after("step15", "step16", llm, args, attention_backend=llm.model.attention_backend.name)  # the same path
    if llm.model.attention_backend.name != "triton":
        print("Both engines ran the same per-sequence loop here: what the kernels change needs a GPU (the chapter "
              "has the H200's figures).")


def print_attention_backend(llm) -> None:
    """Which attention path the engine runs: this step's kernels, or step14_7's loop (their reference math)."""
    if llm.model.attention_backend.name == "triton":
        path = "decodes: one Triton kernel launch per layer (kernels/decode.py, v2); prefill chunks: step15's kernel"
    else:
        path = "every sequence through step14_7's loop (the kernels' reference math); " + (
            "no CUDA device here" if llm.device.type != "cuda" else "as asked")
    print(f"attention backend: {llm.model.attention_backend.name} -> {path}")


def paged_decodes(llm, batch: int, context: int, block_size: int = 16, seed: int = 0):
    """`batch` decodes of `context` tokens each on the model's shapes: q [batch, heads, D], a paged cache with the
    blocks of all sequences in shuffled order, block tables, lengths."""
    c = llm.model.config
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    shape = (batch * per_seq, block_size, c.num_kv_heads, c.head_dim)
    k = torch.randn(shape, generator=gen).to(llm.device, llm.dtype)
    v = torch.randn(shape, generator=gen).to(llm.device, llm.dtype)
    q = torch.randn(batch, c.num_heads, c.head_dim, generator=gen).to(llm.device, llm.dtype)
    tables = torch.randperm(batch * per_seq, generator=gen).to(torch.int32).view(batch, per_seq).to(llm.device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=llm.device)
    return q, k, v, tables, lens


def show_decode_kernels(llm) -> None:
    c = llm.model.config
    on_gpu = llm.device.type == "cuda"
    if kernels_cannot_run(llm):
        print(f"\nthe kernels do not run here: {kernels_cannot_run(llm)}")
        return
    try:
        from .kernels.decode import decode_reference, paged_decode_v1, paged_decode_v2
    except ImportError as error:
        print(f"\nthe kernels cannot be loaded here ({error}); the engine ran the torch path")
        return
    scale = c.head_dim ** -0.5
    q, k, v, tables, lens = paged_decodes(llm, 3, 40)
    lens = torch.tensor([40, 17, 1], dtype=torch.int32, device=llm.device)  # ragged: one block, two and a half
    expected = decode_reference(q, k, v, tables, lens, scale).float()
    diffs = [(paged_decode_v1(q, k, v, tables, lens, scale).float() - expected).abs().max().item(),
             (paged_decode_v2(q, k, v, tables, lens, scale).float() - expected).abs().max().item()]
    where = "compiled for the GPU" if on_gpu else "in Triton's interpreter (TRITON_INTERPRET=1), on the CPU"
    print(f"\nThe decode kernels, {where}, against their torch reference on 3 decodes of 40, 17 and 1 tokens of "
          f"context ({c.num_heads} query heads, {c.num_kv_heads} KV heads, head_dim {c.head_dim}): max |difference| "
          f"v1 {diffs[0]:.2e}, v2 {diffs[1]:.2e}")
    batch, context = (64, 2048) if on_gpu else (8, 256)
    q, k, v, tables, lens = paged_decodes(llm, batch, context)
    flat_k, flat_v = k.view(-1, c.num_kv_heads, c.head_dim), v.view(-1, c.num_kv_heads, c.head_dim)
    slots = [(tables[i].long()[:, None] * 16 + torch.arange(16, device=llm.device)).flatten()[:context]
             for i in range(batch)]  # each sequence's flat slots, as step14_2 computes them

    def loop():  # step15's decode path: one sequence at a time
        for i in range(batch):
            grouped_attention(q[i:i + 1], flat_k.index_select(0, slots[i]), flat_v.index_select(0, slots[i]), None)

    kv_bytes = 2 * batch * context * c.num_kv_heads * c.head_dim * k.element_size()  # K and V, read once
    copy = copy_gb_per_s(llm.device, 1024 if on_gpu else 64)
    rows = [["copy bandwidth (a 1 GiB copy, read + write)" if on_gpu else "copy bandwidth (a 64 MiB copy)",
             "-", "-", f"{copy:.0f}", "100%"]]
    timed = [("step15's loop (gather + attention per sequence)", loop)]
    if on_gpu:
        timed += [("v1 kernel: whole context per (sequence, head), stored scores",
                   lambda: paged_decode_v1(q, k, v, tables, lens, scale)),
                  ("v2 kernel: online softmax per (sequence, KV head)",
                   lambda: paged_decode_v2(q, k, v, tables, lens, scale))]
    for name, fn in timed:
        ms = time_ms(fn, llm.device, repeat=10)
        gpu = kernel_ms(fn, llm.device)  # the kernels alone (None on a CPU)
        gbs = kv_bytes / ((gpu or ms) / 1000) / 1e9
        rows.append([name, f"{ms:.3f}", f"{gpu:.3f}" if gpu else "-", f"{gbs:.0f}", f"{100 * gbs / copy:.0f}%"])
    print(f"\n{batch} decodes of {context} tokens of context each, one layer ({kv_bytes / 2**20:.0f} MiB of K/V to "
          f"read; median of repeated calls, {llm.device}; GB/s from the kernels' own time where there is one):")
    print(format_table(["how", "ms per call", "kernels alone ms", "GB/s of K/V", "of copy bandwidth"], rows))
    if on_gpu:
        print("\"ms per call\" is what a caller waits, Python and launches included; \"kernels alone\" is the GPU's "
              "time in the kernels (CUDA profiler). When the first is much larger, the CPU cannot launch fast enough to "
              "keep the GPU busy: step21's CUDA graphs remove that cost.")
    if not on_gpu:
        print("On a CPU the kernels run only in Triton's interpreter (correct, and far too slow to time), so only "
              "the loop is timed here.")


if __name__ == "__main__":
    main()
