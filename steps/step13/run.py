"""step13 demo: where an engine step's time goes, phase by phase, and a torch.profiler trace on request."""
import contextlib
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import torch

from shared import SamplingParams
from shared.cli import answer_question, format_table, int_at_least, print_header, step_arg_parser, user_errors

from .engine import LLM


QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "List three uses of a paperclip.", "Why is the sky blue?", "How do bees make honey?",
             "What is a prime number?", "Describe a cat in one sentence."]


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=32)
    parser.add_argument("--requests", type=int_at_least(1), default=8, help="requests in the measured run (default: %(default)s)")
    parser.add_argument("--profile", metavar="TRACE.json", default=None,
                        help="also write a torch.profiler Chrome trace of the measured run (open it in chrome://tracing "
                             "or https://ui.perfetto.dev); it records every op, so keep the run small")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        print_header("step13: measure", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    """Run a batch of requests with the phase timers on, and print where the time went."""
    conversations = [[{"role": "user", "content": q}] for q in (QUESTIONS * (args.requests // len(QUESTIONS) + 1))]
    params = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True)
    llm.chat(conversations[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    llm.timers.reset()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if llm.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities) if args.profile else contextlib.nullcontext()
    with profiler:
        start = time.perf_counter()
        outs = llm.chat(conversations[:args.requests], params)
        wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    timed = sum(llm.timers.seconds.values())
    print(f"\n{args.requests} requests x {args.lesson_tokens} new tokens on {llm.device}: {llm.timers.steps} engine steps, "
          f"{tokens} tokens in {wall:.2f} s ({tokens / wall:.1f} tokens/s); the phases cover {100 * timed / wall:.1f}% "
          "of the wall time:")
    print(format_table(["phase", "total ms", "ms per step", "share"], llm.timers.rows()))
    slowest = max(llm.timers.seconds, key=llm.timers.seconds.get)
    print(f"the largest phase: {slowest}. Part 5 takes the engine apart and makes each phase fast in PyTorch.")
    if args.profile:
        profiler.export_chrome_trace(args.profile)
        print(f"trace written: {args.profile} (open it in chrome://tracing or https://ui.perfetto.dev; the phases "
              "appear by name)")


if __name__ == "__main__":
    main()
