"""`pytest --step <step>` (make test STEP=<step>): the tests that concern one step, and only those.

Each check collects the suite (--collect-only: nothing runs) with a probe plugin that writes, for every test kept
and every test deselected, its id, its `step` parameter and its `copies` mark. The expectations are read from the
registry and from the test files' text, not from conftest.py's own rule functions.

The collections that succeed run in one subprocess, one pytest session after another (the module fixture
`collections`): the first imports the test modules (about 10 s), the later ones find them imported (about 1 s each).
Each session selects by its own --step from scratch. A usage error is checked in a subprocess of its own: what it
prints, and the process's exit status.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from registry import BY_NAME, NEWEST, STEPS, previous

PROBE = '''
import json, os

def _record(item):
    params = getattr(item, "callspec", None) and item.callspec.params or {}
    copies = [list(m.args) for m in item.iter_markers("copies")]
    return {"id": item.nodeid, "file": item.nodeid.split("::")[0], "step": params.get("step"),
            "copies": copies[0] if copies else None}

DESELECTED = []

def pytest_sessionstart(session):  # one process may run several sessions (the fixture `collections`)
    DESELECTED.clear()

def pytest_deselected(items):
    DESELECTED.extend(_record(item) for item in items)

def pytest_collection_finish(session):
    with open(os.environ["STEP_SELECTION_PROBE_OUT"], "w") as f:
        json.dump({"kept": [_record(i) for i in session.items], "deselected": DESELECTED}, f)
'''


# Runs `pytest --collect-only` once per (key, args) in one process, each session's output framed by markers.
SESSIONS = '''
import json, os, sys
import pytest

for key, args in json.loads(sys.argv[2]):
    os.environ["STEP_SELECTION_PROBE_OUT"] = os.path.join(sys.argv[1], key + ".json")
    print(f"\\n=== session {key} ===", flush=True)
    rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-p", "step_selection_probe", *args])
    print(f"\\n=== exit {key} {int(rc)} ===", flush=True)
'''


def probe_env(tmp_path) -> dict:
    (tmp_path / "step_selection_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not an xdist worker's settings
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]),
               STEP_SELECTION_PROBE_OUT=str(tmp_path / "collected.json"))
    return env


def collect(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """One collection in a process of its own."""
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "step_selection_probe", *args], cwd=ROOT, env=probe_env(tmp_path),
                          capture_output=True, text=True, timeout=300)


def collect_in_one_process(tmp_path, sessions: dict[str, list[str]]) -> dict[str, tuple[int, str, dict]]:
    """Each of `sessions` (key -> pytest arguments) collected in turn in one subprocess.
    -> key -> (its exit code, what it printed, what the probe wrote)."""
    proc = subprocess.run([sys.executable, "-c", SESSIONS, str(tmp_path), json.dumps(list(sessions.items()))],
                          cwd=ROOT, env=probe_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {}
    for key in sessions:
        found = re.search(rf"^=== session {key} ===\n(.*?)^=== exit {key} (\d+) ===$", proc.stdout, flags=re.M | re.S)
        assert found, f"session {key} did not finish: " + proc.stdout[-3000:] + proc.stderr[-3000:]
        probe = tmp_path / f"{key}.json"
        results[key] = (int(found[2]), found[1], json.loads(probe.read_text()) if probe.exists() else {})
    return results


UNION_ARGS = {"union-comma": ["--step", f"{previous(NEWEST)},{NEWEST}"],
              "union-repeated": ["--step", previous(NEWEST), "--step", NEWEST]}

# The file's collections share one process: its tests run on one pytest-xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("step_selection")


@pytest.fixture(scope="module")
def collections(tmp_path_factory):
    """--step STEPS[0], --step NEWEST (the whole suite), and the two ways to name two steps (one file: the rule is
    the same in every file), collected in one process."""
    sessions = {name: ["--step", name] for name in (STEPS[0], NEWEST)}
    sessions |= {key: ["tests/test_equivalence.py", *args] for key, args in UNION_ARGS.items()}
    return collect_in_one_process(tmp_path_factory.mktemp("step_selection"), sessions)


def lesson_files(name: str) -> set[str]:
    """The test files that name `name`'s lesson at module level: `NAME = introducing("<a feature name adds>")`."""
    found = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for feature in BY_NAME[name].adds:
            if re.search(rf'^\w+\s*=\s*introducing\("{feature}"\)', path.read_text(), flags=re.M):
                found.add(f"tests/{path.name}")
    return found


