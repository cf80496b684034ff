"""The registry of steps: every step folder, its Part, and what it has.

Tests select steps by what they have (`having("scheduler")`, `introducing("prefix_cache")`), never by a step's
name. A step keeps every feature of the step before it unless its line says `removes=`; so a new step copied
from the newest one joins every test that applies to it by one line here, `step("step18", part=6)`.
`tests/test_scripts.py::test_every_step_folder_is_complete` checks that this list names every step folder.

The features (the step that brings each one in is where its lesson is tested in full):

    greedy_decode       a model, greedy decoding, EOS and max_tokens               step01
    sampling            steps/<step>/sampler.py: temperature, top-k/p, min-p, seeds; stop strings and ids
    kv_cache            prefill once, then one token per forward
    batch               several requests in one forward (static batching)
    scheduler           add_request()/step(), max_num_seqs, RequestStatus (continuous batching)
    chunked_prefill     max_num_batched_tokens: prompts prefilled in chunks, stats["prefill_chunks"]
    preemption          a KV budget (max_kv_tokens) that preempts the newest request
    kv_budget_in_tokens the budget is counted in reserved tokens (scheduler.reserved_tokens), not in blocks
    paged_kv            block_size, a block manager over a pool of KV blocks
    prefix_cache        enable_prefix_caching, block hashes, hits
    pool_forward        model.forward(tokens, positions, block_tables, pool): one sequence's rows at a time
    model_families      Llama and Qwen3 through one loader, fused QKV and gate/up projections
    memory_sizing       the KV pool sized from the device's memory (kv_pool_blocks, gpu_memory_utilization)
    batched_sampler     one sampler call per step (sample_batch), the incremental detokenizer
    phase_timers        llm.timers: where the time of a step goes; run.py --profile writes a trace
    model_runner        one KV tensor for all layers, a model runner between engine and model
    slot_mapping_write  the KV write as one indexed copy (model.slot_mapping, model.write_kv)
    index_select_gather the KV read as one index_select (model.context_slots, model.gather_kv)
    gqa_view            grouped-query attention by a view (model.grouped_attention)
    mask_once           the causal mask built once per forward, none for decodes (model.causal_mask)
    incremental_hash    each full block hashed once (block_manager.num_hashed, hash_new_blocks)
    lru_eviction        release()/append(), cached blocks evicted least recently used first
    flat_varlen_batch   one model forward per engine step, chunks and decodes in one flat batch
    triton_prefill      kernels/attention.py: flash attention over the paged cache (Triton)
    triton_decode       kernels/decode.py: paged decode kernels v1 and v2 (Triton); step17 keeps v2 beside flash
                        decoding, step18 removes it (the mixed kernel takes every decode that does not split)
    flash_decoding      kernels/decode.py: split-K decode (split + merge kernels), choose_num_splits
    mixed_batch_kernel  kernels/attention.py: one attention launch per layer for decodes and chunks, no phases
    block_table_rows    model_runner.BlockTables: persistent block-table rows, a step writes only the new blocks
    fused_kernels       kernels/fused.py: residual add + RMSNorm, SiLU * up, q/k norm + RoPE (Triton)
    int8_kv             kv_cache_dtype="int8": K/V stored as int8 with a scale per token and KV head
    cuda_graphs         cuda_graphs.py: the decode forward captured per batch bucket and replayed; enforce_eager
    fused_sampler       kernels/sampling.py: the draw and the chosen tokens' logprobs as one kernel (no filters)
    tensor_parallel     tensor_parallel_size: the model sharded over N ranks (parallel.py), all-reduces per layer
    async_engine        async_llm.py's AsyncLLM: async generate() streams cumulative outputs, abort(request_id)
    openai_server       serve.py: the OpenAI API (completions, chat completions, streaming) over HTTP
    overlap_scheduling  async_scheduling: step N + 1 launched before step N's tokens are read (PENDING places, the
                        device's last_token table), stats["discarded_tokens"]
    engine_core_process engine_core.py: AsyncLLM's EngineCore in its own process over ZMQ + msgpack, outputs as deltas
    scheduler_output    the step's plan (scheduler.py's SchedulerOutput) names its rows' requests by id and holds their
                        values: the runner's block tables, draws and CUDA graphs read it, never a request
    speculative_decoding speculative_config: n-gram drafts verified as a chunk of k + 1, exact (speculative.py)
    fused_projections   ops.linear: each projection with its RMSNorm, SiLU * up or residual add; kernels/gemv.py's
                        GEMV at one row on CUDA; ops.qk_norm_rope_write stores K and V in the q/k norm + RoPE kernel
    int4_weights        quant.py: the GGUF's Q4_1 blocks kept as stored, int4 on load; kernels/gemv4.py
    fp8_kv              kv_cache_dtype="fp8": K/V stored as float8 e4m3 with one scale per layer for each of K and V;
                        quantization="fp8": e4m3 weights with a scale per output row
    moe                 a mixture of experts (Qwen3-MoE): route, kernels/moe.py's grouped GEMMs (fused == the loop over
                        experts), enable_expert_parallel
    kv_offload          kv_offloading_size: evicted prefix-cache blocks stored in host memory and restored on a hit
                        (offload.py: HostKVTier decides, HostKVStore on every rank copies), in the order asked,
                        before the forward that reads them
    mla                 DeepSeek-V2/V3: multi-head latent attention (one cache row of kv_lora_rank + rope dims a token;
                        a decode absorbs W_UK / W_UV, a prefill chunk decompresses) and DeepSeek's router
"""
from __future__ import annotations

