"""step06 demo: a short request queued behind a long prompt gets its first token early with chunked prefill."""
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

from shared import SamplingParams
from shared.cli import (REPEATS, answer_question, format_table, int_at_least, print_header, runs_differ,
                        step_arg_parser, user_errors)

from .engine import LLM

LONG_TEXT = ("The history of the printing press begins with movable type, which allowed pages to be composed "
             "from reusable letters instead of carved as whole blocks. ") * 40


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=16)
    parser.add_argument("--budget", type=int_at_least(1), default=128,
                        help="max_num_batched_tokens with chunking (default: %(default)s)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_batched_tokens=args.budget)
        print_header("step06: chunked prefill", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    """A long prompt arrives, then a short question right behind it: how long does the short one wait?"""
    long_ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": LONG_TEXT + "\nSummarise this."}])
    short_ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    params = SamplingParams(temperature=0, max_tokens=args.lesson_tokens)
    rows, short_ttft = [], []
    for label, budget in (("off (whole prompt at once)", len(long_ids) + len(short_ids)), ("on", args.budget)):
        llm.scheduler.max_num_batched_tokens = budget
        ttfts = []
        for _ in range(REPEATS):
            long_id, short_id = llm.add_request(long_ids, params), llm.add_request(short_ids, params)
            done, steps = {}, 0
            while llm.has_unfinished_requests():
                steps += 1
                done.update({o.request_id: o for o in llm.step()})
            ttfts.append([done[k].metrics.time_to_first_token * 1000 for k in (short_id, long_id)])
        short_ttft.append([short for short, _ in ttfts])
        rows.append([label, budget, steps, f"{statistics.median(short_ttft[-1]):.0f}",
                     f"{statistics.median(long for _, long in ttfts):.0f}"])
    print(f"\na {len(long_ids)}-token prompt, then a {len(short_ids)}-token question queued behind it "
          f"(median of {REPEATS} runs):")
    print(format_table(["chunked prefill", "token budget", "iterations", "short TTFT ms", "long TTFT ms"], rows))
    sooner = statistics.median(short_ttft[0]) / statistics.median(short_ttft[1])
    if runs_differ(*short_ttft) and sooner > 1:
        print(f"with chunks of at most {args.budget} tokens the short request no longer waits for the whole long "
              f"prefill: its first token comes {sooner:.1f}x sooner.")
    else:
        print(f"with chunks of at most {args.budget} tokens the short request's first token came {sooner:.2f}x sooner, "
              "within the run-to-run spread here: this long prompt is too short to keep it waiting measurably.")


if __name__ == "__main__":
    main()
