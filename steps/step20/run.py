"""step20 demo: an int8 KV cache. K and V are stored as int8 with one fp32 scale per token and KV head
(kv_cache_dtype="int8"; --kv-cache-dtype picks the demo engine's, int8 by default). Which path ran is printed first.
Then the bytes one token's K/V take and the tokens that fit in the same memory, auto beside int8; the kernels that
read an int8 cache checked against the torch reference on the dequantised cache; the quality drift on the model:
greedy answers to the standard questions with an int8 cache against auto (how long they agree, how far the chosen
tokens' logprobs move); on CUDA the decode attention kernel's time at batch 64, context 8192, bf16 beside int8;
then the engine with kv_cache_dtype="auto" against step19 on the same requests (unchanged, token for token)."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import torch

from shared import SamplingParams
from shared.anatomy import (before_after, demo_options, interpreter_off_cuda, kernel_arg_parser, kernel_ms,
                            kernels_cannot_run, load_llm, step_module)
from shared.cli import answer_question, format_table, print_header, user_errors
from shared.models import RANDOM_SHAPES
from shared.prompts import QUESTIONS

from .engine import LLM, kv_bytes_per_token, kv_pool_blocks
from .kv_spec import KV_CACHE_DTYPES
from .model import dequantize_kv, quantize_kv


def main() -> None:
    parser = kernel_arg_parser(__doc__)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="int8",
                        help="the demo engine's KV cache: auto (the model's dtype) or int8 (default: %(default)s)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        interpreter_off_cuda(args)  # before the model loads: loading it imports triton
        llm = LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                  kv_cache_dtype=args.kv_cache_dtype, **demo_options(args))
        print_header("step20: an int8 KV cache", llm)
        print_attention_backend(llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    show_bytes_per_token(llm)
    show_int8_kernels(llm)
    auto = show_drift(llm, args)
    show_decode_time(llm)
    # "auto" is step19's cache: the same tokens, at the same speed (int8's outputs differ, so it is not compared here)
    before_after("step19", "step20", auto, args, attention_backend=llm.model.attention_backend.name)


def print_attention_backend(llm) -> None:
    """Which attention path the engine runs, and where an int8 cache is dequantised on it."""
    int8 = llm.memory["kv_spec"].scale_bytes > 0  # a scale per row
    if llm.model.attention_backend.name == "triton":
        path = ("every row of a step in one launch per layer (kernels/attention.py's mixed_attention); a step of "
                "decodes only that splits: flash decoding (kernels/decode.py)"
                + ("; both dequantise each int8 K/V tile as they load it" if int8 else ""))
    else:
        path = ("every sequence through step14_7's loop" + (", its K/V dequantised right after the gather" if int8
                                                            else "") + "; " +
                ("no CUDA device here" if llm.device.type != "cuda" else "as asked"))
    print(f"attention backend: {llm.model.attention_backend.name} -> {path}")


class Shape:
    """What kv_bytes_per_token reads of a config, from one of shared.models' shapes."""

    def __init__(self, name: str):
        s = RANDOM_SHAPES[name]
        self.num_layers, self.num_kv_heads, self.head_dim = (s["num_hidden_layers"], s["num_key_value_heads"],
                                                             s["head_dim"])


def tokens_that_fit(config, dtype, kv_cache_dtype: str, budget_bytes: int, block_size: int) -> int:
    """The tokens a pool of budget_bytes holds, in whole blocks (the engine's kv_pool_blocks)."""
    per_block = kv_bytes_per_token(config, dtype, kv_cache_dtype) * block_size
    return kv_pool_blocks(budget_bytes, 1.0, 0, per_block) * block_size


def show_bytes_per_token(llm) -> None:
    """Bytes of K/V per token and the tokens that fit, auto beside int8: this model, and two real shapes in bf16."""
    m, block_size = llm.memory, llm.memory["block_size"]
    if "total_bytes" in m:  # CUDA: the pool is what this run's share of the device left after weights and warm-up
        budget, where = int(m["total_bytes"] * m["utilization"]) - m["used_bytes"], "this run's KV budget"
    else:  # CPU: the pool is max_kv_tokens long; compare at one fixed budget instead
        budget, where = 2**30, "1 GiB"
    cases = [(f"{llm.model_name} (this run)", llm.model.config, llm.dtype),
             ("smollm2-135m shape, bf16", Shape("smollm2-135m"), torch.bfloat16),
             ("qwen3-0.6b shape, bf16", Shape("qwen3-0.6b"), torch.bfloat16)]
    rows = []
    for label, config, dtype in cases:
        auto, int8 = (kv_bytes_per_token(config, dtype, d) for d in ("auto", "int8"))
        fit_auto, fit_int8 = (tokens_that_fit(config, dtype, d, budget, block_size) for d in ("auto", "int8"))
        rows.append([label, str(dtype).replace("torch.", ""), config.head_dim, auto, int8, fit_auto, fit_int8,
                     f"{fit_int8 / max(fit_auto, 1):.2f}x"])
    print(f"\nKV bytes per token (K and V of every layer; int8 counts each row's fp32 scale: head_dim + 4 bytes per "
          f"row) and the tokens that fit in {where} ({budget / 2**30:.2f} GiB, blocks of {block_size}):")
    print(format_table(["model", "model dtype", "head_dim", "auto B/token", "int8 B/token", "tokens (auto)",
                        "tokens (int8)", "int8 / auto"], rows))
    print("With head_dim 64 the 4-byte scale is a larger share of a row than with 128: 128 / 68 = 1.88x in bf16, "
          "256 / 132 = 1.94x; an fp32 model gains 3.8x. This run's pool: "
          f"{m['num_blocks']} blocks, KV dtype {m['kv_dtype']}, sized by {m['sized_by']}.")


