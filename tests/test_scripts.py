"""Every step's run.py and run_all.py run from the repo root, say what they ran on, and refuse bad input
with one `error:` line (exit status 2, no traceback)."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, STEPS
from helpers import shell_env
from registry import NEWEST

# The skeleton every run.py shares (shared/cli.py), so that the diff between two steps shows only the lesson.
SKELETON = [
    "    args = parser.parse_args()\n",
    "    with user_errors(parser):",
    "        llm = LLM(args.model, device=args.device, dtype=args.dtype",
    "        answer_question(llm, args)\n",
    "        show_lesson(llm, args)\n",
    "\ndef show_lesson(llm, args) -> None:\n",
]


def run(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def cheapest_run(step: str) -> list[str]:
    """The options of steps/<step>/run.py's cheapest run: the tiny random model on the CPU, a one-token answer and
    the lesson's figure at the fewest tokens its --lesson-tokens takes (shared/cli.py's step_arg_parser: 1, or the
    run.py's lesson_tokens_min). The scripts' plumbing, not the model, is tested."""
    least = re.search(r"lesson_tokens_min=(\d+)", (ROOT / "steps" / step / "run.py").read_text())
    return ["--model", "random:tiny-llama", "--device", "cpu", "--max-tokens", "1",
            "--lesson-tokens", least.group(1) if least else "1"]


@pytest.mark.parametrize("step", STEPS)
def test_run_py(step):
    """Every step's run.py runs to its end as the real command: `python steps/<step>/run.py`, from the repo root, in a
    fresh process (its own imports, its own argument parsing, its exit status), without TRITON_INTERPRET. Inside the
    test process, where the switch is set before anything imports triton, step21's and step22's run.py passed while
    the command stopped at once: their engine imported triton before main() set the switch."""
    proc = run(f"steps/{step}/run.py", *cheapest_run(step), env=shell_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    for word in ("model: random:tiny-llama", "device: cpu", "dtype: float32", "backend:", "\nQ: ", "\nA: "):
        assert word in proc.stdout, proc.stdout[-3000:]


def test_every_step_folder_is_complete():
    for step in STEPS:
        for f in ("model.py", "engine.py", "run.py", "README.md", "__init__.py"):
            assert (ROOT / "steps" / step / f).is_file(), f"steps/{step}/{f} is missing"
    on_disk = sorted(p.name for p in (ROOT / "steps").iterdir() if p.is_dir() and p.name.startswith("step"))
    assert sorted(STEPS) == on_disk, "tests/conftest.py STEPS must list every step folder"



def scripts_with_a_path_setup() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "steps").glob("*/*.py")
                  if 'if __package__ in (None, ""):' in p.read_text())


def test_a_steps_script_finds_an_installed_package_before_a_folder_of_the_step(tmp_path):
    """Python puts a script's own folder first on sys.path, where steps/<step>/kernels/ would hide an installed
    package named `kernels` (transformers imports the hub's one, when it is installed, to read any config).
    A `kernels` installed through PYTHONPATH is imported when each script exits (sitecustomize's atexit hook):
    it must be that one, in the newest step's scripts of both forms (the next test checks that every script has
    one of them)."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit\n"
        "def _which():\n"
        "    import kernels\n"
        "    print('kernels from', kernels.__file__)\n"
        "atexit.register(_which)\n")
    scripts = [f"steps/{NEWEST}/run.py", f"steps/{NEWEST}/bench_serve.py"]  # the two forms of the set-up
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for script in scripts:
        proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, env=env,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"kernels from {tmp_path / 'kernels' / '__init__.py'}" in proc.stdout, (script, proc.stdout[-500:])


def test_every_script_sets_up_its_path_the_same_way():
    setups = {script: re.search(r'if __package__ in \(None, ""\):.*\n((?:    .*\n)+)', (ROOT / script).read_text())
              for script in scripts_with_a_path_setup()}
    assert all(setups.values())
    assert len({m.group(1) for m in setups.values()}) == 2, "run.py/serve.py and bench_serve.py: two forms"
    for script, m in setups.items():
        assert "Path(__file__).resolve().parent]" in m.group(1), script  # this folder taken off the path
def step_names_in_code(path) -> set[str]:
    """The steps a file names in its code: string constants (docstrings left out) that are a step's name or a
    module path into one ("steps.step16", "steps/step16"), and a module path completed at run time
    (f"steps.{name}", "steps." + name), reported as "steps.<computed>"."""
    import ast

    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    # `__package__ = "steps." + Path(__file__).parent.name`: a run.py naming its own package, to run as a script
    own_package = {id(c) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "__package__" for t in node.targets)
                   for c in ast.walk(node.value)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings | own_package:
            text = node.value
            names |= {s for s in STEPS if text == s or f"steps.{s}" in text or f"steps/{s}" in text}
            if re.fullmatch(r"steps[./]", text):  # a step chosen at run time: f"steps.{name}" -> its own entry
                names.add("steps.<computed>")
    return names


