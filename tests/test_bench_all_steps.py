"""The all-steps benchmark: nano-vllm's workload, engine options a step may or may not take, and
docs/data/bench_all_steps.py's three parts (alone, calibration, lanes) on the CPU with a tiny model."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from registry import STEPS, has, introducing, last_before

# The engine option (shared/bench.py's ENGINE_OPTIONS) that each feature brings to a step's LLM.
OPTION_OF_FEATURE = {"scheduler": "max_num_seqs", "chunked_prefill": "max_num_batched_tokens",
                     "preemption": "max_kv_tokens", "int8_kv": "kv_cache_dtype", "cuda_graphs": "enforce_eager",
                     "tensor_parallel": "tensor_parallel_size"}


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
    """Every step's LLM takes exactly the options of the features it has (tests/registry.py)."""
    from shared.bench import ENGINE_OPTIONS, step_engine_options

    assert set(OPTION_OF_FEATURE.values()) == set(ENGINE_OPTIONS)
    for step in STEPS:
        expected = {option for feature, option in OPTION_OF_FEATURE.items() if has(step, feature)}
        assert step_engine_options(step) == expected, step


def test_an_option_the_step_lacks_is_refused_by_name():
    step = last_before("scheduler")  # the last step without seats
    proc = subprocess.run([sys.executable, "-m", "shared.bench", "--step", step, "--model", "random:tiny-llama",
                           "--max-num-seqs", "8"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{step}'s LLM has no option max_num_seqs" in proc.stderr, proc.stderr[-2000:]



class WarmUpRecorder:
    """An engine as warm_up sees it: a device, and the generate calls it got."""

    def __init__(self, device: str):
        import torch

        self.device, self.calls = torch.device(device), []

    def generate(self, prompts, params):
        self.calls.append((prompts, params))


def test_the_warm_up_on_cuda_runs_the_workload_the_timed_runs_will(monkeypatch):
    """Triton compiles a kernel on its first call for each specialisation, so a CUDA warm-up that meets fewer
    shapes and sampling paths than the timed runs leaves compiling inside the clock (a greedy 2-token request
    never meets a long prompt's tiles, flash decoding's splits or the sampled draw). On CUDA the warm-up is the
    workload itself; on the CPU, where nothing compiles, one short request. run_bench warms up through it."""
    from shared import SamplingParams, bench

    prompts = [[1, 2, 3] * 100, [4, 5]]
    params = [SamplingParams(temperature=0.6, max_tokens=500, ignore_eos=True), SamplingParams(max_tokens=7)]
    gpu, cpu = WarmUpRecorder("cuda"), WarmUpRecorder("cpu")
    bench.warm_up(gpu, prompts, params)
    bench.warm_up(cpu, prompts, params)
    assert gpu.calls == [(prompts, params)]
    assert len(cpu.calls) == 1 and cpu.calls[0][0] == prompts[:1] and cpu.calls[0][1].max_tokens == 2

    seen = []
    monkeypatch.setattr(bench, "warm_up", lambda llm, p, sp: seen.append((p, sp)))
    result = bench.run_bench(STEPS[0], "random:tiny-llama", device="cpu", dtype="float32", max_tokens=2)
    assert len(seen) == 1 and len(seen[0][0]) == result["requests"] > 1  # the timed workload, every request
    assert seen[0][1].max_tokens == 2  # the standard workload: one SamplingParams for all, with the run's max_tokens


@pytest.mark.slow
def test_bench_all_steps_runs_alone_calibration_and_lanes(tmp_path):
    # A step without seats (one request at a time), one with seats and no KV pool option, one with a KV pool (the
    # calibrated one), and the newest step, which runs alone (the script runs step04 and step14_7 on alone).
    seatless, seats, pool = introducing("kv_cache"), introducing("scheduler"), introducing("prefix_cache")
    assert not has(seatless, "scheduler") and not has(seats, "preemption") and has(pool, "preemption")
    out = tmp_path / "all.jsonl"
    proc = subprocess.run([sys.executable, "docs/data/bench_all_steps.py", "--model", "random:tiny-llama",
                           "--workload", "standard", "--max-tokens", "8", "--steps", seatless, seats, pool,
                           STEPS[-1], "--hf", "generate", "--lanes", "2", "--calibrate", pool, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    parts = [(r["step"], r["part"]) for r in results]
    # HF and the newest step first, alone; then the pool step alone (the calibration); then the rest two at a time.
    assert parts[:3] == [("hf", "alone"), (STEPS[-1], "alone"), (pool, "calibration")]
    assert sorted(parts[3:]) == sorted([(seatless, "lanes"), (seats, "lanes"), (pool, "lanes")])
    by = {(r["step"], r["part"]): r for r in results}
    assert by[(seats, "lanes")]["options"] == {"max_num_seqs": 64}  # seats, no KV pool option
    assert by[(pool, "lanes")]["options"] == {"max_num_seqs": 64, "max_kv_tokens": 32768}
    assert by[(seatless, "lanes")]["options"] == {} and by[(seatless, "lanes")]["lanes"] == 2
    assert all(r["generated_tokens"] == results[0]["generated_tokens"] for r in results)  # the same work
