"""step14_5 demo: admission looking up a long waiting prompt in the prefix cache, hashing it from its first block
every time (step14_4) against hashes computed once and kept on the sequence; then the whole engine, step14_4
against step14_5, on the same requests."""
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

from .block_manager import BlockManager
from .engine import LLM


class Waiting:
    """A prompt waiting for admission: what the block manager reads of a sequence."""

    def __init__(self, token_ids):
        self.token_ids, self.block_table, self.block_hashes = token_ids, [], []
        self.num_computed_tokens = self.num_cached_blocks = 0

    @property
    def num_tokens(self):
        return len(self.token_ids)


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))  # GPU: room for 2 engines
        print_header("step14_5: incremental hash", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    old_module = step_module("step14_4", "block_manager")  # step14_4's block manager
    OldBlockManager = old_module.BlockManager

    calls = {"n": 0}
    old_hash = old_module.block_hash

    def counted_hash(*a):  # count step14_4's hashing
        calls["n"] += 1
        return old_hash(*a)

    old_module.block_hash = counted_hash
    rng, rows = random.Random(0), []
    for tokens in (512, 4096):
        prefix = [rng.randrange(49152) for _ in range(tokens)]  # a long system prompt, already in the cache
        prompt = prefix + [rng.randrange(49152) for _ in range(16)]  # ... and a new question after it
        managers = []
        for manager in (OldBlockManager(1024, 16), BlockManager(1024, 16)):
            owner = Waiting(prefix)  # a running request that computed the prefix and still holds it
            manager.allocate(owner, tokens)
            owner.num_computed_tokens = tokens
            manager.cache_full_blocks(owner)
            managers.append((manager, Waiting(prompt)))
        (old, old_seq), (new, new_seq) = managers
        calls["n"], new.num_hashed = 0, 0
        # A full pool keeps the prompt waiting, so admission asks again at every engine step: 21 times here.
        rows.append([f"{tokens:,} cached tokens + a 16-token question",
                     time_ms(lambda: old.can_allocate(old_seq, len(prompt)), llm.device),
                     time_ms(lambda: new.can_allocate(new_seq, len(prompt)), llm.device)])
    old_module.block_hash = old_hash
    print_micro("One admission check of a waiting prompt whose prefix is cached (the scheduler asks at every step "
                "while it waits; median of 20 asks after the first):", rows)
    print(f"Block hashes computed for the last prompt over those 21 asks: step14_4 {calls['n']} (every cached block "
          f"and the first miss, every ask); step14_5 {new.num_hashed} (each full block once).")
    before_after("step14_4", "step14_5", llm, args)


if __name__ == "__main__":
    main()
