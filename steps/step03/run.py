"""step03 demo: answer one question, then show that a KV cache keeps the cost per token flat."""
import statistics
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
from shared.cli import (REPEATS, answer_question, format_table, per_token_ms, print_header, runs_differ,
                        step_arg_parser, user_errors)

from .engine import LLM
from .model import KVCache


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=256, lesson_tokens_min=9)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        print_header("step03: KV cache", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    """With the cache, each token costs about the same however long the sequence is."""
    conversation = [{"role": "user", "content": args.prompt}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True))[0]
    ms = per_token_ms(out.metrics.token_times, out.metrics.arrival_time)
    prompt_len = len(out.prompt_token_ids)
    marks = [n for n in (2, 8, 16, 32, 64, 128, 256, 512) if n <= len(ms)]
    rows = [[n, prompt_len + n - 1, f"{ms[n - 1]:.1f}"] for n in marks]
    print(f"\nms per token while generating {len(ms)} tokens (greedy, ignore_eos; token 1 includes the prefill):")
    print(format_table(["token #", "sequence length", "ms/token"], rows))

    # step02 pays, for token n, one forward over the whole sequence. Measure that cost with this same model
    # by running the full sequence through an empty cache (exactly step02's work for that token).
    full = torch.tensor(out.prompt_token_ids + out.outputs[0].token_ids[:-1], device=llm.device)
    timings = []
    for _ in range(REPEATS):
        cache = KVCache(llm.model.config, len(full), llm.device, llm.dtype)
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.model.forward(full, 0, cache)
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        timings.append((time.perf_counter() - start) * 1000)
    no_cache_ms = statistics.median(timings)
    cached_ms = statistics.median(ms[-8:])  # the last 8 decode steps
    print(f"\nat token {len(ms)} (sequence {len(full)}): {cached_ms:.1f} ms with the cache (median of the last 8 "
          f"tokens), {no_cache_ms:.1f} ms re-running the whole sequence (step02's way, median of {REPEATS} runs)",
          end="")
    if runs_differ(timings, ms[-8:]) and no_cache_ms > cached_ms:
        print(f": {no_cache_ms / cached_ms:.1f}x speed-up.")
    else:
        print(f": {no_cache_ms / cached_ms:.1f}x, within the spread of the runs; at {len(full)} tokens the re-run is "
              "still too short to cost clearly more here (a larger --lesson-tokens makes it longer).")


if __name__ == "__main__":
    main()
