"""How far an fp8 KV cache moves the embedded model, beside step20's int8 one, on a CPU (float32).

(1) Greedy answers to shared/prompts.py's 16 questions, 32 tokens each, through step30 with kv_cache_dtype "auto",
"fp8" and "int8": for each quantised cache, how many answers agree with auto's for their first 16 tokens, where each
answer first parts, whether each parting is a near-tie (the vLLM rule: each side's token among the other's 5 most
likely), and the mean |logprob difference| of the chosen tokens where they agree. (2) The K and V the model writes for
four of the questions, quantised as each cache stores them: the relative error ||restored - x|| / ||x||, for fp8 at
several per-layer scales (e4m3's error does not depend on the scale while the values stay in its range) and for
int8's per-row scales.

    python docs/data/bench_step30_drift.py > docs/data/raw/cpu_step30_drift.txt
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from shared import SamplingParams  # noqa: E402
from shared.prompts import QUESTIONS  # noqa: E402
from steps.step30.engine import LLM  # noqa: E402
from steps.step30.model import dequantize_fp8, dequantize_kv, quantize_fp8, quantize_kv  # noqa: E402


def answers(kv_cache_dtype: str):
    llm = LLM(kv_cache_dtype=kv_cache_dtype)
    sp = SamplingParams(temperature=0, max_tokens=32, logprobs=5)
    return [o.outputs[0] for o in llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], sp)]


def compare(auto, other, name: str) -> None:
    agree, drifts, firsts, near = 0, [], [], 0
    for a, b in zip(auto, other):
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        n = min(len(a.token_ids), len(b.token_ids)) if first is None else first
        agree += n >= min(16, len(a.token_ids))
        firsts.append(first)
        if first is not None:
            near += a.token_ids[first] in b.logprobs[first] and b.token_ids[first] in a.logprobs[first]
        drifts += [abs(b.logprobs[i][b.token_ids[i]] - a.logprobs[i][a.token_ids[i]]) for i in range(n)]
    parted = sum(f is not None for f in firsts)
    early = sum(f is not None and f < 4 for f in firsts)
    print(f"{name}: {agree} of {len(auto)} answers agree with auto's for their first 16 tokens; {parted} part, "
          f"{near} of them at a near-tie, {early} within the first 4 tokens; first differences {firsts}; mean "
          f"|dlogprob| {sum(drifts) / len(drifts):.4f} over {len(drifts)} agreeing tokens (largest {max(drifts):.3f})",
          flush=True)


def relative_errors() -> None:
    llm = LLM(kv_cache_dtype="auto")
    llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS[:4]], SamplingParams(temperature=0, max_tokens=8))
    data = llm.kv_cache.data  # [2, layers, blocks, block_size, kv_heads, head_dim]
    written = data.abs().amax(dim=(0, 1, 4, 5)) > 0  # the (block, slot) pairs the requests wrote
    for name, x in (("K", data[0][:, written]), ("V", data[1][:, written])):
        x = x.float()
        err = lambda r: ((r - x).norm() / x.norm()).item()  # noqa: E731
        fp8 = {s: err(dequantize_fp8(quantize_fp8(x, s), s, torch.float32)) for s in (0.0625, 1.0, 4.0)}
        q, scale = quantize_kv(x)
        print(f"{name}: {x.numel()} values, largest |x| {x.abs().max().item():.1f}; relative error: fp8 "
              + ", ".join(f"scale {s}: {e:.4f}" for s, e in fp8.items())
              + f"; int8 per row: {err(dequantize_kv(q, scale, torch.float32)):.4f}", flush=True)


def main():
    runs = {d: answers(d) for d in ("auto", "fp8", "int8")}
    compare(runs["auto"], runs["fp8"], "fp8")
    compare(runs["auto"], runs["int8"], "int8")
    relative_errors()


if __name__ == "__main__":
    main()
