import ast
import functools
import os
import sys
from pathlib import Path

import pytest
import torch

# Part 6's Triton kernels: without CUDA they run in Triton's interpreter. It is chosen when a kernel is defined
# (at import), so the variable is set here, before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (make test runs two workers, one per core) each worker computes on one thread: two workers
# with two threads each would ask four threads of two cores. The processes a test starts (a run.py, the first run,
# the benchmark scripts) inherit the same one thread through OMP_NUM_THREADS: with torch's default of one thread
# per core they would ask three threads of two cores while the other worker computes, and a torch thread that waits
# for a descheduled sibling spins (test_run_py[step09] took 11 s so, 6 s on one thread).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The registry of steps and what each has (tests/registry.py), and the harness prompts, are re-exported here.
import registry  # noqa: E402  (tests/registry.py)
from registry import STEPS  # noqa: E402
from registry import CHAT_PROMPTS, EQUIV_MAX_TOKENS, TEXT_PROMPTS  # noqa: E402,F401

# `make test-fast` (pytest -m "not slow") tests every step-independent thing and the newest steps fully;
# `make test` tests every step. A test that takes a step is marked slow unless its step, or one of the steps it
# stands for (helpers.copies_param), is one of these, so the quick run stays the same size however many steps
# there are.
FAST_STEPS = 2


class GroupSuffix:
    """--dist loadgroup sends the tests of one xdist_group to one worker by the suffix "@<group>" that pytest-xdist
    (3.8) gives their node ids on the worker, by assigning `item._nodeid`. pytest 9 keeps a node's id in `item._id`
    and ignores that attribute: without the suffix every test was its own group, a step's tests ran on both workers
    and each built the step's engines and references. Where the suffix is missing, it is added here the same way,
    after pytest-xdist's hook and before the worker reports its collection."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if not getattr(config.option, "loadgroup", False):
            return
        try:  # pytest 9's node id type; an older pytest has no _id and takes pytest-xdist's suffix itself
            from _pytest.nodeid import NodeId
        except ImportError:
            return

        for item in items:
            groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                             for m in item.iter_markers("xdist_group")})
            if groups and "@" not in item.nodeid and hasattr(item, "_id"):
                item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


def pytest_addoption(parser):
    parser.addoption("--step", action="append", default=[], metavar="STEP",
                     help="keep only the tests that concern STEP (a step folder: step27, step14_7): its own tests, "
                          "its equivalence test, its lesson's tests (tests/conftest.py, steps_of_test); repeat it, "
                          "or give STEP,STEP, for several steps. make test STEP=step27 passes it.")


def selected_steps(config) -> set[str]:
    """The steps named by --step (a step per option, or several joined by commas); an unknown name is a usage error
    that lists the known ones."""
    names = {name.strip() for value in config.getoption("step") for name in value.split(",") if name.strip()}
    unknown = sorted(names - set(STEPS))
    if unknown or (config.getoption("step") and not names):
        raise pytest.UsageError(f"--step: unknown step {', '.join(map(repr, unknown)) or 'name (empty)'}; "
                                f"the known steps (tests/registry.py): {' '.join(STEPS)}")
    return names


def pytest_configure(config):
    selected_steps(config)  # an unknown --step fails here, before any worker starts or any test is collected
    if os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(GroupSuffix(), "xdist-group-suffix")
    config.addinivalue_line("markers", "copies(*steps): the test runs on the first of these steps and stands for "
                                       "all of them: they hold the files it exercises byte for byte "
                                       "(helpers.copies_param)")


# ---- --step: the tests that concern one step ---------------------------------------------------------------------
# A test concerns
#   - the step it takes (its `step` parameter), and every step its `copies` mark stands for (helpers.copies_param);
#     test_equivalence.py's test_step_matches_golden[<step>-...] is so the step's equivalence test: every step is
#     compared with the same reference, step01's golden outputs, rather than with the step before it;
#   - a step named by an xdist_group mark of its own (test_equivalence.py's step01 tests against HF run on step01's
#     worker: step01's equivalence to what comes before it);
#   - if it takes no step: the lessons of its file, the steps that the file names at module level as
#     `NAME = introducing("feature")` (test_part9_spec.py's SPEC = introducing("speculative_decoding")). A Part
#     file's step-free tests exercise its lesson's step (against the step before it, which is a reference there and
#     is not selected by them), so a new step's Part file joins its --step run by the name it already has.
# A test that concerns no step (the docs, the scripts, the benchmarks) is deselected by --step.

@functools.lru_cache(maxsize=None)
def lessons_of_module(module) -> frozenset:
    """The steps a test module names at module level as `NAME = introducing(feature)` (registry.introducing, under
    whatever name the module imported it): the lessons its step-free tests are about."""
    names = set()
    for node in ast.parse(Path(module.__file__).read_text(), module.__file__).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call) \
                and isinstance(node.value.func, ast.Name) \
                and getattr(module, node.value.func.id, None) is registry.introducing:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return frozenset(getattr(module, name) for name in names)


def steps_of_test(item) -> set[str]:
    """The steps a collected test concerns (the rules above)."""
    params = getattr(item, "callspec", None) and item.callspec.params or {}
    steps = {str(m.args[0] if m.args else m.kwargs.get("name")) for m in item.iter_markers("xdist_group")}
    if "step" in params:
        steps.add(params["step"])
        steps.update(*(m.args for m in item.iter_markers("copies")))
    elif getattr(item, "module", None) is not None:
        steps |= lessons_of_module(item.module)
    return steps & set(STEPS)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    wanted = selected_steps(config)
    if wanted:
        concerns = {item: bool(steps_of_test(item) & wanted) for item in items}
        config.hook.pytest_deselected(items=[item for item in items if not concerns[item]])
        items[:] = [item for item in items if concerns[item]]
    newest = set(STEPS[-FAST_STEPS:])
    for item in items:
        step = getattr(item, "callspec", None) and item.callspec.params.get("step")
        if step is not None:
            copies = item.get_closest_marker("copies")  # a test run once for steps of the same content
            if newest.isdisjoint(copies.args if copies else [step]):
                item.add_marker(pytest.mark.slow)
            # --dist loadgroup: a step's tests run on one worker, which then builds that step's engines once. Under
            # --step every test is one step's: grouped by step they would all run on one worker while the other
            # idles, so there a group is one step's tests in one file (a file's tests still share what they cache).
            item.add_marker(pytest.mark.xdist_group(f"{step}-{item.module.__name__}" if wanted else step))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_memory_of_earlier_tests_is_given_back(request):
    """A `gpu` test sizes its KV pool from the memory the device has left: first collect the engines of earlier
    tests (engines hold reference cycles, so they wait for the garbage collector) and return their cached
    blocks, or the new engine counts memory that a dead one still holds."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    yield


def equivalence_prompts(tokenizer) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_PROMPTS]
    return chats + [tokenizer.encode(t) for t in TEXT_PROMPTS]


@functools.lru_cache(maxsize=None)
def greedy_outputs(step: str, model: str):
    """Each step's greedy outputs on the harness prompts, computed once per test process (CPU, fp32)."""
    from helpers import load_engine
    from shared import SamplingParams

    llm = load_engine(step).LLM(model, device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=EQUIV_MAX_TOKENS, logprobs=5)
    return llm.generate(equivalence_prompts(llm.tokenizer), params)


@functools.lru_cache(maxsize=4)
def cached_llm(step: str, model: str):
    """An engine shared by tests across files, to save load time. Use it with its default options only and
    never change its settings or limits: a test that needs other options builds its own engine."""
    from helpers import load_engine

    return load_engine(step).LLM(model, device="cpu", dtype="float32")
