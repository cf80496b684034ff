"""step31 demo: a mixture of experts. A Qwen3-MoE layer's MLP is E experts and a router: each token runs its k most
probable experts, and the layer adds their outputs weighted by the router's probabilities (renormalised when the
model's config says norm_topk_prob). The engine loads HF's Qwen3MoeForCausalLM checkpoints (model_type "qwen3_moe",
one tensor per expert and projection, stacked on load). The torch path loops over the experts that got tokens (two
matmuls each); the Triton path (kernels/moe.py) sorts the (token, expert) pairs by expert and runs every expert in
one grouped GEMM per projection: two launches a layer, whatever the routing, and a shape fixed by the token count,
so a CUDA graph holds it. tensor_parallel_size=N cuts each expert's width over N ranks; with
enable_expert_parallel=True each rank holds E / N whole experts instead. The lesson runs --moe-model (a random
model of a real MoE shape) on one question, shows how its tokens spread over the experts, and runs it through the
loop and the fused kernels (in Triton's interpreter on a CPU): the same tokens, 2 launches a layer against the
loop's 2 per expert hit. Then the dense --model through step30 and this step: equal, token for token."""
import sys
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name


from shared import SamplingParams
from shared.anatomy import anatomy_arg_parser, before_after, compared_options, demo_options, interpreter_off_cuda
from shared.cli import answer_question, format_table, print_header, user_errors


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    parser.set_defaults(requests=1, lesson_tokens=8)
    parser.add_argument("--moe-model", default="random:tiny-qwen3-moe",
                        help="the mixture of experts of the lesson (default random:tiny-qwen3-moe: 8 experts, 2 a "
                             "token); its fused path runs in Triton's interpreter on a CPU")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        interpreter_off_cuda(args)  # before anything imports triton: the fused experts run in the interpreter here
        from .engine import LLM
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))
        print_header("step31: a mixture of experts, one grouped GEMM per projection", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def routed(engine) -> list[Counter]:
    """Wrap engine's ops.experts to count, per sparse layer call, how many tokens chose each expert (every forward)."""
    calls, experts = [], engine.model.ops.experts

    def counting(h, weights, chosen, gate_up, down):
        calls.append(Counter(chosen.flatten().tolist()))
        return experts(h, weights, chosen, gate_up, down)

    engine.model.ops.experts = counting
    return calls


def show_lesson(llm, args) -> None:
    from .engine import LLM
    sp = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True)
    question = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    outs, engines = {}, {}
    for path, backend in (("loop", "torch"), ("fused", "triton")):
        engines[path] = LLM(args.moe_model, device=args.device, dtype=args.dtype, attention_backend=backend,
                            **compared_options(args))
        calls = routed(engines[path]) if path == "loop" else None
        outs[path] = engines[path].chat([question], sp)[0].outputs[0].token_ids
        if calls is not None:
            loads = calls
    moe = engines["loop"].model
    c = moe.config
    sparse = [i for i in range(c.num_layers) if c.is_moe_layer(i)]
    print(f"\n{args.moe_model}: {c.num_layers} layers, {len(sparse)} of them sparse, {c.num_experts} experts of width "
          f"{c.moe_intermediate_size}, {c.num_experts_per_tok} per token"
          f"{', renormalised' if c.norm_topk_prob else ''}")
    prefill = loads[:len(sparse)]  # the first forward: the prompt, every sparse layer
    tokens = sum(prefill[0].values()) // c.num_experts_per_tok
    rows = [[str(layer), str(len(count)), str(max(count.values())), str(c.num_experts - len(count)),
             " ".join(str(count.get(e, 0)) for e in range(min(c.num_experts, 16)))]
            for layer, count in zip(sparse, prefill)]
    print(f"The prompt's {tokens} tokens, routed (each token to {c.num_experts_per_tok} experts):")
    print(format_table(["layer", "experts hit", "most tokens on one", "experts idle",
                        f"tokens per expert{' (the first 16)' if c.num_experts > 16 else ''}"], rows))
    forwards = {path: engine.stats["forwards"] for path, engine in engines.items()}
    rows = [["loop over experts (torch)", str(forwards["loop"]), str(engines["loop"].model.ops.expert_matmuls)],
            ["grouped GEMMs (kernels/moe.py)", str(forwards["fused"]), str(engines["fused"].model.ops.moe_launches)]]
    where = "compiled" if llm.device.type == "cuda" else "in Triton's interpreter"
    print(f"\n{args.lesson_tokens} greedy tokens through each path (the fused kernels {where}):")
    print(format_table(["experts run by", "forwards", "expert launches"], rows))
    same = outs["loop"] == outs["fused"]
    print("The two paths' tokens are " + ("equal, token for token." if same else
                                          "not equal (a near-tie in the sums' order)."))
    for engine in engines.values():
        engine.shutdown()
    before_after("step30", "step31", llm, args)


if __name__ == "__main__":
    main()
