"""step32's host tier on a multi-turn chat workload, with and without the tier, in one process.

The workload: C conversations x T turns. Every conversation starts with the same system prompt and its own first user
message; each turn is sent whole (the system prompt, every earlier message and answer, and a new user message), the
C requests of a turn together, and the next turn waits for the answers (temperature 0.6, seeded per conversation and
turn, ignore_eos). The KV pool is sized to a quarter of the working set (every conversation's last turn, whole), so
every turn evicts histories the next turn needs; the host tier holds all of it. Two engines of this step, one with
the tier and one without (recompute), run the workload alternately, --repeats times each: tokens/s (answer tokens over
the workload's wall time), TTFT p50 and p99 over its requests, prompt tokens computed, and the tier's counters. Then
a pool large enough for everything: step31 against this step with the tier (which then stores nothing): the tier's
cost when unused. And in the same run, the crossover: copying a block back (its bytes over the host-to-device
bandwidth, measured on pinned memory) against computing it again (its tokens over the prefill rate, measured on a
prompt of --prefill-tokens).

    python3 docs/data/bench_step32.py --out $OUT/h200_step32.json > $OUT/h200_step32.txt
    python docs/data/bench_step32.py --model random:tiny-qwen3 --device cpu --conversations 8 --system 64 \\
        --user 16 --answer 16 --repeats 1 --prefill-tokens 512 > docs/data/raw/cpu_step32_chat.txt
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from shared import SamplingParams  # noqa: E402


def count_computed_prompt_tokens(llm) -> list[int]:
    """Wrap llm's scheduler so that every token a step computes that is not a decode's is summed into the returned
    list's one item: prompt chunks, and the history of a preempted request computed again when it resumes. (The
    prefix cache's tokens_saved cannot give this: a request admitted again after preemption counts its cached blocks
    again, and its recomputed tokens were never in its prompt's length.)"""
    counter, schedule = [0], llm.scheduler.schedule

    def counting():
        work = schedule()
        counter[0] += sum(n for seq, n in work if not (n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens))
        return work

    llm.scheduler.schedule = counting
    return counter


