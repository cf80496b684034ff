"""step14_7 demo: one model forward per engine step, whatever the mix of prefill chunks and decodes; the forwards
per step and tokens/s against step14_6 on the same requests; then Part 5 in one table: step13, step14_7 and HF
transformers `generate` on the same chat requests, at batch 1 and batch 4."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

from shared import SamplingParams
from shared.anatomy import anatomy_arg_parser, before_after, demo_options, time_ms
from shared.cli import answer_question, format_table, print_header, user_errors

from .engine import LLM


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    parser.add_argument("--no-hf", action="store_true",
                        help="leave HF transformers out of the last table (it loads the model a third time)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))  # GPU: room for 2 engines
        print_header("step14_7: batched varlen forward", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_one_step(llm) -> None:
    """Schedule a mixed step by hand (two requests decoding, two prompts arriving) and show its flat batch."""
    first = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}])
    second = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is a prime number?"}])
    for prompt in (first, second):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.step()  # both prompts prefill in one step: now they decode
    for text in ("Name three primary colors.", "Write a haiku about the sea."):
        llm.add_request(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    decodes, chunks = llm.scheduler.schedule()
    input_ids, positions, attn = llm.runner.prepare([(seq, 1) for seq in decodes] + chunks)
    print(f"\nOne engine step by hand: {len(decodes)} decodes and {len(chunks)} prompt chunks "
          f"({', '.join(str(n) for _, n in chunks)} tokens) in one flat batch of {input_ids.shape[0]} tokens:")
    print(f"  cu_seqlens_q = {attn.cu_seqlens_q}   (where each sequence's new tokens start)")
    print(f"  positions    = {positions.tolist()[:4]} ... (each token's position in its own sequence)")
    print(f"  slot_mapping = {attn.slot_mapping.tolist()[:4]} ... (each token's K/V slot in the cache)")
    logits = llm.model.forward(input_ids, positions, attn)
    print(f"  one forward -> logits {tuple(logits.shape)}: one row per sequence (lm_head on its last token only), "
          f"not one per token ({input_ids.shape[0]})")
    llm.scheduler.postprocess(decodes, chunks)  # finish these requests normally
    for seq in [*llm.scheduler.running, *llm.scheduler.waiting]:
        llm.abort_request(seq.request_id)


def matmul_floor_tokens_per_s(llm, batch: int) -> float:
    """The tokens/s of a decode step that did nothing but its matmuls: every weight matrix of every layer and
    lm_head applied to `batch` rows, nothing else. On a CPU these read every weight from memory once per step,
    so no engine that computes in this dtype can go much faster than this."""
    import torch

    c, w = llm.model.config, llm.model.w
    x = torch.randn(batch, c.hidden_size, device=llm.device, dtype=llm.dtype)
    attn_out = torch.randn(batch, c.num_heads * c.head_dim, device=llm.device, dtype=llm.dtype)
    hidden = torch.randn(batch, c.intermediate_size, device=llm.device, dtype=llm.dtype)

    def matmuls():
        for layer in range(c.num_layers):
            p = f"model.layers.{layer}."
            x @ w[p + "self_attn.qkv_proj.weight"].T
            attn_out @ w[p + "self_attn.o_proj.weight"].T
            x @ w[p + "mlp.gate_up_proj.weight"].T
            hidden @ w[p + "mlp.down_proj.weight"].T
        x @ w["lm_head.weight"].T

    return batch / (time_ms(matmuls, llm.device, repeat=10) / 1000)


def part5_table(args, floors: dict) -> None:
    """step13, step14_7 and HF generate on the standard chat requests, at batch 1 and 4 (shared/bench.py), and
    the matmul floor measured in the same run."""
    from shared.bench import run_bench, run_hf_bench

    rows = []
    for workload, label, batch in (("single", "batch 1", 1), ("standard", "batch 4", 4)):
        runs = {step: run_bench(step, args.model, args.device, args.dtype, workload, args.lesson_tokens)
                for step in ("step13", "step14_7")}
        if not args.no_hf:
            runs["hf"] = run_hf_bench(args.model, args.device, args.dtype, workload, args.lesson_tokens)
        hf = runs.get("hf", {}).get("tokens_per_s")
        for name, r in runs.items():
            rows.append([label, "HF transformers generate" if name == "hf" else name, f"{r['tokens_per_s']:.1f}",
                         f"{r['tokens_per_s'] / runs['step13']['tokens_per_s']:.2f}x",
                         f"{r['tokens_per_s'] / hf:.2f}x" if hf else "-"])
        floor = floors[batch]
        rows.append([label, "matmuls alone (the floor)", f"{floor:.1f}",
                     f"{floor / runs['step13']['tokens_per_s']:.2f}x", f"{floor / hf:.2f}x" if hf else "-"])
    print(f"\nPart 5 in one table: the standard chat requests, {args.lesson_tokens} new tokens each, greedy "
          f"(one warm-up, then one run each; progress above):")
    print(format_table(["batch", "engine", "tokens/s", "vs step13", "vs HF"], rows))
    print("\"matmuls alone\": one decode step's weight matrices applied to the batch's rows and nothing else, timed "
          "here: no engine computing in this dtype gets far past it. On a CPU, for SmolLM2 in fp32, it is about the time "
          "to read every weight from memory once per step; on a GPU the engines are far from it (Parts 6 and 7 close "
          "that gap).")


def show_lesson(llm, args) -> None:
    show_one_step(llm)
    before, after = before_after("step14_6", "step14_7", llm, args)
    print(f"Forwards per engine step: {before['forwards_per_step']:.2f} in step14_6 (one per prefill chunk, one for "
          f"the decodes) and {after['forwards_per_step']:.2f} in step14_7, whatever the mix.")
    # The last table loads each engine afresh (on a GPU beside this one: it holds 40% of the memory).
    part5_table(args, {batch: matmul_floor_tokens_per_s(llm, batch) for batch in (1, 4)})


if __name__ == "__main__":
    main()
