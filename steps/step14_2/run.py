"""step14_2 demo: the K/V read, a Python loop over blocks and a cat (step14_1) against one index_select through
flat slot indices, on one layer's cache; then the whole engine, step14_1 against step14_2, on the same requests."""
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

from shared.anatomy import anatomy_arg_parser, before_after, demo_options, print_micro, step_module, time_ms
from shared.cli import answer_question, print_header, user_errors

from .engine import LLM
from .model import context_slots, gather_kv


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))  # GPU: room for 2 engines
        print_header("step14_2: index_select gather", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    gather_kv_from_blocks = step_module("step14_1", "model").gather_kv_from_blocks  # step14_1's loop
    cache = llm.kv_cache.k[0]  # one layer's K: [num_blocks, block_size, kv_heads, head_dim]
    num_blocks, block_size = cache.shape[:2]
    rows = []
    for case, context in [("a row with 100 tokens of context", 100), ("a row with 1,000 tokens of context", 1000)]:
        table = random.Random(context).sample(range(num_blocks), -(-context // block_size))  # scattered blocks
        slots = context_slots(table, context, block_size, cache.device)  # once per step in the engine
        rows.append([case, time_ms(lambda: gather_kv_from_blocks(cache, table, context), llm.device),
                     time_ms(lambda: gather_kv(cache, slots), llm.device)])
    layers = llm.model.config.num_layers
    print_micro(f"Reading one row's K from one layer (the engine does this {2 * layers} times per row and forward: "
                f"K and V, {layers} layers):", rows)
    before_after("step14_1", "step14_2", llm, args)


if __name__ == "__main__":
    main()