def run_workload(llm, args) -> dict:
    """The chat workload through llm -> tokens/s, TTFT p50/p99 (ms), prompt tokens computed, the tier's counters."""
    g = torch.Generator().manual_seed(0)
    vocab = llm.model.config.vocab_size
    words = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    system = words(args.system)
    history = [system + words(args.user) for _ in range(args.conversations)]
    counters = {k: v for k, v in llm.stats.items() if k.startswith("host_")}  # this run's: the change from here
    computed = count_computed_prompt_tokens(llm)
    ttfts, generated, prompt_tokens, answers = [], 0, 0, []
    start = time.perf_counter()
    for turn in range(args.turns):
        params = [SamplingParams(temperature=0.6, seed=1000 * turn + i, max_tokens=args.answer, ignore_eos=True)
                  for i in range(len(history))]
        outs = llm.generate(history, params)
        answers.append([list(o.outputs[0].token_ids) for o in outs])
        ttfts += [o.metrics.time_to_first_token for o in outs]
        generated += sum(len(o.outputs[0].token_ids) for o in outs)
        prompt_tokens += sum(map(len, history))
        history = [h + list(o.outputs[0].token_ids) + words(args.user) for h, o in zip(history, outs)]
    wall = time.perf_counter() - start
    llm.scheduler.schedule = type(llm.scheduler).schedule.__get__(llm.scheduler)  # unwrapped again
    ttfts.sort()
    row = dict(tokens_per_s=generated / wall, wall_s=wall, ttft_p50_ms=1e3 * ttfts[len(ttfts) // 2],
               ttft_p99_ms=1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
               prompt_tokens=prompt_tokens, prompt_tokens_computed=computed[0],
               working_set_tokens=sum(map(len, history)) - len(history) * args.user, answers=answers)
    row.update({k: v if k == "host_blocks" else v - counters[k] for k, v in llm.stats.items() if k.startswith("host_")})
    return row


def h2d_gb_per_s(device) -> float | None:
    """Host-to-device copy rate from pinned memory (256 MiB, median of 5); on a CPU, a plain copy's."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty_like(src, device=device)
    times = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return src.numel() / statistics.median(times[1:]) / 1e9


def prefill_tokens_per_s(llm, tokens: int) -> float:
    """Prompt tokens per second: one prompt of random ids, one new token, prefix caching out of the way (a fresh
    prompt every time), median of 3."""
    g = torch.Generator().manual_seed(7)
    rates = []
    for _ in range(3):
        prompt = torch.randint(0, llm.model.config.vocab_size, (tokens,), generator=g).tolist()
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        rates.append(tokens / (time.perf_counter() - t))
    return statistics.median(rates)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen3-0.6b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=512, help="system prompt tokens")
    p.add_argument("--user", type=int, default=128, help="tokens of each user message")
    p.add_argument("--answer", type=int, default=128, help="tokens of each answer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    engine = importlib.import_module("steps.step32.engine")
    device = torch.device(args.device)
    working_set = args.conversations * (args.system + args.turns * (args.user + args.answer))
    block = 16
    pool = max(block * 4, working_set // 4 // block * block)  # a quarter of the working set, whole blocks
    per_token = engine.kv_bytes_per_token(engine.ModelConfig.from_json(
        __import__("shared").resolve_model(args.model) / "config.json"), torch.bfloat16 if device.type == "cuda"
        else torch.float32, "auto")
    tier_gib = 1.25 * working_set * per_token / 2**30  # the whole working set, and room to spare
    common = dict(device=args.device, max_num_seqs=args.conversations, max_num_batched_tokens=2048)
    if device.type == "cuda":
        common.update(gpu_memory_utilization=0.25)
    engines = {"recompute": engine.LLM(args.model, max_kv_tokens=pool, **common),
               "host tier": engine.LLM(args.model, max_kv_tokens=pool, kv_offloading_size=tier_gib, **common)}
    print(f"{args.model} on {device}: {args.conversations} conversations x {args.turns} turns (system {args.system}, "
          f"user {args.user}, answer {args.answer} tokens)\nworking set {working_set} tokens, KV pool {pool} tokens "
          f"({100 * pool / working_set:.0f}%), host tier {tier_gib:.3f} GiB; {per_token} KV bytes per token",
          flush=True)
    runs = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            llm.block_manager.reset_prefix_cache()  # each run starts cold: no turn of an earlier run is cached
            runs[name].append(run_workload(llm, args))
    result = {"args": vars(args), "pool_tokens": pool, "working_set_tokens": working_set, "runs": runs}
    for name, rows in runs.items():
        best = sorted(rows, key=lambda r: r["tokens_per_s"])[len(rows) // 2]
        host = (f"; stored {best['host_stores']} blocks, restored {best['host_restores']}, dropped "
                f"{best['host_drops']}" if "host_stores" in best else "")
        print(f"{name:10}: {best['tokens_per_s']:.1f} tokens/s, TTFT p50 {best['ttft_p50_ms']:.1f} ms, p99 "
              f"{best['ttft_p99_ms']:.1f} ms (the median of {len(rows)} runs by tokens/s)\n{name:10}: prompt tokens "
              f"computed {best['prompt_tokens_computed']} of {best['prompt_tokens']}{host}", flush=True)
    a, b = (sorted(runs[n], key=lambda r: r["tokens_per_s"])[len(runs[n]) // 2] for n in ("host tier", "recompute"))
    same = sum(x == y for ra, rb in zip(runs["host tier"], runs["recompute"])
               for x, y in zip(sum(ra["answers"], []), sum(rb["answers"], [])))
    total = sum(len(sum(r["answers"], [])) for r in runs["recompute"])
    print(f"host tier against recompute: {a['tokens_per_s'] / b['tokens_per_s']:.2f}x tokens/s, TTFT p50 "
          f"{a['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x; answers equal in {same} of {total}", flush=True)
    for llm in engines.values():
        llm.shutdown()
    # unused: a pool that holds everything, step31 against this step with a tier
    before = importlib.import_module("steps.step31.engine")
    room = 2 * working_set + args.prefill_tokens  # every turn, and the prefill measurement below
    big = {"step31": before.LLM(args.model, max_kv_tokens=room, **common),
           "step32 + tier": engine.LLM(args.model, max_kv_tokens=room, kv_offloading_size=tier_gib, **common)}
    unused = {name: [] for name in big}
    for _ in range(args.repeats):
        for name, llm in big.items():
            llm.block_manager.reset_prefix_cache()
            unused[name].append(run_workload(llm, args))
    a, b = (sorted(unused[n], key=lambda r: r["tokens_per_s"])[len(unused[n]) // 2] for n in ("step32 + tier", "step31"))
    result["unused"] = unused
    # the crossover: a block copied back against a block computed again
    bw = h2d_gb_per_s(device)
    rate = prefill_tokens_per_s(big["step31"], args.prefill_tokens)
    copy_us, compute_us = per_token * block / (bw * 1e3), block / rate * 1e6
    result.update(h2d_gb_per_s=bw, prefill_tokens_per_s=rate, block_copy_us=copy_us, block_compute_us=compute_us)
    print(f"crossover: a block of {block} tokens ({per_token * block} bytes) copies back in {copy_us:.2f} us at "
          f"{bw:.1f} GB/s host-to-device,\n  and is computed again in {compute_us:.1f} us at {rate:.0f} prompt "
          f"tokens/s: copying is {compute_us / copy_us:.0f}x cheaper", flush=True)
    print(f"a pool that holds everything: step32 with the tier {a['tokens_per_s']:.1f} tokens/s, step31 "
          f"{b['tokens_per_s']:.1f}: {a['tokens_per_s'] / b['tokens_per_s']:.2f}x\n  (the tier stored "
          f"{a.get('host_stores', 0)} blocks)", flush=True)
    for llm in big.values():
        llm.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
