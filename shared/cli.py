"""What every run.py shares: its arguments, the header, the answer to the question, errors, tables.

Every step's run.py has the same skeleton, so that the diff between two steps shows only the new lesson:

    parser = step_arg_parser(__doc__, lesson_tokens=...)   # + the lesson's own options
    with user_errors(parser):                                 # bad input: one `error:` line, exit 2
        args = parser.parse_args()
        llm = LLM(args.model, device=args.device, dtype=args.dtype, ...)
        print_header("stepNN: title", llm)
        answer_question(llm, args)                            # --prompt, --max-tokens
        show_lesson(llm, args)                                # the lesson's figure (--lesson-tokens ...)
"""
from __future__ import annotations

import argparse
import contextlib

from shared.models import DEFAULT_MODEL

DEFAULT_QUESTION = "What is the capital of France?"
ANSWER_MAX_TOKENS = 64


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, else argparse's own error (`argument --x: ...`, exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def question(text: str) -> str:
    """An argparse type: a question with something in it. The chat template would wrap an empty or blank --prompt
    into a valid prompt, and the model would answer a question nobody asked."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a question, got {text!r}")
    return text


def step_arg_parser(description: str, lesson_tokens: int, lesson_tokens_min: int = 1) -> argparse.ArgumentParser:
    """The options every step takes. --max-tokens is the answer's length; --lesson-tokens the figure's work."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"{DEFAULT_MODEL} (embedded), random:<shape> or a local folder (default: %(default)s)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--prompt", type=question, default=DEFAULT_QUESTION,
                        help="the user's question, not empty (default: %(default)r)")
    parser.add_argument("--max-tokens", type=int_at_least(1), default=ANSWER_MAX_TOKENS,
                        help="at most this many tokens in the answer to --prompt (default: %(default)s)")
    parser.add_argument("--lesson-tokens", type=int_at_least(lesson_tokens_min), default=lesson_tokens,
                        help=f"new tokens per request in the lesson's figure, at least {lesson_tokens_min} "
                             "(default: %(default)s)")
    return parser


@contextlib.contextmanager
def user_errors(parser: argparse.ArgumentParser):
    """Turn the engine's ValueErrors (unknown model, prompt too long, a bad size ...) into argparse's
    error style: the usage line, one `error:` line on stderr, exit status 2, no traceback."""
    try:
        yield
    except ValueError as e:
        parser.error(" ".join(str(e).split()))  # raises SystemExit(2)


def print_header(title: str, llm) -> None:
    dtype = str(llm.dtype).replace("torch.", "")
    print(f"== {title} ==")
    print(f"model: {llm.model_name}   device: {llm.device}   dtype: {dtype}   backend: {llm.backend}")


def answer_question(llm, args) -> None:
    """Answer --prompt as a chat (greedy, at most --max-tokens tokens) and print it."""
    from shared.params import SamplingParams

    out = llm.chat([{"role": "user", "content": args.prompt}],
                   SamplingParams(temperature=0, max_tokens=args.max_tokens))[0].outputs[0]
    print(f"\nQ: {args.prompt}\nA: {out.text.strip()}   "
          f"[{len(out.token_ids)} tokens, greedy, finish_reason={out.finish_reason}]")


def format_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    # numbers (and ratios like 1.5x) are right-aligned, words left-aligned
    numeric = [all(_is_number(row[i]) for row in cells[1:]) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def per_token_ms(token_times: list[float], arrival_time: float) -> list[float]:
    """Milliseconds spent on each generated token (the first includes the prompt's processing)."""
    times = [arrival_time] + list(token_times)
    return [(b - a) * 1000 for a, b in zip(times, times[1:])]


def runs_differ(a: list[float], b: list[float]) -> bool:
    """Whether two sets of repeated measurements differ by more than their run-to-run noise: every run of one
    side is above every run of the other (the runs do not overlap). With one run each this is always True, so
    lessons measure at least REPEATS runs before they word a conclusion."""
    return min(a) > max(b) or max(a) < min(b)


REPEATS = 3  # runs of a timed lesson figure: the median is printed, and a ratio is called clear only by runs_differ


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("x%"))
        return True
    except ValueError:
        return text in ("-", "None")
