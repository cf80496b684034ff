"""step07 demo: a KV budget too small for every request at once; preemption keeps the outputs unchanged."""
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
    parser = step_arg_parser(__doc__, lesson_tokens=48)
    parser.add_argument("--kv-budget", type=int_at_least(1), default=400,
                        help="max_kv_tokens for the tight run (default: %(default)s)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=8)
        print_header("step07: preemption", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    """8 requests that together need more KV memory than the budget allows."""
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[:8]]
    params = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True)
    rows, texts, seconds = [], {}, {}
    for label, budget in (("ample", 32768), ("tight", args.kv_budget)):
        llm.scheduler.max_kv_tokens = budget
        seconds[label] = []
        for _ in range(REPEATS):
            llm.scheduler.num_preemptions = 0
            start = time.perf_counter()
            outs = llm.chat(conversations, params)
            seconds[label].append(time.perf_counter() - start)
        texts[label] = [o.outputs[0].text for o in outs]
        need = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
        rows.append([label, budget, need, llm.scheduler.num_preemptions,
                     sum(o.finished for o in outs), f"{statistics.median(seconds[label]):.2f}"])
    same = sum(a == b for a, b in zip(texts["ample"], texts["tight"]))
    print(f"\n8 requests x {args.lesson_tokens} tokens, at most 8 running (seconds: median of {REPEATS} runs):")
    print(format_table(["KV budget", "max_kv_tokens", "tokens in all", "preemptions", "finished", "seconds"], rows))
    if not rows[1][3]:
        print(f"{same} of 8 texts identical to the ample run; the tight budget preempted nothing here (a larger "
              "--lesson-tokens or a smaller --kv-budget makes the requests outgrow it).")
    else:
        print(f"{same} of 8 texts identical to the ample run" + (": preempted requests were recomputed, not lost or "
                                                                 "cut." if same == 8 else "."))
    cost = statistics.median(seconds["tight"]) / statistics.median(seconds["ample"])
    if rows[1][3] and runs_differ(seconds["tight"], seconds["ample"]) and cost > 1:
        print(f"The tight run pays for the recomputation: {cost:.2f}x the seconds of the ample one.")
    elif rows[1][3]:
        print(f"The tight run took {cost:.2f}x the seconds of the ample one, within the run-to-run spread: the "
              "recomputation costs too little to show here.")


if __name__ == "__main__":
    main()
