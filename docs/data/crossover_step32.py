"""When does step32's host tier win? A block copied back over the host link against the same block computed again,
from a model's shape alone (no GPU, no timing): the bytes its KV takes, the FLOPs its tokens cost in a prefill.

    python docs/data/crossover_step32.py > docs/data/raw/cpu_step32_crossover.txt

Per token, in the model's dtype (2 bytes here, bf16):
    KV bytes             2 (K and V) x layers x KV heads x head_dim x 2
    prefill FLOPs at p   2 x the layers' projection weights (q, k, v, o, gate, up, down)
                         + 4 x layers x heads x head_dim x p   (q.k and p.v over the p tokens before it)
A block of B tokens copies back in B x KV bytes / link bandwidth and is computed again in B x FLOPs(p) / prefill rate,
the prefill rate being the GPU's peak bf16 rate times the share of it a prefill reaches (its MFU). The tier wins
where the copy is shorter:

    KV bytes / link bandwidth  <  FLOPs(p) / prefill rate

The copy costs the same wherever the block sits; computing it again costs more the later it sits (the attention
term). The crossover position p* is where the two are equal: past it the copy wins (p* is 0 where the copy wins from
a context's first token).
The link bandwidths and MFUs below are a grid of assumptions, not measurements; the peak is the H200's data sheet.
What this step's GPU run measures (not run yet): the host-to-device bandwidth of pinned copies and the prefill's rate
on this engine, which place the real crossover on this grid.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shared.models import RANDOM_SHAPES  # noqa: E402

PEAK_TFLOPS = 989.0  # H200 (and H100 SXM) dense bf16, NVIDIA's data sheet
BLOCK = 16  # tokens in a KV block (the engine's default block_size)
DTYPE_BYTES = 2  # bf16
LINKS_GBS = (25.0, 50.0, 64.0)  # host-to-device bandwidths to try, GB/s (PCIe 5.0 x16 is 64 GB/s a direction on paper)
MFUS = (0.3, 0.5, 0.7)  # shares of the peak a prefill reaches
# Qwen3-8B's shape (HF's Qwen/Qwen3-8B config.json), a larger model beside the repository's random shapes
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128)


def per_token(shape: dict) -> tuple[int, float, float]:
    """-> (KV bytes per token, projection FLOPs per token, attention FLOPs per token per token of context)."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape.get("head_dim") or h // heads
    kv_bytes = 2 * layers * kv_heads * d * DTYPE_BYTES
    projections = h * heads * d + 2 * h * kv_heads * d + heads * d * h + 3 * h * shape["intermediate_size"]
    return kv_bytes, 2.0 * layers * projections, 4.0 * layers * heads * d


def main() -> None:
    shapes = {name: RANDOM_SHAPES[name] for name in ("smollm2-135m", "qwen3-0.6b")}
    shapes["qwen3-8b"] = QWEN3_8B
    print(f"A block of {BLOCK} tokens, bf16, against the H200's peak of {PEAK_TFLOPS:.0f} TFLOP/s (data sheet)")
    for name, shape in shapes.items():
        kv, linear, attention = per_token(shape)
        print(f"\n{name}: KV {kv} bytes a token ({kv * BLOCK / 1e6:.2f} MB a block); prefill {linear / 1e9:.3f} "
              f"GFLOP a token + {attention / 1e6:.3f} MFLOP per token of context before it")
        for link in LINKS_GBS:
            copy_us = kv * BLOCK / (link * 1e9) * 1e6
            for mfu in MFUS:
                rate = PEAK_TFLOPS * 1e12 * mfu
                recompute_us = linear * BLOCK / rate * 1e6
                # FLOPs(p*) = kv * rate / link  ->  p* = (kv * rate / link - linear) / attention
                crossover = max(0.0, (kv * rate / (link * 1e9) - linear) / attention)
                print(f"{name} link {link:.0f} GB/s mfu {mfu:.1f}: copy {copy_us:.1f} us, recompute at position 0 "
                      f"{recompute_us:.1f} us, the tier wins from position {crossover:.0f}")


if __name__ == "__main__":
    main()
