"""step14_3 demo: one sequence's attention, K and V copied per query head with repeat_interleave and two einsums
(step14_2) against all heads in one batched matmul with GQA by a view; then the whole engine, step14_2 against
step14_3, on the same requests."""
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
from .model import grouped_attention


def copied_attention(q, keys, values, mask):
    """step14_2's attention of one row: K and V expanded to one copy per query head, then two einsums."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, values).reshape(q.shape[0], -1)


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))  # GPU: room for 2 engines
        print_header("step14_3: batched heads, GQA without copies", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    c = llm.model.config
    group = c.num_heads // c.num_kv_heads
    rows, copied = [], []
    for case, new, context in [("decode: 1 query, 1,000 tokens of context", 1, 1000),
                               ("prefill: 128 queries, 128 tokens", 128, 128)]:
        q = torch.randn(new, c.num_heads, c.head_dim, device=llm.device).to(llm.dtype)
        keys, values = (torch.randn(context, c.num_kv_heads, c.head_dim, device=llm.device).to(llm.dtype) for _ in "kv")
        mask = torch.arange(context, device=llm.device)[None, :] <= torch.arange(context - new, context,
                                                                                  device=llm.device)[:, None]
        torch.testing.assert_close(grouped_attention(q, keys, values, mask), copied_attention(q, keys, values, mask))
        rows.append([case, time_ms(lambda: copied_attention(q, keys, values, mask), llm.device),
                     time_ms(lambda: grouped_attention(q, keys, values, mask), llm.device)])
        copied.append(2 * context * c.num_heads * c.head_dim * keys.element_size())
    print_micro(f"One row's attention in one layer ({c.num_heads} query heads share {c.num_kv_heads} KV heads: groups "
                f"of {group}; same result both ways):", rows)
    print(f"Bytes step14_2 copies per row and layer with repeat_interleave (K and V, {group} copies of each KV head): "
          f"{copied[0] / 2**10:.0f} KiB at 1,000 tokens of context; step14_3 copies none.")
    before_after("step14_2", "step14_3", llm, args)


if __name__ == "__main__":
    main()
