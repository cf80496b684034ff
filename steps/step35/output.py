"""How a request ends, decided in one place for the three that decide it: Finish (why and where a request ended)
and check_stop (must it end at its newest token?).

The offline engine (engine.py's LLM) checks a request's tokens and the text its detokenizer grows; the engine core
(engine_core.py) decodes no text and checks tokens only (EOS, stop token ids, max_tokens); the front end
(async_llm.py) checks the tokens the core sends and the text it decodes itself, so that a stop string ends a request
exactly where the offline engine ends it. This module imports the standard library, `shared` and detokenizer.py
only, never torch nor the engine, so that the front end, which imports it, runs without either.
"""
from __future__ import annotations

from typing import NamedTuple

from shared import SamplingParams

from .detokenizer import IncrementalDetokenizer


class Finish(NamedTuple):
    """Why and where a request ended."""

    reason: str  # "stop" (EOS, a stop token or a stop string), "length" (max_tokens), "abort", "error"
    stop_reason: int | str | None  # the stop token id or stop string that ended it; None for EOS and length
    text: str  # the output text, cut just before a stop string ("" where no text is decoded: the core)


def check_stop(params: SamplingParams, last: int, num_outputs: int, eos_token_ids,
               detokenizer: IncrementalDetokenizer | None = None) -> Finish | None:
    """-> a Finish once the request must end at its newest token, else None. last is that token, its num_outputs-th
    output token. The checks, in order: EOS (unless ignore_eos), a stop token id, a stop string, max_tokens.

    With a detokenizer the token joins the request's text, and stop strings are looked for only where the new text
    could complete one: O(1) per token, not O(n). Without one (the core) no text is decoded: stop strings are not
    looked for, and a Finish's text is ""."""
    if last in eos_token_ids and not params.ignore_eos:
        return Finish("stop", None, _final_text(detokenizer))  # the stop token is not in the text
    if last in params.stop_token_ids:
        return Finish("stop", last, _final_text(detokenizer))
    if detokenizer is not None:
        new = detokenizer.add(last)
        if new and params.stop:
            text = detokenizer.text
            # A stop string that ends in the new text starts at most len(stop) - 1 characters before it.
            window_start = max(0, len(text) - len(new) - max(len(s) for s in params.stop) + 1)
            window = text[window_start:]
            hits = [(window.find(s), s) for s in params.stop if s in window]
            if hits:
                cut, stop = min(hits)  # the earliest stop string; the text ends just before it
                return Finish("stop", stop, text[:window_start + cut])
    if num_outputs >= params.max_tokens:
        return Finish("length", None, _final_text(detokenizer))
    return None


def _final_text(detokenizer: IncrementalDetokenizer | None) -> str:
    return detokenizer.final_text() if detokenizer is not None else ""
