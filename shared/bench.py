"""The benchmark harness: one fixed workload through one step's LLM, measured the same way for every step.

    python -m shared.bench --step step03 [--model M] [--device D] [--dtype T] [--workload standard]
    python -m shared.bench --hf [...]      the same workload through HF transformers `generate` (one padded batch)
    python -m shared.bench --hf cb [...]   ... through HF transformers' continuous batching (add_request per request)

prints one JSON line: tokens/s, time to first token (median over requests), peak memory, wall time.
run_all.py --bench runs this once per step, each in a fresh process, so peak memory is per step.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import random
import resource
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from shared.anatomy import copy_gb_per_s  # noqa: E402
from shared.models import DEFAULT_MODEL  # noqa: E402
from shared.params import SamplingParams  # noqa: E402

STANDARD_QUESTIONS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the moon.",
    "List three uses of a paperclip.",
]


def standard_workload(tokenizer, max_tokens: int = 128):
    """Several chat prompts, `max_tokens` new tokens each, greedy, ignore_eos (every step does the same work)."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in STANDARD_QUESTIONS]
    return prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def mixed_workload(tokenizer, max_tokens: int = 128, num_requests: int = 64, seed: int = 2024):
    """Many requests of mixed lengths, where batching matters: prompt lengths 8-192 and output lengths
    8-max_tokens drawn from a fixed seed; prompts are random token ids (the work, not the text, matters)."""
    rng = random.Random(seed)
    vocab = tokenizer.hf.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(8, 192))] for _ in range(num_requests)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, max_tokens), ignore_eos=True)
              for _ in range(num_requests)]
    return prompts, params


def shared_prefix_workload(tokenizer, max_tokens: int = 128, num_requests: int = 32, seed: int = 7):
    """Requests that share a long system prompt (about 410 tokens), each with its own question, 32 new tokens:
    where prefix caching matters. max_tokens is not used: the answers are kept short on purpose."""
    rng = random.Random(seed)
    words = ["library", "opens", "closes", "members", "borrow", "books", "weeks", "renew", "online", "late",
             "returns", "cost", "reading", "room", "quiet", "children", "parents", "games", "laptops", "club"]
    system = " ".join(rng.choice(words) for _ in range(400))
    questions = [f"Question {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 30)))
                 for i in range(num_requests)]
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    return prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def nano_vllm_workload(tokenizer, max_tokens: int = 128, num_requests: int = 256, seed: int = 0,
                       temperature: float = 0.6):
    """nano-vllm's bench workload exactly as its bench.py draws it, so figures compare with its published ones:
    random.seed(0); 256 prompts of randint(100, 1024) ids, each randint(0, 10000); then for each request
    SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024)). That is 142,827 prompt
    tokens and 133,966 new tokens. The same calls in the same order on a random.Random(seed), which gives the
    global generator's sequence. Sampled, as nano-vllm runs it: sampling costs work greedy decoding does not
    (nano_vllm_greedy_workload is the same draws at temperature 0, another workload). max_tokens is not used."""
    rng = random.Random(seed)
    if tokenizer.hf.vocab_size <= 10000:
        raise ValueError(f"nano-vllm's workload draws ids up to 10,000; this vocabulary has {tokenizer.hf.vocab_size}")
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_requests)]
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=rng.randint(100, 1024))
              for _ in range(num_requests)]
    return prompts, params


def nano_vllm_greedy_workload(tokenizer, max_tokens: int = 128, num_requests: int = 256, seed: int = 0):
    """nano-vllm's draws (nano_vllm_workload), decoded greedily: not nano-vllm's benchmark, an easier one."""
    return nano_vllm_workload(tokenizer, max_tokens, num_requests, seed, temperature=0.0)


def single_workload(tokenizer, max_tokens: int = 128):
    """The standard workload's first chat prompt alone: batch 1, where per-token overheads show most."""
    prompts, params = standard_workload(tokenizer, max_tokens)
    return prompts[:1], params


WORKLOADS = {"standard": standard_workload, "single": single_workload, "mixed": mixed_workload,
             "shared-prefix": shared_prefix_workload, "nano-vllm": nano_vllm_workload,
             "nano-vllm-greedy": nano_vllm_greedy_workload}
# The engine options `python -m shared.bench` can set (each only for a step whose LLM takes it).
ENGINE_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "max_kv_tokens", "kv_cache_dtype", "enforce_eager",
                  "tensor_parallel_size")


