"""step21 demo: CUDA graphs. The decode forward is recorded once per batch-size bucket and replayed with one call;
the host work around it is cut to one wait for the GPU per step. Which path ran is printed first (graphs on a CUDA
GPU with the kernels' backend; eagerly otherwise, with the reason).

On CUDA: what one decode forward costs the host and the GPU, eager against replayed (launches, host ms, GPU ms);
batch-1 decode latency (a 128-token prompt, 512 new tokens), eager against graphs, beside the weights' read time
at the copy bandwidth measured in the same run; a large workload (256 requests) eager against graphs, tokens/s;
one engine step at 256 decoding seats, its host time by phase and its GPU time; then the engine against step20.
On a CPU: the buckets and padding the GPU would use, and the eager engine against step20 (the same tokens)."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import random
import statistics
import time

import torch

from shared import SamplingParams
from shared.anatomy import (before_after, copy_gb_per_s, demo_options, gpu_kernels, interpreter_off_cuda,
                            kernel_arg_parser, load_llm)
from shared.bench import decode_weight_bytes
from shared.cli import answer_question, format_table, print_header, user_errors

from .cuda_graphs import graph_batch_sizes, padded_size


def main() -> None:
    parser = kernel_arg_parser(__doc__)
    parser.add_argument("--enforce-eager", action="store_true", help="the demo engine without CUDA graphs")
    parser.add_argument("--seats", type=int, default=256, help="seats of the large workload (default: %(default)s)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        # before the engine is imported: importing it imports triton (model_runner.py imports kernels/sampling.py),
        # which reads the interpreter's switch then (shared/anatomy.py)
        interpreter_off_cuda(args)
        from .engine import LLM

        llm = LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                  enforce_eager=args.enforce_eager, **demo_options(args))
        print_header("step21: CUDA graphs", llm)
        print_graphs(llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    if llm.cuda_graphs["enabled"]:
        show_one_forward(llm)
        show_batch1_latency(llm, args)
        show_large_workload(args)
    else:
        show_buckets(llm)
    before_after("step20", "step21", llm, args, attention_backend=llm.model.attention_backend.name)


def print_graphs(llm) -> None:
    g = llm.cuda_graphs
    if g["enabled"]:
        print(f"CUDA graphs: {len(g['sizes'])} captured in {g['seconds']:.1f} s (decode batches "
              f"{', '.join(map(str, g['sizes']))}); their memory pool: {g['pool_bytes'] / 2**20:.0f} MiB (measured "
              f"before the KV pool was sized: {llm.memory.get('graph_pool_estimate_bytes', 0) / 2**20:.0f} MiB). "
              "A step of decodes replays its bucket's graph; a step with a prompt chunk runs eagerly.")
    else:
        print(f"CUDA graphs: off, every step runs eagerly ({g['reason']}).")


def show_buckets(llm) -> None:
    """What the GPU would do: the buckets of this engine's seats, and the padding of a few batch sizes."""
    sizes = graph_batch_sizes(llm.scheduler.max_num_seqs)
    seats = graph_batch_sizes(256)
    rows = [[n, padded_size(n, seats), padded_size(n, seats) - n] for n in (1, 3, 5, 13, 100, 250)]
    print(f"\nOn a CUDA GPU this engine ({llm.scheduler.max_num_seqs} seats) would capture {len(sizes)} graphs, for "
          f"decode batches of {', '.join(map(str, sizes))}; with 256 seats, {len(seats)}. A batch is padded to the "
          "smallest that holds it; each padding row decodes one token into the scratch block "
          f"(block {llm.runner.scratch_block} here, past the {llm.memory['num_blocks']} the block manager hands out):")
    print(format_table(["decode batch", "bucket (256 seats)", "padding rows"], rows))
    print("Here the engine is step20's eager path, with the host work cut (sequences compared by identity, sampling "
          "decided on the host, no wait for the device but the one that reads the tokens); its outputs are step20's.")


def gpu_ms(fn, device, calls: int = 20) -> tuple[float, float]:
    """(host ms per call: until fn returns, the GPU not waited for; GPU ms per call: CUDA events around the calls)."""
    fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = []
    start.record()
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
    end.record()
    torch.cuda.synchronize(device)
    return 1000 * statistics.median(host), start.elapsed_time(end) / calls


def show_one_forward(llm) -> None:
    """One decode forward of bucket 1 and of the largest bucket, eager (the recorded code run again) against
    replayed: kernels the GPU runs, launches the host makes, host and GPU milliseconds."""
    graphs, rows = llm.runner.graphs, []
    for size in (1, graphs.sizes[-1]):
        graphs._fill_padding(size)  # padding rows only: every K/V write goes to the scratch block
        eager, replay = (lambda: graphs.forward(size)), graphs.graphs[size].replay
        kernels = [gpu_kernels(fn, llm.device) for fn in (eager, replay)]
        (eager_host, eager_gpu), (replay_host, replay_gpu) = gpu_ms(eager, llm.device), gpu_ms(replay, llm.device)
        rows.append([size, kernels[0], kernels[1], f"{eager_host:.2f}", f"{replay_host:.3f}", f"{eager_gpu:.2f}",
                     f"{replay_gpu:.2f}"])
    print("\nOne decode forward (the graph's own batch: padding rows), eager against replayed (20 calls, medians):")
    print(format_table(["batch", "kernels (eager)", "kernels (graph)", "host ms (eager)", "host ms (replay)",
                        "GPU ms per call (eager)", "GPU ms per call (replay)"], rows))
    print("Eager, the host launches every kernel itself; a replay is one launch for all of them. Where the host "
          "takes longer to launch a forward than the GPU takes to run it, eager GPU time per call is the host's.")