def test_steps_import_no_other_step():
    """A step's modules name no other step, neither by an import nor by a name loaded at run time
    (importlib, shared.anatomy.step_module). Only run.py may load the steps before it, to show the lesson's
    before and after side by side; never a later one."""
    for step in STEPS:
        for f in (ROOT / "steps" / step).rglob("*.py"):
            named = step_names_in_code(f) - {step}
            if f.name == "run.py" and f.parent.name == step:
                later = {s for s in named if s not in STEPS or STEPS.index(s) > STEPS.index(step)}
                assert not later, f"{f} loads a later step or one chosen at run time: {sorted(later)}"
            else:
                assert not named, f"{f} names another step in its code: {sorted(named)}"


def test_the_import_check_sees_names_loaded_at_run_time(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""Docstrings may name step16."""\nimport importlib\n'
                     'x = step_module("step16", "model")\ny = importlib.import_module(f"steps.{name}.engine")\n')
    assert step_names_in_code(probe) == {"step16", "steps.<computed>"}


# A step's modules, lowest layer first. A module may import modules of its own layer or a lower one, never a higher
# one, and the imports (at the top of a file or inside a function) form no circle. A new module gets its place here.
LAYERS = [
    {"kernels.*", "quant",  # the Triton kernels (steps 15 on); step29: the 4-bit blocks they read
     "linear",  # step29: a linear method per weight format (TritonLayerOps asks it; it calls the GEMV kernels)
     "kv_spec"},  # step20: what one token's KV cache holds, per kv_cache_dtype (no torch, as wire: the front end's too)
    {"sequence", "detokenizer", "scheduler", "block_manager", "sampler", "timers", "cuda_graphs", "parallel",
     "speculative",  # step27: the config and the proposer of drafts
     "wire",  # step26: the messages between the front end and the engine core
     "output",  # step26: Finish and the stop check (the offline engine's, the core's and the front end's)
     "engine_args",  # step25: every engine option written once (no torch: the server's flags are made from it)
     "offload",  # step32: the host tier under the prefix cache (the block manager calls it, the runner flushes it)
     "kv_connector"},  # step35: the KV cache sent between a prefill engine and a decode engine
    {"model"},
    {"model_runner", "attention"},  # the runner and the attention backends that build its metadata
    {"config"},  # the engine's options, checked once (EngineConfig; step25 on): it imports the runner's CPU default
    {"worker"},  # a rank's build and the tensor-parallel worker processes (step22 on)
    {"core"},  # EngineCore: the scheduler, the block manager, the runner and the step (step26 on)
    {"engine"},  # the offline front end (LLM), over an EngineCore from step26 on
    {"engine_core"},  # the engine core process: a busy loop around an EngineCore (step26 on)
    {"async_llm"},  # the streaming engine (step23 on)
    {"serve", "bench_serve", "run", "__init__"},  # what a user runs, and the package's own file
    {"router"},  # step35: the router in front of a prefill and a decode engine (it serves with serve.py's pieces)
]


def step_imports(step: str) -> dict[str, set[str]]:
    """{module: the modules of the same step it imports}, relative imports anywhere in the file; module names are
    dotted paths inside the step ("kernels.decode")."""
    import ast

    folder = ROOT / "steps" / step
    modules = {".".join(f.relative_to(folder).with_suffix("").parts): f for f in folder.rglob("*.py")}
    graph = {}
    for name, f in modules.items():
        package = name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[:len(package) - (node.level - 1)]
                targets = [base + node.module.split(".")] if node.module else [base + [a.name] for a in node.names]
                found |= {".".join(t) for t in targets}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def layer_of(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if module in layer or (module.startswith("kernels.") and "kernels.*" in layer):
            return i
    raise AssertionError(f"{module}.py has no layer in tests/test_scripts.py's LAYERS: give it one")


def import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (a -> b -> ... -> a), or None."""
    state, path = {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (circle := visit(module)):
            return circle
    return None


@pytest.mark.parametrize("step", STEPS)
def test_a_steps_imports_form_no_circle_and_never_go_up_a_layer(step):
    graph = step_imports(step)
    layers = {m: layer_of(m) for m in graph}
    upward = [f"{m} imports {d}" for m, deps in sorted(graph.items()) for d in sorted(deps) if layers[d] > layers[m]]
    assert not upward, f"steps/{step}: a lower layer imports a higher one: {upward}"
    circle = import_circle(graph)
    assert circle is None, f"steps/{step}: the imports go round in a circle: {' -> '.join(circle)}"


def test_the_layer_check_sees_a_circle_and_an_upward_import():
    assert import_circle({"engine": {"model"}, "model": {"parallel"}, "parallel": {"engine"}}) == \
        ["engine", "model", "parallel", "engine"]
    assert import_circle({"engine": {"model"}, "model": set()}) is None
    assert layer_of("parallel") < layer_of("engine") and layer_of("kernels.decode") == 0


@pytest.mark.parametrize("step", STEPS)
def test_run_py_has_the_shared_skeleton(step):
    text = (ROOT / "steps" / step / "run.py").read_text()
    for line in SKELETON:
        assert text.count(line) == 1, f"steps/{step}/run.py: expected once: {line!r}"
    assert f'print_header("{step}: ' in text


@pytest.mark.parametrize("step, args, expected", [
    ("step08", ["--requests", "-3"], "argument --requests: must be at least 1, got -3"),
    ("step01", ["--lesson-tokens", "1"], "argument --lesson-tokens: must be at least 2, got 1"),
    ("step03", ["--max-tokens", "0"], "argument --max-tokens: must be at least 1, got 0"),
    # the engine's ValueErrors: an unknown model, a prompt + max_tokens longer than the context
    ("step05", ["--model", "nope"], "unknown model 'nope'"),
    ("step09", ["--model", "random:tiny-llama", "--max-tokens", "5000"], "exceeds the model's context"),
])
def test_run_py_bad_input_is_one_error_line(step, args, expected):
    proc = run(f"steps/{step}/run.py", *args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("run.py: error: "), proc.stderr
    assert expected in errors[0]


@pytest.mark.parametrize("argv", [["--steps", "step09", "step03"], ["--steps", "step03,step09"],
                                  ["--steps", "step03,", "step09", "step03"]])
def test_run_all_steps_option_takes_both_forms(argv):
    import run_all

    assert run_all.parse_args(argv).steps == ["step03", "step09"]
    assert run_all.parse_args([]).steps == STEPS


@pytest.mark.parametrize("argv", [["--steps", "step03,step99"], ["--steps", "nope"], ["--steps", ","]])
def test_run_all_unknown_step_is_an_error(argv, capsys):
    import run_all

    with pytest.raises(SystemExit) as exit_info:
        run_all.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("run_all.py: error: argument --steps: ") and "known: step01, step02" in err


def test_run_all_one_step():
    proc = run("run_all.py", "--steps", "step03", "--model", "random:tiny-llama", "--lesson-tokens", "9")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[1/1] python steps/step03/run.py" in proc.stdout and "-> step03: ok in " in proc.stdout
    assert "    == step03: KV cache ==" in proc.stdout  # the step's own output, shown as it runs
    table = proc.stdout[proc.stdout.rindex("step  "):].splitlines()
    assert len(table) == 3 and table[2].split()[0] == "step03" and " ok " in table[2], table


@pytest.mark.slow
def test_run_all_table():
    # Two steps, not all: every step's run.py is run by test_run_py already; this tests run_all's table.
    some = STEPS[:2]
    proc = run("run_all.py", "--model", "random:tiny-llama", "--lesson-tokens", "9", "--steps", *some, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.rindex("step  "):]
    for step in some:
        assert any(line.split()[:1] == [step] and " ok " in line for line in table.splitlines()), table


@pytest.mark.slow
def test_run_all_bench(tmp_path):
    out = tmp_path / "bench.json"
    proc = run("run_all.py", "--bench", "--model", "random:tiny-llama", "--max-tokens", "8",
               "--steps", *STEPS[:2], "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["step"] for r in results] == STEPS[:2]
    for r in results:  # per-step progress while it runs, then the table
        assert f"-> {r['step']}: {r['tokens_per_s']:.1f} tokens/s" in proc.stdout
        assert f"[bench] {r['step']}: run 1/{r['repeat']}" in proc.stderr
    lines = proc.stdout[proc.stdout.rindex("step  "):].splitlines()
    header, rows = lines[0].split(), [line.split() for line in lines[2:2 + len(STEPS[:2])]]
    assert header[:5] == ["step", "tokens/s", "vs", STEPS[0], "vs"] and "TTFT" in lines[0]
    first, second = rows
    assert first[:4] == [STEPS[0], f"{results[0]['tokens_per_s']:.1f}", "1.00x", "-"]
    assert second[0] == STEPS[1]
    ratio = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
    assert second[2] == second[3] == f"{ratio:.2f}x"  # vs the first step, and vs the previous (the same here)


# ---- run_all.py --bench --hf: HF transformers generate beside the steps ----------------------------------------

@pytest.mark.slow
def test_run_all_bench_hf(tmp_path):
    out = tmp_path / "bench.json"
    proc = run("run_all.py", "--bench", "--hf", "--steps", "step03,step04", "--model", "random:tiny-llama",
               "--max-tokens", "8", "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hf, *steps = json.loads(out.read_text())
    assert hf["step"] == "hf" and hf["label"] == "HF transformers generate (padded)"
    assert [r["step"] for r in steps] == ["step03", "step04"]
    for key in ("model", "device", "dtype", "workload", "requests", "repeat"):  # the same workload, device and dtype
        assert {r[key] for r in steps} == {hf[key]}, key
    assert (hf["device"], hf["dtype"]) == ("cpu", "float32")
    # The standard workload ignores EOS: every request runs to its max_tokens, in HF (cut at max_tokens) as in
    # the steps, so the counted tokens are the same.
    assert hf["generated_tokens"] == hf["requests"] * 8 == steps[0]["generated_tokens"] == steps[1]["generated_tokens"]
    for r in steps:
        assert r["vs_hf"] == r["tokens_per_s"] / hf["tokens_per_s"]
    # The table: HF's row first, then the steps, each with "vs HF" = its tokens/s over HF's.
    lines = proc.stdout[proc.stdout.rindex("step  "):].splitlines()
    header = lines[0]
    columns = [m.start() for m in re.finditer(r"-+", lines[1])]  # where each column starts, from the dashes
    cells = [[line[a:b].strip() for a, b in zip(columns, columns[1:] + [None])] for line in [header] + lines[2:5]]
    vs_hf = cells[0].index("vs HF generate")
    assert cells[1][:2] == [hf["label"], f"{hf['tokens_per_s']:.1f}"] and cells[1][vs_hf] == "1.00x"
    for row, r in zip(cells[2:], steps):
        assert row[:2] == [r["step"], f"{r['tokens_per_s']:.1f}"]
        assert row[vs_hf] == f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}x"


def test_hf_counted_tokens_match_what_the_steps_count():
    from shared import SamplingParams
    from shared.bench import hf_counted_tokens

    eos = {2}
    row = [5, 6, 2, 7, 2, 2]  # HF's new tokens for one row (after a stop, HF pads with the pad token = EOS)
    assert hf_counted_tokens(row, SamplingParams(max_tokens=6, ignore_eos=True), eos) == 6
    assert hf_counted_tokens(row, SamplingParams(max_tokens=4, ignore_eos=True), eos) == 4  # its own max_tokens
    assert hf_counted_tokens(row, SamplingParams(max_tokens=6), eos) == 3  # the EOS counts, as in token_ids
    assert hf_counted_tokens(row, SamplingParams(max_tokens=2), eos) == 2
    assert hf_counted_tokens(row, SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=[6]), eos) == 2
    assert hf_counted_tokens(row[:3], SamplingParams(max_tokens=6, ignore_eos=True), eos) == 3  # HF stopped early


def test_hf_refuses_a_workload_it_cannot_serve_as_one_batch():
    from shared import SamplingParams
    from shared.bench import _hf_stop_ids

    greedy = SamplingParams(temperature=0, max_tokens=4)
    assert _hf_stop_ids([greedy, greedy], {2}) == [2]
    assert _hf_stop_ids([SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)], {2}) is None
    for params in ([greedy, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)],
                   [SamplingParams(temperature=0.7, max_tokens=4)], [SamplingParams(temperature=0, stop=["."])]):
        with pytest.raises(ValueError, match="--hf: "):
            _hf_stop_ids(params, {2})


@pytest.mark.parametrize("argv, expected", [
    (["--hf"], "argument --hf: only with --bench"),
    (["--bench", "--hf", "--repeat", "0"], "argument --repeat: must be at least 1, got 0"),
    (["--bench", "--max-tokens", "0"], "argument --max-tokens: must be at least 1, got 0"),
])
def test_run_all_bad_bench_flags(argv, expected, capsys):
    import run_all

    with pytest.raises(SystemExit) as exit_info:
        run_all.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"run_all.py: error: {expected}"), err


@pytest.mark.parametrize("args, expected", [
    (["--hf", "--step", "step03"], "error: argument --step: not allowed with argument --hf"),
    ([], "one of the arguments --step --hf is required"),
    (["--hf", "--model", "nope"], "unknown model 'nope'"),
])
def test_bench_hf_bad_input_is_one_error_line(args, expected):
    proc = run("-m", "shared.bench", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert expected in proc.stderr.splitlines()[-1]


def test_single_workload_is_batch_one():
    from shared import Tokenizer, resolve_model
    from shared.bench import WORKLOADS

    tok = Tokenizer(resolve_model("random:tiny-llama"))
    single, params = WORKLOADS["single"](tok, 16)
    standard, standard_params = WORKLOADS["standard"](tok, 16)
    assert single == standard[:1] and params == standard_params
