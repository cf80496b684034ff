"""What the Part 5 run.py files share: the same batch of chat requests through two steps, phase by phase.

Each step of Part 5 changes one part of the engine. Its run.py runs the same requests through the step
before it and through itself, on the same model and device, and prints both profiles side by side (ms per
engine step in each phase, model forwards per step, tokens/s), next to a micro-benchmark of the part it
changed. One run, one process: a ratio of two numbers measured together, not two numbers from two days.
"""
from __future__ import annotations

import contextlib
import importlib
import time

from shared.cli import REPEATS, format_table, int_at_least, runs_differ, step_arg_parser

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "List three uses of a paperclip.", "Why is the sky blue?", "How do bees make honey?",
             "What is a prime number?", "Describe a cat in one sentence."]
# A copy-heavy task (step27's speculative decoding): the answer is mostly the given text again, its typos fixed.
TYPO_PARAGRAPH = ("Teh library opens at nine in the morning and closes at six in the evening. Members may borow up to "
                  "five books at a time, for three weeks. Books can be renewed online, unless another member has "
                  "reserved them. Late returns cost ten cents a day, and the reading room is quiet at all times.")
FIX_THE_TYPOS = f"Rewrite this paragraph with its spelling mistakes fixed, and change nothing else:\n\n{TYPO_PARAGRAPH}"


def anatomy_arg_parser(description: str):
    """A Part 5 run.py's options: every step's, plus --requests and --profile."""
    parser = step_arg_parser(description, lesson_tokens=32)
    parser.add_argument("--requests", type=int_at_least(1), default=8,
                        help="requests in the measured run (default: %(default)s)")
    parser.add_argument("--profile", metavar="TRACE.json", default=None,
                        help="also write a torch.profiler Chrome trace of this step's measured run (open it in "
                             "chrome://tracing or https://ui.perfetto.dev); it records every op, so keep the run small")
    return parser


def profile_run(llm, requests: int, new_tokens: int, trace: str | None = None) -> dict:
    """Run `requests` chat questions, `new_tokens` each (greedy, EOS ignored), after a short warm-up; with
    `trace`, under torch.profiler, written there as a Chrome trace.
    -> tokens/s, ms per engine step of each phase, forwards per step, the outputs' token ids (and in bfloat16,
    each token's 5 most likely alternatives, which before_after's near-tie rule reads)."""
    import torch

    from shared.params import SamplingParams

    conversations = [[{"role": "user", "content": q}] for q in (QUESTIONS * (requests // len(QUESTIONS) + 1))]
    llm.block_manager.reset_prefix_cache()  # every run from the same start: nothing cached
    llm.chat(conversations[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    llm.timers.reset()
    forwards = llm.stats.get("forwards", 0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if llm.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities) if trace else contextlib.nullcontext()
    with profiler:
        start = time.perf_counter()
        top = TOP_K_NEAR_TIE if llm.dtype == torch.bfloat16 else None
        outs = llm.chat(conversations[:requests], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                                                                 logprobs=top))
        wall = time.perf_counter() - start
    if trace:
        profiler.export_chrome_trace(trace)
    steps = max(llm.timers.steps, 1)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "steps": llm.timers.steps, "tokens": tokens,
            "ms_per_step": {name: 1000 * s / steps for name, s in llm.timers.seconds.items()},
            "phase_share": sum(llm.timers.seconds.values()) / wall,
            "forwards_per_step": (llm.stats.get("forwards", 0) - forwards) / steps if "forwards" in llm.stats else None,
            "token_ids": [o.outputs[0].token_ids for o in outs], "logprobs": [o.outputs[0].logprobs for o in outs],
            "bf16": llm.dtype == torch.bfloat16}


TOP_K_NEAR_TIE = 5  # bf16 runs: a divergence is a near-tie if each token is among the other's 5 most likely


def diverge_at_near_ties(a: dict, b: dict) -> tuple[int, str | None]:
    """Two runs' outputs under the rule the gpu tests use for bf16 (vLLM's): identical up to a first difference,
    where each run's token is among the other's TOP_K_NEAR_TIE most likely, and not compared after it (the texts
    have diverged). -> (requests that diverged, None) or (_, what broke the rule)."""
    diverged = 0
    for r, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])):
        i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if i is None:
            if len(x) != len(y):
                return diverged, f"request {r}: {len(x)} against {len(y)} tokens"
            continue
        diverged += 1
        if a["logprobs"][r] is None or x[i] not in b["logprobs"][r][i] or y[i] not in a["logprobs"][r][i]:
            return diverged, f"request {r}, token {i}: {x[i]} against {y[i]}, not a near-tie"
    return diverged, None


