"""step14_4 demo: the causal mask's cost per forward, built for every row in every layer (step14_3) against built
once per step for a prefill chunk and not at all for decode rows; then the whole engine, step14_3 against step14_4,
on the same requests."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import torch

from shared.anatomy import anatomy_arg_parser, before_after, demo_options, print_micro, time_ms
from shared.cli import answer_question, print_header, user_errors

from .engine import LLM
from .model import causal_mask


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))  # GPU: room for 2 engines
        print_header("step14_4: causal mask", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    c, device = llm.model.config, llm.device
    group = c.num_heads // c.num_kv_heads
    rows = []
    for case, batch, start, new in [("decode forward: 16 rows, 200 tokens of context", 16, 199, 1),
                                    ("prefill forward: 1 row x 128 tokens", 1, 0, 128)]:
        scores = torch.randn(c.num_kv_heads, group, new, start + new, device=device)  # one row's scores, one layer

        def every_row_every_layer():  # before: two aranges, a compare and a masked_fill per row, per layer
            for _ in range(c.num_layers):
                for _ in range(batch):
                    query_pos = torch.arange(start, start + new, device=device)
                    mask = torch.arange(start + new, device=device)[None, :] <= query_pos[:, None]
                    scores.masked_fill(~mask, float("-inf"))

        def once_per_step():  # now: built once (the model runner), applied per layer; nothing for decodes
            masks = [causal_mask(start, new, device) for _ in range(batch)]
            for _ in range(c.num_layers):
                for mask in masks:
                    if mask is not None:
                        scores.masked_fill(~mask, float("-inf"))

        rows.append([case, time_ms(every_row_every_layer, device), time_ms(once_per_step, device)])
    print_micro(f"The mask work of one forward ({c.num_layers} layers):", rows)
    before_after("step14_3", "step14_4", llm, args)


if __name__ == "__main__":
    main()
