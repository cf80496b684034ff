"""step01 demo: answer one question, then show the cost per token growing with the sequence."""
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

from shared import SamplingParams
from shared.cli import (REPEATS, answer_question, format_table, per_token_ms, print_header, runs_differ,
                        step_arg_parser, user_errors)

from .engine import LLM


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=128, lesson_tokens_min=2)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        print_header("step01: naive generation", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    """Every token re-runs the whole sequence, so each costs more than the last. The generation runs REPEATS times;
    each token's time is the median of its runs, and the growth is called clear only if the runs do not overlap."""
    conversation = [{"role": "user", "content": args.prompt}]
    params = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True)
    runs = []
    for _ in range(REPEATS):
        out = llm.chat(conversation, params)[0]
        runs.append(per_token_ms(out.metrics.token_times, out.metrics.arrival_time))
    ms = [statistics.median(times) for times in zip(*runs)]  # token n: the median of its REPEATS runs
    prompt_len = len(out.prompt_token_ids)
    marks = [n for n in (2, 8, 16, 32, 64, 128, 256, 512) if n <= len(ms)]
    rows = [[n, prompt_len + n - 1, f"{ms[n - 1]:.1f}"] for n in marks]
    print(f"\nms per token while generating {len(ms)} tokens (greedy, ignore_eos; median of {REPEATS} runs):")
    print(format_table(["token #", "sequence length", "ms/token"], rows))
    # The first and the last few tokens (token 1 is left out: it includes the prompt's own pass), per run.
    k = max(1, min(8, (len(ms) - 1) // 2))
    first = [statistics.median(run[1:1 + k]) for run in runs]
    last = [statistics.median(run[-k:]) for run in runs]
    ratio = statistics.median(last) / statistics.median(first)
    what = f"the last {k} tokens cost {ratio:.1f}x the first {k} after the prompt (medians of {REPEATS} runs)"
    if runs_differ(last, first) and ratio > 1:
        print(f"\n{what}: the work grows with the sequence (O(n^2) in total).")
    else:
        print(f"\n{what}, within the run-to-run spread: over {len(ms)} tokens the growth does not show above this "
              "machine's noise; a larger --lesson-tokens makes the sequence, and the cost, grow further.")


if __name__ == "__main__":
    main()
