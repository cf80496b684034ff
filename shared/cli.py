"""Small helpers for the run.py scripts: common arguments, a header, tables."""
from __future__ import annotations

import argparse

DEFAULT_QUESTION = "What is the capital of France?"


def step_arg_parser(description: str, max_tokens: int = 64) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="smollm2-135m",
                        help="smollm2-135m (embedded), random:<shape> or a local folder (default: %(default)s)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--prompt", default=DEFAULT_QUESTION, help="the user's question (default: %(default)r)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate (default: %(default)s)")
    return parser


def print_header(title: str, llm) -> None:
    dtype = str(llm.dtype).replace("torch.", "")
    print(f"== {title} ==")
    print(f"model: {llm.model_name}   device: {llm.device}   dtype: {dtype}   backend: {llm.backend}")


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


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("x%"))
        return True
    except ValueError:
        return text in ("-", "None")
