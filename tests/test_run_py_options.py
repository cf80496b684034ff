"""A run.py refuses what it cannot serve before it loads anything: one `error:` line, exit status 2, no answer."""
import subprocess
import sys

import pytest

from conftest import ROOT, STEPS

# The steps whose run.py runs Triton kernels in its lesson (in the interpreter on a CPU).
KERNEL_STEPS = [s for s in STEPS if "interpreter_off_cuda(args)" in (ROOT / "steps" / s / "run.py").read_text()]


def run_py(step, *args):
    return subprocess.run([sys.executable, f"steps/{step}/run.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def assert_refused_before_loading(proc, expected):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("run.py: error: ") and expected in errors[0], proc.stderr
    assert proc.stdout == "", proc.stdout  # nothing loaded, nothing answered


@pytest.mark.parametrize("step", [STEPS[0], STEPS[-1]])  # every run.py takes --prompt from shared/cli.py
@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_an_empty_prompt_is_refused(step, prompt):
    proc = run_py(step, "--model", "random:tiny-llama", "--prompt", prompt)
    assert_refused_before_loading(proc, f"argument --prompt: must be a question, got {prompt!r}")


@pytest.mark.skipif(not KERNEL_STEPS, reason="no step runs Triton kernels in its run.py")
@pytest.mark.parametrize("step", KERNEL_STEPS)
def test_bfloat16_in_the_interpreter_is_refused(step):
    proc = run_py(step, "--model", "random:tiny-llama", "--device", "cpu", "--dtype", "bf16")
    assert_refused_before_loading(proc, "argument --dtype: bfloat16 on cpu: the kernels run in Triton's interpreter")
