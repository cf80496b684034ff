"""The benchmark harness: one fixed workload through one step's LLM, measured the same way for every step.

    python -m shared.bench --step step03 [--model M] [--device D] [--dtype T] [--workload standard]

prints one JSON line: tokens/s, time to first token (median over requests), peak memory, wall time.
run_all.py --bench runs this once per step, each in a fresh process, so peak memory is per step.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import resource
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.params import SamplingParams  # noqa: E402

STANDARD_QUESTIONS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the moon.",
    "List three uses of a paperclip.",
]


def standard_workload(tokenizer, max_tokens: int = 128):
    """Several chat prompts, `max_tokens` new tokens each, greedy, ignore_eos (every step does the same work)."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in STANDARD_QUESTIONS]
    return prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def mixed_workload(tokenizer, max_tokens: int = 128, num_requests: int = 64, seed: int = 2024):
    """Many requests of mixed lengths, where batching matters: prompt lengths 8-192 and output lengths
    8-max_tokens drawn from a fixed seed; prompts are random token ids (the work, not the text, matters)."""
    rng = random.Random(seed)
    vocab = tokenizer.hf.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(8, 192))] for _ in range(num_requests)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, max_tokens), ignore_eos=True)
              for _ in range(num_requests)]
    return prompts, params


def shared_prefix_workload(tokenizer, max_tokens: int = 128, num_requests: int = 32, seed: int = 7):
    """Requests that share a long system prompt (about 410 tokens), each with its own question, 32 new tokens:
    where prefix caching matters. max_tokens is not used: the answers are kept short on purpose."""
    rng = random.Random(seed)
    words = ["library", "opens", "closes", "members", "borrow", "books", "weeks", "renew", "online", "late",
             "returns", "cost", "reading", "room", "quiet", "children", "parents", "games", "laptops", "club"]
    system = " ".join(rng.choice(words) for _ in range(400))
    questions = [f"Question {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 30)))
                 for i in range(num_requests)]
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    return prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


WORKLOADS = {"standard": standard_workload, "mixed": mixed_workload, "shared-prefix": shared_prefix_workload}


def _progress(msg: str) -> None:
    """Progress goes to stderr; stdout carries only the result line that run_all.py reads."""
    print(f"    [bench] {msg}", file=sys.stderr, flush=True)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_bandwidth_gbs(device) -> float | None:
    """Device memory bandwidth (GB/s) from a large device-to-device copy: the decode roofline's ceiling."""
    import torch

    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() / statistics.median(times) / 1e9  # read + write


def decode_weight_bytes(model: str, bytes_per_weight: int) -> int:
    """Bytes of weights one decode step must read: every layer, the final norm and the lm_head matrix
    (the embedding is only looked up, one row per token). Counted from the model's config."""
    from shared.models import random_weight_names, resolve_model

    cfg = json.loads((resolve_model(model) / "config.json").read_text())
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg["tie_word_embeddings"] = False  # count the lm_head matrix whether or not it is shared
    count = sum(math.prod(shape) for name, shape in random_weight_names(cfg) if name != "model.embed_tokens.weight")
    return count * bytes_per_weight


def run_bench(step: str, model: str, device=None, dtype=None, workload: str = "standard", max_tokens: int = 128,
              repeat: int | None = None) -> dict:
    """Run the workload `repeat` times (default: 3 on CUDA, 1 on CPU) after a warm-up; report the median run."""
    import importlib

    import torch

    _progress(f"{step}: loading {model} ...")
    engine = importlib.import_module(f"steps.{step}.engine")
    llm = engine.LLM(model, device=device, dtype=dtype)
    prompts, params = WORKLOADS[workload](llm.tokenizer, max_tokens)
    if repeat is None:
        repeat = 3 if llm.device.type == "cuda" else 1  # the CPU runs are long and steady; the GPU's are short
    _progress(f"{step}: warm-up, then {repeat} run(s) of {len(prompts)} requests on {llm.device} ...")
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    _sync(llm.device)
    if llm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        _sync(llm.device)
        wall = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        ttft = statistics.median(o.metrics.time_to_first_token for o in outputs)
        runs.append((generated / wall, wall, ttft))
        _progress(f"{step}: run {len(runs)}/{repeat}: {generated} tokens in {wall:.1f} s = {generated / wall:.1f} tokens/s")
    tokens_per_s, wall, ttft = sorted(runs)[len(runs) // 2]  # the median run by throughput
    if llm.device.type == "cuda":
        peak_mb, peak_kind = torch.cuda.max_memory_allocated() / 2**20, "cuda allocated"
    else:
        peak_mb, peak_kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process RSS"
    result = dict(
        step=step, model=model, device=str(llm.device), dtype=str(llm.dtype).replace("torch.", ""),
        backend=llm.backend, workload=workload, requests=len(prompts), generated_tokens=generated,
        repeat=repeat, wall_s=wall, tokens_per_s=tokens_per_s, ttft_median_ms=ttft * 1000,
        peak_memory_mb=peak_mb, peak_memory_kind=peak_kind,
    )
    if llm.device.type == "cuda":
        weight_bytes = decode_weight_bytes(model, llm.dtype.itemsize)
        bandwidth = measure_bandwidth_gbs(llm.device)
        result.update(weight_mb=weight_bytes / 2**20, bandwidth_gbs=bandwidth,
                      roofline_tokens_per_s_batch1=bandwidth * 1e9 / weight_bytes)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step", required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--workload", default="standard", choices=sorted(WORKLOADS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=None, help="runs of the workload (default: 3 on cuda, 1 on cpu)")
    args = parser.parse_args()
    result = run_bench(args.step, args.model, args.device, args.dtype, args.workload, args.max_tokens, args.repeat)
    print("BENCH_JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
