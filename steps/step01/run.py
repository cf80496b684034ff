"""step01 demo: answer one question, then show the cost per token growing with the sequence."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "steps." + Path(__file__).parent.name

from shared import SamplingParams
from shared.cli import answer_question, format_table, per_token_ms, print_header, step_arg_parser, user_errors

from .engine import LLM


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=128, lesson_tokens_min=2)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        print_header("step01: naive generation", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    """Every token re-runs the whole sequence, so each costs more than the last."""
    conversation = [{"role": "user", "content": args.prompt}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True))[0]
    ms = per_token_ms(out.metrics.token_times, out.metrics.arrival_time)
    prompt_len = len(out.prompt_token_ids)
    marks = [n for n in (2, 8, 16, 32, 64, 128, 256, 512) if n <= len(ms)]
    rows = [[n, prompt_len + n - 1, f"{ms[n - 1]:.1f}"] for n in marks]
    print(f"\nms per token while generating {len(ms)} tokens (greedy, ignore_eos):")
    print(format_table(["token #", "sequence length", "ms/token"], rows))
    print(f"\nthe last token cost {ms[-1] / ms[1]:.1f}x the second: the work grows with the sequence (O(n^2) in total).")


if __name__ == "__main__":
    main()