def _progress(msg: str) -> None:
    """Progress goes to stderr; stdout carries only the result line that run_all.py reads."""
    print(f"    [bench] {msg}", file=sys.stderr, flush=True)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_memory(device) -> tuple[float, str]:
    """Peak memory in MiB since the last reset: the CUDA allocator's on a GPU, the process's resident set on the CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20, "cuda allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process RSS"


def decode_weight_bytes(model: str, bytes_per_weight: int) -> int:
    """Bytes of weights one decode step must read: every layer, the final norm and the lm_head matrix
    (the embedding is only looked up, one row per token). Counted from the model's config."""
    from shared.models import random_weight_names, resolve_model

    cfg = json.loads((resolve_model(model) / "config.json").read_text())
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg["tie_word_embeddings"] = False  # count the lm_head matrix whether or not it is shared
    count = sum(math.prod(shape) for name, shape in random_weight_names(cfg) if name != "model.embed_tokens.weight")
    return count * bytes_per_weight


def step_engine_options(step: str) -> set[str]:
    """Which of ENGINE_OPTIONS the step's LLM takes (step_option_names)."""
    return set(step_option_names(step)) & set(ENGINE_OPTIONS)


def step_option_names(step: str) -> list[str]:
    """Every option the step's LLM takes, read from the code without importing torch: its __init__'s parameters, and
    where it takes **options, the fields of the step's engine_args.py's EngineArgs (each option written once there)."""
    import ast

    folder = Path(__file__).resolve().parents[1] / "steps" / step
    for node in ast.walk(ast.parse((folder / "engine.py").read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "LLM":
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    names = [a.arg for a in f.args.args[1:]]
                    return names + (engine_args_fields(folder / "engine_args.py") if f.args.kwarg else [])
    raise ValueError(f"{step}: engine.py has no LLM.__init__")


def engine_args_fields(path: Path) -> list[str]:
    """The fields of the EngineArgs dataclass in `path`, in order, but the model (LLM's first parameter)."""
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            return [f.target.id for f in node.body if isinstance(f, ast.AnnAssign) and f.target.id != "model"]
    raise ValueError(f"{path}: no class EngineArgs")


def warm_up(llm, prompts: list, params: list[SamplingParams]) -> None:
    """Untimed, before the timed runs. On CUDA: the workload itself, once. Triton compiles a kernel on its first
    call for each new specialisation (tile sizes, the int8 or the model's dtype, arguments' alignment), and which
    ones a run needs depends on its prompts, batch sizes, context lengths (flash decoding's splits) and sampling
    parameters (the fused draw, the filters): only the same workload meets them all, so no timed run compiles.
    Elsewhere nothing compiles (the torch path, or Triton's interpreter): one short request."""
    if llm.device.type == "cuda":
        llm.generate(prompts, params)
    else:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))


