"""How a request ends is decided in one place, in every step whose engine core runs in its own process.

The offline engine (engine.py), the engine core (engine_core.py) and the front end (async_llm.py) all end a request
by output.py's `Finish` and its stop check: the step's files define one `class Finish` and one stop check, both in
output.py, and output.py loads neither torch nor the engine (the front end, which imports it, runs without them).
Read from the code (AST), nothing is run.
"""
import ast

import pytest

from conftest import ROOT
from registry import having, step_files

CORE_STEPS = having("engine_core_process")
STOP_CHECK_NAMES = {"check_stop", "_check_stop"}
ENGINE_MODULES = {"engine.py", "engine_core.py"}
TORCH_PACKAGES = {"torch", "triton"}


def definitions(step: str, kind: type, names: set[str]) -> list[str]:
    """The files of steps/<step> (paths in the step) that define a `kind` (ast.ClassDef, ast.FunctionDef) named one
    of `names`, at any depth (a method too): one entry per definition."""
    folder = ROOT / "steps" / step
    return sorted(f.relative_to(folder).as_posix() for f in folder.rglob("*.py")
                  for node in ast.walk(ast.parse(f.read_text(), str(f)))
                  if isinstance(node, kind) and node.name in names)


def absolute_imports(path) -> set[str]:
    """The top-level packages a file imports by an absolute import, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("step", CORE_STEPS)
def test_finish_is_defined_once_in_output_py(step):
    finishes = definitions(step, ast.ClassDef, {"Finish"})
    assert finishes == ["output.py"], f"steps/{step}: class Finish defined in {finishes}, expected once in output.py"


@pytest.mark.parametrize("step", CORE_STEPS)
def test_the_stop_check_is_defined_once_in_output_py(step):
    checks = definitions(step, (ast.FunctionDef, ast.AsyncFunctionDef), STOP_CHECK_NAMES)
    assert checks == ["output.py"], f"steps/{step}: a stop check defined in {checks}, expected once in output.py"


@pytest.mark.parametrize("step", CORE_STEPS)
def test_output_py_loads_neither_torch_nor_the_engine(step):
    """output.py and every module of the step it loads (registry.step_files: its relative imports, transitively)."""
    loaded = step_files(step, "output")
    engine = sorted(f.name for f in loaded if f.name in ENGINE_MODULES)
    assert not engine, f"steps/{step}/output.py loads the engine: {engine}"
    for f in loaded:
        torch = absolute_imports(f) & TORCH_PACKAGES
        assert not torch, f"steps/{step}/{f.name} (loaded by output.py) imports {sorted(torch)}"
