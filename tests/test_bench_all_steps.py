"""The all-steps benchmark: nano-vllm's workload, engine options a step may or may not take, and
docs/data/bench_all_steps.py's three parts (alone, calibration, lanes) on the CPU with a tiny model."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from registry import STEPS


def test_nano_vllm_workload_is_nano_vllms_draws():
    """The same draws as nano-vllm's bench.py (random.seed(0), randint(0, 10000) ids in randint(100, 1024)-long
    prompts, then randint(100, 1024) new tokens each, temperature 0.6, ignore_eos), replayed here on the global
    generator exactly as its script does, and its published totals."""
    import random

    from shared import Tokenizer, resolve_model
    from shared.bench import WORKLOADS

    tokenizer = Tokenizer(resolve_model("random:tiny-llama"))
    prompts, params = WORKLOADS["nano-vllm"](tokenizer, 128)
    random.seed(0)
    theirs = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    their_max_tokens = [random.randint(100, 1024) for _ in range(256)]
    assert prompts == theirs and [sp.max_tokens for sp in params] == their_max_tokens
    assert sum(map(len, prompts)) == 142_827 and sum(sp.max_tokens for sp in params) == 133_966
    assert all(sp.ignore_eos and sp.temperature == 0.6 and sp.seed is None for sp in params)
    greedy_prompts, greedy = WORKLOADS["nano-vllm-greedy"](tokenizer, 128)
    assert greedy_prompts == prompts and all(sp.temperature == 0 for sp in greedy)
    assert [sp.max_tokens for sp in greedy] == their_max_tokens


def test_engine_options_are_read_from_each_steps_signature():
    from shared.bench import step_engine_options

    assert step_engine_options("step01") == set()
    assert step_engine_options("step05") == {"max_num_seqs"}
    part6 = {"max_num_seqs", "max_num_batched_tokens", "max_kv_tokens", "kv_cache_dtype"}
    assert step_engine_options("step20") == part6
    assert step_engine_options("step21") == part6 | {"enforce_eager"}
    assert step_engine_options("step22") == part6 | {"enforce_eager", "tensor_parallel_size"}
    assert part6 | {"enforce_eager", "tensor_parallel_size"} <= step_engine_options(STEPS[-1])


def test_an_option_the_step_lacks_is_refused_by_name():
    proc = subprocess.run([sys.executable, "-m", "shared.bench", "--step", "step03", "--model", "random:tiny-llama",
                           "--max-num-seqs", "8"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "step03's LLM has no option max_num_seqs" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_bench_all_steps_runs_alone_calibration_and_lanes(tmp_path):
    out = tmp_path / "all.jsonl"
    proc = subprocess.run([sys.executable, "docs/data/bench_all_steps.py", "--model", "random:tiny-llama",
                           "--workload", "standard", "--max-tokens", "8", "--steps", "step03", "step05", "step09",
                           STEPS[-1], "--hf", "generate", "--lanes", "2", "--calibrate", "step09", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    parts = [(r["step"], r["part"]) for r in results]
    # HF and the newest step first, alone; then step09 alone (the calibration); then the rest two at a time.
    assert parts[:3] == [("hf", "alone"), (STEPS[-1], "alone"), ("step09", "calibration")]
    assert sorted(parts[3:]) == [("step03", "lanes"), ("step05", "lanes"), ("step09", "lanes")]
    by = {(r["step"], r["part"]): r for r in results}
    assert by[("step05", "lanes")]["options"] == {"max_num_seqs": 64}  # step05 has seats, no KV pool option
    assert by[("step09", "lanes")]["options"] == {"max_num_seqs": 64, "max_kv_tokens": 32768}
    assert by[("step03", "lanes")]["options"] == {} and by[("step03", "lanes")]["lanes"] == 2
    assert all(r["generated_tokens"] == results[0]["generated_tokens"] for r in results)  # the same work