# On a GPU two engines live side by side in these demos, and each sizes its KV cache from the memory it is allowed
# (gpu_memory_utilization): the step's own engine takes 40% of the device, the one it is compared with 85% (of
# which the first engine's 40% is already used), so both fit.
DEMO_SHARE, COMPARED_SHARE = 0.4, 0.85


def _gpu_share(args, share: float) -> dict:
    from shared import resolve_device_dtype

    device, _ = resolve_device_dtype(args.device, args.dtype)
    return {"gpu_memory_utilization": share} if device.type == "cuda" else {}


def demo_options(args) -> dict:
    """The options of the step's own engine in its run.py: on a GPU, a share that leaves room for a second engine."""
    return _gpu_share(args, DEMO_SHARE)


def compared_options(args) -> dict:
    """The options of a second engine beside the demo's own (the one it is compared with, or a second way to run
    it): on a GPU, the larger share, of which the demo's engine already holds its part."""
    return _gpu_share(args, COMPARED_SHARE)


def step_module(step: str, module: str):
    """steps/<step>/<module>.py, loaded by name: a run.py compares its own code with the step before it."""
    return importlib.import_module(f"steps.{step}.{module}")


def load_llm(step: str, args, **options):
    """steps/<step>'s LLM on the same model, device and dtype as this run (beside the demo's own engine)."""
    engine = importlib.import_module(f"steps.{step}.engine")
    if "max_kv_tokens" not in options:
        options = {**compared_options(args), **options}
    return engine.LLM(args.model, device=args.device, dtype=args.dtype, **options)


def before_after(previous: str, this: str, llm, args, **options) -> tuple[dict, dict]:
    """The same args.requests requests through the previous step and this one, REPEATS runs each (alternated, so
    that a drift of the machine falls on both); print the median runs side by side, and call the tokens/s ratio
    a difference only if the runs do not overlap. The outputs must be equal (greedy): say so, or fail loudly.
    --profile traces this step's first run."""
    requests, trace = args.requests, getattr(args, "profile", None)
    old, befores, afters = load_llm(previous, args, **options), [], []
    for i in range(REPEATS):
        befores.append(profile_run(old, requests, args.lesson_tokens))
        afters.append(profile_run(llm, requests, args.lesson_tokens, trace=trace if i == 0 else None))
    before, after = (sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2] for runs in (befores, afters))
    rows = [[name, f"{before['ms_per_step'][name]:.2f}", f"{after['ms_per_step'][name]:.2f}",
             _ratio(before["ms_per_step"][name], after["ms_per_step"][name])] for name in after["ms_per_step"]]
    if before["forwards_per_step"] is not None:
        rows.append(["model forwards per step", f"{before['forwards_per_step']:.2f}",
                     f"{after['forwards_per_step']:.2f}", ""])
    rows.append(["tokens/s", f"{before['tokens_per_s']:.1f}", f"{after['tokens_per_s']:.1f}",
                 _ratio(after["tokens_per_s"], before["tokens_per_s"])])
    print(f"\n{requests} requests x {args.lesson_tokens} new tokens on {llm.device}, the same requests through "
          f"{previous} and {this}, {REPEATS} runs each (the median run; ms per engine step; ratio = before / after, "
          "tokens/s: after / before):")
    print(format_table(["phase", f"{previous} ms", f"{this} ms", "ratio"], rows))
    if all(run["token_ids"] == before["token_ids"] for run in befores + afters):
        print(f"The outputs are equal, token for token ({after['tokens']} tokens in {after['steps']} engine steps). "
              f"{this}'s phases cover {100 * after['phase_share']:.1f}% of its wall time.")
    elif before["bf16"]:  # bf16: other kernels round differently, and a near-tie can go either way
        checks = [diverge_at_near_ties(run, before) for run in befores + afters]
        broken = [why for _, why in checks if why]
        if broken:
            raise SystemExit(f"error: {this}'s outputs differ from {previous}'s beyond bf16 near-ties: {broken[0]}")
        diverged = max(n for n, _ in checks)
        print(f"The outputs are equal token for token in {requests - diverged} of {requests} requests; the other "
              f"{diverged} part at a bf16 near-tie (both tokens among each other's {TOP_K_NEAR_TIE} most likely, the "
              f"rule of the gpu tests) and are not compared after it. {this}'s phases cover "
              f"{100 * after['phase_share']:.1f}% of its wall time.")
    else:
        raise SystemExit(f"error: {this}'s outputs differ from {previous}'s on the same requests")
    speeds = [[run["tokens_per_s"] for run in runs] for runs in (afters, befores)]
    ratio = after["tokens_per_s"] / before["tokens_per_s"]
    if runs_differ(*speeds):
        print(f"{this} made {ratio:.2f}x {previous}'s tokens/s ({'faster' if ratio > 1 else 'slower'}: the "
              f"{REPEATS} runs of each do not overlap).")
    else:
        print(f"{this} made {ratio:.2f}x {previous}'s tokens/s, within the run-to-run spread: {previous} "
              f"{min(speeds[1]):.1f}-{max(speeds[1]):.1f}, {this} {min(speeds[0]):.1f}-{max(speeds[0]):.1f} tokens/s.")
    if trace:
        print(f"trace written: {trace} ({this}'s first run; open it in chrome://tracing or https://ui.perfetto.dev; "
              "the phases appear by name)")
    return before, after


