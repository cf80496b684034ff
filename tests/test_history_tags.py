"""No history in the code: a comment or a docstring says what a thing is and why, not in which step it came.

What changed in which step belongs in the step's README.md and its chapter. So no line of a .py file under
steps/<step>/ names a step with a colon after it (`# step18: the block tables ...`), except two title lines that
name the file's own step: line 1 of its engine.py (the module docstring's title, "step12: batched sampler, ...")
and run.py's `print_header("step12: ...", llm)`. A step named without the colon ("as in step17", "step18's
tables") is not a tag. Read from the files as text, nothing is run.
"""
import re

import pytest

from conftest import ROOT

TAG = re.compile(r"\bstep\d+(_\d+)?:")
STEP_DIRS = sorted((p.name for p in (ROOT / "steps").iterdir() if re.fullmatch(r"step\d+(_\d+)?", p.name)),
                   key=lambda name: tuple(int(n) for n in re.findall(r"\d+", name)))  # step14_7 before step15


def without_title(step: str, relative: str, number: int, line: str) -> str:
    """The line with its step's title taken out, where it is one of the two title lines; else the line itself."""
    if relative == "engine.py" and number == 1 and line.startswith(f'"""{step}:'):
        return line[len(f'"""{step}:'):]
    if relative == "run.py":
        return line.replace(f'print_header("{step}:', 'print_header("', 1)
    return line


def history_tags(step: str) -> list[str]:
    """Every line of steps/<step>'s .py files that carries a step tag, as 'path:line: text'."""
    folder = ROOT / "steps" / step
    found = []
    for path in sorted(folder.rglob("*.py")):
        relative = path.relative_to(folder).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if TAG.search(without_title(step, relative, number, line)):
                found.append(f"steps/{step}/{relative}:{number}: {line.strip()}")
    return found


@pytest.mark.parametrize("step", STEP_DIRS)
def test_no_history_tags_in_the_code(step):
    found = history_tags(step)
    assert not found, (f"{len(found)} line(s) of steps/{step} say in which step something came (history belongs in "
                       f"the step's README.md and chapter):\n" + "\n".join(found))


def test_the_title_lines_are_allowed_and_nothing_else():
    """The check itself: a title names its own step only, in its own place."""
    assert without_title("step12", "engine.py", 1, '"""step12: batched sampler.') == " batched sampler."
    assert TAG.search(without_title("step12", "engine.py", 2, '"""step12: batched sampler.'))
    assert TAG.search(without_title("step12", "engine.py", 1, '"""step11: batched sampler.'))
    assert TAG.search(without_title("step12", "model.py", 1, '"""step12: batched sampler.'))
    assert not TAG.search(without_title("step12", "run.py", 34, '        print_header("step12: batched", llm)'))
    assert TAG.search(without_title("step12", "run.py", 34, '        print_header("step11: batched", llm)'))
    assert TAG.search("    x = 1  # step11: one call per request")
    assert TAG.search("# ---- step14_7: the loop ----")
    assert not TAG.search("as in step17, step18's tables, step19 vs step18, substep1: x")
