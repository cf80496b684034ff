"""The engine's host-side hot path, old against new: the same step of two trees of steps, in one process.

An engine step does Python work besides the forward: build the flat batch (token ids, positions, slot mapping,
block tables), copy it to the device, time the phases, grow the text. At batch 1 on a GPU the forward of a small
model is shorter than that work, so it sets the decode speed. This script times `LLM.generate` of one step (step17
unless --step) from each --steps-root given (a folder holding step directories: the repo's `steps/`, or an old copy
made with `git archive <commit> steps | tar -x -C /tmp/old`), on two workloads:

    decode1   1 prompt, 64 new tokens (EOS ignored), median of --repeats runs
    batch8    8 prompts, 32 new tokens each, median of --repeats runs
    mixed     the benchmark's mixed workload (shared/bench.py: 64 requests, prompts of 8-192 tokens, 8-128 new
              tokens each), median of --repeats runs

and prints one JSON line per (variant, workload): wall ms, ms per generated token, tokens/s, the median time between
consecutive tokens of a request (decode only: the prefill is left out), and on CUDA the number of
torch.cuda.synchronize() calls and of synchronizing operations seen by torch.cuda.set_sync_debug_mode.

    python docs/data/bench_hot_path.py --steps-root /tmp/old/steps --steps-root steps              CPU, tiny model
    python docs/data/bench_hot_path.py --steps-root /tmp/old/steps --steps-root steps --model smollm2-135m --device cuda
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from shared import SamplingParams  # noqa: E402
from shared.bench import mixed_workload  # noqa: E402

WORKLOADS = {"decode1": (1, 64), "batch8": (8, 32), "mixed": (64, None)}  # name -> (prompts, new tokens each)
PROMPTS = ["The capital of France is", "Once upon a time", "The best way to learn is", "In 1969 the first",
           "My favourite colour is", "A prime number is", "The ocean is", "def fibonacci(n):"]


def load_engine(steps_root: Path, step: str, tag: str):
    """Import steps_root/step/engine.py as the package `tag` (two trees hold the same module names)."""
    package_dir = steps_root / step
    spec = importlib.util.spec_from_file_location(tag, package_dir / "__init__.py",
                                                  submodule_search_locations=[str(package_dir)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[tag] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{tag}.engine")


class SyncCounter:
    """Counts torch.cuda.synchronize() calls and operations that make the host wait for the GPU (CUDA only)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.synchronize_calls = self.sync_ops = 0

    def __enter__(self):
        if self.cuda:
            self.original = torch.cuda.synchronize

            def counted(*args, **kwargs):
                self.synchronize_calls += 1
                return self.original(*args, **kwargs)

            torch.cuda.synchronize = counted
            self.caught = warnings.catch_warnings(record=True)
            self.records = self.caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self.caught.__exit__(*exc)
            torch.cuda.synchronize = self.original
            # explicit synchronize() calls also warn; count the other synchronizing operations
            self.sync_ops = sum("synchroniz" in str(w.message) for w in self.records) - self.synchronize_calls
        return False


def backend_name(llm) -> str | None:
    """Which attention ran: a name, or an attention object's name (steps that hold one)."""
    backend = getattr(llm.model, "attention_backend", None)
    return getattr(backend, "name", None) or (backend if isinstance(backend, str) or backend is None
                                              else type(backend).__name__)


def run_workload(llm, num_prompts: int, new_tokens: int | None, device: torch.device, count_syncs: bool) -> dict:
    if new_tokens is None:  # the mixed workload: its own prompts and lengths
        prompts, params = mixed_workload(llm.tokenizer, num_requests=num_prompts)
    else:
        prompts, params = PROMPTS[:num_prompts], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    counter = SyncCounter(device if count_syncs else torch.device("cpu"))
    with counter:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    gaps = [b - a for o in outs for a, b in zip(o.metrics.token_times, o.metrics.token_times[1:])]
    return {"wall_ms": 1000 * wall, "tokens": tokens, "inter_token_ms": 1000 * statistics.median(gaps),
            "synchronize_calls": counter.synchronize_calls if counter.cuda else None,
            "sync_ops": counter.sync_ops if counter.cuda else None,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps-root", action="append", required=True,
                        help="a folder of step directories; give it twice (old, new) to compare")
    parser.add_argument("--step", default="step17")
    parser.add_argument("--model", default="random:tiny-llama")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention-backend", default=None, help="None: the engine's default for the device")
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS), help="default: all of them")
    args = parser.parse_args()
    tokens_of = {}
    for index, root in enumerate(args.steps_root):
        engine = load_engine(Path(root).resolve(), args.step, f"hot_path_variant{index}")
        llm = engine.LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend)
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        for name, (num_prompts, new_tokens) in WORKLOADS.items():
            if args.workload and name not in args.workload:
                continue
            runs = [run_workload(llm, num_prompts, new_tokens, llm.device, count_syncs=i == 0)
                    for i in range(args.repeats + 1)]
            counted, timed = runs[0], runs[1:]  # the sync-counting run is not timed (the debug mode costs time)
            wall = statistics.median(r["wall_ms"] for r in timed)
            tokens = timed[0]["tokens"]
            same = tokens_of.setdefault(name, counted["token_ids"]) == counted["token_ids"]
            print(json.dumps({"variant": str(root), "step": args.step, "workload": name, "model": args.model,
                              "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
                              "backend": backend_name(llm),
                              "prompts": num_prompts, "new_tokens": new_tokens or "8-128", "repeats": args.repeats,
                              "wall_ms": round(wall, 2), "ms_per_token": round(wall / tokens, 4),
                              "tokens_per_s": round(1000 * tokens / wall, 1),
                              "inter_token_ms": round(statistics.median(r["inter_token_ms"] for r in timed), 4),
                              "synchronize_calls": counted["synchronize_calls"], "sync_ops": counted["sync_ops"],
                              "same_tokens_as_first_variant": same}), flush=True)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
