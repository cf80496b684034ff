"""Every "Try it" of chapters 22-32 that a CPU machine can run, run as a reader runs it.

A chapter's Try it section (from "## Try it" to "## Source files") holds bullets with shell commands in backticks,
Python in ```python blocks, and suggestions to edit code. Here:
- every ```python block runs in a fresh process (`python -c`, from the repo root) and must exit 0 and print something
  (a snippet that prints nothing shows the reader nothing); a block that needs what a CPU machine lacks is listed in
  SKIPPED_BLOCKS with its reason;
- every backticked command that starts with `python` or `python3` (after any `VAR=value` before it) is either in
  COMMANDS (run as written, from the repo root, in a user's environment: it must exit as the chapter says, 0 unless
  the chapter says it refuses, and print something) or in SKIPPED_COMMANDS with its reason (a server, a GPU, a folder
  the reader supplies). A command in neither fails test_every_command_is_run_or_skipped, so that a new try-it is
  never silently left out, and an entry no chapter holds any more fails it too.
Edit suggestions (change this in run.py) and inline fragments that are not whole statements are not run.
"""
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

from conftest import ROOT
from helpers import shell_env

CHAPTERS = [f"step{n}" for n in range(22, 33)]


@dataclass(frozen=True)
class Command:
    """How a command of COMMANDS is run and what it must do."""
    timeout: int = 300
    slow: bool = False  # longer than the quick run can afford: marked slow (run by make test, not make test-fast)
    returncode: int = 0  # the chapter says the command refuses: its exit status (shared/cli.py's error: 2)
    says: str = ""  # a text the output must hold, where the chapter quotes one
    prints_nothing: bool = False  # the chapter says it prints nothing (a pipeline through grep that finds nothing)
    cheapest: tuple = ()  # the command's cheapest mode, as the suite runs it: these words replace (old, new) pairs


# The commands run, as written, each in its cheapest mode (CHEAPEST_RUN_PY appended to a run.py: a one-token answer and
# a one-token lesson, the chapter's own options kept; fewer held-out tokens for the perplexity table), so the suite
# pays seconds, not the minutes a whole lesson or benchmark takes on 2 shared cores. Those still over a few seconds
# are slow (make test runs them, make test-fast does not).
CHEAPEST_RUN_PY = ("--max-tokens", "1", "--lesson-tokens", "1")
COMMANDS = {
    # smollm2-135m split over 3 processes on the CPU: about 90 s
    "python steps/step22/run.py --tensor-parallel-size 3":
        Command(slow=True, says="tensor parallel: 3 ranks (gloo), each 3 heads / 1 KV heads / 512 MLP columns"),
    "python steps/step22/run.py --tensor-parallel-size 2":
        Command(returncode=2, says="9 heads and 3 KV heads do not split into 2"),
    "python steps/step25/run.py --device cpu": Command(slow=True, says="scheduling: async"),
    # The server's process never loads torch: grep finds nothing (exit status 1) and the pipeline prints nothing.
    # test_step26_server_imports_no_torch checks that the import itself succeeds.
    'python -X importtime -c "import steps.step26.serve" 2>&1 | grep torch': Command(returncode=1, prints_nothing=True),
    "python steps/step27/run.py": Command(slow=True, says="The outputs are equal"),
    "python steps/step28/run.py": Command(slow=True, says="projections: torch matmuls"),
    "python steps/step29/run.py": Command(slow=True, says="The outputs are equal"),
    # the perplexity of the float model and of six roundings (AWQ searched per layer) over 2,048 tokens: minutes
    "python3 docs/data/bench_step29_ppl.py --out /tmp/ppl.json --tokens 2048":
        Command(slow=True, says="int4 AWQ, groups of 192: perplexity", cheapest=(("--tokens 2048", "--tokens 128"),)),
    "python steps/step30/run.py --kv-cache-dtype int8": Command(slow=True, says="KV dtype int8"),
    "python docs/data/bench_step30_drift.py": Command(slow=True, says="relative error"),
    "python steps/step32/run.py --kv-offloading-size 0": Command(slow=True, says="KV tier: off"),
}

