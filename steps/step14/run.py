"""step14 demo: the engine re-cut into sequence / scheduler / block manager / model runner; the per-phase
profile that steps 14_1 .. 14_7 will move, beside step13's on the same requests."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

from shared.anatomy import anatomy_arg_parser, before_after, demo_options
from shared.cli import answer_question, print_header, user_errors

from .engine import LLM


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))  # GPU: room for 2 engines
        print_header("step14: engine anatomy", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    cache = llm.kv_cache.data
    print(f"\nThe KV cache: one tensor {tuple(cache.shape)} (K/V, layers, blocks, block size, kv heads, head dim), "
          f"{cache.numel() * cache.element_size() / 2**20:.0f} MiB; the model reads it through an AttentionMetadata.")
    _, after = before_after("step13", "step14", llm, args)
    slowest = max(after["ms_per_step"], key=after["ms_per_step"].get)
    print(f"Same engine, re-cut: the profiles match. The largest phase is {slowest}; inside it, steps 14_1 .. 14_7 "
          "remove the per-token KV write, the per-block gather, the GQA copies, the per-row masks and the one "
          f"forward per prefill chunk ({after['forwards_per_step']:.2f} forwards per step here).")


if __name__ == "__main__":
    main()
