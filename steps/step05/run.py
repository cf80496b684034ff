"""step05 demo: continuous batching vs static groups on a mix of short and long requests."""
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
from shared.cli import (REPEATS, answer_question, format_table, int_at_least, print_header, runs_differ,
                        step_arg_parser, user_errors)
from shared.prompts import QUESTIONS

from .engine import LLM


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=96)
    parser.add_argument("--max-num-seqs", type=int_at_least(1), default=4,
                        help="running requests at most (default: %(default)s)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
        print_header("step05: continuous batching", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    """16 requests: every 4th is long (--lesson-tokens tokens), the rest short (12 tokens)."""
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[:16]]
    params = [SamplingParams(temperature=0, max_tokens=args.lesson_tokens if i % 4 == 0 else 12, ignore_eos=True)
              for i in range(16)]
    n = args.max_num_seqs
    rows, speeds = [], {}
    for policy in ("static groups", "continuous"):
        speeds[policy], runs = [], []
        for _ in range(REPEATS):
            llm.stats = {"prefill_steps": 0, "decode_steps": 0, "decode_rows": 0}
            start = time.perf_counter()
            if policy == "static groups":  # step04's policy: a group of n starts only when the previous one has ended
                outs = [o for g in range(0, 16, n) for o in llm.chat(conversations[g:g + n], params[g:g + n])]
            else:  # all 16 at once: a finished request's seat is taken by the next one at the following step
                outs = llm.chat(conversations, params)
            runs.append(time.perf_counter() - start)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            speeds[policy].append(tokens / runs[-1])
        s = llm.stats  # greedy: every run takes the same steps
        rows.append([policy, tokens, s["decode_steps"], f"{100 * s['decode_rows'] / (s['decode_steps'] * n):.0f}%",
                     f"{statistics.median(runs):.2f}", f"{statistics.median(speeds[policy]):.1f}"])
    print(f"\n16 requests (4 of {args.lesson_tokens} tokens, 12 of 12 tokens), at most {n} running at once "
          f"(median of {REPEATS} runs):")
    print(format_table(["policy", "tokens", "decode steps", "seats used", "seconds", "tokens/s"], rows))
    gain = statistics.median(speeds["continuous"]) / statistics.median(speeds["static groups"])
    if runs_differ(speeds["continuous"], speeds["static groups"]) and gain > 1:
        print(f"continuous batching: {gain:.2f}x the tokens/s of static groups, because a finished request's seat is "
              "refilled at once.")
    else:
        print(f"continuous batching: {gain:.2f}x the tokens/s of static groups, within the run-to-run spread here; "
              f"the seats it keeps busy are in the table ({rows[1][3]} against {rows[0][3]}).")

if __name__ == "__main__":
    main()
