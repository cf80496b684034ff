"""A newcomer's first command: `make demo` on a fresh machine, with the model conversion in the same process.

Every other test runs with the model already converted and with TRITON_INTERPRET set before anything is imported,
so neither of them sees what a first run does. This one runs the demo step's run.py as `make demo` does, in a
clean process with an empty cache folder and without TRITON_INTERPRET in its environment.
"""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT


def demo_script() -> str:
    """The run.py that `make demo` runs, read from the Makefile."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("\ndemo:") + 1:].splitlines()[1]
    return re.search(r"steps/\S+/run\.py", recipe).group(0)


def test_make_demo_runs_the_newest_step():
    from registry import NEWEST

    assert demo_script() == f"steps/{NEWEST}/run.py", "make demo must show the newest step (Makefile, README)"
    assert f"steps/{NEWEST}/run.py" in (ROOT / "README.md").read_text()


@pytest.mark.slow
def test_make_demo_works_on_an_empty_cache(tmp_path):
    script = demo_script()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LLM_STEPS_CACHE"] = str(tmp_path / "cache")  # nothing converted yet
    proc = subprocess.run([sys.executable, script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{script} failed on its first run:\n{proc.stderr[-4000:]}"
    assert "converted in" in proc.stderr, "the cache was not empty: the conversion did not run"
    assert "\nA: " in proc.stdout and "Traceback" not in proc.stderr
    assert (tmp_path / "cache" / "models" / "smollm2-135m" / "config.json").is_file()
