"""step10 demo: a Llama and a Qwen3 load through one loader; fused projections make a forward cheaper."""
import sys
import statistics
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import torch

from shared import SamplingParams
from shared.cli import answer_question, format_table, print_header, step_arg_parser, user_errors

from .engine import LLM


def main() -> None:
    parser = step_arg_parser(__doc__, lesson_tokens=8)
    parser.add_argument("--other-model", default="random:tiny-qwen3",
                        help="a second checkpoint to load and run: a random:<shape> or a local folder holding a "
                             "Llama or Qwen3 checkpoint (default: %(default)s)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        print_header("step10: model families", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def describe(llm) -> list:
    c = llm.model.config
    return [llm.model_name, c.model_type, c.num_layers, f"{c.num_heads}/{c.num_kv_heads}", c.head_dim,
            c.num_heads * c.head_dim, c.hidden_size, "yes" if c.qk_norm else "no", "yes" if c.tie_word_embeddings else "no"]


def time_ms(fn, repeat: int = 20) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def show_lesson(llm, args) -> None:
    """Both families side by side, then the projections of one forward with and without fusing."""
    other = LLM(args.other_model, device=args.device, dtype=args.dtype, max_kv_tokens=4096)
    print("\nTwo checkpoints, one loader (HF names: q/k/v_proj, gate/up_proj, q/k_norm for Qwen3):")
    print(format_table(["model", "family", "layers", "heads/kv", "head_dim", "heads x head_dim", "hidden",
                        "q/k norm", "tied lm_head"], [describe(llm), describe(other)]))
    sp = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True)
    for engine in (llm, other):
        out = engine.chat([{"role": "user", "content": args.prompt}], sp)[0].outputs[0]
        print(f"{engine.model_name} ({engine.model.config.model_type}): tokens {out.token_ids} -> {out.text.strip()!r}")
    if other.model_name.startswith("random:"):
        print(f"({other.model_name} has seeded random weights: its tokens are noise. Give a Llama or Qwen3 "
              "checkpoint folder, e.g. --other-model ~/models/Qwen3-0.6B, to see a second real answer.)")

    # The lesson's figure: the projection matmuls of one forward, three + two separate vs one + one fused.
    c, w, dtype, device = llm.model.config, llm.model.w, llm.dtype, llm.device
    qkv, gate_up = w["model.layers.0.self_attn.qkv_proj.weight"], w["model.layers.0.mlp.gate_up_proj.weight"]
    sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    q, k, v = [t.contiguous() for t in qkv.split(sizes)]  # what an unfused checkpoint holds
    gate, up = [t.contiguous() for t in gate_up.chunk(2)]
    rows = []
    for label, tokens in (("decode, 16 requests", 16), ("prefill, 256 tokens", 256)):
        x = torch.randn(tokens, c.hidden_size, device=device, dtype=dtype)
        separate = time_ms(lambda: (x @ q.T, x @ k.T, x @ v.T, x @ gate.T, x @ up.T)) * c.num_layers
        fused = time_ms(lambda: (x @ qkv.T, x @ gate_up.T)) * c.num_layers
        rows.append([label, 5 * c.num_layers, f"{separate:.2f}", 2 * c.num_layers, f"{fused:.2f}",
                     f"{separate / fused:.2f}x"])
    print(f"\nThe projections of one forward of {llm.model_name} ({c.num_layers} layers) on {device}, "
          "median of 20, ms:")
    print(format_table(["batch", "matmuls unfused", "ms unfused", "matmuls fused", "ms fused", "speed-up"], rows))
    print("Fusing changes no number the model computes (the same products, side by side); it launches fewer, "
          "larger matmuls.")


if __name__ == "__main__":
    main()
