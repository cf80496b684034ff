"""step22 demo: tensor parallelism. The model is split over N ranks (this process, the engine, and N - 1 worker
processes), each holding its share of every layer's heads and MLP columns and of the KV cache, joined by
torch.distributed: two all-reduces per layer, gloo between CPU processes, NCCL between GPUs.

First the split of one layer, shapes per rank. Then the same requests through tp=1 and tp=N (N: the smallest size
that splits this model's heads; on CUDA, only sizes the GPUs allow): the same tokens, tokens/s of each, and what the
collectives carried, counted (all-reduces per forward, bytes all-reduced per token, logits gathered per sampled
token). Then this engine against step21."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import time
import traceback

import torch

from shared import SamplingParams, resolve_model
from shared.anatomy import QUESTIONS, before_after, demo_options, interpreter_off_cuda, kernel_arg_parser, load_llm
from shared.cli import answer_question, format_table, print_header, user_errors

from .model import ModelConfig, rank_config
from .parallel import TIMEOUT_S, TensorParallel, WorkerError, free_port, rank_device


def main() -> None:
    parser = kernel_arg_parser(__doc__)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks of the demo engine itself (default: %(default)s); the lesson compares 1 and N")
    parser.add_argument("--enforce-eager", action="store_true", help="the demo engine without CUDA graphs")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        # before the engine is imported: importing it imports triton (model_runner.py imports kernels/sampling.py),
        # which reads the interpreter's switch then (shared/anatomy.py)
        interpreter_off_cuda(args)
        from .engine import LLM

        llm = LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                  enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
                  **demo_options(args))
        print_header("step22: tensor parallelism", llm)
        answer_question(llm, args)
        show_lesson(llm, args)
        llm.shutdown()


def show_lesson(llm, args) -> None:
    config = ModelConfig.from_json(resolve_model(args.model) / "config.json")
    size = split_size(config, llm.device)
    if smallest_split(config) is not None:
        show_split(config, size or smallest_split(config), llm)
    demo_size = llm.tp.size
    if demo_size > 1:  # a process holds one tensor-parallel group (torch.distributed's): the comparison needs it
        llm.shutdown()
    if size is None:
        print(f"\nOnly tp=1 runs here: {args.model} does not split" if smallest_split(config) is None else
              f"\nThis machine has {torch.cuda.device_count()} GPU(s) and tensor parallelism needs one GPU per rank, so "
              "only tp=1 runs here (the NCCL path is the same code as the CPU's gloo path, the collectives on GPUs).")
        compare_sizes(args, [1])
    else:
        compare_sizes(args, [1, size])
    if demo_size > 1:  # the group is free again: the demo's engine comes back for the comparison with step21
        llm = demo_engine(args, demo_size)
    before_after("step21", "step22", llm, args, attention_backend=llm.model.attention_backend.name)
    llm.shutdown()


def demo_engine(args, tensor_parallel_size: int):
    """The demo's engine as main() builds it (with --tensor-parallel-size, started again after the comparison)."""
    from .engine import LLM  # after main()'s interpreter_off_cuda, as there

    return LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
               enforce_eager=args.enforce_eager, tensor_parallel_size=tensor_parallel_size, **demo_options(args))


def smallest_split(config) -> int | None:
    """The smallest N > 1 that divides the heads, the KV heads and the MLP width (None: the model does not split)."""
    return next((n for n in range(2, config.num_kv_heads + 1)
                 if not (config.num_heads % n or config.num_kv_heads % n or config.intermediate_size % n)), None)


def split_size(config, device: torch.device) -> int | None:
    """The size the lesson compares with tp=1: the smallest split of the model; on CUDA, if the GPUs allow it."""
    n = smallest_split(config)
    return n if n is not None and (device.type != "cuda" or n <= torch.cuda.device_count()) else None


