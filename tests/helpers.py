"""Helpers for the tests: importing a step's engine, comparing outputs, the golden outputs, the tolerances (in one
place)."""
from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

# Tolerances, justified by measurement (see docs/reference/testing.md):
# - step01 vs HF transformers, fp32 logits: same math, different op order. Measured max |diff| 5.8e-5
#   on smollm2-135m over a 45-token sequence; the bound leaves ~10x headroom.
HF_LOGITS_ATOL_FP32 = 5e-4
# - consecutive steps, fp32: a KV cache or a batch changes matmul shapes and so the rounding order.
#   Differences measured so far are below 1e-4; the bound leaves headroom.
STEP_LOGPROB_ATOL_FP32 = 1e-3
# - tensor parallel (step22) vs one rank, fp32 on the CPU: a row-parallel matmul is N partial sums added by an
#   all-reduce, the same additions in another order (fp32, ~1e-7 relative each), through every layer. Measured max
#   |dlogprob| 6.4e-6 at tp=3 on smollm2-135m and 9.5e-7 at tp=2 on the tiny models; the bound leaves >10x headroom.
TP_LOGPROB_ATOL_FP32 = 1e-4
# - any step vs HF in bf16 on the GPU: bf16 keeps 8 bits of mantissa, so logits wobble by ~1e-2
#   relative; logprobs of the chosen tokens are compared on average and at worst.
BF16_LOGPROB_MEAN_ATOL = 0.05
BF16_LOGPROB_MAX_ATOL = 0.5
# - the vLLM rule: at the first position where two runs choose different tokens, each side's token
#   must be among the other's top-k candidates (a near-tie broken differently, not a bug).
VLLM_RULE_TOP_K = 5


class FakeRequest:
    """What a block manager reads of a request (or sequence), without an engine: for block-manager tests."""

    def __init__(self, token_ids):
        self.token_ids = list(token_ids)
        self.block_table, self.block_hashes = [], []
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0  # step14_5 on: blocks registered in the cache (block_hashes then covers all tokens)

    @property
    def num_tokens(self):
        return len(self.token_ids)


class RowWrites:
    """Counts, while active, the entries that torch operators write into a BlockTables' rows (model_runner.py, step18
    on): a TorchDispatchMode sees every operator as it runs, so the count is what reaches the rows tensor, not what
    the code says it wrote. An indexed write (index_put_) counts the entries it indexes; any other write into the
    rows counts the whole view it writes."""

    def __init__(self, tables):
        self.storage = tables.rows.untyped_storage().data_ptr()
        self.entries = 0

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                schema = func._schema.arguments
                values = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
                for a, v in zip(schema, values):
                    if (a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor)
                            and v.untyped_storage().data_ptr() == counter.storage):
                        counter.entries += counter.count(func, v, values)
                return func(*args, **kwargs)

        self._mode = Mode()
        self._mode.__enter__()
        return self

    @staticmethod
    def count(func, target, values) -> int:
        """The entries one operator writes into target (a view of the rows)."""
        indices = values[1] if func._schema.name in ("aten::index_put_", "aten::_index_put_impl_") else None
        if indices is None or any(i is None for i in indices):
            return target.numel()
        import torch

        indexed = math.prod(torch.broadcast_shapes(*(i.shape for i in indices)))
        return indexed * math.prod(target.shape[len(indices):])

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


def edited_model(tmp_path, model: str, edit_config=None, drop=None) -> str:
    """A copy of `model`'s folder (a name resolve_model knows) in tmp_path, with its config.json edited in place by
    edit_config(dict), or one tensor (its name: drop) left out of its checkpoint."""
    import shutil

    from safetensors.torch import load_file, save_file

    from shared import resolve_model

    src, dst = resolve_model(model), tmp_path / "edited"
    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop:
        weights = load_file(dst / "model.safetensors")
        del weights[drop]
        save_file(weights, dst / "model.safetensors")
    return str(dst)


def load_engine(step: str):
    """The `engine` module of steps/<step>."""
    return importlib.import_module(f"steps.{step}.engine")


def step_module(step: str, name: str):
    """steps/<step>/<name>.py (name may be dotted: "kernels.decode")."""
    return importlib.import_module(f"steps.{step}.{name}")


