"""Why a verify step costs more than a decode on a CPU: PyTorch's matmul at a few rows, on the model's own shapes.

    python docs/data/cpu_small_m_matmul.py --model smollm2-135m --out docs/data/raw/cpu_small_m_matmul.txt

A decode multiplies one row (M = 1) by every weight matrix; a verify step of k drafts multiplies k + 1 rows. The
weights are the same bytes either way, so on a device that is bound by reading them the two should cost about the
same. For each weight shape of the model (the fused qkv, the attention output, the fused gate-up, the MLP down, and
the lm_head), at M = 1 .. 9 rows: the time of `x @ w.T` (torch.nn.functional.linear's product, what the model
runs) and of the same product computed as `(w @ x.T).T` (the weight as the left operand: another kernel of the
same library, the same result up to rounding). Every layer's matrices are tensors of their own, so each pass reads
all the weights from memory as a forward does; the median of --repeats passes, the row counts and forms alternated.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from shared.cli import format_table  # noqa: E402
from shared.models import resolve_model  # noqa: E402

ROWS = (1, 2, 3, 4, 5, 9)


def shapes_of(config: dict) -> dict[str, tuple[int, int]]:
    """The model's weight matrices as (in features, out features)."""
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return {"qkv": (hidden, (heads + 2 * kv) * head_dim), "o": (heads * head_dim, hidden),
            "gate_up": (hidden, 2 * config["intermediate_size"]), "down": (config["intermediate_size"], hidden),
            "lm_head": (hidden, config["vocab_size"])}


def one_pass(weights: list[tuple[str, torch.Tensor]], m: int, form: str) -> dict[str, float]:
    """Every weight of the model once, in order (layer by layer, then the lm_head), each multiplied by M rows ->
    seconds per shape name, summed over the layers. Each matrix is its own tensor, so a pass reads all the weights'
    bytes from memory, as a forward does, rather than a matrix the cache still holds."""
    spent = dict.fromkeys([name for name, _ in weights], 0.0)
    for name, w in weights:
        x = torch.randn(m, w.shape[1])
        start = time.perf_counter()
        x @ w.T if form == "x@w.T" else (w @ x.T).T
        spent[name] += time.perf_counter() - start
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    import json

    config = json.loads((resolve_model(args.model) / "config.json").read_text())
    shapes = shapes_of(config)
    torch.manual_seed(0)
    layers = config["num_hidden_layers"]
    weights = [(name, torch.randn(n, k)) for _ in range(layers) for name, (k, n) in shapes.items() if name != "lm_head"]
    weights.append(("lm_head", torch.randn(shapes["lm_head"][1], shapes["lm_head"][0])))
    weights = sorted(weights, key=lambda nw: nw[0] == "lm_head")  # the layers' four in order, the lm_head last
    forms = ("x@w.T", "(w@x.T).T")
    samples = {(m, form): [] for m in ROWS for form in forms}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for m in ROWS:
            for form in forms:
                samples[m, form].append(one_pass(weights, m, form))
    ms = {(m, form, name): 1000 * statistics.median(run[name] for run in samples[m, form][1:])
          for m in ROWS for form in forms for name in shapes}
    total = {(m, form): sum(ms[m, form, name] for name in shapes) for m in ROWS for form in forms}
    base = total[1, "x@w.T"]
    megabytes = sum(w.numel() * 4 for _, w in weights) / 1e6
    lines = [f"command: python docs/data/cpu_small_m_matmul.py --model {args.model} --repeats {args.repeats} "
             f"--out {args.out}",
             f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32; {args.model}: {layers} layers, "
             f"{megabytes:.0f} MB of weights read per pass; median of {args.repeats} passes, alternated", ""]
    rows = [[form] + [f"{total[m, form]:.1f} ({total[m, form] / base:.2f}x)" for m in ROWS] for form in forms]
    lines += ["one forward's products (every layer's four, then the lm_head), ms at M rows; x the M = 1 of x@w.T",
              format_table(["form"] + [f"M={m}" for m in ROWS], rows), ""]
    for form in forms:
        rows = [[f"{name} {k}->{n}" + (f" x {layers}" if name != "lm_head" else "")]
                + [f"{ms[m, form, name]:.1f}" for m in ROWS] for name, (k, n) in shapes.items()]
        lines += [f"{form} by weight, ms summed over the layers", format_table(["weight"] + [f"M={m}" for m in ROWS],
                                                                              rows), ""]
    text = "\n".join(lines).rstrip()
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
