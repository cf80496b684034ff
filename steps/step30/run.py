"""step30 demo: a KV cache in float8. kv_cache_dtype="fp8" (or "fp8_e4m3", vLLM's two names) stores K and V as
e4m3 (one byte, 3 bits of mantissa) with one scale per layer for K and one for V; the fused q/k norm + RoPE kernel
writes them, and the attention kernels convert each tile to the model's dtype in registers (on a CPU the torch path
dequantises after the gather). The lesson runs one greedy question (--lesson-tokens tokens) through this step with
an fp8 cache and with the model's dtype ("auto"), and shows where the answers part, how far their logprobs drift, and what a token of K and V
takes in each cache (and in step20's int8 one); then auto's runs beside step29's, equal token for token.

step29's demo, below, for reference: 4-bit weights, the checkpoint as shipped. The embedded model's projections stay the GGUF's Q4_1 blocks
(quant.py): on a CPU a torch path dequantises them for each matmul, on CUDA a GEMV reads the blocks and dequantises
in registers (kernels/gemv4.py); quantization="int4" rounds a float checkpoint's projections to the same blocks.
The outputs of the embedded model are step28's: the same weights. The lesson compares the two and their weights'
bytes."""
import sys
import textwrap
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
from .kv_spec import KV_CACHE_DTYPES


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    parser.set_defaults(requests=1, lesson_tokens=32)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="fp8",
                        help="the cache of the step's own engine (default fp8); the lesson compares it with auto")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                  **demo_options(args))
        print_header("step30: FP8 on Hopper, a KV cache in float8", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    from .model_runner import kv_bytes_per_token
    auto = LLM(args.model, device=args.device, dtype=args.dtype, **compared_options(args))
    sp = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, logprobs=1, ignore_eos=True)
    question = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    a, b = (engine.chat([question], sp)[0].outputs[0] for engine in (auto, llm))
    first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
    same = len(a.token_ids) if first is None else first
    drift = [abs(a.logprobs[i][a.token_ids[i]] - b.logprobs[i][b.token_ids[i]]) for i in range(same)]
    print(f"\n{args.lesson_tokens} greedy tokens, KV cache {args.kv_cache_dtype} against auto: "
          + (f"equal for all {same}" if first is None else f"equal for the first {same}, then they part"))
    if drift:
        print(f"mean |logprob difference| of the chosen tokens {sum(drift) / len(drift):.4f} (largest "
              f"{max(drift):.4f})")
    for name, out in (("auto", a), (args.kv_cache_dtype, b)):
        print(textwrap.fill(repr(out.text), width=100, initial_indent=f"  {name}: ", subsequent_indent="    "))
    c = llm.model.config
    rows = [[name, str(kv_bytes_per_token(c, llm.dtype, name))] for name in ("auto", "int8", "fp8")]
    print(format_table(["KV cache", "bytes per token (K and V, every layer)"], rows))
    # "auto" is step29's cache: the same tokens as step29 (fp8's differ, so it is not the one compared there)
    before_after("step29", "step30", auto, args)
    auto.shutdown()


if __name__ == "__main__":
    main()
