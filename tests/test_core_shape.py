"""The engine's shape, in every step whose engine core runs in its own process.

One core, two front ends: core.py's EngineCore owns the scheduler, the block manager, the runner and the step; the
offline LLM (engine.py) is a thin front end over one, and the core process (engine_core.py) a busy loop around one,
which imports nothing from engine.py, subclasses nothing of it and calls no private name of the core.

How a request ends is decided in one place: the offline engine (engine.py, core.py), the engine core process
(engine_core.py) and the front end (async_llm.py) all end a request by output.py's `Finish` and its stop check: the
step's files define one `class Finish` and one stop check, both in output.py, and output.py loads neither torch nor
the engine (the front end, which imports it, runs without them). The runner's side (the model runner, its attention
metadata, its CUDA graphs, the tensor-parallel workers) reads the step's plan and imports nothing of sequence.py. Read
from the code (AST), nothing is run.
"""
import ast

import pytest

from conftest import ROOT
from registry import having, step_files

CORE_STEPS = having("engine_core_process")
STOP_CHECK_NAMES = {"check_stop", "_check_stop"}
ENGINE_MODULES = {"engine.py", "core.py", "engine_core.py"}
LLM_MAX_LINES = 200  # the front end stays thin: the step is the core's
FUNCTION_MAX_LINES = 60  # a function a reader takes in at once (kernels/ aside: a kernel is read as one piece)
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


def module(step: str, name: str) -> ast.Module:
    path = ROOT / "steps" / step / name
    return ast.parse(path.read_text(), str(path))


@pytest.mark.parametrize("step", CORE_STEPS)
def test_the_core_process_runs_the_engine_core_not_the_offline_engine(step):
    """engine_core.py imports nothing from engine.py (only core.py's EngineCore), and none of its classes derives from
    one of engine.py's."""
    tree = module(step, "engine_core.py")
    from_engine = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level
                   and node.module in ("engine", None) and (node.module or any(a.name == "engine" for a in node.names))]
    assert not from_engine, f"steps/{step}/engine_core.py imports engine.py (line {from_engine})"
    assert any(isinstance(node, ast.ImportFrom) and node.level and node.module == "core"
               and any(a.name == "EngineCore" for a in node.names) for node in tree.body), \
        f"steps/{step}/engine_core.py does not import core.py's EngineCore"
    engine_classes = {node.name for node in module(step, "engine.py").body if isinstance(node, ast.ClassDef)}
    derived = [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
               and any(isinstance(b, ast.Name) and b.id in engine_classes for b in node.bases)]
    assert not derived, f"steps/{step}/engine_core.py derives {derived} from engine.py's classes"


@pytest.mark.parametrize("step", CORE_STEPS)
def test_the_core_process_calls_no_private_name_of_the_core(step):
    """The busy loop reaches the EngineCore through its public methods and attributes only (core.x, self.core.x with
    x not starting with an underscore)."""
    tree = module(step, "engine_core.py")
    private = sorted({f"{ast.unparse(node.value)}.{node.attr}" for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                      and ast.unparse(node.value) in ("core", "self.core")})
    assert not private, f"steps/{step}/engine_core.py reaches into the core: {private}"


@pytest.mark.parametrize("step", CORE_STEPS)
def test_the_offline_engine_is_a_thin_front_end_over_the_core(step):
    """LLM (engine.py) holds no step: it builds an EngineCore and is at most LLM_MAX_LINES lines; the step's methods
    (step, _step_async, _launch, _read_step, _fail_step, _record_tokens) are EngineCore's, in core.py."""
    llm = next(node for node in module(step, "engine.py").body if isinstance(node, ast.ClassDef) and node.name == "LLM")
    lines = llm.end_lineno - llm.lineno + 1
    assert lines <= LLM_MAX_LINES, f"steps/{step}/engine.py: LLM is {lines} lines (at most {LLM_MAX_LINES})"
    core = next(node for node in module(step, "core.py").body
                if isinstance(node, ast.ClassDef) and node.name == "EngineCore")
    step_methods = {"step", "_step_async", "_launch", "_read_step", "_fail_step", "_record_tokens"}
    core_methods = {node.name for node in core.body if isinstance(node, ast.FunctionDef)}
    assert step_methods <= core_methods, f"steps/{step}/core.py's EngineCore lacks {sorted(step_methods - core_methods)}"
    llm_methods = {node.name for node in llm.body if isinstance(node, ast.FunctionDef)}
    assert not (step_methods - {"step"}) & llm_methods, f"steps/{step}/engine.py's LLM still runs the step itself"


@pytest.mark.parametrize("step", CORE_STEPS)
def test_no_function_outside_the_kernels_is_over_60_lines(step):
    folder = ROOT / "steps" / step
    long = [f"{f.relative_to(folder).as_posix()}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for f in sorted(folder.rglob("*.py")) if "kernels" not in f.relative_to(folder).parts
            for node in ast.walk(ast.parse(f.read_text(), str(f)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > FUNCTION_MAX_LINES]
    assert not long, f"steps/{step}: functions over {FUNCTION_MAX_LINES} lines: {long}"


@pytest.mark.parametrize("step", CORE_STEPS)
def test_the_core_gets_tokens_from_the_runner_never_logits(step):
    """The runner runs the forward and the draws (execute_model) and hands back tokens: core.py imports no torch (it
    holds no tensor) and calls none of the runner's logits-level methods (execute, sample, launch_sample, verify)."""
    tree = module(step, "core.py")
    assert not absolute_imports(ROOT / "steps" / step / "core.py") & TORCH_PACKAGES, f"steps/{step}/core.py imports torch"
    logits_level = {"execute", "sample", "launch_sample", "verify"}
    calls = sorted({node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == "self.runner"
                    and node.func.attr in logits_level})
    assert not calls, f"steps/{step}/core.py calls the runner's {calls}: it would hold logits"


RUNNER_SIDE = ("model_runner.py", "attention.py", "cuda_graphs.py", "worker.py", "parallel.py")


@pytest.mark.parametrize("step", having("scheduler_output"))
def test_the_runner_side_reads_the_plan_not_the_requests(step):
    """The runner, its attention metadata, its CUDA graphs and the tensor-parallel workers import nothing of
    sequence.py: what they know of a request is what the step's plan (SchedulerOutput) holds, which a worker gets
    serialised whole (no stand-in for a sequence is rebuilt there)."""
    for name in RUNNER_SIDE:
        tree = module(step, name)
        relative = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level
                    and (node.module == "sequence" or any(a.name == "sequence" for a in node.names))]
        assert not relative, f"steps/{step}/{name} imports sequence.py (line {relative})"
        stand_ins = [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                     and node.name in ("StepRow", "NewTokens")]
        assert not stand_ins, f"steps/{step}/{name} defines {stand_ins}: a worker's stand-in for a sequence"