def random_cache(llm, num_blocks: int, block_size: int, gen):
    c = llm.model.config
    dtype = llm.dtype if llm.device.type == "cuda" else torch.float32
    shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
    return [torch.randn(shape, generator=gen).to(dtype).to(llm.device) for _ in range(2)], dtype


def show_int8_kernels(llm) -> None:
    """The two kernels the engine calls, on an int8 cache, against the torch reference on the dequantised cache."""
    if kernels_cannot_run(llm):
        print(f"\nthe kernels do not run here: {kernels_cannot_run(llm)}")
        return
    from .kernels.attention import attention_reference, mixed_attention
    from .kernels.decode import decode_reference, flash_decode

    c, dev = llm.model.config, llm.device
    gen = torch.Generator().manual_seed(0)
    query_lens, cached, block_size = [1, 1, 12, 1, 30], [40, 7, 20, 0, 0], 16
    ctx = [a + b for a, b in zip(query_lens, cached)]
    num_blocks = sum(-(-n // block_size) for n in ctx)
    (k, v), dtype = random_cache(llm, num_blocks, block_size, gen)
    tables = torch.arange(num_blocks, dtype=torch.int32)[torch.randperm(num_blocks, generator=gen)]
    starts = [0]
    for n in ctx:
        starts.append(starts[-1] + -(-n // block_size))
    width = max(b - a for a, b in zip(starts, starts[1:]))
    tables = torch.stack([torch.nn.functional.pad(tables[a:b], (0, width - (b - a)))  # [S, widest], padded with 0
                          for a, b in zip(starts, starts[1:])])
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    kd, vd = dequantize_kv(k8, ks, dtype), dequantize_kv(v8, vs, dtype)
    q = torch.randn(sum(query_lens), c.num_heads, c.head_dim, generator=gen).to(dtype).to(dev)
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    lens, tables, scale = torch.tensor(ctx, dtype=torch.int32, device=dev), tables.to(dev), c.head_dim ** -0.5
    mixed = (mixed_attention(q, k8, v8, tables, cu, lens, scale, max(query_lens), k_scale=ks, v_scale=vs).float()
             - attention_reference(q, kd, vd, tables, cu, lens, scale).float()).abs().max().item()
    drift = (attention_reference(q, kd, vd, tables, cu, lens, scale).float()
             - attention_reference(q, k, v, tables, cu, lens, scale).float()).abs().max().item()
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    q_dec, t_dec, l_dec = q[cu[decodes].long()], tables[decodes], lens[decodes]
    split = (flash_decode(q_dec, k8, v8, t_dec, l_dec, scale, 2, k_scale=ks, v_scale=vs).float()
             - decode_reference(q_dec, kd, vd, t_dec, l_dec, scale).float()).abs().max().item()
    where = "compiled for the GPU" if dev.type == "cuda" else "in Triton's interpreter (TRITON_INTERPRET=1), on the CPU"
    print(f"\nThe kernels on an int8 cache, {where}, {c.num_heads} query heads / {c.num_kv_heads} KV heads, head_dim "
          f"{c.head_dim}, against the torch reference on the same cache dequantised first: mixed_attention (3 decodes, "
          f"2 chunks) max |difference| {mixed:.1e}; flash_decode (the 3 decodes, 2 splits) {split:.1e}. The "
          f"quantisation itself moves the same attention output by up to {drift:.1e} (dequantised cache against the "
          "unquantised one).")


def divergence(a, b) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)


def show_drift(llm, args):
    """Greedy answers to the standard questions with an int8 cache against auto, on this run's model. -> the engine
    with kv_cache_dtype="auto" (the demo's own, or the second one built here)."""
    other = {"auto": "int8", "int8": "auto"}[llm.kv_cache_dtype]
    # A pool of a fixed size (the CPU default; on CUDA it leaves the device's memory to the engines compared later)
    second = load_llm("step20", args, kv_cache_dtype=other, attention_backend=llm.model.attention_backend.name,
                      max_kv_tokens=32768)
    engines = {llm.kv_cache_dtype: llm, other: second}
    sp = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, logprobs=5)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = {name: [o.outputs[0] for o in engine.chat(chats, sp)] for name, engine in engines.items()}
    rows, drifts, whole = [], [], 0
    for question, a, b in zip(QUESTIONS, outs["auto"], outs["int8"]):
        first = divergence(a, b)
        n = min(len(a.token_ids), len(b.token_ids)) if first is None else first
        diffs = [abs(b.logprobs[i][b.token_ids[i]] - a.logprobs[i][a.token_ids[i]]) for i in range(n)]
        drifts += diffs
        whole += first is None and len(a.token_ids) == len(b.token_ids)
        if first is None:
            parted = "-"
        else:  # how close the two best tokens were where the answers part
            best = sorted(a.logprobs[first].values(), reverse=True)
            parted = f"token {first}: auto's best two {best[0] - best[1]:.3f} apart"
        rows.append([question if len(question) <= 40 else question[:37] + "...", len(a.token_ids), n,
                     f"{sum(diffs) / max(len(diffs), 1):.4f}", parted])
    mean = sum(drifts) / max(len(drifts), 1)
    print(f"\nQuality drift on {llm.model_name} ({llm.device}, {str(llm.dtype).replace('torch.', '')}, "
          f"{llm.model.attention_backend.name} attention): the {len(QUESTIONS)} standard questions "
          "(shared/prompts.py), "
          f"greedy, at most {args.lesson_tokens} tokens, int8 cache against auto. |dlogprob| = |logprob of the chosen "
          "token with int8 - with auto|, over the tokens where the answers agree:")
    print(format_table(["question", "auto tokens", "agree for", "mean |dlogprob|", "where they part"], rows))
    print(f"{whole} of {len(QUESTIONS)} answers are the same token for token; mean |dlogprob| {mean:.4f} over "
          f"{len(drifts)} agreeing tokens (max {max(drifts, default=0):.3f}). Where two answers part, it is where the "
          "model was nearly undecided between two tokens: int8's rounding tips a near-tie, it does not change what "
          "the model knows.")
    return engines["auto"]


def show_decode_time(llm) -> None:
    """CUDA: decode attention at batch 64, context 8192, one layer, bf16 cache beside int8 (the kernels' own time):
    the kernel the engine runs for such a step (the split rule's choice: flash decoding if it splits, else the mixed
    kernel), and the other one for comparison."""
    if llm.device.type != "cuda" or kernels_cannot_run(llm):
        print("\nNot timed here: the decode kernel's time needs a GPU (on a CPU the kernels run only in Triton's "
              "interpreter, far too slow to time). On a GPU this run times decode attention at batch 64, context 8192, "
              "on a bf16 cache and on an int8 one; the chapter has the H200's figures.")
        return
    from .kernels.attention import mixed_attention
    from .kernels.decode import choose_num_splits, flash_decode

    c, batch, context = llm.model.config, 64, 8192
    q, k, v, tables, lens = step_module("step16", "run").paged_decodes(llm, batch, context)
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    rule = getattr(llm.model.attention_backend, "split_rule", None) or {  # TritonAttention's, or the same rule
        "num_sms": torch.cuda.get_device_properties(llm.device).multi_processor_count, "min_tokens_per_split": 256}
    splits = choose_num_splits(batch, c.num_kv_heads, context, **rule)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=llm.device)
    scale = c.head_dim ** -0.5
    dtype = str(k.dtype).replace("torch.", "")
    auto_bytes, int8_bytes = k.numel() * k.element_size() * 2, (k8.numel() + ks.numel() * 4) * 2
    engine_kernel = "flash decoding" if splits > 1 else "mixed kernel"
    cases = [("mixed kernel", f"auto ({dtype})", auto_bytes, lambda: mixed_attention(q, k, v, tables, cu, lens, scale, 1)),
             ("mixed kernel", "int8 + scales", int8_bytes,
              lambda: mixed_attention(q, k8, v8, tables, cu, lens, scale, 1, k_scale=ks, v_scale=vs)),
             ("flash decoding", f"auto ({dtype})", auto_bytes,
              lambda: flash_decode(q, k, v, tables, lens, scale, max(splits, 2))),
             ("flash decoding", "int8 + scales", int8_bytes,
              lambda: flash_decode(q, k8, v8, tables, lens, scale, max(splits, 2), k_scale=ks, v_scale=vs))]
    rows, auto_ms = [], {}
    for kernel, label, kv_bytes, fn in cases:
        ms = kernel_ms(fn, llm.device, calls=20)
        auto_ms.setdefault(kernel, ms)
        rows.append([kernel + (" (the engine's)" if kernel == engine_kernel else ""), label, f"{kv_bytes / 2**20:.0f}",
                     f"{ms:.3f}", f"{kv_bytes / ms / 1e6:.0f}", f"{auto_ms[kernel] / ms:.2f}x"])
    print(f"\nDecode attention, one layer, batch {batch}, context {context} ({c.num_kv_heads} KV heads, head_dim "
          f"{c.head_dim}; the split rule picks {splits} split(s), so the engine runs the {engine_kernel}; flash "
          f"decoding timed with {max(splits, 2)} splits; the kernels' own GPU time, CUDA profiler):")
    print(format_table(["kernel", "KV cache", "K/V MiB read", "kernels ms", "GB/s", "int8 speed-up"], rows))


if __name__ == "__main__":
    main()