import ast
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

# The harness prompts (chat questions and plain text), the length of their greedy answers, and the golden file.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]
TEXT_PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    "]
EQUIV_MAX_TOKENS = 32

REAL = "smollm2-135m"
TINY = "random:tiny-llama"
TINY_QWEN3 = "random:tiny-qwen3"


@dataclass(frozen=True)
class Step:
    name: str
    part: int
    features: frozenset
    adds: frozenset


REGISTRY: list[Step] = []


def step(name: str, part: int, adds: tuple = (), removes: tuple = ()) -> None:
    """Register a step: the features of the step before it, plus `adds`, minus `removes`."""
    before = REGISTRY[-1].features if REGISTRY else frozenset()
    assert not set(adds) & before, f"{name} adds what it already has: {set(adds) & before}"
    assert set(removes) <= before, f"{name} removes what it does not have: {set(removes) - before}"
    REGISTRY.append(Step(name, part, (before | set(adds)) - set(removes), frozenset(adds)))


step("step01", 1, adds=("greedy_decode",))
step("step02", 1, adds=("sampling",))
step("step03", 1, adds=("kv_cache",))
step("step04", 2, adds=("batch",))
step("step05", 2, adds=("scheduler",))
step("step06", 2, adds=("chunked_prefill",))
step("step07", 2, adds=("preemption", "kv_budget_in_tokens"))
step("step08", 3, adds=("paged_kv", "pool_forward"), removes=("kv_budget_in_tokens",))
step("step09", 3, adds=("prefix_cache",))
step("step10", 4, adds=("model_families",))
step("step11", 4, adds=("memory_sizing",))
step("step12", 4, adds=("batched_sampler",))
step("step13", 4, adds=("phase_timers",))
step("step14", 5, adds=("model_runner",), removes=("pool_forward",))
step("step14_1", 5, adds=("slot_mapping_write",))
step("step14_2", 5, adds=("index_select_gather",))
step("step14_3", 5, adds=("gqa_view",))
step("step14_4", 5, adds=("mask_once",))
step("step14_5", 5, adds=("incremental_hash",))
step("step14_6", 5, adds=("lru_eviction",))
step("step14_7", 5, adds=("flat_varlen_batch",))
step("step15", 6, adds=("triton_prefill",))
step("step16", 6, adds=("triton_decode",))
step("step17", 6, adds=("flash_decoding",))
step("step18", 6, adds=("mixed_batch_kernel", "block_table_rows"), removes=("triton_prefill", "triton_decode"))
step("step19", 6, adds=("fused_kernels",))
step("step20", 6, adds=("int8_kv",))
step("step21", 7, adds=("cuda_graphs", "fused_sampler"))
step("step22", 7, adds=("tensor_parallel",))
step("step23", 8, adds=("async_engine",))
step("step24", 8, adds=("openai_server",))
step("step25", 9, adds=("overlap_scheduling",))
step("step26", 9, adds=("engine_core_process", "scheduler_output"))
step("step27", 9, adds=("speculative_decoding",))
step("step28", 10, adds=("fused_projections",))
step("step29", 10, adds=("int4_weights",))
step("step30", 10, adds=("fp8_kv",))
step("step31", 10, adds=("moe",))
step("step32", 10, adds=("kv_offload",))
step("step33", 10, adds=("mla",))
step("step34", 11, adds=("pipeline_parallel",))
step("step35", 11, adds=("pd_disaggregation",))

STEPS = [s.name for s in REGISTRY]
BY_NAME = {s.name: s for s in REGISTRY}
ALL_FEATURES = frozenset().union(*(s.features for s in REGISTRY))
NEWEST = STEPS[-1]


def _known(feature: str) -> str:
    assert feature in ALL_FEATURES, f"unknown feature {feature!r}"
    return feature


def has(name: str, feature: str) -> bool:
    return _known(feature) in BY_NAME[name].features


def having(*features: str) -> list[str]:
    """The steps that have every one of `features`."""
    return [s.name for s in REGISTRY if all(_known(f) in s.features for f in features)]


def introducing(feature: str) -> str:
    """The step that brings `feature` in (its lesson)."""
    return next(s.name for s in REGISTRY if _known(feature) in s.adds)


