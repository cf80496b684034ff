"""Time the test suite as a newcomer runs it and write docs/data/test_suite.json (the testing page reads it).

    git clone <repo> /tmp/fresh && cd /tmp/fresh                 a fresh clone, on a quiet machine
    /usr/bin/time -f %e make .venv/.installed                    the set-up alone: S seconds
    .venv/bin/python docs/data/measure_test_suite.py --setup-s S  then copy docs/data/test_suite.json back

Runs `make test` and `make test-fast` (pytest-xdist, two workers, as the Makefile runs them) with a JUnit report,
times each, and from the report's per-test times works out what each step costs: the sum of the times of the
tests that take that step. A new step copied from the newest one costs what an ordinary step costs (tiny-model
tests only); the newest step and the last step of each Part also run the real model. The projection to more steps
adds those costs, divided by the two workers, to the measured time.

In a fresh clone the first `make test` also converts the embedded model (the cache is empty), as CI does: CI's
time (`bash .ci/run` = `make test` on a fresh clone) is the set-up (--setup-s) plus that first `make test`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from registry import NEWEST, STEPS, part_ends  # noqa: E402  (tests/registry.py)

WORKERS = 2  # the Makefile's PYTEST_WORKERS


def run_make(target: str, junit: Path) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(["make", target, f"PYTEST_ARGS=--junitxml={junit} -q"], cwd=ROOT, capture_output=True,
                          text=True)
    wall = time.perf_counter() - start
    summary = [line for line in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    if proc.returncode != 0:
        sys.exit(f"make {target} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"wall_s": round(wall, 1), "summary": summary[-1].strip("= ") if summary else ""}


def test_times(junit: Path) -> list[tuple[str, float]]:
    """(node id, seconds) of every test case of a JUnit report."""
    cases = ET.parse(junit).getroot().iter("testcase")
    return [(f"{c.get('classname')}::{c.get('name')}", float(c.get("time", 0))) for c in cases]


def step_of(name: str) -> str | None:
    """The step a test takes, read from its parameters (`test_x[step16-...]`, `test_y[1-step10]`). A test run once
    for steps of the same content (`test_z[step20+step21+step22-...]`, tests/helpers.py's copies_param) ran on the
    first of them: its time is that step's."""
    # pytest-xdist's --dist loadgroup suffix: "test_x[step16]@step16", in a JUnit report "test_x[step16]@step16]"
    name = re.sub(r"@[^\[\]]*\]?$", "", name)
    params = name[name.find("[") + 1:-1] if "[" in name else ""
    found = [(m.start(), s) for s in STEPS for m in [re.search(rf"(^|[-+]){re.escape(s)}($|[-+])", params)] if m]
    return min(found)[1] if found else None


def project(data: dict) -> dict:
    """What one more step costs, and the suite's time at more steps, from the measured per-step times.

    A new step is a copy of the newest one: it brings every test the newest step has, and once a newer step
    follows it, it costs what the step before the newest costs now (that step's own copies of the kernels and the
    tiny-model tests, no real model unless it ends a Part). A Part's last step adds the real-model tests."""
    per_step, ends = data["step_seconds"], set(part_ends())
    plain = [s for s in STEPS[:-1] if s not in ends]  # steps that are neither a Part's end nor the newest
    step_cost = per_step[plain[-1]]
    ordinary = [per_step[s] for s in plain if s != STEPS[0]]
    part_end_extra = max(statistics.median([per_step[s] for s in ends if s != NEWEST]) - statistics.median(ordinary),
                         0.0)
    parts_now, wall = len(ends), data["full"]["wall_s"]
    setup = (data.get("ci") or {}).get("setup_s")

    def projected(num_steps: int, parts: int) -> float:
        return wall + ((num_steps - len(STEPS)) * step_cost + (parts - parts_now) * part_end_extra) / WORKERS

    return {"new_step_like": plain[-1], "new_step_seconds": round(step_cost, 1),
            "part_end_extra_seconds": round(part_end_extra, 1),
            "projection": [{"steps": n, "parts": p, "full_wall_s": round(projected(n, p), 1),
                            "full_minutes": round(projected(n, p) / 60, 1),
                            "ci_minutes": round((setup + projected(n, p)) / 60, 1) if setup else None}
                           # now; one step more; a Part of three steps more (the targets follow the steps there are)
                           for n, p in ((len(STEPS), parts_now), (len(STEPS) + 1, parts_now),
                                        (len(STEPS) + 3, parts_now + 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recompute", action="store_true",
                        help="only recompute the projection of docs/data/test_suite.json from its measured times")
    parser.add_argument("--setup-s", type=float, default=None,
                        help="seconds that `make .venv/.installed` took in this fresh clone (CI's set-up)")
    args = parser.parse_args()
    out = Path(__file__).resolve().parent / "test_suite.json"
    if args.recompute:
        data = json.loads(out.read_text())
        data.update(project(data))
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(json.dumps({k: data[k] for k in ("new_step_like", "new_step_seconds", "projection")}))
        return
    from shared.models import cache_dir

    cold_cache = not (cache_dir() / "models").is_dir()
    with tempfile.TemporaryDirectory() as tmp:
        full_xml, fast_xml = Path(tmp) / "full.xml", Path(tmp) / "fast.xml"
        print("make test ...", file=sys.stderr, flush=True)
        full = run_make("test", full_xml)
        print(f"  {full}", file=sys.stderr)
        print("make test-fast ...", file=sys.stderr, flush=True)
        fast = run_make("test-fast", fast_xml)
        print(f"  {fast}", file=sys.stderr)
        times = test_times(full_xml)
        full["tests"], fast["tests"] = len(times), len(test_times(fast_xml))
    per_step = {s: 0.0 for s in STEPS}
    for name, seconds in times:
        step = step_of(name)
        if step:
            per_step[step] += seconds
    total = sum(t for _, t in times)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    data = {
        "command": "python docs/data/measure_test_suite.py" + (f" --setup-s {args.setup_s:g}" if args.setup_s
                                                                else ""),
        "cold_model_cache": cold_cache,
        "date": date.today().isoformat(), "git_commit": commit, "git_dirty": dirty,
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}",
        "workers": WORKERS, "steps": len(STEPS), "parts": len(part_ends()),
        "full": {**full, "minutes": round(full["wall_s"] / 60, 1)},
        "fast": {**fast, "minutes": round(fast["wall_s"] / 60, 1)},
        "ci": ({"setup_s": args.setup_s, "wall_s": round(args.setup_s + full["wall_s"], 1),
                "minutes": round((args.setup_s + full["wall_s"]) / 60, 1)} if args.setup_s and cold_cache else None),
        "test_seconds_total": round(total, 1),
        "slowest": [[name, round(seconds, 1)] for name, seconds in sorted(times, key=lambda t: -t[1])[:25]],
        "step_seconds": {s: round(v, 1) for s, v in per_step.items()},
    }
    data.update(project(data))
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps({k: data[k] for k in ("full", "fast", "ci", "new_step_seconds", "projection")}))
    print(f"written: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
