"""step27's measurements: speculative decoding with n-gram drafts against step26, in one call.

    python docs/data/bench_spec.py --model smollm2-135m --max-tokens 128 --repeats 3 --out docs/data/raw/cpu_step27_spec
    python3 docs/data/bench_spec.py --model random:qwen3-0.6b --max-tokens 128 --repeats 3 --verify-cost --nano-vllm \\
        --gpu-memory-utilization 0.3 --out h200_step27_spec_graphs                      (on a GPU)
    python3 docs/data/bench_spec.py --model random:qwen3-0.6b --max-tokens 128 --repeats 3 --no-batch1 \\
        --batch-sweep 1 2 4 8 16 32 64 --gpu-memory-utilization 0.3 --out h200_step27_sweep

Batch 1 (one request at a time), four workloads, greedy but the last:
    copy-heavy   the model is given a text and asked to repeat, edit or refactor it: a paragraph to rewrite with its
                 typos fixed, a function to refactor (a variable renamed), a function to copy
    chat         chat questions (shared/anatomy.py's QUESTIONS), answered to their end
    standard     shared/bench.py's standard prompts, --max-tokens new tokens each (EOS ignored)
    random-0.6   nano-vllm's first 4 prompts of random ids, sampled at 0.6 with seeds 0..3, --max-tokens each (EOS
                 ignored): text that never repeats, so no step can draft and step27 overlaps as step26 does (the
                 overlapped steps column counts spec_undraftable_steps)
Each workload runs through step26 and step27 (speculative_config: --k drafts, lookup 4..2), alternated --repeats
times; tokens/s is the median run's (all its requests' tokens over their time). The outputs of both must be equal,
token for token; the drafts proposed and accepted, the mean accepted length (1 + accepted / verified requests) and the
tokens per forward are step27's over all its runs.

--verify-cost: the time of one forward for one request with k = 0 (a decode; also replayed as a CUDA graph, on a
GPU) .. 8 drafts, after a prompt of 256 tokens, the median of 20: eager, and (on a GPU, k < --k + 1) replayed from
the verify graph, whose rows are --k + 1 tokens.
--batch-sweep B ..: B requests at once, greedy, through step26 and step27 drafting in every step
(disable_by_batch_size None), for each B: where drafting stops paying.
--nano-vllm: shared/bench.py's nano-vllm workload (sampled, as nano-vllm runs it; 256 seats, a budget of 16,384
tokens) through step26 and step27 with its default disable_by_batch_size (or --disable-by-batch-size), alternated;
with --nano-always, step27 drafting in every step too.
Each part builds its engines and shuts them down before the next.
--out PREFIX writes PREFIX.json and PREFIX.txt (this output).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from shared import SamplingParams  # noqa: E402
from shared.anatomy import FIX_THE_TYPOS, QUESTIONS  # noqa: E402
from shared.bench import STANDARD_QUESTIONS, nano_vllm_workload  # noqa: E402
from shared.cli import format_table  # noqa: E402

CODE = '''def count_words(text):
    x = {}
    for word in text.split():
        word = word.lower().strip(".,;:!?")
        if word:
            x[word] = x.get(word, 0) + 1
    return sorted(x.items(), key=lambda item: -item[1])
'''
COPY_HEAVY = [FIX_THE_TYPOS,
              f"Refactor this function: rename the variable x to counts. Show the whole function.\n\n{CODE}",
              f"Repeat this function exactly.\n\n{CODE}"]
LINES: list[str] = []
# the engine options of the project's nano-vllm runs (shared/bench.py --max-num-seqs 256 --max-num-batched-tokens
# 16384): every one of the 256 requests has a seat, and a step holds nano-vllm's token budget
NANO_OPTIONS = {"max_num_seqs": 256, "max_num_batched_tokens": 16384}


def say(text: str = "") -> None:
    print(text, flush=True)
    LINES.append(text)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_at_a_time(llm, prompts, params) -> tuple[list[list[int]], float, int]:
    """Each prompt alone -> (the outputs, the seconds of all of them, the tokens)."""
    outs, seconds = [], 0.0
    for prompt, sp in zip(prompts, params):
        sync(llm.device)
        start = time.perf_counter()
        out = llm.generate([prompt], sp)[0].outputs[0]
        sync(llm.device)
        seconds += time.perf_counter() - start
        outs.append(out.token_ids)
    return outs, seconds, sum(len(o) for o in outs)


def batch_one(args, old, new) -> dict:
    tok = new.tokenizer
    chat = lambda qs: [tok.apply_chat_template([{"role": "user", "content": q}]) for q in qs]  # noqa: E731
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    random_prompts = nano_vllm_workload(tok)[0][:4]
    workloads = {
        "copy-heavy": (chat(COPY_HEAVY), [greedy] * len(COPY_HEAVY)),
        "chat": (chat(QUESTIONS[:4]), [greedy] * 4),
        "standard": (chat(STANDARD_QUESTIONS), [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                               ignore_eos=True)] * len(STANDARD_QUESTIONS)),
        # nano-vllm's first 4 draws of random ids, sampled at its 0.6, seeded: drafts almost never match
        "random-0.6": (random_prompts, [SamplingParams(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True,
                                                       seed=i) for i in range(len(random_prompts))]),
    }
    results, rows = {}, []
    workloads = {name: w for name, w in workloads.items() if name in args.workloads}
    for name, (prompts, params) in workloads.items():
        one_at_a_time(old, prompts[:1], [SamplingParams(temperature=0, max_tokens=8)])  # warm-ups
        one_at_a_time(new, prompts[:1], [SamplingParams(temperature=0, max_tokens=8)])
        before = dict(new.stats)
        runs = {"step26": [], "step27": []}
        outputs = []
        for _ in range(args.repeats):
            for label, llm in (("step26", old), ("step27", new)):
                outs, seconds, tokens = one_at_a_time(llm, prompts, params)
                runs[label].append(tokens / seconds)
                outputs.append(outs)
        equal = all(o == outputs[0] for o in outputs)
        s = {k: new.stats[k] - before[k] for k in ("spec_proposed", "spec_accepted", "spec_verified", "forwards",
                                                    "emitted_tokens", "spec_undraftable_steps")}
        med = {label: statistics.median(v) for label, v in runs.items()}
        results[name] = {"tokens_per_s": runs, "median_tokens_per_s": med, "speedup": med["step27"] / med["step26"],
                         "outputs_equal": equal, "tokens": sum(map(len, outputs[0])), **s,
                         "acceptance_rate": s["spec_accepted"] / max(s["spec_proposed"], 1),
                         "mean_accepted_length": 1 + s["spec_accepted"] / max(s["spec_verified"], 1),
                         "tokens_per_forward": s["emitted_tokens"] / max(s["forwards"], 1)}
        r = results[name]
        rows.append([name, len(prompts), r["tokens"], f"{med['step26']:.1f}", f"{med['step27']:.1f}",
                     f"{r['speedup']:.2f}x", f"{100 * r['acceptance_rate']:.0f}%", f"{r['mean_accepted_length']:.2f}",
                     f"{r['tokens_per_forward']:.2f}", r["spec_undraftable_steps"], "yes" if equal else "NO"])
    say(f"batch 1 (one request at a time; greedy, random-0.6 sampled), {args.model} on {new.device}, {args.repeats} runs each, alternated; "
        f"tokens/s of the median run; step27 with up to {args.k} drafts")
    say(format_table(["workload", "requests", "tokens", "step26 tok/s", "step27 tok/s", "speed-up", "accepted",
                      "mean accepted length", "tokens per forward", "overlapped steps", "equal"], rows))
    return results


def verify_cost(args, new) -> dict:
    """One request after a 256-token prompt: the forward of k drafts + 1 token, k = 0..8, timed alone: eager, and
    replayed from the verify graph (k + 1 tokens padded to the graph's, up to --k), when there are graphs."""
    llm = new
    prompt = list(range(1000, 1256))
    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), request_id="cost")
    seq, bm = None, llm.block_manager
    while seq is None or not seq.output_ids:  # its prompt computed, its first token out
        llm.step()
        seq = llm.scheduler.requests.get("cost")
    llm.scheduler._make_room(seq)
    runner, verify_graphs = llm.runner, llm.runner.verify_graphs
    from steps.step27.scheduler import SchedulerOutput

    def timed(plan, rows=None) -> float:
        samples = []
        for i in range(25):
            sync(llm.device)
            start = time.perf_counter()
            runner.execute(plan, logits_rows=rows)
            sync(llm.device)
            if i >= 5:
                samples.append(time.perf_counter() - start)
        return 1000 * statistics.median(samples)

    times, graphed = {}, {}
    for k in range(0, 9):
        drafts = list(range(2000, 2000 + k))
        bm.allocate(seq, seq.num_tokens + k)
        seq.token_ids.extend(drafts)
        plan, rows = SchedulerOutput.build([(seq, 1)], drafts={0: drafts}), list(range(k + 1))  # k + 1 tokens
        runner.verify_graphs = None  # eager
        times[k] = timed(plan, rows)
        runner.verify_graphs = verify_graphs
        if verify_graphs is not None and verify_graphs.can_run(plan):
            graphed[k] = timed(plan, rows)
        del seq.token_ids[len(seq.token_ids) - k:]
        bm.trim(seq, seq.num_tokens)
    graph = timed(SchedulerOutput.build([(seq, 1)])) if runner.graphs is not None else None
    llm.abort_request("cost")
    rows = [[k, f"{times[k]:.3f}", f"{times[k] / times[0]:.2f}", f"{graphed[k]:.3f}" if k in graphed else "-",
             f"{graphed[k] / graph:.2f}" if k in graphed else "-"] for k in times]
    say("\nthe forward of one request after a 256-token prompt, with k drafts (k + 1 tokens), median of 20, ms:")
    say(f"eager, and replayed from the verify graph ({verify_graphs.query_len if verify_graphs else 'none'} tokens "
        f"per row); a decode replayed from its graph: {f'{graph:.3f} ms' if graph is not None else 'no graphs here'}")
    say(format_table(["k", "eager ms", "vs k = 0", "graph ms", "vs a decode's graph"], rows))
    return {"ms": times, "graph_ms": graphed, "decode_graph_ms": graph}


