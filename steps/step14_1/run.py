"""step14_1 demo: the KV write, a Python loop per token (step14) against one scatter through a slot mapping,
on one layer's cache; then the whole engine, step14 against step14_1, on the same requests."""
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import torch

from shared.anatomy import anatomy_arg_parser, before_after, demo_options, print_micro, step_module, time_ms
from shared.cli import answer_question, print_header, user_errors

from .engine import LLM
from .model import slot_mapping, write_kv


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))  # GPU: room for 2 engines
        print_header("step14_1: vectorized KV write", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    write_kv_to_blocks = step_module("step14", "model").write_kv_to_blocks  # step14's loop
    cache = llm.kv_cache.k[0]  # one layer's K: [num_blocks, block_size, kv_heads, head_dim]
    num_blocks, block_size = cache.shape[:2]
    free = random.Random(0).sample(range(num_blocks), 128)  # scattered blocks, as a busy cache hands them out
    rows = []
    for case, batch, start, new_tokens in [("decode: 16 rows x 1 token", 16, 100, 1),
                                           ("prefill: 1 row x 128 tokens", 1, 0, 128)]:
        tables = [free[i * 8:(i + 1) * 8] for i in range(batch)]  # 8 blocks of 16: room for 128 tokens
        new = torch.randn(batch, new_tokens, *cache.shape[2:], device=cache.device).to(cache.dtype)

        def loop():
            for row in range(batch):
                write_kv_to_blocks(cache, tables[row], start, new[row])

        def scatter():  # the slot mapping is computed once per step for all layers; here, once per call
            slots = slot_mapping([start] * batch, new_tokens, tables, block_size).to(cache.device)
            write_kv(cache, slots, new.reshape(-1, *cache.shape[2:]))

        rows.append([case, time_ms(loop, llm.device), time_ms(scatter, llm.device)])
    layers = llm.model.config.num_layers
    print_micro(f"Writing one layer's new K (the engine does this {2 * layers} times per forward: K and V, "
                f"{layers} layers):", rows)
    before_after("step14", "step14_1", llm, args)


if __name__ == "__main__":
    main()
