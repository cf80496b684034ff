"""Measure the data behind the chapter figures that the benchmark does not give, and write it to
docs/data/figures.json. The docs hook (docs/hooks/figures.py) draws the plots and the traced tables
from that file when the site is built; nothing here is drawn.

    .venv/bin/python docs/data/make_figures.py            # all of it (a few minutes on a 2-core CPU)
    .venv/bin/python docs/data/make_figures.py --only ms_per_token

What it measures, each with the step's own LLM on the embedded smollm2-135m (CPU, fp32 by default):
  ms_per_token     steps 01-03: milliseconds spent on each generated token, one chat question
  batch_size       step04: tokens/s of one generate() call at batch sizes 1-32 (same length answers)
  timeline         step05: who is in the batch at each iteration, static groups vs continuous batching
  utilisation      step08: tokens stored / KV slots reserved, contiguous rules vs paged blocks
  slot_mapping     step08: a request's block table, and where its tokens live in the pool
  hash_chain       step09: the chained block hashes of a real prompt, and a second request that hits them
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shared import DEFAULT_MODEL, SamplingParams  # noqa: E402
from shared.cli import per_token_ms  # noqa: E402
from shared.prompts import QUESTIONS  # noqa: E402
from steps.step08.run import contiguous_reservation  # noqa: E402  (the rule step08's figure uses)

OUT = Path(__file__).resolve().parent / "figures.json"


def llm_of(step: str, model: str, device, **kwargs):
    return importlib.import_module(f"steps.{step}.engine").LLM(model, device=device, **kwargs)


def ms_per_token(model, device, tokens=160):
    """Steps 01-03 generate `tokens` tokens for one chat question; the time of each token."""
    out = {"question": QUESTIONS[0], "tokens": tokens}
    for step in ("step01", "step02", "step03"):
        llm = llm_of(step, model, device)
        llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        o = llm.chat([{"role": "user", "content": QUESTIONS[0]}],
                     SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))[0]
        out["prompt_tokens"] = len(o.prompt_token_ids)
        out[step] = [round(ms, 2) for ms in per_token_ms(o.metrics.token_times, o.metrics.arrival_time)]
        print(f"  {step}: token 2 {out[step][1]:.1f} ms, token {tokens} {out[step][-1]:.1f} ms", flush=True)
    return out


def batch_size(model, device, sizes=(1, 2, 4, 8, 16, 32), tokens=32):
    """step04: one generate() call of B chat questions, `tokens` new tokens each (ignore_eos, so every row
    has the same length and nothing finishes early): tokens/s against B."""
    llm = llm_of("step04", model, device)
    llm.chat([[{"role": "user", "content": QUESTIONS[0]}]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    rows = []
    for b in sizes:
        convs = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(b)]
        start = time.perf_counter()
        outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"batch": b, "tokens": generated, "seconds": round(seconds, 3),
                     "tokens_per_s": round(generated / seconds, 2)})
        print(f"  batch {b}: {generated / seconds:.1f} tokens/s", flush=True)
    return {"tokens_per_request": tokens, "rows": rows}


def _trace(llm, groups):
    """Run the requests of each group (a group starts when the previous one has ended) through add_request
    and step(); after every iteration record who was computed: the requests that joined (a prefill
    iteration) or, if none joined, everyone who was running before it (a decode iteration)."""
    iterations, names = [], {}
    for group in groups:
        for name, max_tokens in group:
            rid = llm.add_request(f"Request {name}: tell me about the number {len(names)}.",
                                  SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            names[rid] = name
        while llm.has_unfinished_requests():
            before = {r.request_id for r in llm.scheduler.running}
            finished = [o.request_id for o in llm.step()]
            after = {r.request_id for r in llm.scheduler.running}
            joined = (after | set(finished)) - before
            computed = joined if joined else before
            iterations.append({"kind": "prefill" if joined else "decode",
                               "computed": sorted(names[i] for i in computed),
                               "finished": sorted(names[i] for i in finished),
                               "seated": sorted(names[i] for i in after | set(finished))})
    return iterations


def timeline(model, device, seats=4):
    """step05: A needs 12 tokens, B..K 3 each, 4 seats: step04's policy (static groups of 4) against
    continuous batching, traced iteration by iteration with the real scheduler."""
    requests = [("A", 12)] + [(c, 3) for c in "BCDEFGHIJK"]
    llm = llm_of("step05", model, device, max_num_seqs=seats)
    static = _trace(llm, [requests[i:i + seats] for i in range(0, len(requests), seats)])
    continuous = _trace(llm, [requests])
    print(f"  static {len(static)} iterations, continuous {len(continuous)}", flush=True)
    return {"seats": seats, "requests": dict(requests), "static": static, "continuous": continuous}


def utilisation(model, device, block_sizes=(64, 16, 4), num_requests=16, max_tokens=96):
    """step08: 16 seeded requests (prompts of 8-64 tokens, 8-96 new tokens); after every iteration, add up
    tokens stored and KV slots reserved: paged (measured from the block tables) for several block sizes,
    and the two contiguous rules (computed for the same requests at the same moments)."""
    result = {"requests": num_requests, "max_tokens": max_tokens, "rows": []}
    for bs in block_sizes:
        llm = llm_of("step08", model, device, block_size=bs, max_num_seqs=8)
        rng = random.Random(0)
        vocab = llm.model.config.vocab_size
        lengths = {}
        for _ in range(num_requests):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(8, 64))]
            sp = SamplingParams(temperature=0, max_tokens=rng.randint(8, max_tokens), ignore_eos=True)
            lengths[llm.add_request(prompt, sp)] = (len(prompt), sp.max_tokens)
        stored = paged = upfront = doubling = 0
        while llm.has_unfinished_requests():
            llm.step()
            for r in llm.scheduler.running:
                p, m = lengths[r.request_id]
                stored += r.num_computed_tokens
                paged += len(r.block_table) * bs
                upfront += contiguous_reservation(p, m, r.num_computed_tokens, doubling=False)
                doubling += contiguous_reservation(p, m, r.num_computed_tokens, doubling=True)
        if not result["rows"]:
            result["rows"] += [{"policy": "contiguous, prompt + max_tokens (step05-06)", "utilisation": stored / upfront},
                               {"policy": "contiguous, doubling (step07)", "utilisation": stored / doubling}]
        result["rows"].append({"policy": f"paged, blocks of {bs} (step08)", "utilisation": stored / paged})
        print(f"  blocks of {bs}: {100 * stored / paged:.1f}%", flush=True)
    return result


def slot_mapping(model, device, block_size=4):
    """step08 with blocks of 4: three requests join together, A then decodes past its second block and
    takes a block the others left; record A's block table and where each of its tokens lives."""
    llm = llm_of("step08", model, device, block_size=block_size, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = {llm.add_request(list(range(1000, 1000 + n)), sp): name for name, n in (("A", 7), ("B", 3), ("C", 9))}
    tables = {}
    while llm.has_unfinished_requests():
        llm.step()
        for r in llm.scheduler.running:
            tables[ids[r.request_id]] = (list(r.block_table), r.num_computed_tokens)
    table, length = tables["A"]
    rows = [{"pos": p, "logical": p // block_size, "physical": table[p // block_size], "offset": p % block_size,
             "slot": table[p // block_size] * block_size + p % block_size} for p in range(length)]
    return {"block_size": block_size, "prompts": {"A": 7, "B": 3, "C": 9}, "max_tokens": 6,
            "tables": {k: v[0] for k, v in tables.items()}, "lengths": {k: v[1] for k, v in tables.items()},
            "rows": rows}


def hash_chain(model, device, block_size=16):
    """step09: the chained hashes of the first blocks of a real chat prompt with a system prompt, computed
    by step09's block_hash, and the hits a second request with the same system prompt gets."""
    bm_module = importlib.import_module("steps.step09.block_manager")
    llm = llm_of("step09", model, device, block_size=block_size)
    system = ("You are a helpful librarian at a small town library. Answer questions about books, opening hours "
              "and membership in one short sentence, politely, and never invent facts.")
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in QUESTIONS[:2]]
    prompt = llm.tokenizer.apply_chat_template(convs[0])
    rows, parent = [], None
    for b in range((len(prompt) - 1) // block_size):
        tokens = tuple(prompt[b * block_size:(b + 1) * block_size])
        h = bm_module.block_hash(parent, tokens)
        rows.append({"block": b, "tokens": list(tokens), "parent": parent, "hash": h})
        parent = h
    sp = SamplingParams(temperature=0, max_tokens=4)
    llm.chat(convs[:1], sp)
    before = dict(llm.block_manager.stats)
    llm.chat(convs[1:], sp)
    after = dict(llm.block_manager.stats)
    second = llm.tokenizer.apply_chat_template(convs[1])
    common = next((i for i, (a, b) in enumerate(zip(prompt, second)) if a != b), min(len(prompt), len(second)))
    return {"block_size": block_size, "system": system, "questions": QUESTIONS[:2], "prompt_tokens": len(prompt),
            "second_prompt_tokens": len(second), "common_prefix_tokens": common, "rows": rows,
            "second_request": {k: after[k] - before.get(k, 0) for k in after}}


MEASURES = {"ms_per_token": ms_per_token, "batch_size": batch_size, "timeline": timeline,
            "utilisation": utilisation, "slot_mapping": slot_mapping, "hash_chain": hash_chain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default=None, help="comma-separated measures (default: all)")
    args = parser.parse_args()
    import torch

    data = json.loads(OUT.read_text()) if OUT.is_file() else {}
    names = args.only.split(",") if args.only else list(MEASURES)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for name in names:
        print(f"{name} ...", flush=True)
        start = time.perf_counter()
        result = MEASURES[name](args.model, args.device)
        result["meta"] = {
            "command": f"python docs/data/make_figures.py --only {name}" + (f" --model {args.model}" if args.model != DEFAULT_MODEL else ""),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": f"{args.device} ({platform.machine()}, {torch.get_num_threads()} torch threads), fp32" if args.device == "cpu" else args.device,
            "model": args.model, "torch": torch.__version__, "git_commit": commit,
            "seconds": round(time.perf_counter() - start, 1),
        }
        data[name] = result
        OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"written {OUT}")


if __name__ == "__main__":
    main()