def batch_sweep(args, old, new) -> dict:
    """B requests at once (greedy, --max-tokens each, EOS ignored; the copy-heavy, chat and standard prompts in
    turn), for each B of --batch-sweep: step26 against step27 drafting in every step (disable_by_batch_size None),
    alternated --repeats times. Where the ratio falls below 1, drafting costs more than it gives."""
    tok = new.tokenizer
    chat = lambda qs: [tok.apply_chat_template([{"role": "user", "content": q}]) for q in qs]  # noqa: E731
    pool = chat(COPY_HEAVY + QUESTIONS + STANDARD_QUESTIONS)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in (old, new):  # warm-up: the shapes
        llm.generate(pool[:2], SamplingParams(temperature=0, max_tokens=8))
    results, rows = {}, []
    for b in args.batch_sweep:
        prompts = [pool[i % len(pool)] for i in range(b)]
        before = dict(new.stats)
        runs = {"step26": [], "step27": []}
        for _ in range(args.repeats):
            for label, llm in (("step26", old), ("step27", new)):
                sync(llm.device)
                start = time.perf_counter()
                outs = llm.generate(prompts, [sp] * b)
                sync(llm.device)
                runs[label].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
        s = {k: new.stats[k] - before[k] for k in ("spec_accepted", "spec_verified", "forwards", "emitted_tokens",
                                                    "verify_replays", "spec_steps")}
        med = {label: statistics.median(v) for label, v in runs.items()}
        results[b] = {"tokens_per_s": runs, "median_tokens_per_s": med, "speedup": med["step27"] / med["step26"],
                      **s, "mean_accepted_length": 1 + s["spec_accepted"] / max(s["spec_verified"], 1)}
        rows.append([b, f"{med['step26']:.0f}", f"{med['step27']:.0f}", f"{med['step27'] / med['step26']:.2f}x",
                     f"{results[b]['mean_accepted_length']:.2f}",
                     f"{s['verify_replays']} of {s['spec_steps']}"])
    say(f"\nB requests at once (greedy, {args.max_tokens} new tokens each), {args.repeats} runs each, alternated; "
        f"tokens/s of the median run;")
    say(f"step27 drafts in every step (up to {args.k} drafts, disable_by_batch_size None)")
    say(format_table(["B", "step26 tok/s", "step27 tok/s", "speed-up", "mean accepted length",
                      "verify steps from a graph"], rows))
    return results


