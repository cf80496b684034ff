"""step09 demo: requests that share a long system prompt reuse its KV blocks instead of prefilling it again."""
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

SYSTEM_PROMPT = ("You are the assistant of a small public library. The library opens at nine and closes at six, "
                 "except on Sundays, when it is closed. Members may borrow up to five books for three weeks and "
                 "renew them twice online. Late returns cost ten cents a day. The reading room is quiet; phone "
                 "calls are taken outside. Children under twelve need a parent to sign up. The library also lends "
                 "board games, museum passes and laptops, and runs a book club on the first Monday of each month. "
                 "Answer briefly and politely, and when you do not know, say so. ") * 2


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=16)
    parser.add_argument("--requests", type=int_at_least(1), default=16,
                        help="requests sharing the system prompt (default: %(default)s)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        print_header("step09: prefix caching", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    """One request computes the system prompt, then many others arrive that share it."""
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
                     for q in (QUESTIONS * 4)[:args.requests + 1]]
    params = SamplingParams(temperature=0, max_tokens=args.lesson_tokens)
    rows, texts, seconds = [], {}, {}
    for enabled in (False, True):
        bm = llm.block_manager
        bm.enable_prefix_caching = enabled
        seconds[enabled] = []
        for _ in range(REPEATS):  # each run from the same start: an empty cache, then the first user
            bm.reset_prefix_cache()
            llm.chat(conversations[0], params)  # the first user: its blocks enter the prefix cache
            start = time.perf_counter()
            outs = llm.chat(conversations[1:], params)
            seconds[enabled].append(time.perf_counter() - start)
        texts[enabled] = [o.outputs[0].text for o in outs]
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        hit_rate = f"{100 * bm.stats['hits'] / bm.stats['lookups']:.0f}%" if bm.stats["lookups"] else "-"
        rows.append(["on" if enabled else "off", prompt_tokens, hit_rate, bm.stats["tokens_saved"],
                     f"{statistics.median(seconds[enabled]):.2f}"])
    system_len = len(llm.tokenizer.apply_chat_template(conversations[0][:1] + [{"role": "user", "content": ""}]))
    print(f"\n{args.requests} requests sharing a system prompt of about {system_len} tokens "
          f"(blocks of {llm.block_manager.block_size}), {args.lesson_tokens} new tokens each:")
    print(format_table(["prefix caching", "prompt tokens", "block hit rate", "prefill tokens saved", "seconds"], rows))
    same = sum(a == b for a, b in zip(texts[False], texts[True]))
    speedup = statistics.median(seconds[False]) / statistics.median(seconds[True])
    if runs_differ(seconds[False], seconds[True]) and speedup > 1:
        print(f"{speedup:.2f}x faster with the cache (median of {REPEATS} runs); {same} of {args.requests} answers "
              "identical.")
    else:
        print(f"{speedup:.2f}x with the cache, within the run-to-run spread of {REPEATS} runs; {same} of "
              f"{args.requests} answers identical.")


if __name__ == "__main__":
    main()