def decode_latency(llm, prompt, new_tokens: int) -> float:
    """ms per output token after the first, one request alone."""
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
    m = out.metrics
    return 1000 * (m.finished_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1)


def show_batch1_latency(llm, args) -> None:
    eager = load_llm("step21", args, enforce_eager=True, max_kv_tokens=32768)
    prompt = [random.Random(1).randrange(1, 5000) for _ in range(128)]
    decode_latency(llm, prompt, 8), decode_latency(eager, prompt, 8)  # warm-up
    runs = {"eager": [], "graphs": []}
    for _ in range(3):  # alternated
        runs["eager"].append(decode_latency(eager, prompt, 512))
        runs["graphs"].append(decode_latency(llm, prompt, 512))
    weights = decode_weight_bytes(args.model, llm.dtype.itemsize)
    bandwidth = copy_gb_per_s(llm.device)
    roof = f"{weights / (bandwidth * 1e9) * 1000:.3f}"
    e, g = (statistics.median(runs[k]) for k in ("eager", "graphs"))
    print(f"\nBatch-1 decode, a 128-token prompt and 512 new tokens, 3 alternated runs each (median ms per token after "
          f"the first; the weights' read time at the copy bandwidth measured now, {bandwidth:.0f} GB/s):")
    print(format_table(["engine", "ms per token", "tokens/s", "runs (ms per token)", "weights' read time, ms"],
                       [["step21, enforce_eager=True", f"{e:.2f}", f"{1000 / e:.1f}",
                         ", ".join(f"{x:.2f}" for x in runs["eager"]), roof],
                        ["step21, CUDA graphs", f"{g:.2f}", f"{1000 / g:.1f}",
                         ", ".join(f"{x:.2f}" for x in runs["graphs"]), roof]]))
    print(f"Graphs decode {e / g:.2f}x faster per token; what is left above the weights' read time is the host's "
          "work per step and the kernels' own time.")


def show_large_workload(args) -> None:
    """256 requests (prompts of 100-1,024 random tokens, 128 new each) through an eager and a graph engine; then one
    engine step at 256 decoding seats: host time by phase (the GPU waited for at each phase's end) and GPU busy."""
    rng = random.Random(0)
    seats = args.seats
    prompts = [[rng.randrange(1, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(seats)]
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    options = dict(max_num_seqs=seats, max_num_batched_tokens=8192, max_kv_tokens=seats * 1200)
    rows, steps = [], {}
    for eager in (True, False):
        llm = load_llm("step21", args, enforce_eager=eager, **options)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        llm.timers.reset()
        start = time.perf_counter()
        outs = llm.generate(prompts, sp)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append(["enforce_eager=True" if eager else "CUDA graphs", f"{tokens / wall:.1f}", f"{wall:.1f}",
                     llm.timers.steps, llm.stats["graph_replays"]])
        steps[eager] = one_step_at_full_seats(llm, prompts, seats)
        del llm
        torch.cuda.empty_cache()
    print(f"\n{seats} requests, prompts of 100-1,024 tokens, 128 new tokens each, {seats} seats (one run each):")
    print(format_table(["engine", "tokens/s", "wall s", "engine steps", "graph replays"], rows))
    names = list(steps[True]["phases"])
    table = [[name, f"{steps[True]['phases'][name]:.2f}", f"{steps[False]['phases'][name]:.2f}"] for name in names]
    table += [["engine step (no waits)", f"{steps[True]['step_ms']:.2f}", f"{steps[False]['step_ms']:.2f}"],
              ["GPU busy in it, ms", f"{steps[True]['gpu_ms']:.2f}", f"{steps[False]['gpu_ms']:.2f}"],
              ["GPU busy share", f"{steps[True]['busy']:.0%}", f"{steps[False]['busy']:.0%}"]]
    print(f"\nOne engine step at {seats} decoding seats (10 steps, mean ms). By phase: the GPU waited for at each "
          "phase's end (timers.sync), so a phase's time includes the GPU work it queued. Then the same steps without "
          "those waits, and the share of that time the GPU is running kernels (the CUDA profiler's kernel time):")
    print(format_table(["", "eager ms", "graphs ms"], table))


def one_step_at_full_seats(llm, prompts, seats: int) -> dict:
    """Fill every seat with a long decode, let the prompts finish prefilling, then time 10 steps twice."""
    from torch.profiler import ProfilerActivity, profile

    for p in prompts[:seats]:
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    while any(s.num_computed_tokens + 1 < s.num_tokens for s in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    llm.step()
    llm.timers.reset()
    llm.timers.sync = True
    for _ in range(10):
        llm.step()
    phases = {name: 1000 * s / llm.timers.steps for name, s in llm.timers.seconds.items()}
    llm.timers.sync = False
    torch.cuda.synchronize(llm.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(10):
            llm.step()
        torch.cuda.synchronize(llm.device)
        wall = (time.perf_counter() - start) / 10
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.time_range.elapsed_us() for e in kernels) / 10 / 1000
    for s in list(llm.scheduler.running) + list(llm.scheduler.waiting):
        llm.abort_request(s.request_id)
    return {"phases": phases, "step_ms": 1000 * wall, "gpu_ms": gpu, "busy": gpu / (1000 * wall)}


if __name__ == "__main__":
    main()
