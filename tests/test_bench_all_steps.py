"""The all-steps benchmark: nano-vllm's workload, engine options a step may or may not take, and
docs/data/bench_all_steps.py's three parts (alone, calibration, lanes) on the CPU with a tiny model."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from registry import STEPS


def test_nano_vllm_workload_is_nano_vllms_shape():
    from shared import Tokenizer, resolve_model
    from shared.bench import WORKLOADS

    prompts, params = WORKLOADS["nano-vllm"](Tokenizer(resolve_model("random:tiny-llama")), 128)
    assert len(prompts) == len(params) == 256
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= sp.max_tokens <= 1024 for sp in params)
    assert all(sp.ignore_eos and sp.temperature == 0 for sp in params)
    assert all(0 <= t < 10000 for p in prompts for t in p)
    again, _ = WORKLOADS["nano-vllm"](Tokenizer(resolve_model("random:tiny-llama")), 128)
    assert again == prompts  # a fixed seed: every step serves the same requests


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
