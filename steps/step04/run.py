"""step04 demo: one batch of prompts at once; tokens/s grows with the batch, and so does the waste."""
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

from shared import SamplingParams
from shared.cli import (REPEATS, answer_question, format_table, print_header, runs_differ, step_arg_parser,
                        user_errors)
from shared.prompts import QUESTIONS

from .engine import LLM


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=48)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        print_header("step04: static batching", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    """Throughput at batch sizes 1, 4, 16 (median of REPEATS runs each), and the token slots the batch wasted (left
    padding of short prompts, and rows that finished early but ride along until the longest ends)."""
    rows, speeds = [], {}
    for batch_size in (1, 4, 16):
        conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[:batch_size]]
        speeds[batch_size], runs = [], []
        for _ in range(REPEATS):
            llm.stats = {"slots": 0, "padding": 0, "finished": 0}
            start = time.perf_counter()
            outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=args.lesson_tokens))
            seconds = time.perf_counter() - start
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            speeds[batch_size].append(generated / seconds)
            runs.append(seconds)
        s = llm.stats  # greedy: every run computes the same tokens, so the slots are the same too
        rows.append([batch_size, generated, f"{statistics.median(runs):.2f}",
                     f"{statistics.median(speeds[batch_size]):.1f}", f"{100 * s['padding'] / s['slots']:.0f}%",
                     f"{100 * s['finished'] / s['slots']:.0f}%"])
    print(f"\n{args.lesson_tokens} tokens at most per request, greedy, stopping at EOS (median of {REPEATS} runs):")
    print(format_table(["batch", "tokens", "seconds", "tokens/s", "padding slots", "finished-row slots"], rows))
    gain = statistics.median(speeds[16]) / statistics.median(speeds[1])
    if runs_differ(speeds[16], speeds[1]) and gain > 1:
        print(f"A bigger batch reads the weights once for many rows: batch 16 made {gain:.1f}x the tokens/s of "
              "batch 1.")
    else:
        print(f"Batch 16 made {gain:.2f}x the tokens/s of batch 1 here, not clearly more than the run-to-run spread.")
    print("Every row pays for the longest prompt (padding) and waits for the longest answer (finished rows keep\n"
          "computing).")


if __name__ == "__main__":
    main()
