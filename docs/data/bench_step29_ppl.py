"""step29: the perplexity of the embedded model (smollm2-135m) on a held-out text, float32, with its projections'
weights as the checkpoint ships them (the GGUF's Q4_1 blocks, which is what the float checkpoint holds,
dequantised), rounded to int4 (round to nearest, groups of G) and rounded with AWQ's activation-aware scales
(quant.py's awq_scales, alpha searched per projection on a calibration text), for G = 32 (the blocks the kernels
read), 64 and 192 (coarser groups, where rounding loses more; the hidden size, 576, is no multiple of 128).

Texts: Python's own reference documentation (pydoc_data.topics, shipped with every Python): the calibration text
and the held-out text are different topics. The model is transformers' (the same weights every step loads); the
perplexity is exp of the mean negative log-likelihood of every token after the first, in windows of 1,024 tokens.

    python3 docs/data/bench_step29_ppl.py --out docs/data/raw/cpu_step29_ppl.json > docs/data/raw/cpu_step29_ppl.txt
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from shared.models import resolve_model  # noqa: E402
from steps.step29.quant import awq_scales, fake_quantize  # noqa: E402

CALIBRATION = ["assignment", "class", "for", "if"]
HELD_OUT = ["exceptions", "import", "lambda", "function", "try", "while", "with", "numbers", "specialnames"]


def text(topics: list[str]) -> str:
    from pydoc_data.topics import topics as docs
    return "\n\n".join(docs[t] for t in topics)


def perplexity(model, ids: torch.Tensor, window: int = 1024) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, ids.numel() - 1, window):
            chunk = ids[start:start + window + 1]
            if chunk.numel() < 2:
                break
            logits = model(chunk[None, :-1]).logits[0].float()
            nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
            count += chunk.numel() - 1
    return math.exp(nll / count)


def groups(model):
    """The projections that share an input, by layer: (q, k, v), (o,), (gate, up), (down,)."""
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        yield [a.q_proj, a.k_proj, a.v_proj]
        yield [a.o_proj]
        yield [m.gate_proj, m.up_proj]
        yield [m.down_proj]


def calibration_inputs(model, ids: torch.Tensor) -> dict:
    """Each projection's input rows on the calibration text (a hook on the first projection of each group)."""
    seen, hooks = {}, []
    for g in groups(model):
        hooks.append(g[0].register_forward_hook(lambda mod, inp, out, g=g: seen.__setitem__(id(g[0]), inp[0][0].detach())))
    with torch.no_grad():
        model(ids[None])
    for h in hooks:
        h.remove()
    return seen


def quantized_copy(float_state: dict, model, group: int, calib: dict | None) -> dict:
    """The projections' weights replaced by their int4 rounding (AWQ: Q(W s) / s with s per group of projections)."""
    alphas = []
    with torch.no_grad():
        for g in groups(model):
            ws = [float_state[id(p)] for p in g]
            if calib is None:
                for p, w in zip(g, ws):
                    p.weight.copy_(fake_quantize(w, group))
                continue
            s, alpha = awq_scales(torch.cat(ws), calib[id(g[0])], group)
            alphas.append(alpha)
            for p, w in zip(g, ws):
                p.weight.copy_(fake_quantize(w * s, group) / s)
    return {"alphas": alphas}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=8192, help="held-out tokens (at most)")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    held = torch.tensor(tok(text(HELD_OUT))["input_ids"][:args.tokens])
    calib_ids = torch.tensor(tok(text(CALIBRATION))["input_ids"][:512])
    float_state = {id(p): p.weight.detach().clone() for g in groups(model) for p in g}
    result = {"model": "smollm2-135m", "held_out_tokens": held.numel(), "calibration_tokens": calib_ids.numel(),
              "held_out_topics": HELD_OUT, "calibration_topics": CALIBRATION, "perplexity": {}}
    t = time.time()
    result["perplexity"]["float (the Q4_1 blocks dequantised)"] = perplexity(model, held)
    calib = calibration_inputs(model, calib_ids)
    for group in (32, 64, 192):
        for name, c in ((f"int4 round to nearest, groups of {group}", None), (f"int4 AWQ, groups of {group}", calib)):
            info = quantized_copy(float_state, model, group, c)
            result["perplexity"][name] = perplexity(model, held)
            if info["alphas"]:
                result[f"awq_alphas_g{group}"] = info["alphas"]
    with torch.no_grad():  # back to the float weights: the same perplexity as at the start
        for g in groups(model):
            for p_ in g:
                p_.weight.copy_(float_state[id(p_)])
    result["perplexity_float_again"] = perplexity(model, held)
    result["seconds"] = time.time() - t
    for name, value in result["perplexity"].items():
        print(f"{name}: perplexity {value:.4f}")
    print(f"held-out tokens {held.numel()}, calibration tokens {calib_ids.numel()}; float again: "
          f"{result['perplexity_float_again']:.4f}")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
