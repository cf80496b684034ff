"""Every step's run.py and run_all.py run from the repo root and say what they ran on."""
import subprocess
import sys

import pytest

from conftest import ROOT, STEPS

TINY = ["--model", "random:tiny-llama", "--max-tokens", "8"]


@pytest.mark.parametrize("step", STEPS)
def test_run_py(step):
    proc = subprocess.run([sys.executable, f"steps/{step}/run.py", *TINY], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for word in ("model: random:tiny-llama", "device: cpu", "dtype: float32", "backend:"):
        assert word in proc.stdout


def test_every_step_folder_is_complete():
    for step in STEPS:
        for f in ("model.py", "engine.py", "run.py", "README.md", "__init__.py"):
            assert (ROOT / "steps" / step / f).is_file(), f"steps/{step}/{f} is missing"
    on_disk = sorted(p.name for p in (ROOT / "steps").iterdir() if p.is_dir() and p.name.startswith("step"))
    assert sorted(STEPS) == on_disk, "tests/conftest.py STEPS must list every step folder"


def test_steps_import_no_other_step():
    for step in STEPS:
        for f in (ROOT / "steps" / step).glob("*.py"):
            text = f.read_text()
            for other in STEPS:
                if other != step:
                    assert f"steps.{other}" not in text and f"steps/{other}" not in text, f"{f} refers to {other}"


def test_run_all_table():
    proc = subprocess.run([sys.executable, "run_all.py", "--model", "random:tiny-llama"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.rindex("step  "):]
    for step in STEPS:
        assert any(line.split()[:1] == [step] and " ok " in line for line in table.splitlines()), table


def test_run_all_bench():
    proc = subprocess.run([sys.executable, "run_all.py", "--bench", "--model", "random:tiny-llama", "--max-tokens", "8",
                           "--steps", ",".join(STEPS[:2])], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tokens/s" in proc.stdout and "TTFT" in proc.stdout
    assert proc.stdout.count("1.00x") >= 1
