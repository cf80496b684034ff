"""step33 demo: DeepSeek's multi-head latent attention (MLA). A DeepSeek-V2/V3 layer caches, per token, one row: a
latent of kv_lora_rank values and qk_rope_head_dim roped key dims that every head shares, where a GQA model caches a
key and a value per KV head. A prefill chunk turns the latents back into each head's keys and values (kv_b_proj) and
attends as usual (its cached context and its own tokens apart, merged by log-sum-exp); a decode instead absorbs
kv_b_proj's key half into its query and its value half into its output, and attends straight over the latents: one
row read for every head (kernels/latent.py on the triton backend). The router is DeepSeek's: sigmoid scores with a
correction bias for the choice only, the best groups of experts first (V3), or softmax and greedy (V2), with shared
experts beside the routed ones. The lesson runs --mla-model on one question through the torch path and the kernel (in
Triton's interpreter on a CPU): the same tokens; it shows what one token's cache takes against keys and values per
head. Then the dense --model through step32 and this step: equal, token for token."""
import sys
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
    parser.add_argument("--mla-model", default="random:tiny-deepseek-v3",
                        help="the latent-attention model of the lesson (default random:tiny-deepseek-v3); its decode "
                             "kernel runs in Triton's interpreter on a CPU")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        interpreter_off_cuda(args)  # before anything imports triton: the latent kernel runs in the interpreter here
        from .engine import LLM
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **demo_options(args))
        print_header("step33: DeepSeek's latent attention, one cache row a token", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    from .engine import LLM
    from .model_runner import kv_spec_of

    sp = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True)
    question = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    outs, engines = {}, {}
    for backend in ("torch", "triton"):
        engines[backend] = LLM(args.mla_model, device=args.device, dtype=args.dtype, attention_backend=backend,
                               **compared_options(args))
        outs[backend] = engines[backend].chat([question], sp)[0].outputs[0].token_ids
    model = engines["torch"].model
    c = model.config
    spec = kv_spec_of(c, model.w["model.norm.weight"].dtype)
    row, per_head = spec.row_elements, spec.stands_for  # a key (nope + rope) and a value (v) per head
    print(f"\n{args.mla_model}: {c.num_layers} layers, {c.num_heads} heads, a latent of {c.kv_lora_rank} and "
          f"{c.qk_rope_head_dim} roped dims a token")
    rows = [["one latent row (this step)", str(row), str(spec.bytes_per_token)],
            ["a key and a value per head", str(per_head), str(spec.bytes_per_token * per_head // row)]]
    print(format_table(["what a token's cache holds", "elements a layer", "bytes a token (every layer)"], rows))
    where = "compiled" if llm.device.type == "cuda" else "in Triton's interpreter"
    launches = engines["triton"].model.attention_backend.launches
    print(f"\n{args.lesson_tokens} greedy tokens through the torch path and through the latent kernel ({where}: "
          f"{launches} launches over the decode steps' layers):")
    same = outs["torch"] == outs["triton"]
    print("The two paths' tokens are " + ("equal, token for token." if same else
                                          "not equal (a near-tie in the sums' order)."))
    for engine in engines.values():
        engine.shutdown()
    before_after("step32", "step33", llm, args)


if __name__ == "__main__":
    main()
