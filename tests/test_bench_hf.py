"""run_all.py --bench --hf cb / both: HF transformers' continuous batching beside its padded generate and a step,
each request with its own max_tokens, counted the way the steps count."""
import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT


def run(*args, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def table_cells(stdout: str, rows: int) -> list[list[str]]:
    """The benchmark table's header and first `rows` rows, cut into cells where the dashes line has its columns."""
    lines = stdout[stdout.rindex("step  "):].splitlines()
    columns = [m.start() for m in re.finditer(r"-+", lines[1])]
    return [[line[a:b].strip() for a, b in zip(columns, columns[1:] + [None])] for line in [lines[0]] + lines[2:2 + rows]]


@pytest.mark.slow
def test_run_all_bench_hf_both_on_the_mixed_workload(tmp_path):
    from shared import Tokenizer, resolve_model
    from shared.bench import WORKLOADS

    out = tmp_path / "bench.json"
    # mixed with --max-tokens 12: 64 requests, each asking for its own 8-12 tokens (ignore_eos)
    proc = run("run_all.py", "--bench", "--hf", "both", "--workload", "mixed", "--steps", "step05",
               "--model", "random:tiny-llama", "--max-tokens", "12", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hf, cb, step = json.loads(out.read_text())
    assert (hf["step"], hf["label"]) == ("hf", "HF transformers generate (padded)")
    assert (cb["step"], cb["label"]) == ("hf-cb", "HF transformers continuous batching")
    assert step["step"] == "step05"
    for key in ("model", "device", "dtype", "workload", "requests", "repeat"):
        assert hf[key] == cb[key] == step[key], key
    assert (cb["device"], cb["dtype"], cb["workload"], cb["requests"]) == ("cpu", "float32", "mixed", 64)
    assert "continuous batching" in cb["backend"] and cb["ttft_median_ms"] > 0
    # Every request ran to its own max_tokens, in both HF baselines as in the step: the same tokens counted.
    _, params = WORKLOADS["mixed"](Tokenizer(resolve_model("random:tiny-llama")), 12)
    asked = sum(sp.max_tokens for sp in params)
    assert len({sp.max_tokens for sp in params}) > 1  # the requests do ask for different lengths
    assert cb["generated_tokens"] == hf["generated_tokens"] == step["generated_tokens"] == asked
    assert hf["padded_generated_tokens"] > asked  # generate ran every row to the longest request's length
    # One ratio per baseline in every row, and one column each in the table.
    for r in (hf, cb, step):
        assert r["vs_hf"] == r["tokens_per_s"] / hf["tokens_per_s"]
        assert r["vs_hf_cb"] == r["tokens_per_s"] / cb["tokens_per_s"]
    header, hf_row, cb_row, step_row = table_cells(proc.stdout, 3)
    vs_generate, vs_cb = header.index("vs HF generate"), header.index("vs HF cb")
    assert hf_row[:2] == [hf["label"], f"{hf['tokens_per_s']:.1f}"] and hf_row[vs_generate] == "1.00x"
    assert cb_row[:2] == [cb["label"], f"{cb['tokens_per_s']:.1f}"] and cb_row[vs_cb] == "1.00x"
    assert cb_row[vs_generate] == f"{cb['tokens_per_s'] / hf['tokens_per_s']:.2f}x"
    assert step_row[0] == "step05"
    assert step_row[vs_generate] == f"{step['vs_hf']:.2f}x" and step_row[vs_cb] == f"{step['vs_hf_cb']:.2f}x"
    assert f"[bench] {cb['label']}: run 1/1: {asked} tokens" in proc.stderr


def test_hf_cb_stops_each_request_by_its_own_rule():
    from shared import SamplingParams
    from shared.bench import _hf_cb_stop_ids

    eos = {2, 0}
    assert _hf_cb_stop_ids(SamplingParams(temperature=0, max_tokens=4), eos) == [0, 2]
    assert _hf_cb_stop_ids(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), eos) == -1  # none
    assert _hf_cb_stop_ids(SamplingParams(temperature=0, ignore_eos=True, stop_token_ids=[7]), eos) == [7]
    assert _hf_cb_stop_ids(SamplingParams(temperature=0, stop_token_ids=[7]), eos) == [0, 2, 7]
    # sampled with ignore_eos (nano-vllm's workload): each request runs to its max_tokens, as in the steps
    assert _hf_cb_stop_ids(SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True), eos) == -1
    for sp in (SamplingParams(temperature=0.7), SamplingParams(temperature=0, stop=["."])):
        with pytest.raises(ValueError, match="--hf cb: the HF baseline runs without stop strings, and samples only"):
            _hf_cb_stop_ids(sp, eos)


@pytest.mark.parametrize("args, expected", [
    (["--hf", "nope"], "argument --hf: invalid choice: 'nope'"),
    (["--hf", "cb", "--max-num-seqs", "4"], "--max-num-seqs is an engine option"),
    (["--hf", "cb", "--model", "nope"], "unknown model 'nope'"),
])
def test_bench_hf_cb_bad_input_is_one_error_line(args, expected):
    proc = run("-m", "shared.bench", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert expected in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize("argv, hf", [(["--bench", "--hf"], "generate"), (["--bench", "--hf", "cb"], "cb"),
                                      (["--bench", "--hf", "both"], "both"), (["--bench"], None)])
def test_run_all_hf_choices(argv, hf):
    import run_all

    assert run_all.parse_args(argv).hf == hf