SERVER = "a server: runs until stopped, for curl or a client in another terminal"
SKIPPED_COMMANDS = {
    "python steps/step24/serve.py --model smollm2-135m": SERVER,
    "LLM_STEPS_API_KEY=secret python steps/step24/serve.py": SERVER,
    "python steps/step26/serve.py --model smollm2-135m --port 8000": SERVER,
    "python steps/step26/bench_serve.py --model smollm2-135m --request-rates 2 inf --client-processes 2":
        "needs a server: sends its requests to step26's serve.py started in another terminal",
    """python steps/step27/serve.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'""": SERVER,
    "python steps/step28/run.py --requests 4":
        "CUDA only: the bullet compares the GEMV against cuBLAS at four rows, which a CPU runs neither of",
    "python steps/step31/run.py --moe-model <folder>": "needs a checkpoint folder the reader supplies (a Qwen3-MoE)",
    "python tests/mutations.py --only step22-down-proj-not-reduced":
        "not a step's script: runs the test suite's tests under a mutation (tests/mutations.py)",
    "python tests/mutations.py --only step23-no-stop-holdback":
        "not a step's script: runs the test suite's tests under a mutation (tests/mutations.py)",
    "python tests/mutations.py --only step24-gone-client-not-aborted":
        "not a step's script: runs the test suite's tests under a mutation (tests/mutations.py)",
}

# ```python blocks not run, each found by a line of it: {(chapter, a line of the block): reason}.
SKIPPED_BLOCKS = {
    ("step28", "TritonLayerOps.gemv_max_rows = 8"):
        "CUDA only: the Triton GEMV and the CUDA graphs it sets the rows of run on a GPU (on a CPU the projections "
        "are torch matmuls)",
}
SLOW_BLOCKS: set[tuple[str, str]] = set()  # {(chapter, a line of the block)}: blocks too long for the quick run


def try_it(chapter: str) -> str:
    text = (ROOT / "docs" / "steps" / f"{chapter}.md").read_text()
    m = re.search(r"^## Try it\n(.*?)^## Source files", text, re.S | re.M)
    assert m, f"{chapter}.md has no '## Try it' section before '## Source files'"
    return m.group(1)


FENCE = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)


def python_blocks(section: str) -> list[str]:
    return [textwrap.dedent(m.group(2)) for m in FENCE.finditer(section)]


ENV_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")


def commands(section: str) -> list[str]:
    """The backticked spans outside the ```python blocks that run python or python3, whitespace collapsed (a span
    may wrap across lines)."""
    prose = re.sub(r"^( *)```.*?^\1```", "", section, flags=re.S | re.M)
    spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]
    return [s for s in spans if re.match(r"python3? ", ENV_PREFIX.sub("", s))]


def all_commands() -> list[tuple[str, str]]:
    return [(chapter, c) for chapter in CHAPTERS for c in commands(try_it(chapter))]


def all_blocks() -> list[tuple[str, int, str]]:
    return [(chapter, i, b) for chapter in CHAPTERS for i, b in enumerate(python_blocks(try_it(chapter)))]


def skip_reason(chapter: str, block: str) -> str | None:
    return next((r for (c, line), r in SKIPPED_BLOCKS.items() if c == chapter and line in block), None)


def _output(proc) -> str:
    return (proc.stdout + proc.stderr).strip()


def test_the_sections_are_found():
    """The parsers see what the chapters hold: a wrapped command, a block indented in a bullet."""
    section = ("- `python steps/step9/run.py\n  --x 1`: text, `LLM(\"a\")`, `A=b python3 x.py`, `pytest -k y`\n"
               "- Save this:\n\n    ```python\n    print(1)\n    ```\n\n- `curl localhost`\n")
    assert commands(section) == ["python steps/step9/run.py --x 1", "A=b python3 x.py"]
    assert python_blocks(section) == ["print(1)\n"]
    assert sum(len(python_blocks(try_it(c))) for c in CHAPTERS) >= 6


