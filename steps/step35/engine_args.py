"""Every engine option, written once: its name (vLLM's), its default, what it means, and the group vLLM files it
under (ModelConfig, CacheConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig), as vLLM's EngineArgs holds them.

EngineArgs is the options as given, unchecked. LLM(model, **options) and AsyncLLM(model, **options) take them as
keywords (an unknown one is a ValueError that names it: check_option_names); config.py's EngineConfig is an EngineArgs
whose construction checks and resolves every option. serve.py's flags are made from the same fields
(add_cli_args): one flag per option, in one argument group per config, so a new option is one field here and
nothing else to write. This module imports no torch: the front end's process (serve.py, async_llm.py) reads it.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields

from shared import DEFAULT_MODEL

from .kv_spec import KV_CACHE_DTYPES

GROUPS = {  # vLLM's config classes, in the order the flags are listed
    "model": "ModelConfig: which model, on which device, with which weights and kernels",
    "cache": "CacheConfig: the paged KV cache",
    "parallel": "ParallelConfig: the ranks the model is split over",
    "scheduler": "SchedulerConfig: what one step holds and in which order steps run",
    "speculative": "SpeculativeConfig: drafts verified by the model",
    "kv_transfer": "KVTransferConfig: prefill and decode on separate engines, the KV cache sent between them",
}
QUANTIZATIONS = ("int4", "fp8")  # quantization's names besides None (the checkpoint as shipped)


def json_object(text: str) -> dict:
    """A flag's value that is a JSON object (vLLM's form of --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def option(default, group: str, help: str, parse=str, choices=None):
    """A field of EngineArgs: its default, its group (GROUPS) and help, and how its flag's text is read (parse: a
    type, or bool for an on/off flag)."""
    return field(default=default, metadata=dict(group=group, help=help, parse=parse, choices=choices))


@dataclass
class EngineArgs:
    """Every engine option, vLLM's names and LLM's defaults, unchecked (EngineConfig checks them)."""

    # ---- model (vLLM's ModelConfig, LoadConfig and quantization)
    model: str = option(DEFAULT_MODEL, "model", "a known name, random:<shape> or a folder")
    device: str | None = option(None, "model", "cuda when torch sees a GPU, else cpu")
    dtype: str | None = option(None, "model", "bfloat16 on cuda, float32 on the cpu")
    quantization: str | None = option(None, "model", "the linear layers' weights, rounded on load (none given: as "
                                      "the checkpoint ships them)", choices=QUANTIZATIONS)
    attention_backend: str | None = option(None, "model", "triton on cuda (when installed), else torch",
                                           choices=("triton", "torch"))
    enforce_eager: bool = option(False, "model", "no CUDA graphs: every step runs eagerly", parse=bool)
    max_logprobs: int = option(20, "model", "the most logprobs a request may ask for", parse=int)
    # ---- cache (vLLM's CacheConfig)
    block_size: int = option(16, "cache", "tokens per KV block", parse=int)
    max_kv_tokens: int | None = option(None, "cache", "the KV pool in tokens; none given: from free memory on cuda, "
                                       "32768 on the cpu", parse=int)
    gpu_memory_utilization: float = option(0.9, "cache", "the share of the GPU's memory the engine may use (weights, "
                                           "cache, graphs)", parse=float)
    kv_cache_dtype: str = option("auto", "cache", "how K and V are stored (auto: in the model's dtype)",
                                 choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = option(True, "cache", "share the KV blocks of prompts' common prefixes", parse=bool)
    kv_offloading_size: float | None = option(None, "cache", "a second tier for the prefix cache in host memory, in "
                                              "GiB over all ranks; none given or 0: none", parse=float)
    # ---- parallel (vLLM's ParallelConfig)
    tensor_parallel_size: int = option(1, "parallel", "ranks per pipeline stage, each with 1/N of every layer",
                                       parse=int)
    pipeline_parallel_size: int = option(1, "parallel", "stages, each with a contiguous range of the layers: ranks = "
                                         "tensor_parallel_size x pipeline_parallel_size", parse=int)
    pp_layer_partition: str | None = option(None, "parallel", "each stage's layer count, as 6,5,5 (vLLM's "
                                            "VLLM_PP_LAYER_PARTITION); none given: as even as the count allows")
    distributed_executor_backend: str | None = option(None, "parallel", "how the other ranks start: mp (spawned by "
                                                      "this process) or external_launcher (torchrun started every "
                                                      "rank); none given: external_launcher under torchrun, else mp",
                                                      choices=("mp", "external_launcher"))
    enable_expert_parallel: bool = option(False, "parallel", "a mixture of experts: each rank holds E/N whole experts "
                                          "(else 1/N of every expert's width)", parse=bool)
    # ---- kv transfer (vLLM's KVTransferConfig)
    kv_transfer_config: dict | None = option(None, "kv_transfer", 'prefill and decode on separate engines, as JSON: '
                                             '{"kv_role": "kv_producer"} (the prefill engine) or {"kv_role": '
                                             '"kv_consumer"} (the decode engine), with kv_host, kv_port, kv_lease_s, '
                                             'kv_load_failure_policy', parse=json_object)
    # ---- scheduler (vLLM's SchedulerConfig)
    max_num_seqs: int = option(16, "scheduler", "requests running at once", parse=int)
    max_num_batched_tokens: int = option(512, "scheduler", "tokens computed in one step (its token budget)",
                                         parse=int)
    async_scheduling: bool | None = option(None, "scheduler", "step N + 1 launched before step N's tokens are read; "
                                           "none given: on with cuda, off elsewhere", parse=bool)
    # ---- speculative (vLLM's SpeculativeConfig)
    speculative_config: dict | None = option(None, "speculative", 'n-gram drafts, as JSON: {"method": "ngram", '
                                             '"num_speculative_tokens": 4}', parse=json_object)


def option_fields() -> list:
    """EngineArgs' fields, in their order."""
    return list(fields(EngineArgs))


def check_option_names(options: dict) -> None:
    """Every keyword is an engine option, else a ValueError that names it and lists the options."""
    known = [f.name for f in option_fields()]
    unknown = [name for name in options if name not in known]
    if unknown:
        raise ValueError(f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                         f"the options are {', '.join(known)}")


def add_cli_args(parser: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    """One flag per option (--max-num-seqs for max_num_seqs), in one argument group per config; an on/off option is
    --name / --no-name. defaults: a front end's own defaults for some options (serve.py serves 64 requests at once)."""
    groups = {name: parser.add_argument_group(name, about) for name, about in GROUPS.items()}
    for f in option_fields():
        meta, default = f.metadata, defaults.get(f.name, f.default)
        shown = "none" if default is None else default
        flag, help = "--" + f.name.replace("_", "-"), f"{meta['help']} (default: {shown})"
        if meta["parse"] is bool:
            groups[meta["group"]].add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)
        else:
            groups[meta["group"]].add_argument(flag, type=meta["parse"], default=default, choices=meta["choices"],
                                               help=help)
    return parser


def from_cli_args(args: argparse.Namespace) -> dict:
    """The parsed flags -> {option: value}, every option (the model included), as LLM and AsyncLLM take them."""
    return {f.name: getattr(args, f.name) for f in option_fields()}

