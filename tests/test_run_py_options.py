"""A run.py refuses what it cannot serve before it loads anything: one `error:` line, exit status 2, no answer."""
import subprocess
import sys

import pytest

from conftest import ROOT, STEPS
from registry import NEWEST

# The steps whose run.py runs Triton kernels in its lesson (in the interpreter on a CPU).
KERNEL_STEPS = [s for s in STEPS if "interpreter_off_cuda(args)" in (ROOT / "steps" / s / "run.py").read_text()]


def run_py(step, args, capsys, monkeypatch):
    """`python steps/<step>/run.py args...` -> (exit status, stdout, stderr). The newest step runs as the real
    command, in a fresh process; the others in this process (runpy, patched argv), where an exception other than
    SystemExit, a traceback in a process, fails the test. (These runs stop before the model loads;
    test_scripts.py's test_run_py runs every step's run.py to its end as the real command.)"""
    if step == NEWEST:
        proc = subprocess.run([sys.executable, f"steps/{step}/run.py", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        return proc.returncode, proc.stdout, proc.stderr
    import runpy

    monkeypatch.setattr(sys, "argv", [f"steps/{step}/run.py", *args])
    capsys.readouterr()
    try:
        runpy.run_module(f"steps.{step}.run", run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def assert_refused_before_loading(result, expected):
    status, stdout, stderr = result
    assert status == 2 and "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("run.py: error: ") and expected in errors[0], stderr
    assert stdout == "", stdout  # nothing loaded, nothing answered


@pytest.mark.parametrize("step", [STEPS[0], STEPS[-1]])  # every run.py takes --prompt from shared/cli.py
@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_an_empty_prompt_is_refused(step, prompt, capsys, monkeypatch):
    result = run_py(step, ["--model", "random:tiny-llama", "--prompt", prompt], capsys, monkeypatch)
    assert_refused_before_loading(result, f"argument --prompt: must be a question, got {prompt!r}")


@pytest.mark.skipif(not KERNEL_STEPS, reason="no step runs Triton kernels in its run.py")
@pytest.mark.parametrize("step", KERNEL_STEPS)
def test_bfloat16_in_the_interpreter_is_refused(step, capsys, monkeypatch):
    result = run_py(step, ["--model", "random:tiny-llama", "--device", "cpu", "--dtype", "bf16"], capsys, monkeypatch)
    assert_refused_before_loading(result, "argument --dtype: bfloat16 on cpu: the kernels run in Triton's interpreter")