def shell_env() -> dict:
    """The environment of a command a test runs as a user runs it: this process's, without what tests/conftest.py
    sets for the tests' own imports, TRITON_INTERPRET (a user's shell on a CPU has none; a run.py that runs kernels
    sets it itself, before anything imports triton)."""
    import os

    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def copies_param(group: list[str], *values, id: str = ""):
    """A pytest.param for a test of step modules that the steps of `group` (one group of registry.distinct_copies)
    hold byte for byte: the test runs on the group's first step, its id names every step of the group
    ("step20+step21+step22-..."), and the mark `copies` carries them (conftest.py: the group is part of make
    test-fast when it holds one of the newest steps)."""
    steps = "+".join(group)
    return pytest.param(group[0], *values, id=f"{steps}-{id}" if id else steps, marks=pytest.mark.copies(*group))


def copies_params(steps: list[str], *modules: str) -> list:
    """One copies_param per distinct content of `modules` among `steps` (registry.distinct_copies): the values of
    a test's `step` parameter for a test that exercises nothing of a step but those modules."""
    from registry import distinct_copies

    return [copies_param(group) for group in distinct_copies(steps, *modules)]


# ---- the golden outputs: step01's greedy answers to the harness prompts -------------------------------------
# step01 is checked against HF transformers (test_equivalence.py); every other step is checked against this file
# instead of against its predecessor's outputs computed again. Regenerate it with `python tests/golden.py`.
GOLDEN = Path(__file__).resolve().parent / "golden" / "step01.json"


def completion_record(completion) -> dict:
    """What the golden file keeps of one completion: tokens, finish reason, each position's top logprobs."""
    return {"token_ids": list(completion.token_ids), "finish_reason": completion.finish_reason,
            "logprobs": [sorted([[int(t), float(lp)] for t, lp in row.items()], key=lambda x: -x[1])
                         for row in completion.logprobs]}


def read_golden(model: str, path: Path = GOLDEN) -> tuple[list[list[int]], list]:
    """-> (the prompts' token ids, one completion-like object per prompt) for `model`."""
    entry = json.loads(path.read_text())["models"][model]
    outs = [SimpleNamespace(token_ids=r["token_ids"], finish_reason=r["finish_reason"],
                            logprobs=[{t: lp for t, lp in row} for row in r["logprobs"]]) for r in entry["outputs"]]
    return entry["prompts"], outs


def chosen_logprobs(completion) -> list[float]:
    return [lp[t] for t, lp in zip(completion.token_ids, completion.logprobs)]


def scheduled_work(result) -> list:
    """What a scheduler's schedule() returned, as one list of (request, tokens): up to step17 it returns
    (decodes, chunks), a decode being one token; from step18, which has no phases, that list itself."""
    if isinstance(result, tuple):
        decodes, chunks = result
        return [(r, 1) for r in decodes] + list(chunks)
    return list(result)


def compare_completions(a, b, logprob_atol: float, exact: bool = True, label: str = "") -> float:
    """Assert two completions agree. exact=True: identical tokens. exact=False: the vLLM rule.

    Returns the largest |logprob difference| over the compared tokens.
    """
    ta, tb = list(a.token_ids), list(b.token_ids)
    n = min(len(ta), len(tb))
    first_diff = next((i for i in range(n) if ta[i] != tb[i]), None)
    if exact:
        assert ta == tb, f"{label}: tokens differ at position {first_diff}: {ta[:first_diff + 3] if first_diff is not None else ta} vs {tb[:first_diff + 3] if first_diff is not None else tb}"
        assert a.finish_reason == b.finish_reason, f"{label}: finish_reason {a.finish_reason} vs {b.finish_reason}"
    elif first_diff is not None:
        top_a = sorted(a.logprobs[first_diff], key=a.logprobs[first_diff].get, reverse=True)[:VLLM_RULE_TOP_K]
        top_b = sorted(b.logprobs[first_diff], key=b.logprobs[first_diff].get, reverse=True)[:VLLM_RULE_TOP_K]
        assert tb[first_diff] in top_a and ta[first_diff] in top_b, (
            f"{label}: first divergence at {first_diff}: {ta[first_diff]} vs {tb[first_diff]} not in each other's top-{VLLM_RULE_TOP_K}")
        n = first_diff
    else:  # no divergence: the rule allows none of a shorter output (a request cut early is not a near-tie)
        assert len(ta) == len(tb) and a.finish_reason == b.finish_reason, (
            f"{label}: equal up to {n} tokens, then {len(ta)} ({a.finish_reason}) vs {len(tb)} ({b.finish_reason})")
    worst = 0.0
    for i in range(n):
        la, lb = a.logprobs[i][ta[i]], b.logprobs[i][tb[i]]
        assert math.isfinite(la) and math.isfinite(lb), f"{label}: non-finite logprob at {i}"
        worst = max(worst, abs(la - lb))
    assert worst <= logprob_atol, f"{label}: logprob differs by {worst:.2e} > {logprob_atol:.0e}"
    return worst


