"""step34 on several GPUs: one engine at a time (a process holds one torch.distributed group), each built as nano-vllm's
bench builds its own (max_num_seqs 256, max_num_batched_tokens 16384; with several stages max_num_seqs is per batch
in flight), one warm-up request, then the clock around one `generate` of nano-vllm's workload (its draws, temperature
0.6, ignore_eos; tokens/s = its max_tokens summed over the seconds) and batch 1 (128 random ids, 512 new tokens at 0.6).
For every layout it records tokens/s, the engine steps, and:
  pp > 1   each stage's idle share of the workload's run (parallel.py's idle_shares, from every stage's recorded
           forwards) and the residual-stream bytes rank 0 sent;
  tp > 1   rank 0's host time in all-reduces per engine step and the bytes all-reduced (TensorParallel's counters).
Then NCCL's own all-reduce and point-to-point bandwidth between GPUs 0 and 1, measured in the same call (two
processes, one per GPU: 64 MiB tensors, median of 10), which those times are read against.

    python docs/data/bench_step34.py --out $OUT/step34.jsonl --layouts 1 tp2 pp2 tp2pp2 tp4
    python docs/data/bench_step34.py --dry-run    # the CPU, gloo, random:tiny-qwen3, a few requests: the script runs
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYOUTS = {"1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2), "tp4": (4, 1), "pp4": (1, 4)}


def run_layout(name: str, args) -> dict:
    import torch

    from shared import SamplingParams, Tokenizer
    from shared.bench import nano_vllm_workload
    from steps.step34.engine import LLM
    from steps.step34.parallel import idle_shares

    tp, pp = LAYOUTS[name]
    options = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=16384)
    if args.dry_run:
        options.update(device="cpu", dtype="float32", max_kv_tokens=65536, async_scheduling=True)
    else:
        options.update(gpu_memory_utilization=args.share)
    llm = LLM(args.model, **options)
    prompts, params = nano_vllm_workload(Tokenizer(llm.config.model_dir))
    prompts, params = prompts[:args.requests], params[:args.requests]
    llm.generate(["Benchmark: "], SamplingParams())  # nano-vllm's warm-up
    core = llm.core
    core.pipe.timeline.clear()
    skip = {r["rank"]: len(r["timeline"]) for r in core.workers.stages()} if core.workers else {}
    steps, reduce_s, reduced = core.timers.steps, core.tp.all_reduce_s, core.tp.bytes_all_reduced
    start = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - start
    result = {"layout": name, "tp": tp, "pp": pp, "model": args.model, "requests": len(prompts),
              "tokens": sum(p.max_tokens for p in params), "seconds": wall,
              "tokens_per_s": sum(p.max_tokens for p in params) / wall, "engine_steps": core.timers.steps - steps,
              "backend": llm.backend}
    engine_steps = max(result["engine_steps"], 1)
    if tp > 1:
        result.update(all_reduce_ms_per_step=1000 * (core.tp.all_reduce_s - reduce_s) / engine_steps,
                      bytes_all_reduced_per_step=(core.tp.bytes_all_reduced - reduced) / engine_steps)
    if pp > 1:
        reports = {r["rank"]: r for r in core.workers.stages()}
        lines = [list(core.pipe.timeline)] + [
            reports[core.pipe.layout.rank(s, 0)]["timeline"][skip[core.pipe.layout.rank(s, 0)]:] for s in range(1, pp)]
        result.update(idle_shares=idle_shares(lines), most_batches_in_flight=core.stats["most_batches_in_flight"],
                      stream_bytes_sent_rank0=core.pipe.bytes_sent)
    # batch 1: 128 random ids, 512 new tokens at 0.6
    rng = random.Random(1)
    prompt = [rng.randint(0, 10000) for _ in range(128)]
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0.6, max_tokens=args.batch1_tokens, ignore_eos=True))
    result["batch1_tokens_per_s"] = len(out[0].outputs[0].token_ids) / (time.perf_counter() - start)
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _nccl_rank(rank: int, port: int, queue, numel: int) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(numel, dtype=torch.bfloat16, device=device)
    times = {"all_reduce": [], "send": []}
    for _ in range(13):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        times["all_reduce"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        (dist.send if rank == 0 else dist.recv)(x, 1 - rank)
        torch.cuda.synchronize()
        times["send"].append(time.perf_counter() - start)
    if rank == 0:
        nbytes = numel * 2
        ar, p2p = statistics.median(times["all_reduce"][3:]), statistics.median(times["send"][3:])
        # a ring all-reduce moves 2 (N - 1) / N of the tensor through each link: N = 2, the tensor once
        queue.put({"kind": "nccl", "bytes": nbytes, "all_reduce_s": ar, "all_reduce_bus_gb_s": nbytes / ar / 1e9,
                   "p2p_s": p2p, "p2p_gb_s": nbytes / p2p / 1e9})
    dist.destroy_process_group()


def nccl_bandwidth(numel: int = 32 * 2**20) -> dict:
    import multiprocessing as mp

    from steps.step34.parallel import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, queue, numel)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--layouts", nargs="+", default=["1", "tp2", "pp2"], choices=sorted(LAYOUTS))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--batch1-tokens", type=int, default=512)
    parser.add_argument("--share", type=float, default=0.8, help="gpu_memory_utilization of each engine")
    parser.add_argument("--out", default=None, help="a .jsonl file: one line per layout (and NCCL's figures)")
    parser.add_argument("--dry-run", action="store_true", help="the CPU over gloo, random:tiny-qwen3, 4 requests")
    args = parser.parse_args()
    if args.dry_run:
        args.model, args.requests, args.max_num_seqs, args.batch1_tokens = "random:tiny-qwen3", 4, 2, 8
    import torch

    lines = []
    for name in args.layouts:
        tp, pp = LAYOUTS[name]
        if not args.dry_run and tp * pp > torch.cuda.device_count():
            print(f"{name}: needs {tp * pp} GPUs, this machine has {torch.cuda.device_count()}: not run", flush=True)
            continue
        result = run_layout(name, args)
        lines.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "backend"}), flush=True)
    if not args.dry_run and torch.cuda.device_count() >= 2:
        lines.append(nccl_bandwidth())
        print(json.dumps(lines[-1]), flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
