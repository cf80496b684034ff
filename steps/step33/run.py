"""step32 demo: a second tier for the KV cache in host memory. kv_offloading_size (GiB, vLLM's name) gives the prefix
cache a pool of host blocks (pinned on CUDA): a cached block the GPU pool evicts is copied there first, keyed by its
hash, and a prompt whose blocks the GPU no longer holds finds them there, each copied back into a GPU block before
the forward that reads it (offload.py; on CUDA the copies run on a side stream, in the order asked). The lesson runs
a multi-turn chat, each turn sent whole, in a KV pool of about a quarter of its working set, through two engines of this
step, one with the tier and one without: the same answers, and how many prompt tokens each computed turn by turn.
Then this step against step31 on one request: equal, token for token."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name


from shared import SamplingParams
from shared.anatomy import anatomy_arg_parser, before_after, compared_options, demo_options
from shared.cli import answer_question, format_table, print_header, user_errors

from .engine import LLM

CONVERSATIONS, TURNS, SYSTEM, USER = 4, 3, 48, 16  # the lesson's chat: a shared system prompt, then user turns


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    parser.set_defaults(requests=1, lesson_tokens=16)
    parser.add_argument("--kv-offloading-size", type=float, default=0.25,
                        help="the host tier of the step's own engine, in GiB (default 0.25; 0: none)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_offloading_size=args.kv_offloading_size,
                  **demo_options(args))
        print_header("step32: a second tier for the KV cache, in host memory", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def chat(engine, args, vocab: int):
    """CONVERSATIONS chats of TURNS turns, each turn sent whole -> (answers, per turn: prompt tokens, tokens computed,
    blocks restored from host memory)."""
    import torch

    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, vocab, (SYSTEM,), generator=g).tolist()
    history = [system + torch.randint(0, vocab, (USER,), generator=g).tolist() for _ in range(CONVERSATIONS)]
    sp = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True)
    answers, turns = [], []
    for _ in range(TURNS):
        saved, restored = engine.block_manager.stats["tokens_saved"], engine.stats.get("host_restores", 0)
        outs = engine.generate(history, sp)
        prompt = sum(map(len, history))
        turns.append((prompt, prompt - (engine.block_manager.stats["tokens_saved"] - saved),
                      engine.stats.get("host_restores", 0) - restored))
        answers.append([o.outputs[0].token_ids for o in outs])
        history = [h + list(o.outputs[0].token_ids) + torch.randint(0, vocab, (USER,), generator=g).tolist()
                   for h, o in zip(history, outs)]
    return answers, turns


def show_lesson(llm, args) -> None:
    block = llm.config.block_size
    working_set = CONVERSATIONS * (SYSTEM + TURNS * USER + TURNS * args.lesson_tokens)
    longest = SYSTEM + TURNS * USER + TURNS * args.lesson_tokens
    pool = max(working_set // 4, longest + block) // block * block + block  # a quarter, and room for the longest
    options = {**compared_options(args), "max_kv_tokens": pool, "max_num_seqs": CONVERSATIONS}
    engines = {"recompute": LLM(args.model, device=args.device, dtype=args.dtype, **options),
               "host tier": LLM(args.model, device=args.device, dtype=args.dtype, kv_offloading_size=0.25, **options)}
    vocab = llm.model.config.vocab_size
    results = {name: chat(engine, args, vocab) for name, engine in engines.items()}
    print(f"\n{CONVERSATIONS} conversations x {TURNS} turns, each turn sent whole (a {SYSTEM}-token system prompt, "
          f"{USER}-token user turns, {args.lesson_tokens}-token answers): a working set of {working_set} tokens in a "
          f"KV pool of {pool}. Prompt tokens computed, turn by turn:")
    rows = []
    for t in range(TURNS):
        (prompt, recompute, _), (_, tier, restored) = results["recompute"][1][t], results["host tier"][1][t]
        rows.append([str(t + 1), str(prompt), str(recompute), str(tier), str(restored)])
    print(format_table(["turn", "prompt tokens", "computed without the tier", "computed with it",
                        "blocks restored from host memory"], rows))
    s = engines["host tier"].stats
    print(f"The tier stored {s['host_stores']} blocks ({s['host_bytes_out'] / 2**10:.0f} KiB) and restored "
          f"{s['host_restores']} ({s['host_bytes_in'] / 2**10:.0f} KiB); it holds {s['host_blocks']} blocks. The "
          "answers are " + ("equal, token for token." if results["recompute"][0] == results["host tier"][0] else
                            "NOT equal."))
    for engine in engines.values():
        engine.shutdown()
    before_after("step31", "step32", llm, args)


if __name__ == "__main__":
    main()