def stop_longer_than_the_first_text(tokenizer, tokens):
    """A stop string for an output of these tokens: the start of its text, completed by token k + 1, where the text
    of the first k tokens (2 characters or more) is shorter than the hold-back, len(stop) - 1. With it the final
    text is "", and a partial output cut at len(text) - hold, a negative index there, would show all but the last
    character of the text of k tokens."""
    pieces = [tokenizer.decode(tokens[:k]) for k in range(len(tokens) + 1)]
    k = next(k for k in range(1, len(tokens)) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= len(pieces[k]) + 2)
    stop = pieces[k + 1][:len(pieces[k]) + 2]
    assert len(pieces[k]) < len(stop) - 1  # the text so far is shorter than the hold-back
    return stop


class TritonLaunches:
    """Counts, while active, every Triton kernel launch, compiled or in the interpreter, where Triton's runtime runs
    it (JITFunction.run, InterpretedFunction.run), by kernel: by_kernel["steps.step18.kernels.attention.
    _mixed_attention_kernel"] = n. It sees every launch a wrapper makes inside itself, which a counter kept by the
    wrapper's caller does not. A launch Triton only compiles (warmup=True) is not counted."""

    def __enter__(self):
        import collections

        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        self.by_kernel, self._patched = collections.Counter(), []
        for cls in (InterpretedFunction, JITFunction):
            def run(fn_self, *args, _original=cls.run, **kwargs):
                if not kwargs.get("warmup"):
                    self.by_kernel[f"{fn_self.fn.__module__}.{fn_self.fn.__name__}"] += 1
                return _original(fn_self, *args, **kwargs)

            self._patched.append((cls, cls.run))
            cls.run = run
        return self

    def __exit__(self, *exc):
        for cls, original in self._patched:
            cls.run = original
        return False


# ---- processes, read from /proc (Linux) --------------------------------------------------------------------
def stat_fields(pid) -> list[str] | None:
    """/proc/PID/stat after the command name: [state, parent pid, ...]; None once the process is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children_of(pid: int) -> set[int]:
    """The live (not zombie) processes whose parent is pid."""
    return {int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()
            and (f := stat_fields(e.name)) is not None and f[1] == str(pid) and f[0] != "Z"}


def child_processes() -> set[int]:
    """The live children of this process, read from /proc, leaving out multiprocessing's resource tracker (a helper
    the spawn method starts once per process, shared by everything that spawns; not an engine's worker)."""
    import os
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return children_of(os.getpid()) - {tracker}


def alive(pid: int) -> bool:
    """pid exists and has not exited (a zombie has exited: it waits only to be reaped)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def start_server(step: str, *args, script: str = "serve.py", env: dict | None = None, timeout_s: float = 180):
    """steps/<step>/<script> (serve.py, or step35's router.py) run as a command on a free port, once it answers
    /health: -> (the process, its base URL). Its stdout and stderr are pipes; the caller ends it."""
    import subprocess
    import sys
    import time

    import httpx

    port = importlib.import_module(f"steps.{step}.parallel").free_port()
    proc = subprocess.Popen([sys.executable, f"steps/{step}/{script}", "--port", str(port), *args],
                            cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{script} {args} did not start"
        time.sleep(0.2)