def show_split(config, size: int, llm) -> None:
    """One layer's weights and one token's KV cache, whole and per rank (shapes of the matrices x @ W.T reads)."""
    r, c = rank_config(config, size), config
    e = llm.dtype.itemsize
    hd = c.head_dim
    rows = [
        ["embed_tokens (vocab-parallel)", f"{c.vocab_size} x {c.hidden_size}",
         f"{-(-c.vocab_size // size)} x {c.hidden_size}", "1 all-reduce (the rank that holds the id adds it)"],
        ["qkv_proj (column-parallel)", f"{(c.num_heads + 2 * c.num_kv_heads) * hd} x {c.hidden_size}",
         f"{(r.num_heads + 2 * r.num_kv_heads) * hd} x {c.hidden_size}",
         f"none: {r.num_heads} query heads and {r.num_kv_heads} KV head(s) per rank"],
        ["attention, KV cache per token and layer", f"{2 * c.num_kv_heads * hd * e} bytes",
         f"{2 * r.num_kv_heads * hd * e} bytes", "none: each rank attends over its own KV heads"],
        ["o_proj (row-parallel)", f"{c.hidden_size} x {c.num_heads * hd}", f"{c.hidden_size} x {r.num_heads * hd}",
         "1 all-reduce of [tokens, hidden]"],
        ["gate_up_proj (column-parallel)", f"{2 * c.intermediate_size} x {c.hidden_size}",
         f"{2 * r.intermediate_size} x {c.hidden_size}", "none"],
        ["down_proj (row-parallel)", f"{c.hidden_size} x {c.intermediate_size}",
         f"{c.hidden_size} x {r.intermediate_size}", "1 all-reduce of [tokens, hidden]"],
        ["lm_head (vocab-parallel)", f"{c.vocab_size} x {c.hidden_size}",
         f"{-(-c.vocab_size // size)} x {c.hidden_size}", "gather of the logits on rank 0"],
    ]
    per_token = (2 * c.num_layers + 1) * c.hidden_size * e
    print(f"\nThe split over {size} ranks ({c.num_layers} layers; {str(llm.dtype).replace('torch.', '')} weights):")
    print(format_table(["weight", "whole", f"per rank (tp={size})", "communication"], rows))
    print(f"Each token's hidden state is all-reduced {2 * c.num_layers + 1} times per forward (two per layer and the "
          f"embedding): {per_token} bytes per token ({2 * c.num_layers + 1} x {c.hidden_size} x {e}).")