def _ratio(before: float, after: float) -> str:
    return f"{before / after:.2f}x" if after > 0 else "-"


def time_ms(fn, device, repeat: int = 20) -> float:
    """Median milliseconds of fn() over `repeat` calls after one warm-up (on CUDA, waiting for the GPU)."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def print_micro(title: str, rows: list[list]) -> None:
    """rows: [case, before ms, after ms] -> a table with the speed-up."""
    print(f"\n{title}")
    print(format_table(["case", "before ms", "after ms", "speed-up"],
                       [[case, f"{b:.3f}", f"{a:.3f}", _ratio(b, a)] for case, b, a in rows]))


def copy_gb_per_s(device, mib: int = 1024) -> float:
    """The device's copy bandwidth, measured now: a mib-MiB tensor copied into another, bytes read + written per
    second, in GB/s. The memory roofline of a kernel that only streams data (a decode reads the KV cache once)."""
    import torch

    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, repeat=10)
    return 2 * src.numel() / (ms / 1000) / 1e9


def kernel_ms(fn, device, calls: int = 10) -> float | None:
    """The GPU time of fn's kernels alone, ms per call: the durations the CUDA profiler records for every kernel fn
    launches, summed over `calls` calls and divided by them. time_ms measures a call as the CPU sees it, launches
    and Python included; for a kernel of some microseconds the launches take longer than the kernel, and only this
    measures the kernel itself. None off CUDA."""
    if device.type != "cuda":
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / calls / 1000


def busy_us(kernels) -> float:
    """The microseconds a GPU was busy with some profiler events: the union of their intervals. Kernels of one
    stream used not to overlap, so their durations summed to it; a kernel launched as a programmatic dependent
    (step28) starts before the one it follows ends, and the sum would count the overlap twice."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy


# ---- Part 6: the run.py files of the kernel steps ------------------------------------------------------------
def kernel_arg_parser(description: str):
    """A Part 6 run.py's options: a Part 5 run.py's, plus --attention-backend."""
    parser = anatomy_arg_parser(description)
    parser.add_argument("--attention-backend", choices=["triton", "torch"], default=None,
                        help="attention: this step's Triton kernels or the torch loop they replace (default: triton on "
                             "CUDA, torch elsewhere; triton on a CPU runs in Triton's interpreter and is very slow)")
    return parser


def interpreter_off_cuda(args) -> None:
    """Off CUDA the demos run their kernels in Triton's interpreter (TRITON_INTERPRET=1). Triton reads the switch
    as each kernel is defined, its own too: `triton.language`'s functions (tl.sum, tl.max ...) are kernels defined
    when it is first imported, and a kernel of the interpreter fails calling compiled ones. The first load of the
    embedded model imports it (transformers does, to convert the GGUF file), and from step21 on so does importing
    the engine (model_runner.py imports kernels/sampling.py): call this first in main(), before either.
    It also refuses, before anything loads, what the interpreter cannot compute: bfloat16 (it multiplies the raw
    bits), which the demos' kernels would turn into garbage after the model has loaded and answered."""
    import os
    import sys

    import torch

    from shared import resolve_device_dtype

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    if device.type == "cuda":
        return
    if "TRITON_INTERPRET" not in os.environ:
        if "triton.language" in sys.modules:
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set: its kernels would not run in "
                               "the interpreter; set TRITON_INTERPRET=1 before starting Python")
        os.environ["TRITON_INTERPRET"] = "1"
    if dtype == torch.bfloat16 and os.environ["TRITON_INTERPRET"] == "1":
        raise ValueError(f"argument --dtype: bfloat16 on {device.type}: the kernels run in Triton's interpreter "
                         "here, which computes bfloat16 wrongly; use float32 (the default off CUDA) or float16")


