"""step12 demo: the CPU time per step spent sampling and detokenizing, one call per request vs batched."""
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
from shared.cli import (REPEATS, answer_question, format_table, int_at_least, print_header, step_arg_parser,
                        user_errors)

from .detokenizer import IncrementalDetokenizer
from .engine import LLM
from .sampler import request_seed, sample_batch


TEXT = ("Paged attention splits the KV cache into blocks. 分页注意力把缓存切成块。 It packs memory tightly 🧠📦, "
        "so more requests fit at once — déjà vu for anyone who knows virtual memory. ")


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=1000)
    parser.add_argument("--batch", type=int_at_least(1), default=16, help="requests sampled per step (default: %(default)s)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        print_header("step12: batched sampler, incremental detokenizer", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def median_ms(fn, repeat: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def show_lesson(llm, args) -> None:
    """Sampling a step's batch, then detokenizing one request's --lesson-tokens output, before and after."""
    vocab, b = llm.model.config.vocab_size, args.batch
    logits = torch.randn(b, vocab, generator=torch.Generator().manual_seed(0), device="cpu").to(llm.device) * 3
    params = [SamplingParams(temperature=0) if i % 4 == 0 else
              SamplingParams(temperature=0.7 + 0.1 * (i % 3), top_k=50 * (i % 2), top_p=0.9, min_p=0.05 * (i % 2), seed=i)
              for i in range(b)]
    seeds, positions = [request_seed(sp) for sp in params], [0] * b
    per_request = median_ms(lambda: [sample_batch(logits[i:i + 1], [sp], [seeds[i]], [0]) for i, sp in
                                     enumerate(params)])  # one sampler call per request
    batched = median_ms(lambda: sample_batch(logits, params, seeds, positions))
    # Detokenizing: step11 decoded all output ids after every token; here each token decodes a short window.
    tok = llm.tokenizer
    ids = (tok.encode(TEXT) * (args.lesson_tokens // 40 + 1))[:args.lesson_tokens]
    while tok.decode(ids).endswith("\ufffd"):  # do not end inside a character split over several tokens
        ids = ids[:-1]

    def decode_all():  # the whole output decoded again after every token
        for n in range(1, len(ids) + 1):
            text = tok.decode(ids[:n])
        return text

    def incremental():
        detok = IncrementalDetokenizer(tok)
        for t in ids:
            detok.add(t)
        return detok

    full_ms, incremental_ms = median_ms(decode_all, REPEATS), median_ms(incremental, REPEATS)
    full, detok = decode_all(), incremental()
    assert detok.text == full, "the incremental text must equal the full decode"
    rows = [[f"sample {b} requests (per step)", f"{per_request:.2f}", f"{batched:.2f}", f"{per_request / batched:.1f}x"],
            [f"detokenize {len(ids)} tokens (whole request)", f"{full_ms:.0f}", f"{incremental_ms:.0f}",
             f"{full_ms / incremental_ms:.1f}x"],
            ["detokenize, per token (mean)", f"{full_ms / len(ids):.3f}", f"{incremental_ms / len(ids):.3f}",
             f"{full_ms / incremental_ms:.1f}x"]]
    print(f"\nCPU time on {llm.device}, ms (sampling: median of 20 steps, {b} requests, 1 in 4 greedy; "
          f"text: English, Chinese, emoji, median of {REPEATS} runs):")
    print(format_table(["work", "before (step11)", "after (step12)", "speed-up"], rows))
    print(f"The incremental text equals the full decode ({len(detok.text)} characters). Full decoding costs O(n) "
          "per token, so O(n^2) per request; the window costs O(1) per token.")


if __name__ == "__main__":
    main()
