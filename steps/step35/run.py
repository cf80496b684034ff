"""step35 demo: prefill and decode on separate engines. A kv_producer runs each prompt and its first token, and lends
the prompt's KV blocks; a kv_consumer pulls them (torch.distributed point-to-point, gloo here, over a group of two made
at a ZMQ handshake), writes them into blocks of its own and decodes from the first token without running the prompt;
in serving, a router sends each request to one then the other (serve.py --role router). The lesson runs --requests
questions that way, both engines in this process, and shows the blocks and bytes each request moved, that the decode
engine computed no prompt token, that both engines' blocks are free again, and that the tokens are one engine's;
then the same requests through step34 and this step's engine (colocated: the same code as before)."""
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name


from shared import SamplingParams
from shared.anatomy import QUESTIONS, anatomy_arg_parser, before_after, compared_options, demo_options
from shared.cli import answer_question, format_table, print_header, user_errors


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    parser.set_defaults(requests=4, lesson_tokens=8)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        from .engine import LLM
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))
        print_header("step35: prefill and decode apart, the KV cache sent between them", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    from .engine import LLM

    roles = {role: LLM(args.model, device=args.device, dtype=args.dtype, kv_transfer_config={"kv_role": role},
                       **compared_options(args)) for role in ("kv_producer", "kv_consumer")}
    producer, consumer = roles["kv_producer"], roles["kv_consumer"]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in (QUESTIONS * args.requests)[:args.requests]]
    sp = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    start = time.perf_counter()
    first = producer.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                              [{"do_remote_decode": True}] * len(prompts))
    prefilled = time.perf_counter()
    got = consumer.generate(prompts, sp, [o.kv_transfer_params for o in first])
    decoded = time.perf_counter()
    while producer.core.producer.num_leases and time.perf_counter() - decoded < 10:
        producer.core.poll_transfers()  # the consumers' acks free the lent blocks
        time.sleep(0.01)
    size = consumer.config.block_size
    rows = [[str(i), str(len(p)), str(-(-len(p) // size)), str(len(o.outputs[0].token_ids))]
            for i, (p, o) in enumerate(zip(prompts, got))]
    print(f"\n{len(prompts)} requests: the prompt and first token on the kv_producer "
          f"({1000 * (prefilled - start):.0f} ms), the rest on the kv_consumer ({1000 * (decoded - prefilled):.0f} ms):")
    print(format_table(["request", "prompt tokens", "prompt blocks", "tokens"], rows))
    s = consumer.stats
    print(f"The consumer received {s['kv_received_blocks']} blocks, {s['kv_received_bytes']:,} bytes, in "
          f"{s['kv_loads']} transfers, and computed {s['remote_prompt_tokens_computed']} prompt tokens.")
    print(f"Free blocks after: producer {producer.block_manager.num_free_blocks} of {producer.block_manager.num_blocks}, "
          f"consumer {consumer.block_manager.num_free_blocks} of {consumer.block_manager.num_blocks}.")
    same = [o.outputs[0].token_ids for o in got] == want
    print("The tokens are " + ("one engine's, token for token." if same else "NOT one engine's."))
    for engine in roles.values():
        engine.shutdown()
    before_after("step34", "step35", llm, args)


if __name__ == "__main__":
    main()
