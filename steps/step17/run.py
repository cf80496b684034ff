"""step17 demo: flash decoding. A decode's context split into parts that separate programs compute at once, merged
by a log-sum-exp reduce. Which path ran is printed first. Then one long decode (batch 1) on the model's own shapes:
step16's v2 kernel against flash decoding with the split count the engine would choose, and a sweep of split counts,
in ms and GB/s against the copy bandwidth measured in the same run; the split kernels checked against v2 for
several split counts; then the engine against step16 on the same requests."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import torch

from shared.anatomy import (before_after, copy_gb_per_s, demo_options, interpreter_off_cuda, kernel_arg_parser,
                            kernel_ms, kernels_cannot_run, step_module, time_ms)
from shared.cli import answer_question, format_table, print_header, user_errors

from .engine import LLM


def main() -> None:
    parser = kernel_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        interpreter_off_cuda(args)  # before the model loads: loading it imports triton
        llm = LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                  **demo_options(args))
        print_header("step17: flash decoding", llm)
        print_attention_backend(llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    show_flash_decoding(llm)
    before_after("step16", "step17", llm, args, attention_backend=llm.model.attention_backend.name)  # the same path
    if llm.model.attention_backend.name != "triton":
        print("Both engines ran the same per-sequence loop here: what the kernels change needs a GPU (the chapter "
              "has the H200's figures).")


def print_attention_backend(llm) -> None:
    """Which attention path the engine runs: this step's kernels, or step14_7's loop (their reference math)."""
    if llm.model.attention_backend.name == "triton":
        path = ("decodes: flash decoding (kernels/decode.py: split kernel + merge kernel per layer, the split count "
                "chosen each step); prefill chunks: step15's kernel")
    else:
        path = "every sequence through step14_7's loop (the kernels' reference math); " + (
            "no CUDA device here" if llm.device.type != "cuda" else "as asked")
    print(f"attention backend: {llm.model.attention_backend.name} -> {path}")


def show_flash_decoding(llm) -> None:
    c = llm.model.config
    on_gpu = llm.device.type == "cuda"
    if kernels_cannot_run(llm):
        print(f"\nthe kernels do not run here: {kernels_cannot_run(llm)}")
        return
    try:
        from .kernels.decode import choose_num_splits, flash_decode, paged_decode_v2
    except ImportError as error:
        print(f"\nthe kernels cannot be loaded here ({error}); the engine ran the torch path")
        return
    paged_decodes = step_module("step16", "run").paged_decodes  # the same decodes as step16's demo
    scale = c.head_dim ** -0.5
    q, k, v, tables, lens = paged_decodes(llm, 2, 100)
    lens = torch.tensor([100, 33], dtype=torch.int32, device=llm.device)
    expected = paged_decode_v2(q, k, v, tables, lens, scale).float()
    diffs = {n: (flash_decode(q, k, v, tables, lens, scale, n).float() - expected).abs().max().item()
             for n in (1, 2, 3, 8, 50)}
    where = "compiled for the GPU" if on_gpu else "in Triton's interpreter (TRITON_INTERPRET=1), on the CPU"
    print(f"\nFlash decoding, {where}, against step16's v2 on 2 decodes of 100 and 33 tokens of context: max "
          f"|difference| by split count: " + ", ".join(f"{n}: {d:.1e}" for n, d in diffs.items())
          + " (50 splits: most of them get no key at all)")
    context = 32768 if on_gpu else 512
    q, k, v, tables, lens = paged_decodes(llm, 1, context)
    sms = torch.cuda.get_device_properties(llm.device).multi_processor_count if on_gpu else 132
    chosen = choose_num_splits(1, c.num_kv_heads, context, num_sms=sms)
    kv_bytes = 2 * context * c.num_kv_heads * c.head_dim * k.element_size()
    if on_gpu:
        copy = copy_gb_per_s(llm.device, 1024)
        rows = [["copy bandwidth (read + write)", "-", "-", "-", f"{copy:.0f}", "100%", ""]]
        cases = [("step16 v2: one program per KV head", c.num_kv_heads,
                  lambda: paged_decode_v2(q, k, v, tables, lens, scale))]
        for n in sorted({1, 4, 16, chosen, 64}):
            cases.append((f"flash decoding, {n} splits" + (" (chosen)" if n == chosen else ""), c.num_kv_heads * n,
                          lambda n=n: flash_decode(q, k, v, tables, lens, scale, n)))
        v2_gpu = None
        for label, programs, fn in cases:
            ms, gpu = time_ms(fn, llm.device, repeat=50), kernel_ms(fn, llm.device)
            v2_gpu = v2_gpu or gpu
            rows.append([label, programs, f"{ms:.4f}", f"{gpu:.4f}", f"{kv_bytes / gpu / 1e6:.0f}",
                         f"{100 * kv_bytes / gpu / 1e6 / copy:.0f}%", f"{v2_gpu / gpu:.2f}x"])
    gpu_name = f"{sms} SMs" if on_gpu else f"{sms} SMs (an H200's count: this machine has no GPU)"
    if on_gpu:
        print(f"\nOne decode of {context} tokens of context, one layer ({kv_bytes / 2**20:.1f} MiB of K/V; the rule "
              f"picks {chosen} splits for {gpu_name}; median of repeated calls, {llm.device}; GB/s and speed-up from "
              f"the kernels' own time):")
        print(format_table(["how", "programs", "ms per call", "kernels alone ms", "GB/s of K/V", "of copy bandwidth",
                            "vs v2"], rows))
        print("\"ms per call\" is what a caller waits, Python and launches included: at batch 1 the kernels take a few "
              "microseconds and the launches dominate it (step21's CUDA graphs remove them); \"kernels alone\" is the "
              "GPU's time in the kernels (CUDA profiler).")
    else:
        print(f"\nNot timed here: on a CPU the kernels run only in Triton's interpreter (correct, as checked above, "
              f"and far too slow to time). On a GPU this run times v2 against flash decoding with 1, 4, 16 and 64 "
              f"splits on one decode of 32768 tokens, in GB/s against the device's copy bandwidth; the chapter "
              "has the H200's table.")
    picks = [[batch, context, batch * c.num_kv_heads, choose_num_splits(batch, c.num_kv_heads, context, num_sms=sms)]
             for batch, context in ((1, 1024), (1, 32768), (4, 32768), (16, 4096), (64, 2048))]
    print(f"\nWhat choose_num_splits picks for this model ({c.num_kv_heads} KV heads) on {gpu_name}: about two "
          f"programs per SM, never a part shorter than 256 tokens:")
    print(format_table(["batch", "context", "programs without a split", "splits"], picks))


if __name__ == "__main__":
    main()