def previous(name: str) -> str:
    return STEPS[STEPS.index(name) - 1]


def last_before(feature: str) -> str:
    """The newest step without `feature` that comes before the step introducing it."""
    return previous(introducing(feature))


def part_of(name: str) -> int:
    return BY_NAME[name].part


def part_ends() -> list[str]:
    """The last step of each Part."""
    return [s.name for i, s in enumerate(REGISTRY) if i + 1 == len(REGISTRY) or REGISTRY[i + 1].part != s.part]


def real_model_steps() -> list[str]:
    """Where the real model's per-step checks run: step01, the last step of each Part, and the newest step.
    Every other step is checked on the tiny models (and is equal to its neighbours there)."""
    return sorted({STEPS[0], *part_ends(), NEWEST}, key=STEPS.index)


def lesson_and_newest(feature: str) -> list[str]:
    """The step that introduces `feature` and the newest step (which must still have it)."""
    first = introducing(feature)
    return sorted({first, NEWEST} if has(NEWEST, feature) else {first}, key=STEPS.index)


def lesson_and_copies(feature: str, *modules: str) -> list[tuple[list[str], bool]]:
    """Every step that has `feature`, grouped by the content of its `modules` (distinct_copies): each group with
    True where it holds the step that introduces the feature (its full test grid), False for the later groups,
    whose own copies of the code differ from it and get a reduced grid."""
    first = introducing(feature)
    return [(group, first in group) for group in distinct_copies(having(feature), *modules)]


# ---- tests of a step's modules, once per distinct content --------------------------------------------------------
# Steps are copies: steps/step21/kernels/decode.py is often byte for byte steps/step20's. A test that exercises
# only some modules of a step (a kernel against its reference, a sampler's masks) proves the same thing in every
# step whose files it loads are the same, so it runs once for each distinct content, on the first step that has
# it, and its id names every step it stands for. A test that builds an engine loads most of the step: it runs in
# every step.
STEPS_DIR = Path(__file__).resolve().parents[1] / "steps"


def _module_file(step: str, parts: list[str]) -> Path | None:
    """steps/<step>/<parts>.py, or the package steps/<step>/<parts>/__init__.py; None if neither exists."""
    folder = STEPS_DIR.joinpath(step, *parts)
    for path in ([folder.with_suffix(".py")] if parts else []) + [folder / "__init__.py"]:
        if path.is_file():
            return path
    return None


def step_files(step: str, *modules: str) -> list[Path]:
    """The files of steps/<step> that importing its `modules` ("sampler", "kernels.decode") loads: each module, the
    __init__.py of every package above it, and every module of the step that they import, transitively (each
    relative import anywhere in a file, one inside a function included)."""
    files: set[Path] = set()
    todo = [m.split(".") for m in modules]
    while todo:
        parts = todo.pop()
        path = _module_file(step, parts)
        if path is None:
            raise ValueError(f"steps/{step} has no module {'.'.join(parts)!r}")
        if path in files:
            continue
        files.add(path)
        package = parts if path.name == "__init__.py" else parts[:-1]
        todo += [package[:i] for i in range(len(package) + 1)]  # the packages it sits in run their __init__.py
        for level, module, names in _relative_imports(path):  # `from .x import y`, `from . import x`
            target = package[:len(package) - level + 1] + (module.split(".") if module else [])
            todo.append(target)
            todo += [target + [name] for name in names if _module_file(step, target + [name])]
    return sorted(files)


@functools.lru_cache(maxsize=None)
def _relative_imports(path: Path) -> tuple[tuple[int, str | None, tuple[str, ...]], ...]:
    """Each relative import anywhere in a file, (level, module, names): parsed once a session (a collection asks
    for the same files for many tests)."""
    return tuple((node.level, node.module, tuple(a.name for a in node.names))
                 for node in ast.walk(ast.parse(path.read_text(), str(path)))
                 if isinstance(node, ast.ImportFrom) and node.level)


@functools.lru_cache(maxsize=None)
def content_key(step: str, *modules: str) -> str:
    """A hash of the files that `modules` load from steps/<step> (step_files): their paths in the step and their
    bytes. Two steps with the same key run the same code for those modules."""
    digest, root = hashlib.sha256(), STEPS_DIR / step
    for path in step_files(step, *modules):
        data = path.read_bytes()
        digest.update(f"{path.relative_to(root)}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def distinct_copies(steps: list[str], *modules: str) -> list[list[str]]:
    """`steps` grouped by content_key(step, *modules), each group in step order, the groups in the order of their
    first steps. A test that exercises nothing of a step but `modules` runs on each group's first step only."""
    groups: dict[str, list[str]] = {}
    for name in steps:
        groups.setdefault(content_key(name, *modules), []).append(name)
    return list(groups.values())
