"""step23 demo: a streaming engine. AsyncLLM runs the engine's steps in a background thread and hands each request's
outputs to its caller as its tokens arrive, so many callers of one event loop are served at once.

Three requests arrive at different times (the second once the first has 4 tokens, the third once it has 8): every
output is printed as it arrives, with its time, then each request's time to first token and whether its streamed
text equals the offline engine's. Then one request aborted mid-stream, its KV blocks free at once. Then this engine
against step22."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import asyncio
import time

import torch

from shared import SamplingParams
from shared.anatomy import QUESTIONS, anatomy_arg_parser, before_after, compared_options, demo_options
from shared.cli import answer_question, format_table, print_header, user_errors

from .async_llm import AsyncLLM
from .engine import LLM


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))
        print_header("step23: a streaming engine", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    engine = AsyncLLM(args.model, device=args.device, dtype=args.dtype, **compared_options(args))
    try:
        asyncio.run(show_streams(engine, llm, min(args.lesson_tokens, 16)))
        asyncio.run(show_abort(engine))
    finally:
        engine.shutdown()
    del engine  # on a GPU its KV cache goes back before step22's engine sizes its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    before_after("step22", "step23", llm, args)


async def show_streams(engine, llm, tokens: int) -> None:
    """Three streams, the second and third arriving while the first runs; every output printed as it arrives."""
    names, questions = "ABC", QUESTIONS[:3]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start, events, results = time.perf_counter(), [], {}
    arrive_at = min(4, tokens), min(8, tokens)  # B, then C, arrives once A has this many tokens (A has `tokens`)
    first_tokens = asyncio.Event(), asyncio.Event()  # set then

    async def stream(i: int) -> None:
        if i:
            await first_tokens[i - 1].wait()
        arrived = time.perf_counter() - start
        first = None
        async for out in engine.generate(prompts[i], params, request_id=names[i]):
            now = time.perf_counter() - start
            c = out.outputs[0]
            first = first if first is not None else now
            events.append((now, names[i], len(c.token_ids), c.text))
            if i == 0 and len(c.token_ids) >= arrive_at[0]:
                first_tokens[0].set()
            if i == 0 and len(c.token_ids) >= arrive_at[1]:
                first_tokens[1].set()
        results[names[i]] = (arrived, first, now, c)

    await asyncio.gather(*(stream(i) for i in range(3)))
    offline = llm.generate(prompts, params)
    print(f"\nThree requests, {tokens} new tokens each (greedy), on one event loop; B arrives once A has "
          f"{arrive_at[0]} tokens,\nC once A has {arrive_at[1]}. Each line is one output as its stream received it "
          "(the text it added):")
    shown = {}
    for at, name, n, text in events:
        new, shown[name] = text[len(shown.get(name, "")):], text
        print(f"  {at * 1000:8.1f} ms  {name}  token {n:2d}  +{new!r}")
    rows = []
    for i, name in enumerate(names):
        arrived, first, end, c = results[name]
        rows.append([name, f"{arrived * 1000:.1f}", f"{(first - arrived) * 1000:.1f}", len(c.token_ids),
                     f"{end * 1000:.1f}", "yes" if c.text == offline[i].outputs[0].text else "NO"])
    print(format_table(["request", "arrived, ms", "time to first token, ms", "tokens", "finished, ms",
                        "same text as LLM.generate"], rows))
    print("B and C joined the running batch at the next step: their first tokens came while A streamed on.")


async def show_abort(engine) -> None:
    blocks = engine.llm.block_manager
    free = blocks.num_free_blocks
    got = 0
    async for out in engine.generate("Count slowly from one to a thousand.", SamplingParams(max_tokens=500),
                                     request_id="long"):
        got += 1
        if got == 3:
            held = blocks.num_free_blocks
            await engine.abort("long")
            after = blocks.num_free_blocks
    print(f"\nAn aborted request: after 3 outputs it held {free - held} KV block(s); `await engine.abort('long')` "
          f"returned with {free - after} held,\nand its stream ended with finish_reason={out.outputs[0].finish_reason!r} "
          f"after {len(out.outputs[0].token_ids)} tokens.")


if __name__ == "__main__":
    main()