def compare_sizes(args, sizes: list[int]) -> None:
    """The lesson's requests through each size (a fresh engine each), the outputs against tp=1's."""
    conversations = [[{"role": "user", "content": q}] for q in (QUESTIONS * (args.requests // len(QUESTIONS) + 1))]
    conversations = conversations[:args.requests]
    params = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True, logprobs=0)
    rows, reference = [], None
    for size in sizes:
        # no prefix caching: every prompt token is computed, so the bytes per token count every token's all-reduces
        llm = load_llm("step22", args, tensor_parallel_size=size, attention_backend=args.attention_backend,
                       enable_prefix_caching=False)
        llm.chat(conversations[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        llm.block_manager.reset_prefix_cache()
        llm.timers.reset()
        before, forwards, waited = llm.tp.counts(), llm.stats["forwards"], llm.tp.all_reduce_s
        start = time.perf_counter()
        outs = llm.chat(conversations, params)
        wall = time.perf_counter() - start
        all_reduces, reduced, gathered = (b - a for a, b in zip(before, llm.tp.counts()))
        forwards, waited = llm.stats["forwards"] - forwards, llm.tp.all_reduce_s - waited
        steps_ms = 1000 * wall / max(llm.timers.steps, 1)
        computed = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)  # K/V rows written
        sampled = sum(len(o.outputs[0].token_ids) for o in outs)
        llm.shutdown()
        tokens = [o.outputs[0].token_ids for o in outs]
        logprobs = [[d[t] for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
        if reference is None:
            reference = tokens, logprobs
            same, diff = "(reference)", ""
        else:
            same = "yes" if tokens == reference[0] else "NO"
            diff = f"{max(abs(a - b) for x, y in zip(logprobs, reference[1]) for a, b in zip(x, y)):.1e}"
        rows.append([size, llm.tp.backend or "none", f"{sampled / wall:.1f}", same, diff,
                     f"{all_reduces / forwards:.0f}", f"{reduced / computed:.0f}", f"{gathered / sampled:.0f}",
                     f"{steps_ms:.1f}", f"{1000 * waited / forwards:.1f}" if llm.device.type == "cpu" else "-"])
        hidden, layers, device, dtype = llm.model.config.hidden_size, llm.model.config.num_layers, llm.device, llm.dtype
        del llm
    print(f"\nThe same {args.requests} requests, {args.lesson_tokens} new tokens each (greedy), one run per size:")
    print(format_table(["tp", "collectives", "tokens/s", "same as tp=1", "max |dlogprob|", "all-reduces/fwd",
                        "reduced B/token", "gathered B/token", "ms/step", "ms all-reduce/fwd"], rows))
    print("(all-reduces/fwd: per forward; reduced B/token: bytes all-reduced per token computed; gathered B/token: "
          "logit bytes rank 0 received per token sampled; ms all-reduce/fwd: rank 0's time in all-reduce calls, waits "
          "for the other ranks included)")
    if len(sizes) > 1:
        alone = measure_all_reduce(sizes[-1], str(device), [args.requests], hidden, dtype, iters=50)[args.requests]
        print(f"Alone (fresh processes, nothing else running), one all-reduce of a [{args.requests}, {hidden}] "
              f"{str(dtype).replace('torch.', '')} tensor between {sizes[-1]} processes takes {1000 * alone:.2f} ms on "
              f"this machine (measured now, {'NCCL' if device.type == 'cuda' else 'gloo'}); a decode step makes "
              f"{2 * layers + 1} of them: {1000 * alone * (2 * layers + 1):.0f} ms of each step is the collectives' "
              "latency, whatever their bytes.")
        if device.type == "cpu":
            print("The answer is the same, and the split is not faster on one machine's CPU: the ranks share its cores "
                  "and every all-reduce is a round trip between processes. It is what lets a model larger than one "
                  "device's memory run, and between GPUs joined by NVLink, what spreads a step's weight reads over "
                  "N devices.")


# ---- what one all-reduce costs on this machine, alone (a probe of its own, not the engine's) -----------------------
def measure_all_reduce(size: int, device: str, rows: list[int], hidden: int, dtype: torch.dtype,
                       iters: int = 200) -> dict[int, float]:
    """Seconds per all-reduce of a [rows, hidden] tensor between `size` fresh processes (spawned for this, in a
    group of their own: nothing else runs), the median of 5 rounds of `iters` calls, for each rows. On CUDA the
    ranks are GPUs 0..size-1 (NCCL) and each round ends with a synchronize, so the time is the GPU's."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_all_reduce_probe, daemon=True,
                         args=(rank, size, init_method, device, rows, hidden, dtype, iters, results))
             for rank in range(size)]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()
    if isinstance(out, str):
        raise WorkerError(f"the all-reduce probe failed:\n{out}")
    return out


def _all_reduce_probe(rank, size, init_method, device, rows, hidden, dtype, iters, results) -> None:
    import statistics

    import torch.distributed as dist

    try:
        dev = rank_device(torch.device(device), rank)
        if dev.type == "cpu":
            torch.set_num_threads(1)
        TensorParallel.connect(rank, size, init_method, dev)
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        out = {}
        for n in rows:
            x = torch.ones(n, hidden, dtype=dtype, device=dev)
            for _ in range(10):  # warm-up: connections made, buffers allocated
                dist.all_reduce(x)
            rounds = []
            for _ in range(5):
                sync()
                start = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(x)
                sync()
                rounds.append((time.perf_counter() - start) / iters)
            out[n] = statistics.median(rounds)
        if rank == 0:
            results.put(out)
        dist.destroy_process_group()
    except BaseException:
        if rank == 0:
            results.put(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
