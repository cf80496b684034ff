"""step18 demo: mixed batches, one kernel. Every row of an engine step (decodes and prefill chunks alike) goes
through one attention launch per layer, and the scheduler has no phases. Which path ran is printed first. Then the
mixed kernel checked against its torch reference on a batch of decodes and chunks; attention launches per layer per
step, counted, step17 beside step18 on the same requests; an engine trace of a long prompt arriving while three
requests decode, step by step; then the engine against step17 on the same requests."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import random

import torch

from shared import SamplingParams
from shared.anatomy import before_after, demo_options, interpreter_off_cuda, kernel_arg_parser, kernels_cannot_run
from shared.anatomy import step_module
from shared.cli import answer_question, format_table, print_header, user_errors
from shared.stats import percentile

from .engine import LLM


def main() -> None:
    parser = kernel_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        interpreter_off_cuda(args)  # before the model loads: loading it imports triton
        llm = LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                  **demo_options(args))
        print_header("step18: mixed batches, one kernel", llm)
        print_attention_backend(llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    show_mixed_kernel(llm)
    show_launches(llm)
    show_no_phases(llm)
    show_latency(llm)
    before_after("step17", "step18", llm, args, attention_backend=llm.model.attention_backend.name)  # the same path
    if llm.model.attention_backend.name != "triton":
        print("Both engines ran the same per-sequence loop here: what one launch per layer saves needs a GPU (the "
              "chapter has the H200's figures).")


def print_attention_backend(llm) -> None:
    """Which attention path the engine runs: this step's kernel, or step14_7's loop (their reference math)."""
    if llm.model.attention_backend.name == "triton":
        path = ("every row of a step, decodes and prefill chunks alike: one launch per layer (kernels/attention.py's "
                "mixed_attention); a step of decodes only that splits: flash decoding (kernels/decode.py)")
    else:
        path = "every sequence through step14_7's loop (the kernels' reference math); " + (
            "no CUDA device here" if llm.device.type != "cuda" else "as asked")
    print(f"attention backend: {llm.model.attention_backend.name} -> {path}")


def mixed_requests(vocab: int) -> tuple[list, list]:
    """Five prompts of 3 to 64 tokens, 6 to 10 new tokens each: with 4 seats and a budget of 32 tokens, most steps
    hold decodes and a prompt chunk together."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in (3, 17, 40, 9, 64)]
    return prompts, [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(5)]


