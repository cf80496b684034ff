"""step11 demo: the KV pool sized from the device's memory (GPU) or max_kv_tokens (CPU), in bytes and tokens."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import torch

from shared.cli import answer_question, format_table, print_header, step_arg_parser, user_errors

from .engine import LLM


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of the GPU's memory the engine may use, weights + activations + KV pool "
                             "(CUDA only; default: %(default)s)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization)
        print_header("step11: GPU, bf16, memory budget", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    """Where the pool's size comes from, what one token costs, and how many tokens fit at once."""
    m, c = llm.memory, llm.model.config
    element = torch.empty((), dtype=llm.dtype).element_size()
    tokens = m["num_blocks"] * m["block_size"]
    gib = 2**30
    print(f"\nKV bytes per token = 2 (K and V) x {c.num_layers} layers x {c.num_kv_heads} KV heads x {c.head_dim} "
          f"head_dim x {element} bytes ({str(llm.dtype).replace('torch.', '')}) = {m['bytes_per_token']:,} bytes")
    if "total_bytes" in m:
        print(f"device memory {m['total_bytes'] / gib:.2f} GiB x gpu_memory_utilization {m['utilization']} = "
              f"{m['total_bytes'] * m['utilization'] / gib:.2f} GiB; weights + warm-up forward peak "
              f"{m['used_bytes'] / gib:.2f} GiB; left for the KV pool "
              f"{(m['total_bytes'] * m['utilization'] - m['used_bytes']) / gib:.2f} GiB")
    else:
        print(f"on {llm.device}, max_kv_tokens sizes the pool. On CUDA, gpu_memory_utilization does: the pool gets\n"
              "what is left of that share of the device after the weights and a profiled warm-up forward.")
    rows = [["sized by", m["sized_by"]], ["blocks", f"{m['num_blocks']:,} of {m['block_size']} tokens"],
            ["pool", f"{tokens * m['bytes_per_token'] / gib:.3f} GiB"], ["tokens that fit at once", f"{tokens:,}"]]
    print(format_table(["KV pool", ""], rows))
    # What that means for requests: each holds prompt + generated tokens in the pool while it runs.
    prompt = len(llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]))
    per_request = prompt + args.lesson_tokens
    print(f"requests of {prompt} prompt + {args.lesson_tokens} generated tokens: {tokens // per_request:,} fit at once "
          f"(max_num_seqs {llm.scheduler.max_num_seqs} run at a time; the rest of the pool holds cached prefixes)")


if __name__ == "__main__":
    main()
