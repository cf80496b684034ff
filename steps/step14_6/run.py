"""step14_6 demo: the prefix-cache hit rate under eviction pressure, freed blocks reused oldest-freed first
(step14_5) against blocks holding nothing cached first, then cached blocks least recently used first; then the
whole engine, step14_5 against step14_6, on the same requests."""
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

from shared import SamplingParams
from shared.anatomy import anatomy_arg_parser, before_after, demo_options, load_llm
from shared.cli import answer_question, format_table, print_header, user_errors

from .engine import LLM

POOL_TOKENS = 160  # 10 blocks of 16: a small pool, so that blocks must be evicted


def pressure_workload(vocab_size: int, rounds: int = 6) -> list[list[int]]:
    """A 64-token system prompt (4 blocks) asked a new question each round, and between rounds three one-off
    40-token prompts that fill the pool: the system prompt's blocks survive only if eviction spares them."""
    rng = random.Random(1)
    system = [rng.randrange(1, vocab_size) for _ in range(64)]
    work = []
    for _ in range(rounds):
        work.append(system + [rng.randrange(1, vocab_size) for _ in range(8)])
        work += [[rng.randrange(1, vocab_size) for _ in range(40)] for _ in range(3)]
    return work


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))  # GPU: room for 2 engines
        print_header("step14_6: BlockManager.release()", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    work = pressure_workload(llm.model.config.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rows, outputs = [], []
    for step in ("step14_5", "step14_6"):
        engine = load_llm(step, args, max_kv_tokens=POOL_TOKENS)
        outputs.append([engine.generate([p], sp)[0].outputs[0].token_ids for p in work])  # one after the other
        s = engine.block_manager.stats
        rows.append([step, s["lookups"], s["hits"], f"{100 * s['hits'] / max(s['lookups'], 1):.0f}%", s["tokens_saved"]])
    print(f"\n{len(work)} requests one after the other through a pool of {POOL_TOKENS} tokens "
          f"({POOL_TOKENS // 16} blocks of 16): a 64-token system prompt every 4th request, one-off prompts between:")
    print(format_table(["step", "block lookups", "hits", "hit rate", "prompt tokens not recomputed"], rows))
    if outputs[0] != outputs[1]:
        raise SystemExit("error: step14_6's outputs differ from step14_5's under eviction pressure")
    print("Same outputs. step14_5 evicts the system prompt's blocks (freed earliest) while blocks holding nothing "
          "cached wait behind them; step14_6 takes those first and evicts cached blocks least recently used first.")
    before_after("step14_5", "step14_6", llm, args)


if __name__ == "__main__":
    main()