def run_bench(step: str, model: str, device=None, dtype=None, workload: str = "standard", max_tokens: int = 128,
              repeat: int | None = None, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
              max_kv_tokens: int | None = None, kv_cache_dtype: str | None = None,
              enforce_eager: bool | None = None, tensor_parallel_size: int | None = None) -> dict:
    """Run the workload `repeat` times (default: 3 on CUDA, 1 on CPU) after warm_up; report the median run.
    max_num_seqs (the engine's seats), max_num_batched_tokens, max_kv_tokens: engine options (None: the step's
    default); a step whose LLM has no such option refuses it. HF's padded batch always holds every request."""
    import importlib

    import torch

    options = {k: v for k, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                                 ("max_kv_tokens", max_kv_tokens), ("kv_cache_dtype", kv_cache_dtype),
                                 ("enforce_eager", enforce_eager), ("tensor_parallel_size", tensor_parallel_size))
               if v is not None}
    unknown = sorted(set(options) - step_engine_options(step))
    if unknown:
        raise ValueError(f"{step}'s LLM has no option {', '.join(unknown)}")
    _progress(f"{step}: loading {model} ...")
    engine = importlib.import_module(f"steps.{step}.engine")
    llm = engine.LLM(model, device=device, dtype=dtype, **options)
    prompts, params = WORKLOADS[workload](llm.tokenizer, max_tokens)
    if repeat is None:
        repeat = 3 if llm.device.type == "cuda" else 1  # the CPU runs are long and steady; the GPU's are short
    _progress(f"{step}: warm-up, then {repeat} run(s) of {len(prompts)} requests on {llm.device} ...")
    warm_up(llm, prompts, params)
    _sync(llm.device)
    if llm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = []
    reset = getattr(getattr(llm, "block_manager", None), "reset_prefix_cache", None)  # step09 on
    for _ in range(repeat):
        if reset is not None:  # every run from a cold prefix cache: a repeat must not reuse the run before's blocks
            reset()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        _sync(llm.device)
        wall = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        ttft = statistics.median(o.metrics.time_to_first_token for o in outputs)
        runs.append((generated / wall, wall, ttft))
        _progress(f"{step}: run {len(runs)}/{repeat}: {generated} tokens in {wall:.1f} s = {generated / wall:.1f} tokens/s")
    tokens_per_s, wall, ttft = sorted(runs)[len(runs) // 2]  # the median run by throughput
    peak_mb, peak_kind = _peak_memory(llm.device)
    if hasattr(llm, "shutdown"):  # step22 on: a tensor-parallel engine stops its workers
        llm.shutdown()
    result = dict(
        step=step, model=model, device=str(llm.device), dtype=str(llm.dtype).replace("torch.", ""),
        backend=llm.backend, workload=workload, requests=len(prompts), generated_tokens=generated,
        max_num_seqs=getattr(getattr(llm, "scheduler", None), "max_num_seqs", None), options=options,
        repeat=repeat, wall_s=wall, tokens_per_s=tokens_per_s, ttft_median_ms=ttft * 1000,
        peak_memory_mb=peak_mb, peak_memory_kind=peak_kind,
    )
    if llm.device.type == "cuda":
        weight_bytes = decode_weight_bytes(model, llm.dtype.itemsize)
        bandwidth = copy_gb_per_s(llm.device)  # the decode roofline's ceiling
        result.update(weight_mb=weight_bytes / 2**20, bandwidth_gbs=bandwidth,
                      roofline_tokens_per_s_batch1=bandwidth * 1e9 / weight_bytes)
    return result


# ---- HF transformers beside the steps (`--hf`) --------------------------------------------------------------

# The HF baselines (`--hf NAME`): NAME -> the result's "step" key and its label in tables.
HF_BASELINES = {
    "generate": ("hf", "HF transformers generate (padded)"),  # one left-padded batch through model.generate
    "cb": ("hf-cb", "HF transformers continuous batching"),  # model.init_continuous_batching's manager
}
HF_LABEL = HF_BASELINES["generate"][1]
HF_CB_LABEL = HF_BASELINES["cb"][1]


def hf_counted_tokens(new_ids: list[int], sp: SamplingParams, eos_token_ids: set[int]) -> int:
    """How many of the tokens HF generated for one row count: as many as the steps' `_check_stop` keeps.
    The row is cut at the request's own max_tokens, and just after its first EOS (unless ignore_eos) or stop
    token id: the steps count that token too (it is in `token_ids`). HF pads a row that stopped early, and
    keeps generating for rows that asked for fewer tokens than the longest: none of that counts."""
    for i, token in enumerate(new_ids[:sp.max_tokens]):
        if (token in eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            return i + 1
    return min(len(new_ids), sp.max_tokens)


def _hf_stop_ids(params: list[SamplingParams], eos_token_ids: set[int]) -> list[int] | None:
    """The token ids at which HF's one padded batch stops a row, or None (run every row to max_new_tokens).
    One generate call has one stop rule for all rows, so the workload's must be the same for all requests."""
    rules = {(sp.ignore_eos, tuple(sorted(sp.stop_token_ids))) for sp in params}
    if len(rules) > 1:
        raise ValueError("--hf: HF generate serves one padded batch with one stop rule; this workload mixes "
                         "ignore_eos / stop_token_ids across requests")
    if any(sp.temperature != 0 for sp in params) or any(sp.stop for sp in params):
        raise ValueError("--hf: the HF baseline runs greedy without stop strings; this workload samples or uses stop strings")
    ignore_eos, stop_token_ids = rules.pop()
    ids = set(stop_token_ids) | (set() if ignore_eos else eos_token_ids)
    return sorted(ids) or None


def _load_hf_model(model_dir: Path, device, dtype):
    """AutoModelForCausalLM on the same folder of safetensors the steps load, in the steps' device and dtype."""
    import re

    import transformers
    from transformers import AutoModelForCausalLM

    version = tuple(int(n) for n in re.findall(r"\d+", transformers.__version__)[:2])
    dtype_kwarg = "dtype" if version >= (4, 56) else "torch_dtype"  # `torch_dtype=` was renamed `dtype=` in 4.56
    model = AutoModelForCausalLM.from_pretrained(model_dir, **{dtype_kwarg: dtype}).to(device).eval()
    loaded = next(model.parameters()).dtype
    if loaded != dtype:
        raise RuntimeError(f"--hf: transformers {transformers.__version__} loaded {loaded}, not {dtype}")
    return model


def _hf_setup(label: str, model: str, device, dtype, workload: str, max_tokens: int):
    """What both HF baselines start with: the steps' device and dtype, HF's model on the folder the steps load,
    the workload as token ids and checked SamplingParams (one per request)."""
    import transformers

    from shared import Tokenizer, normalize_prompts, normalize_sampling_params, resolve_device_dtype, resolve_model

    device, dtype = resolve_device_dtype(device, dtype)
    model_dir = resolve_model(model)
    _progress(f"{label}: loading {model} with AutoModelForCausalLM ({transformers.__version__}) ...")
    hf_model = _load_hf_model(model_dir, device, dtype)
    tokenizer = Tokenizer(model_dir)
    prompts, params = WORKLOADS[workload](tokenizer, max_tokens)
    prompt_ids = [ids for _, ids in normalize_prompts(prompts, tokenizer, hf_model.config.vocab_size)]
    params = normalize_sampling_params(params, len(prompt_ids), SamplingParams(temperature=0))
    return device, dtype, hf_model, tokenizer, prompt_ids, params


def run_hf_bench(model: str, device=None, dtype=None, workload: str = "standard", max_tokens: int = 128,
                 repeat: int | None = None) -> dict:
    """The same workload through HF transformers `generate`, served as a user would: all requests in one
    left-padded batch (attention mask; pad token = EOS if the tokenizer has none), greedy, max_new_tokens =
    the largest max_tokens asked. Timed like run_bench: a warm-up, then `repeat` runs, the median run."""
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    class FirstTokenClock(BaseStreamer):
        """TTFT of the padded batch: generate() puts the prompt ids first ([batch, length]), then each step's
        new tokens ([batch], already copied to the CPU by generate, so the device is synchronised). The first
        1-D put is the moment every request has its first token. Measured inside the timed run."""

        def __init__(self):
            self.first_token_time = None

        def put(self, value):
            if self.first_token_time is None and value.dim() == 1:
                self.first_token_time = time.perf_counter()

        def end(self):
            pass

    device, dtype, hf_model, tokenizer, prompt_ids, params = _hf_setup(HF_LABEL, model, device, dtype, workload,
                                                                        max_tokens)
    stop_ids = _hf_stop_ids(params, tokenizer.eos_token_ids)
    max_new = max(sp.max_tokens for sp in params)
    width = max(len(ids) for ids in prompt_ids)
    context = getattr(hf_model.config, "max_position_embeddings", None)
    if context is not None and width + max_new > context:
        raise ValueError(f"--hf: the padded batch ({width} prompt tokens + {max_new} new) exceeds the model's "
                         f"context of {context} tokens")
    pad_id = tokenizer.hf.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.hf.eos_token_id if tokenizer.hf.eos_token_id is not None else min(tokenizer.eos_token_ids)

    def generate(batch: list[list[int]], max_new_tokens: int, streamer=None) -> torch.Tensor:
        """One left-padded batch -> the new tokens [batch, n_new] (n_new < max_new_tokens if all rows stopped)."""
        longest = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[pad_id] * (longest - len(ids)) + ids for ids in batch], device=device)
        attention_mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in batch], device=device)
        with torch.inference_mode():
            out = hf_model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, num_beams=1,
                                    max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=stop_ids,
                                    streamer=streamer)
        return out[:, longest:]  # [batch, n_new]  (generate returns prompt + new tokens)

    if repeat is None:
        repeat = 3 if device.type == "cuda" else 1
    _progress(f"{HF_LABEL}: warm-up, then {repeat} run(s) of {len(prompt_ids)} requests in one padded batch "
              f"(max_new_tokens={max_new}) on {device} ...")
    generate(prompt_ids[:1], 2)  # warm-up: HF runs eager PyTorch, which compiles nothing per shape
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = []
    for _ in range(repeat):
        clock = FirstTokenClock()
        start = time.perf_counter()  # the requests arrive together, as in the steps
        new_tokens = generate(prompt_ids, max_new, clock).tolist()  # .tolist() waits for the device
        counts = [hf_counted_tokens(row, sp, tokenizer.eos_token_ids) for row, sp in zip(new_tokens, params)]
        tokenizer.hf.batch_decode([row[:n] for row, n in zip(new_tokens, counts)], skip_special_tokens=True)
        wall = time.perf_counter() - start  # as the steps' generate(), which returns decoded text too
        if stop_ids is None and len(new_tokens[0]) != max_new:
            raise RuntimeError(f"--hf: generate stopped after {len(new_tokens[0])} of {max_new} tokens "
                               "although the workload ignores EOS")
        generated = sum(counts)
        ttft = clock.first_token_time - start
        runs.append((generated / wall, wall, ttft))
        _progress(f"{HF_LABEL}: run {len(runs)}/{repeat}: {generated} tokens counted "
                  f"(of {len(new_tokens) * len(new_tokens[0])} generated) in {wall:.1f} s = {generated / wall:.1f} tokens/s")
    tokens_per_s, wall, ttft = sorted(runs)[len(runs) // 2]  # the median run by throughput
    peak_mb, peak_kind = _peak_memory(device)
    attention = getattr(hf_model.config, "_attn_implementation", None) or "default"
    return dict(
        step="hf", label=HF_LABEL, model=model, device=str(device), dtype=str(dtype).replace("torch.", ""),
        backend=f"transformers {transformers.__version__} generate, one left-padded batch, {attention} attention",
        workload=workload, requests=len(prompt_ids), generated_tokens=generated,
        padded_generated_tokens=len(new_tokens) * len(new_tokens[0]), max_new_tokens=max_new,
        repeat=repeat, wall_s=wall, tokens_per_s=tokens_per_s, ttft_median_ms=ttft * 1000,
        ttft_method="one padded batch: every request gets its first token at once (timed with a streamer)",
        peak_memory_mb=peak_mb, peak_memory_kind=peak_kind,
    )


def _hf_cb_stop_ids(sp: SamplingParams, eos_token_ids: set[int]) -> list[int] | int:
    """The token ids at which HF's continuous batching ends one request (its own rule: each request is added
    alone), or -1 (none: the request runs to its max_new_tokens). No stop strings: the manager has none. A sampled
    request must ignore EOS (nano-vllm's workload does): its length is then max_tokens whatever it draws, so the
    work compares with the steps' although the tokens do not."""
    if sp.stop or (sp.temperature != 0 and not sp.ignore_eos):
        raise ValueError("--hf cb: the HF baseline runs without stop strings, and samples only with ignore_eos; "
                         "this workload has stop strings or samples to EOS")
    ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos_token_ids)
    return sorted(ids) or -1  # -1: no EOS (add_request would otherwise take the generation config's)


