"""step27 demo: exact speculative decoding with n-gram drafts. The engine looks up each decoding request's last few
tokens earlier in its own prompt and output, proposes the tokens that followed as drafts, and checks them all in one
forward: the accepted ones and one token more are emitted, the KV of the rejected ones is rolled back. Greedy outputs
stay exactly those of step26.

The lesson runs --requests chat questions at once through step26 and this step (the phases side by side), then one
request at a time (where a decode leaves the device idle most): a copy-heavy request (the model is asked to rewrite a
given paragraph with its typos fixed) and a chat question, each through step26 and this step, alternated, with the outputs compared
and the drafts counted."""
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
from shared.anatomy import (FIX_THE_TYPOS, QUESTIONS, anatomy_arg_parser, before_after, compared_options, demo_options,
                            step_module)
from shared.cli import answer_question, format_table, print_header, user_errors

from .engine import LLM

SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
WORKLOADS = {"copy-heavy": FIX_THE_TYPOS, "chat": QUESTIONS[0]}
REPEATS = 3


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    parser.set_defaults(lesson_tokens=32)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(args.requests, 16),
                  speculative_config=SPECULATIVE_CONFIG, **demo_options(args))
        print_header("step27: exact speculative decoding with n-gram drafts", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def timed(llm, prompt, tokens: int) -> tuple[list[int], float]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.chat([[{"role": "user", "content": prompt}]], params)[0].outputs[0]
    return out.token_ids, time.perf_counter() - start


def show_lesson(llm, args) -> None:
    drafted = llm.stats["spec_steps"]
    before_after("step26", "step27", llm, args)  # the chat questions, --requests at once
    limit = llm.speculative.disable_by_batch_size
    if limit is not None and args.requests >= limit:
        print(f"Drafting is off from {limit} requests in the engine (disable_by_batch_size), so with {args.requests} "
              f"these are step26's steps: {llm.stats['spec_steps'] - drafted} of step27's steps drafted.")
    old = step_module("step26", "engine").LLM(args.model, device=args.device, dtype=args.dtype,
                                               **compared_options(args))
    rows, equal = [], True
    for name, prompt in WORKLOADS.items():
        for engine in (old, llm):
            timed(engine, prompt, 4)  # warm-up
        before = dict(llm.stats)
        times = {"step26": [], "step27": []}
        outputs = set()
        for _ in range(REPEATS):
            for label, engine in (("step26", old), ("step27", llm)):
                ids, seconds = timed(engine, prompt, args.lesson_tokens)
                times[label].append(seconds)
                outputs.add((label, tuple(ids)))
        equal &= len({ids for _, ids in outputs}) == 1
        s = {k: llm.stats[k] - before[k] for k in ("spec_proposed", "spec_accepted", "spec_verified", "forwards")}
        tokens = REPEATS * args.lesson_tokens
        speed = {label: args.lesson_tokens / statistics.median(t) for label, t in times.items()}
        rows.append([name, f"{speed['step26']:.1f}", f"{speed['step27']:.1f}", f"{speed['step27'] / speed['step26']:.2f}x",
                     f"{s['spec_accepted']} / {s['spec_proposed']}",
                     f"{1 + s['spec_accepted'] / max(s['spec_verified'], 1):.2f}", f"{tokens / max(s['forwards'], 1):.2f}"])
    print(f"\nOne request at a time, {args.lesson_tokens} new tokens (greedy), {REPEATS} runs each, alternated with "
          f"step26 (the median run's tokens/s), on {llm.device}:")
    print(format_table(["workload", "step26 tok/s", "step27 tok/s", "speed-up", "accepted / proposed drafts",
                        "mean accepted length", "tokens per forward"], rows))
    if not equal:
        raise SystemExit("error: step27's outputs differ from step26's on the same requests")
    print("The outputs are equal, token for token. Mean accepted length: the tokens a verify step emits for one "
          "request (its accepted drafts and the target's own token). Text that repeats itself (the paragraph to fix) is "
          "where n-grams find drafts; a chat answer finds fewer.")
    old.shutdown()


if __name__ == "__main__":
    main()
