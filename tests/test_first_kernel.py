"""step15's chapter shows a first Triton kernel (a row softmax) for the reader to run as is on a CPU, in Triton's
interpreter: the code block after `<!-- first-kernel -->` in docs/steps/step15.md runs, matches torch.softmax (the
snippet asserts it) and prints what the chapter says it prints."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("triton")

CHAPTER = ROOT / "docs" / "steps" / "step15.md"


def first_kernel_snippet() -> str:
    text = CHAPTER.read_text()
    m = re.search(r"<!-- first-kernel -->\s*\n\s*```python\n(.*?)\n\s*```", text, flags=re.S)
    assert m, f"{CHAPTER.name}: no ```python block right after <!-- first-kernel -->"
    lines = m.group(1).splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())  # a block inside a list item
    return "\n".join(line[indent:] for line in lines) + "\n"


def test_the_first_kernel_of_step15_runs_in_the_interpreter(tmp_path):
    (tmp_path / "first_kernel.py").write_text(first_kernel_snippet())
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "first_kernel.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "max |difference| from torch.softmax" in run.stdout, run.stdout + run.stderr