def nano_vllm(args, old, switched, always=None) -> dict:
    prompts, params = nano_vllm_workload(old.tokenizer)
    prompts, params = prompts[:args.nano_requests], params[:args.nano_requests]
    engines = {"step26": old, "step27": switched, **({"step27 always": always} if always is not None else {})}
    runs = {label: [] for label in engines}
    limit = switched.speculative.disable_by_batch_size
    for llm in engines.values():  # warm-up: the shapes
        llm.generate(prompts[:8], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16))
    before = dict(switched.stats)  # its steps that drafted and that did not, in the timed runs
    for _ in range(args.nano_repeats):
        for label, llm in engines.items():
            sync(llm.device)
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            sync(llm.device)
            runs[label].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    med = {label: statistics.median(v) for label, v in runs.items()}
    say(f"\nnano-vllm's workload ({len(prompts)} requests, sampled at 0.6, as its bench.py), {args.nano_repeats} runs "
        f"each, alternated,\n{NANO_OPTIONS}, median tokens/s:\n  step26 {med['step26']:.0f}\n"
        f"  step27 with disable_by_batch_size={limit}{' (its default)' if args.disable_by_batch_size is None else ''}: "
        f"{med['step27']:.0f} ({med['step27'] / med['step26']:.2f}x), "
        f"{switched.stats['spec_steps'] - before['spec_steps']} of its steps drafted, "
        f"{switched.stats['spec_disabled_steps'] - before['spec_disabled_steps']} did not")
    if always is not None:
        say(f"  step27 drafting in every step: {med['step27 always']:.0f} "
            f"({med['step27 always'] / med['step26']:.2f}x)")
    return {"tokens_per_s": runs, "median_tokens_per_s": med, "disable_by_batch_size": limit}

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default: %(default)s)")
    p.add_argument("--verify-cost", action="store_true")
    p.add_argument("--no-batch1", action="store_true", help="leave the batch-1 workloads out")
    p.add_argument("--workloads", nargs="+", default=["copy-heavy", "chat", "standard", "random-0.6"],
                   choices=["copy-heavy", "chat", "standard", "random-0.6"],
                   help="the batch-1 workloads (default: all four)")
    p.add_argument("--batch-sweep", type=int, nargs="+", default=[], metavar="B",
                   help="B requests at once, for each B given: step26 against step27 drafting in every step")
    p.add_argument("--nano-vllm", action="store_true")
    p.add_argument("--nano-repeats", type=int, default=3)
    p.add_argument("--nano-always", action="store_true", help="also step27 drafting in every step (slow)")
    p.add_argument("--nano-requests", type=int, default=256, help="the first N of its 256 requests (a quick check)")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="the third nano-vllm engine's (default: the engine's own)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.28, help="each engine's share on a GPU")
    p.add_argument("--out", type=Path, required=True, help="PREFIX: writes PREFIX.json and PREFIX.txt")
    args = p.parse_args()
    from steps.step26.engine import LLM as Before
    from steps.step27.engine import LLM as After

    config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    # on a GPU each engine's share counts what the engines built before it hold: the n-th asks for n shares
    share = lambda n: dict(device=args.device, gpu_memory_utilization=n * args.gpu_memory_utilization)  # noqa: E731
    say(f"command: python docs/data/bench_spec.py {' '.join(sys.argv[1:])}\n")
    result = {"command": " ".join(sys.argv), "model": args.model, "k": args.k}

    def section(name, engines, run):
        """Build the engines (the n-th asks for n shares on a GPU), run, then shut them down before the next."""
        built = [cls(args.model, **options, **share(n)) for n, (cls, options) in enumerate(engines, 1)]
        say(f"[{name}] step27 backend: {built[1].backend}")
        result["device"] = str(built[0].device)
        result[name] = run(*built)
        for llm in built:
            llm.shutdown()
        del built
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    drafting = {"speculative_config": config}  # the engine's own disable_by_batch_size
    always = {"speculative_config": {**config, "disable_by_batch_size": None}}  # drafts in every step
    if not args.no_batch1 or args.verify_cost:
        def small(old, new):
            out = {"batch1": batch_one(args, old, new)} if not args.no_batch1 else {}
            if args.verify_cost:
                out["verify_cost"] = verify_cost(args, new)
            return out
        section("batch 1", [(Before, {}), (After, always)], small)
    if args.batch_sweep:
        seats = {"max_num_seqs": max(args.batch_sweep)}
        section("batch sweep", [(Before, seats), (After, {**always, **seats})],
                lambda old, new: batch_sweep(args, old, new))
    if args.nano_vllm:
        switched = drafting if args.disable_by_batch_size is None else {
            "speculative_config": {**config, "disable_by_batch_size": args.disable_by_batch_size}}
        engines = [(Before, NANO_OPTIONS), (After, {**switched, **NANO_OPTIONS})]
        if args.nano_always:
            engines.append((After, {**always, **NANO_OPTIONS}))
        section("nano-vllm", engines, lambda *built: nano_vllm(args, *built))
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