def show_mixed_kernel(llm) -> None:
    if kernels_cannot_run(llm):
        print(f"\nthe kernels do not run here: {kernels_cannot_run(llm)}")
        return
    from .kernels.attention import attention_reference, mixed_attention

    c, dev = llm.model.config, llm.device
    dtype = llm.dtype if dev.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    query_lens, cached, block_size = [1, 1, 12, 1, 30], [40, 7, 20, 0, 0], 16
    ctx = [a + b for a, b in zip(query_lens, cached)]
    blocks = [-(-n // block_size) for n in ctx]
    tables = torch.zeros(len(ctx), max(blocks), dtype=torch.int32)
    order = torch.randperm(sum(blocks), generator=gen)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used:used + n]
        used += n
    shape = (sum(blocks), block_size, c.num_kv_heads, c.head_dim)
    k, v = (torch.randn(shape, generator=gen).to(dtype).to(dev) for _ in range(2))
    q = torch.randn(sum(query_lens), c.num_heads, c.head_dim, generator=gen).to(dtype).to(dev)
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    lens = torch.tensor(ctx, dtype=torch.int32, device=dev)
    tables, scale = tables.to(dev), c.head_dim ** -0.5
    diff = (mixed_attention(q, k, v, tables, cu, lens, scale, max(query_lens)).float()
            - attention_reference(q, k, v, tables, cu, lens, scale).float()).abs().max().item()
    where = "compiled for the GPU" if dev.type == "cuda" else "in Triton's interpreter (TRITON_INTERPRET=1), on the CPU"
    print(f"\nThe mixed kernel, {where}, {c.num_heads} query heads / {c.num_kv_heads} KV heads, head_dim {c.head_dim}: "
          f"one launch for 3 decodes (contexts of 41, 8 and 1 tokens) and 2 chunks (12 new tokens after 20 cached, a "
          f"prompt of 30): max |difference| from the torch reference {diff:.1e}")


KERNEL_FUNCTIONS = {"attention": ("paged_attention", "mixed_attention"),  # step17's prefill kernel, step18's
                    "decode": ("paged_decode_v2", "flash_decode")}  # flash_decode launches a split and a merge


def count_attention_launches(step: str) -> tuple[dict, list]:
    """Wrap the attention kernels of steps/<step> so that every launch is counted -> (the count, the originals to
    put back with restore())."""
    calls, originals = {"n": 0}, []
    for module, names in KERNEL_FUNCTIONS.items():
        kernels = step_module(step, f"kernels.{module}")
        for name in names:
            if hasattr(kernels, name):
                real = getattr(kernels, name)
                originals.append((kernels, name, real))

                def counted(*a, _real=real, _n=2 if name == "flash_decode" else 1, **kw):
                    calls["n"] += _n
                    return _real(*a, **kw)
                setattr(kernels, name, counted)
    return calls, originals


def restore(originals: list) -> None:
    for module, name, real in originals:
        setattr(module, name, real)


def show_launches(llm) -> None:
    """Attention kernels launched per layer per engine step, counted, step17 and step18 on the same requests. On a
    CPU the kernels run in the interpreter, too slow for the real model: a tiny model of the same code counts."""
    if kernels_cannot_run(llm):
        return
    on_gpu = llm.device.type == "cuda"
    model = llm.model_name if on_gpu else "random:tiny-llama"
    rows = []
    for step in ("step17", "step18"):
        options = dict(attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=32, max_kv_tokens=4096)
        engine = step_module(step, "engine").LLM(model, device=llm.device, dtype=llm.dtype if on_gpu else None,
                                                 **options)
        prompts, params = mixed_requests(engine.model.config.vocab_size)
        calls, originals = count_attention_launches(step)
        try:
            engine.generate(prompts, params)
        finally:
            restore(originals)
        layers, steps = engine.model.config.num_layers, engine.timers.steps
        rows.append([step, steps, engine.stats["decode_steps"], engine.stats["prefill_chunks"], calls["n"],
                     f"{calls['n'] / (steps * layers):.2f}"])
    print(f"\nAttention kernels launched, counted, on 5 requests with 4 seats and a budget of 32 tokens ({model}):")
    print(format_table(["step", "engine steps", "steps with decodes", "prefill chunks", "attention launches",
                        "per layer per step"], rows))
    print("step17 launches its decode kernel and its prefill kernel in a step that holds both; step18 one kernel for "
          "every row.")


def show_no_phases(llm) -> None:
    """A 300-token prompt arrives while three requests decode, budget 64: the schedule, step by step."""
    engine = LLM(llm.model_name, device=llm.device, dtype=llm.dtype, attention_backend=llm.model.attention_backend.name,
                 max_num_seqs=4, max_num_batched_tokens=64, max_kv_tokens=4096)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for n in (5, 7, 9):
        engine.add_request(list(range(10, 10 + n)), sp)
    for _ in range(3):
        engine.step()
    engine.add_request(list(range(10, 310)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    schedule, rows = engine.scheduler.schedule, []

    def traced():
        work = schedule()
        decodes = [n for r, n in work if n == 1 and r.num_computed_tokens + 1 == r.num_tokens]
        chunks = [n for r, n in work if not (n == 1 and r.num_computed_tokens + 1 == r.num_tokens)]
        rows.append([len(rows) + 1, len(decodes), " + ".join(map(str, chunks)) or "-", len(decodes) + sum(chunks)])
        return work

    engine.scheduler.schedule = traced
    while engine.scheduler.has_unfinished() and len(rows) < 8:
        engine.step()
    print("\nNo phases: a prompt of 300 tokens arrives while 3 requests decode (budget 64 tokens per step). Each step, "
          "every request catches up, the least behind first:")
    print(format_table(["step", "decodes (1 token each)", "prompt chunk tokens", "tokens scheduled"], rows))
    print("The decodes get their token in every step; the prompt takes what is left of the budget, 61 tokens a step, "
          "until it is in.")


def latency_run(step: str, llm, decoders: int, decode_tokens: int, long_lens: tuple, budget: int) -> dict:
    """`decoders` requests decode; once every one has its first token, prompts of long_lens tokens arrive. -> the
    gaps between two tokens of a decoding request while the long prompts are in (ms), the long prompts' time to
    first token (ms), and the steps taken."""
    import time

    engine = step_module(step, "engine").LLM(
        llm.model_name, device=llm.device, dtype=llm.dtype, attention_backend=llm.model.attention_backend.name,
        max_num_seqs=decoders + len(long_lens), max_num_batched_tokens=budget,
        max_kv_tokens=16 * (-(-(decoders * (16 + decode_tokens) + sum(long_lens) + 64 * len(long_lens)) // 16)))
    vocab = engine.model.config.vocab_size
    rng = random.Random(3)
    seqs, times = {}, {}

    def add(n_prompt: int, n_new: int) -> str:
        rid = engine.add_request([rng.randrange(1, vocab) for _ in range(n_prompt)],
                                 SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
        seqs[rid] = engine.scheduler.waiting[-1]
        times[rid] = [time.perf_counter()]  # when it arrived, then one time per token
        return rid

    def step() -> None:
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        for rid, seq in seqs.items():
            while len(times[rid]) - 1 < len(seq.output_ids):
                times[rid].append(now)

    decoding = [add(16, decode_tokens) for _ in range(decoders)]
    while any(len(times[r]) < 2 for r in decoding):
        step()
    arrived = time.perf_counter()
    longs = [add(n, 8) for n in long_lens]
    while any(len(times[r]) < 2 for r in longs):  # until every long prompt has its first token
        step()
    settled = time.perf_counter()
    gaps = [1000 * (b - a) for r in decoding for a, b in zip(times[r][1:], times[r][2:]) if a >= arrived and b <= settled]
    ttft = [1000 * (times[r][1] - times[r][0]) for r in longs]
    while engine.scheduler.has_unfinished():
        step()
    return {"gaps": gaps, "ttft": ttft}


def show_latency(llm) -> None:
    """The inter-token latency of running decodes while long prompts arrive, step17 beside step18."""
    on_gpu = llm.device.type == "cuda"
    decoders, decode_tokens, long_lens, budget = (32, 96, (2000, 3000, 4000), 512) if on_gpu else (4, 40, (300,), 64)
    latency_run("step17", llm, 2, 8, (64,), budget)  # warm-up: the kernels are compiled before anything is timed
    latency_run("step18", llm, 2, 8, (64,), budget)
    rows = []
    for step in ("step17", "step18"):
        r = latency_run(step, llm, decoders, decode_tokens, long_lens, budget)
        rows.append([step, len(r["gaps"]), f"{percentile(r['gaps'], 0.5):.1f}", f"{percentile(r['gaps'], 0.99):.1f}",
                     f"{max(r['gaps']):.1f}", f"{percentile(r['ttft'], 0.5):.0f}"])
    print(f"\n{decoders} requests decode; then prompts of {', '.join(map(str, long_lens))} tokens arrive (budget "
          f"{budget} tokens per step, {llm.device}, {llm.model.attention_backend.name} attention). The decoding "
          "requests' inter-token latency until every long prompt has its first token, and the long prompts' time to "
          "first token:")
    print(format_table(["step", "gaps measured", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "TTFT of the long, median ms"],
                       rows))


if __name__ == "__main__":
    main()
