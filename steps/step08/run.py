"""step08 demo: a paged KV cache stores the same tokens in far less reserved memory than contiguous caches."""
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

from shared import SamplingParams
from shared.cli import answer_question, format_table, int_at_least, print_header, step_arg_parser, user_errors

from .engine import LLM


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=96, lesson_tokens_min=8)
    parser.add_argument("--block-size", type=int_at_least(1), default=16, help="tokens per KV block (default: %(default)s)")
    parser.add_argument("--requests", type=int_at_least(1), default=16,
                        help="requests in the mixed workload (default: %(default)s)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, block_size=args.block_size, max_num_seqs=8)
        print_header("step08: paged KV cache", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    """Mixed requests (seeded prompt and output lengths); after every iteration, count the tokens stored and
    the KV slots reserved: by the pool's blocks (measured), and by contiguous caches under step06's and
    step07's rules (computed for the same requests at the same moments)."""
    rng = random.Random(0)
    vocab = llm.model.config.vocab_size
    requests = {}
    for _ in range(args.requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(8, 64))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(8, args.lesson_tokens), ignore_eos=True)
        requests[llm.add_request(prompt, params)] = (len(prompt), params.max_tokens)
    stored = paged = upfront = doubling = 0
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        llm.step()
        for r in llm.scheduler.running:
            prompt_len, max_tokens = requests[r.request_id]
            stored += r.num_computed_tokens
            paged += len(r.block_table) * llm.block_manager.block_size
            upfront += contiguous_reservation(prompt_len, max_tokens, r.num_computed_tokens, doubling=False)
            doubling += contiguous_reservation(prompt_len, max_tokens, r.num_computed_tokens, doubling=True)
    seconds = time.perf_counter() - start
    rows = [["contiguous, prompt + max_tokens up front (step05-06)", f"{100 * stored / upfront:.0f}%"],
            ["contiguous, growing by doubling (step07)", f"{100 * stored / doubling:.0f}%"],
            [f"paged, blocks of {llm.block_manager.block_size} (step08, measured)", f"{100 * stored / paged:.0f}%"]]
    print(f"\n{args.requests} requests, prompts of 8-64 tokens, 8-{args.lesson_tokens} new tokens each ({seconds:.1f} s), "
          "memory utilisation = tokens stored / KV slots reserved, summed over all iterations:")
    print(format_table(["KV memory", "utilisation"], rows))
    print(f"the pool ends with {llm.block_manager.num_free_blocks} of {llm.block_manager.num_blocks} blocks free: none leaked.")


def contiguous_reservation(prompt_len: int, max_tokens: int, num_tokens: int, doubling: bool) -> int:
    """What a contiguous cache holds for a request with num_tokens tokens: step06 reserves prompt + max_tokens
    up front; step07 starts at the prompt and doubles (capped at prompt + max_tokens)."""
    if not doubling:
        return prompt_len + max_tokens
    reserved = prompt_len
    while reserved < num_tokens:
        reserved = min(2 * reserved, prompt_len + max_tokens)
    return reserved


if __name__ == "__main__":
    main()
