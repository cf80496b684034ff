"""Time a newcomer's very first `make demo`, phase by phase, and write docs/data/first_demo.json.

    git clone <repo> /tmp/fresh && cd /tmp/fresh            a fresh clone (no .venv, no .cache), on a quiet machine
    python3 docs/data/measure_first_demo.py                 then copy docs/data/first_demo.json back

Runs `make demo` as a newcomer does (the set-up: the virtual environment, torch, this project, the embedded model's
wheel; then the newest step's run.py, which converts the embedded model on its first use) with every line of its
output timestamped as it arrives, and splits the wall time at the lines that start each phase. Refuses to run where
.venv or the model cache already exists: that would not be a first run.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from registry import NEWEST  # noqa: E402  (tests/registry.py)

# The line that starts each phase (the first line containing the text), in the order they come.
PHASES = [
    ("virtual environment", "==> [1/4]"),
    ("torch", "==> [2/4]"),
    ("this project and its dependencies", "==> [3/4]"),
    ("the embedded model's wheel", "==> [4/4]"),
    ("run.py: imports, until the model's conversion starts", "==> set-up done"),
    ("run.py: the model's conversion (once)", "[shared.models] first use of"),
    ("run.py: the demo", f"== {NEWEST}:"),
]


def main() -> None:
    cache = Path(os.environ.get("LLM_STEPS_CACHE", ROOT / ".cache"))
    if (ROOT / ".venv").exists() or (cache / "models").exists():
        sys.exit(f"not a first run: {ROOT / '.venv'} or {cache / 'models'} exists (use a fresh clone)")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(["make", "demo"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines = []
    for line in proc.stdout:
        lines.append((time.perf_counter() - start, line.rstrip("\n")))
        print(f"{lines[-1][0]:7.1f}s {lines[-1][1]}", flush=True)
    status = proc.wait()
    wall = time.perf_counter() - start
    if status != 0:
        sys.exit(f"make demo failed (exit status {status})")
    starts = []
    for name, marker in PHASES:
        at = next((t for t, text in lines if marker in text), None)
        if at is None:
            sys.exit(f"no line with {marker!r} in make demo's output: the phase {name!r} cannot be timed")
        starts.append((name, at))
    phases = [{"phase": name, "seconds": round((starts[i + 1][1] if i + 1 < len(starts) else wall) - at, 1)}
              for i, (name, at) in enumerate(starts)]
    phases.insert(0, {"phase": "make's own start", "seconds": round(starts[0][1], 1)})
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    record = {"command": "python3 docs/data/measure_first_demo.py (a fresh clone: make demo)", "date": str(date.today()),
              "git_commit": commit, "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python "
              f"{platform.python_version()}", "step": NEWEST, "wall_s": round(wall, 1), "phases": phases}
    out = ROOT / "docs" / "data" / "first_demo.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    for p in phases:
        print(f"{p['seconds']:7.1f} s  {p['phase']}")
    print(f"{wall:7.1f} s  in all -> {out}")


if __name__ == "__main__":
    main()