def test_every_command_is_run_or_skipped():
    found = all_commands()
    neither = [f"{chapter}: {c}" for chapter, c in found if c not in COMMANDS and c not in SKIPPED_COMMANDS]
    assert not neither, ("Try it commands neither run nor skipped (add each to COMMANDS, or to SKIPPED_COMMANDS with "
                         "its reason):\n" + "\n".join(neither))
    both = set(COMMANDS) & set(SKIPPED_COMMANDS)
    assert not both, f"run and skipped: {both}"
    gone = (set(COMMANDS) | set(SKIPPED_COMMANDS)) - {c for _, c in found}
    assert not gone, f"listed here, in no chapter's Try it any more: {gone}"
    for c in COMMANDS:  # what COMMANDS runs: a script under steps/ or docs/data/, or the one pipeline above
        assert re.match(r"python3? (steps|docs/data)/", c) or COMMANDS[c].prints_nothing, c
    blocks = all_blocks()
    for (chapter, line) in [*SKIPPED_BLOCKS, *SLOW_BLOCKS]:
        assert any(c == chapter and line in b for c, _, b in blocks), f"{chapter}: no block holds {line!r}"


def command_params():
    """(step, command, spec): the chapter's step is the test's `step` parameter, so that --step selects it and the
    quick run (make test-fast) runs the try-its of the newest steps only, as for every test that takes a step."""
    chapter_of = {c: chapter for chapter, c in all_commands()}
    return [pytest.param(chapter_of.get(c, CHAPTERS[-1]), c, spec, id=f"{chapter_of.get(c, '?')}-{c[:80]}",
                         marks=[pytest.mark.slow] if spec.slow else [])
            for c, spec in COMMANDS.items()]


def as_run(command: str) -> tuple[list[str] | str, dict, bool]:
    """The command with this interpreter for `python`/`python3`: an argument list, or a shell line where it has a
    pipe; the VAR=value before it go into its environment."""
    env = {**shell_env(), "OMP_NUM_THREADS": "1"}
    prefix = ENV_PREFIX.match(command)
    if prefix:
        env.update(a.split("=", 1) for a in prefix.group(0).split())
        command = command[prefix.end():]
    exe, rest = command.split(" ", 1)
    assert exe in ("python", "python3")
    if "|" in rest:
        return f"{shlex.quote(sys.executable)} {rest}", env, True
    return [sys.executable, *shlex.split(rest)], env, False


@pytest.mark.parametrize("step, command, spec", command_params())
def test_command(step, command, spec):
    assert "--help" not in command.split(), "--help does not run the script"
    for old, new in spec.cheapest:
        assert old in command, (old, command)
        command = command.replace(old, new)
    if re.match(r"python3? steps/step\d+/run\.py", command):
        command += " " + " ".join(CHEAPEST_RUN_PY)
    args, env, shell = as_run(command)
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=spec.timeout, env=env, shell=shell,
                          executable="/bin/bash" if shell else None)
    out = _output(proc)
    assert proc.returncode == spec.returncode, f"exit status {proc.returncode}, not {spec.returncode}:\n{out[-3000:]}"
    if spec.prints_nothing:
        assert not out, f"the chapter says it prints nothing; it printed:\n{out[-3000:]}"
        return
    assert out, "printed nothing"
    assert spec.says in out, f"the output lacks {spec.says!r}:\n{out[-3000:]}"


def test_step26_server_imports_no_torch():
    """The pipeline above prints nothing also when the import fails: the import alone succeeds, and importtime's
    list (all it prints) names modules and none of them is torch."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import steps.step26.serve"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**shell_env(), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps.step26.serve" in proc.stderr
    assert "torch" not in proc.stderr


def block_params():
    params = []
    for chapter, i, block in all_blocks():
        marks = []
        if reason := skip_reason(chapter, block):
            marks.append(pytest.mark.skip(reason=reason))
        if any(c == chapter and line in block for c, line in SLOW_BLOCKS):
            marks.append(pytest.mark.slow)
        params.append(pytest.param(chapter, block, id=f"{chapter}-block{i}", marks=marks))
    return params


@pytest.mark.parametrize("step, block", block_params())
def test_python_block(step, block):
    proc = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{_output(proc)[-3000:]}"
    assert proc.stdout.strip(), f"printed nothing (the reader sees nothing):\n{proc.stderr[-3000:]}"