def kernels_cannot_run(llm) -> str | None:
    """Why this run's kernel demo cannot run here (a CPU without the interpreter), or None."""
    import os

    if llm.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "on a CPU Triton's kernels run only in its interpreter, and TRITON_INTERPRET is not 1"
    return None



# ---- Part 6: counting kernel launches -----------------------------------------------------------------------
NO_KERNEL_PREFIXES = ("aten.empty", "aten.new_empty", "aten.set_", "aten.lift_fresh", "aten.detach", "aten.alias",
                      "profiler.")  # allocations and bookkeeping: the caching allocator, never a kernel


def shares_storage(a, b) -> bool:
    """Whether tensors a and b are views of one storage (an operator that returned a view launched nothing; one
    flagged as a view that copied, such as .to() changing the dtype, did)."""
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return True  # nothing to compare: a list of views (split, chunk)
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class LaunchCounter:
    """Counts, while active, the kernels a block of code would launch on a GPU, on any device: every torch operator
    that runs a kernel of its own (not a view, not an allocation, not a composite that runs others), and every Triton
    kernel launch. The torch operators a Triton launch runs inside itself (Triton's interpreter runs kernels on the
    CPU through torch) are not counted: a compiled launch has none. A matmul counts as one (cuBLAS may launch two). `ops` and `triton` are the two counts; `by_op`
    names each torch operator counted. On a GPU the CUDA profiler's kernel count says the same thing (gpu_kernels)."""

    def __init__(self):
        import collections

        self.ops, self.triton, self.by_op = 0, 0, collections.Counter()

    @property
    def launches(self) -> int:
        return self.ops + self.triton

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        depth = [0]

        class Mode(TorchDispatchMode):
            # The mode sees each operator the code calls, composites included (matmul, not the mm it runs: the
            # operators a handled call runs inside it do not come back here), so nothing is counted twice.
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = str(func)
                if depth[0] == 0 and not name.startswith(NO_KERNEL_PREFIXES) and not (
                        func.is_view and shares_storage(out, args[0] if args else None)):  # a view: no kernel
                    counter.ops += 1
                    counter.by_op[name] += 1
                return out

        self._patched = []
        try:
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction
            classes = (InterpretedFunction, JITFunction)
        except ImportError:  # no Triton: torch operators only
            classes = ()
        for cls in classes:
            original = cls.run

            def run(fn_self, *args, _original=original, **kwargs):
                if kwargs.get("warmup"):
                    return _original(fn_self, *args, **kwargs)
                counter.triton += depth[0] == 0
                depth[0] += 1
                try:
                    return _original(fn_self, *args, **kwargs)
                finally:
                    depth[0] -= 1

            cls.run = run
            self._patched.append((cls, original))
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for cls, original in self._patched:
            cls.run = original
        return False


def gpu_kernels(fn, device) -> int | None:
    """The kernels fn launches on the GPU, counted by the CUDA profiler (after one warm-up call). None off CUDA."""
    if device.type != "cuda":
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def decode_forward_inputs(engine) -> tuple:
    """The inputs of one decode forward of two requests: the last forward of a short greedy run on `engine`."""
    from shared.params import SamplingParams

    forward, seen = engine.model.forward, []
    engine.model.forward = lambda *a: (seen.append(a), forward(*a))[1]
    try:
        engine.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finally:
        engine.model.forward = forward
    return seen[-1]


def forward_launches(engine, inputs: tuple, layers: int | None = None) -> LaunchCounter:
    """The launches of one forward on `inputs`, run with its first `layers` layers (default: all), counted."""
    config = engine.model.config
    all_layers = config.num_layers
    config.num_layers = all_layers if layers is None else layers
    try:
        with LaunchCounter() as counter:
            engine.model.forward(*inputs)
    finally:
        config.num_layers = all_layers
    return counter


def layer_launches(engine, inputs: tuple) -> tuple[LaunchCounter, LaunchCounter]:
    """-> (the forward's launches, one layer's): one layer's count is the forward's minus the same forward run with
    one layer fewer, the forward's own work (embedding, RoPE tables, lm_head) cancelling out."""
    full = forward_launches(engine, inputs)
    fewer = forward_launches(engine, inputs, engine.model.config.num_layers - 1)
    layer = LaunchCounter()
    layer.ops, layer.triton, layer.by_op = full.ops - fewer.ops, full.triton - fewer.triton, full.by_op - fewer.by_op
    return full, layer