def _hf_cb_cpu_config(prompt_ids: list[list[int]], params: list[SamplingParams]):
    """On a CPU HF sizes its KV cache from the machine's RAM (60% of it in 5.24, 90% in 5.17): here the cache
    holds every request at once (blocks of 256 tokens, the default of both versions), and a batch takes at most
    2,048 tokens. On a GPU HF's own defaults are used, as a user would."""
    from transformers import ContinuousBatchingConfig

    block = 256
    blocks = sum(math.ceil((len(ids) + sp.max_tokens) / block) for ids, sp in zip(prompt_ids, params))
    return ContinuousBatchingConfig(num_blocks=blocks + 1, max_batch_tokens=2048)


def run_hf_cb_bench(model: str, device=None, dtype=None, workload: str = "standard", max_tokens: int = 128,
                    repeat: int | None = None) -> dict:
    """The same workload through HF transformers' continuous batching, served as a user would serve many
    requests: the model's `continuous_batching_context_manager` (the manager of `init_continuous_batching`,
    which `generate_batch` also uses), every request added with `add_request` and its own max_new_tokens and
    stop ids, results read with `get_result`. Greedy, or sampled at the workload's temperature (one for all its
    requests; nano-vllm's workload: 0.6) with no other filter. The manager starts once (with its warm-up) and serves the
    warm-up request and the `repeat` timed runs, like a server; the median run is reported.
    TTFT per request: its first token's timestamp (record_timestamps) minus the moment the requests were added."""
    import torch
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    device, dtype, hf_model, tokenizer, prompt_ids, params = _hf_setup(HF_CB_LABEL, model, device, dtype, workload,
                                                                        max_tokens)
    stop_ids = [_hf_cb_stop_ids(sp, tokenizer.eos_token_ids) for sp in params]
    context = getattr(hf_model.config, "max_position_embeddings", None)
    for i, (ids, sp) in enumerate(zip(prompt_ids, params)):
        if context is not None and len(ids) + sp.max_tokens > context:
            raise ValueError(f"--hf cb: request {i} ({len(ids)} prompt tokens + {sp.max_tokens} new) exceeds the "
                             f"model's context of {context} tokens")
    if not hasattr(hf_model, "continuous_batching_context_manager"):
        raise ValueError(f"--hf cb: transformers {transformers.__version__} has no continuous batching "
                         "(init_continuous_batching); it needs transformers 5")
    max_new = max(sp.max_tokens for sp in params)
    pad_id = tokenizer.hf.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.hf.eos_token_id if tokenizer.hf.eos_token_id is not None else min(tokenizer.eos_token_ids)
    temperatures = {sp.temperature for sp in params}
    if len(temperatures) != 1:
        raise ValueError(f"--hf cb: one temperature for the whole workload (HF's manager takes one), not {temperatures}")
    temperature = temperatures.pop()  # a sampled workload (nano-vllm's, at 0.6) samples here too: no top-k, no top-p
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    generation_config = GenerationConfig(num_beams=1, max_new_tokens=max_new, pad_token_id=pad_id,
                                         eos_token_id=sorted(tokenizer.eos_token_ids), **sampling)
    cb_config = _hf_cb_cpu_config(prompt_ids, params) if device.type == "cpu" else None
    hints = WorkloadHints(max_prompt_length=max(len(ids) for ids in prompt_ids), max_generated_length=max_new,
                          num_requests=len(prompt_ids))  # what generate_batch tells the manager
    if repeat is None:
        repeat = 3 if device.type == "cuda" else 1

    def serve(manager, run: str, batch: list[list[int]], batch_params: list[SamplingParams], batch_stops: list):
        """Add every request now; wait for all -> (the moment they were added, outputs in request order)."""
        start = time.perf_counter()
        ids = [manager.add_request(ids, request_id=f"{run}-{i}", max_new_tokens=sp.max_tokens, eos_token_id=stop,
                                   record_timestamps=True)
               for i, (ids, sp, stop) in enumerate(zip(batch, batch_params, batch_stops))]
        if None in ids:
            raise RuntimeError("--hf cb: the manager refused a request (see its warning above)")
        done = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"--hf cb: HF's generation loop stopped with {len(ids) - len(done)} requests "
                                       "unfinished (its error is logged above)")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"--hf cb: request {result.request_id} failed: {result.error}")
                done[result.request_id] = result
        return start, [done[i] for i in ids]

    _progress(f"{HF_CB_LABEL}: starting the manager (with its warm-up), a warm-up request, then {repeat} run(s) of "
              f"{len(prompt_ids)} requests, each with its own max_new_tokens, on {device} ...")
    runs = []
    with torch.no_grad(), hf_model.continuous_batching_context_manager(
            generation_config=generation_config, continuous_batching_config=cb_config, workload_hints=hints) as manager:
        serve(manager, "warm-up", prompt_ids[:1], [SamplingParams(temperature=0, max_tokens=2)], [-1])  # a short one
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        attention = hf_model.config._attn_implementation  # the one the manager switched to
        cache = manager.batch_processor.cache
        for k in range(repeat):
            start, outputs = serve(manager, f"run{k}", prompt_ids, params, stop_ids)
            counts = [hf_counted_tokens(o.generated_tokens, sp, tokenizer.eos_token_ids) for o, sp in zip(outputs, params)]
            tokenizer.hf.batch_decode([o.generated_tokens[:n] for o, n in zip(outputs, counts)], skip_special_tokens=True)
            wall = time.perf_counter() - start  # as the steps' generate(), which returns decoded text too
            for o, sp, n in zip(outputs, params, counts):
                if len(o.generated_tokens) != n or (sp.ignore_eos and not sp.stop_token_ids and n != sp.max_tokens):
                    raise RuntimeError(f"--hf cb: request {o.request_id} generated {len(o.generated_tokens)} tokens; "
                                       f"the steps' rule counts {n} (max_tokens {sp.max_tokens})")
            generated = sum(counts)
            ttft = statistics.median(o.timestamps[0] - start for o in outputs)
            runs.append((generated / wall, wall, ttft))
            _progress(f"{HF_CB_LABEL}: run {len(runs)}/{repeat}: {generated} tokens in {wall:.1f} s = "
                      f"{generated / wall:.1f} tokens/s")
    tokens_per_s, wall, ttft = sorted(runs)[len(runs) // 2]  # the median run by throughput
    peak_mb, peak_kind = _peak_memory(device)
    sized = "sized for this workload (CPU)" if cb_config is not None else "HF's default sizing"
    step, label = HF_BASELINES["cb"]
    return dict(
        step=step, label=label, model=model, device=str(device), dtype=str(dtype).replace("torch.", ""),
        backend=f"transformers {transformers.__version__} continuous batching (init_continuous_batching manager), "
                f"{attention} attention, paged KV cache: {getattr(cache, 'num_blocks', '?')} blocks, "
                f"max_batch_tokens {getattr(cache, 'max_batch_tokens', '?')}, {sized}",
        workload=workload, requests=len(prompt_ids), generated_tokens=generated, max_new_tokens=max_new,
        repeat=repeat, wall_s=wall, tokens_per_s=tokens_per_s, ttft_median_ms=ttft * 1000,
        ttft_method="per request: its first token's timestamp minus the moment all requests were added",
        peak_memory_mb=peak_mb, peak_memory_kind=peak_kind,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", help="the step to measure, e.g. step03")
    which.add_argument("--hf", nargs="?", const="generate", choices=sorted(HF_BASELINES), metavar="{generate,cb}",
                       help="measure an HF transformers baseline on the same workload instead: generate (the default: "
                            "one left-padded batch through model.generate) or cb (its continuous batching manager)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--workload", default="standard", choices=sorted(WORKLOADS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=None, help="runs of the workload (default: 3 on cuda, 1 on cpu)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="the engine's seats, sequences in one step (default: the step's own default)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the engine's token budget per step (default: the step's own)")
    parser.add_argument("--max-kv-tokens", type=int, default=None,
                        help="the engine's KV pool in tokens (default: the step's own; on CUDA, sized from memory)")
    parser.add_argument("--kv-cache-dtype", default=None,
                        help="the KV cache's dtype, for the steps that take it (step20 on): auto or int8")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs, for the steps that capture them (step21 on)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="ranks the model is split over, for the steps that split it (step22 on)")
    args = parser.parse_args()
    options = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   max_kv_tokens=args.max_kv_tokens, tensor_parallel_size=args.tensor_parallel_size)
    for flag, value in (("--max-tokens", args.max_tokens), ("--repeat", args.repeat),
                        *((f"--{k.replace('_', '-')}", v) for k, v in options.items())):
        if value is not None and value < 1:
            parser.error(f"argument {flag}: must be at least 1, got {value}")
    given = [f"--{k.replace('_', '-')}" for k, v in options.items() if v is not None]
    if args.hf and given:
        what = "is an engine option" if len(given) == 1 else "are engine options"
        parser.error(f"{', '.join(given)} {what}: HF's baselines are served with HF's own batching")
    hf_benches = {"generate": run_hf_bench, "cb": run_hf_cb_bench}
    if args.kv_cache_dtype is not None:
        if args.hf:
            parser.error("--kv-cache-dtype is an engine option: HF's baselines keep their own cache")
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.enforce_eager:
        if args.hf:
            parser.error("--enforce-eager is an engine option: HF's baselines run their own way")
        options["enforce_eager"] = True
    bench = hf_benches[args.hf] if args.hf else functools.partial(run_bench, args.step, **options)
    try:
        result = bench(args.model, args.device, args.dtype, args.workload, args.max_tokens, args.repeat)
    except ValueError as e:  # bad input (model, device, dtype, a workload HF cannot serve): one line, no traceback
        parser.error(str(e))
    print("BENCH_JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