def concerns(test: dict, name: str) -> bool:
    """Whether a recorded test takes `name` or stands for it (copies)."""
    return test["step"] == name or name in (test["copies"] or [])


@pytest.mark.parametrize("name", [STEPS[0], NEWEST])  # `name`, not `step`: not one of that step's own tests
def test_step_keeps_its_tests_its_equivalence_and_its_lesson_and_nothing_else(collections, name):
    returncode, stdout, collected = collections[name]
    assert returncode == 0, stdout[-3000:]
    kept, deselected = collected["kept"], collected["deselected"]
    kept_ids = {t["id"] for t in kept}
    assert kept and deselected, "--step should keep some tests and deselect others"
    assert f"{len(kept)}/{len(kept) + len(deselected)} tests collected ({len(deselected)} deselected)" in stdout

    # every test that takes the step, or stands for it, is kept; none that takes or stands for another step only
    assert not [t["id"] for t in deselected if concerns(t, name)]
    others = [t["id"] for t in kept if t["step"] is not None and not concerns(t, name)]
    assert not others, f"--step {name} kept tests of other steps: {others[:5]}"

    # its equivalence: against HF for step01, against the golden file (step01's outputs) for every later step
    equivalence = {t["id"] for t in kept if t["file"] == "tests/test_equivalence.py"}
    if name == STEPS[0]:
        assert {i.split("[")[0].split("::")[1] for i in equivalence} >= {"test_step01_logits_match_hf",
                                                                           "test_step01_greedy_matches_hf_generate"}
    else:
        assert equivalence and all(f"test_step_matches_golden[{name}-" in i for i in equivalence), equivalence
        assert not any(f"[{previous(name)}-" in t["id"] for t in kept)

    # the step-free tests of the files about its lesson are kept, those of every other file deselected
    lessons = lesson_files(name)
    assert lessons or name == STEPS[0], f"no test file names {name}'s lesson as NAME = introducing(...)"
    for t in kept + deselected:
        if t["step"] is None and t["file"] != "tests/test_equivalence.py":
            assert (t["id"] in kept_ids) == (t["file"] in lessons), t["id"]


@pytest.mark.parametrize("key", list(UNION_ARGS))
def test_several_steps_keep_the_union(collections, key):
    returncode, stdout, collected = collections[key]
    assert returncode == 0, stdout[-3000:]
    assert {t["step"] for t in collected["kept"]} == {previous(NEWEST), NEWEST}


@pytest.mark.parametrize("value", ["step99", f"{NEWEST},nope", ","])
def test_an_unknown_step_is_a_usage_error_naming_the_known_steps(tmp_path, value):
    proc = collect(tmp_path, "--step", value)
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]  # pytest's usage error
    assert "--step: unknown step" in proc.stderr and " ".join(STEPS) in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "collected.json").exists()  # it stops before collecting


def test_make_test_passes_step_and_leaves_the_default_run_alone():
    def dry_run(*args):  # make -n prints the commands without running them (a stale set-up's commands included)
        out = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
        return [line for line in out.splitlines() if " -m pytest" in line]

    assert [line for line in dry_run("test", f"STEP={NEWEST}") if f" --step {NEWEST} " in f"{line} "]
    for target in ("test", "test-fast"):
        assert dry_run(target) and not any("--step" in line for line in dry_run(target))
