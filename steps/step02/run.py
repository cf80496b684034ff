"""step02 demo: sample one question at several temperatures; a seed makes a sample repeatable."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import torch

from shared import SamplingParams
from shared.cli import answer_question, format_table, print_header, step_arg_parser, user_errors

from .engine import LLM
from .sampler import apply_min_p, apply_top_k, apply_top_p


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=24)
    parser.add_argument("--prompt-story", default="Write one sentence about a cat.",
                        help="the prompt sampled in the lesson's figure (default: %(default)r)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        print_header("step02: sampling and stopping", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    """Samples at several temperatures and seeds, and how many candidate tokens each filter leaves."""
    story = [{"role": "user", "content": args.prompt_story}]
    print(f"\nSamples of {args.prompt_story!r} (max_tokens={args.lesson_tokens}, stop at '.'):")
    rows = []
    for temperature, seed in [(0.0, None), (0.7, 1), (0.7, 2), (1.0, 1), (1.5, 1), (1.5, 1)]:
        sp = SamplingParams(temperature=temperature, top_p=0.95, seed=seed, max_tokens=args.lesson_tokens, stop=["."])
        o = llm.chat(story, sp)[0].outputs[0]
        rows.append([temperature, seed, o.finish_reason, repr(o.text.strip())[:70]])
    print(format_table(["temperature", "seed", "finish", "text"], rows))
    if rows[-1] == rows[-2]:
        print("(the two rows with temperature 1.5 and seed 1 are the same: a seed makes a sample repeatable)")
    else:
        print("(the two rows with temperature 1.5 and seed 1 differ: the seeded sample did not repeat here)")

    # How many candidate tokens each filter leaves for the first token of the answer.
    prompt_ids = llm.tokenizer.apply_chat_template(story)
    logits = llm.model.forward(torch.tensor(prompt_ids, device=llm.device))[-1] / 0.7
    kept = lambda x: int(torch.isfinite(x).sum())  # noqa: E731
    print(f"\ncandidates for the first token (of {logits.shape[0]}) at temperature 0.7: "
          f"top_k=50 -> {kept(apply_top_k(logits, 50))}, top_p=0.9 -> {kept(apply_top_p(logits, 0.9))}, "
          f"min_p=0.05 -> {kept(apply_min_p(logits, 0.05))}")


if __name__ == "__main__":
    main()
