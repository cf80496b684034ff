"""The engine's options as one typed config (vLLM's EngineConfig, small): EngineConfig holds every option of LLM under
vLLM's name (engine_args.py writes each once: its default, its meaning, its group), and checks them all in one place,
its construction, before anything loads: each bad option is a ValueError that names it. It also resolves what was left
to the engine (None: auto): the device and dtype, the attention backend, async scheduling, and max_kv_tokens on the CPU.
Last it finds the model (a name, a random shape or a folder) and reads its config.json, to check that
tensor_parallel_size splits it. speculative_config, a dict as vLLM takes it, becomes a SpeculativeConfig
(speculative.py).

The LLM builds its EngineConfig from its keyword arguments first, then builds itself from it; the build of a rank
(worker.py's build_rank) and the tensor-parallel workers get the config, not a dict of options. It pickles (the
workers are spawned with it), and it is not checked again on the other side.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared import check_engine_options, check_max_logprobs, resolve_device_dtype, resolve_model
from shared.models import shipped_gguf

from .engine_args import QUANTIZATIONS, EngineArgs
from .kv_spec import check_kv_cache_dtype
from .model import ModelConfig
from .model_runner import CPU_DEFAULT_KV_TOKENS
from .parallel import check_pipeline_parallel_size, check_tensor_parallel_size, stage_layers
from .quant import GROUP
from .offload import check_kv_offloading_size
from .kv_connector import KVTransferConfig
from .speculative import SpeculativeConfig

# verify steps of up to this many requests replay a graph (fewer if disable_by_batch_size says so); a
# larger batch's verify forward is compute, not launches, and runs eagerly
VERIFY_GRAPH_MAX_SEQS = 32


def check_enforce_eager(enforce_eager) -> bool:
    """enforce_eager must be a bool (vLLM's option): True runs every step eagerly, False replays CUDA graphs."""
    if not isinstance(enforce_eager, bool):
        raise ValueError(f"enforce_eager must be True or False, got {enforce_eager!r}")
    return enforce_eager


def choose_async_scheduling(asked, device: torch.device) -> bool:
    """async_scheduling: True, False or None (on with CUDA, off elsewhere). With tensor parallelism too: rank
    0 shares each step's sampled tokens with the workers on the devices (model_runner.py's share_tokens)."""
    if asked is not None and not isinstance(asked, bool):
        raise ValueError(f"async_scheduling must be True, False or None, got {asked!r}")
    return device.type == "cuda" if asked is None else asked


def choose_attention_backend(asked: str | None, device: torch.device) -> str:
    """"triton" (the kernels for prefill chunks and decodes) or "torch" (step14_7's loop). Default: triton on
    CUDA when Triton is installed, torch elsewhere. On a CPU the kernel runs only in Triton's interpreter."""
    has_triton = importlib.util.find_spec("triton") is not None
    if asked is None:
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if asked not in ("triton", "torch"):
        raise ValueError(f"attention_backend must be 'triton', 'torch' or None, got {asked!r}")
    if asked == "triton" and not has_triton:
        raise ValueError("attention_backend='triton': Triton is not installed")
    if asked == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' on the CPU runs only in Triton's interpreter: set TRITON_INTERPRET=1")
    return asked


def check_int4_widths(config: ModelConfig, size: int, what: str) -> None:
    """4-bit weights are blocks of GROUP inputs (quant.py), so every projection's inputs on a rank must be
    whole blocks: q/k/v and gate/up read the whole hidden state on every rank; o_proj and down_proj, cut by their
    inputs (row-parallel), 1/size of theirs. Checked on the config, before a worker starts or a weight loads. `what`
    names where the blocks come from, for the message."""
    widths = {"q/k/v_proj and gate/up_proj": config.hidden_size, "o_proj": config.num_heads * config.head_dim // size,
              "down_proj": config.intermediate_size // size}
    if all(map(config.is_moe_layer, range(config.num_layers))):  # no dense MLP (the experts stay floats)
        del widths["down_proj"]
    for name, inputs in widths.items():
        if inputs % GROUP:
            raise ValueError(f"{what}, tensor_parallel_size={size}: {name} has {inputs} inputs on each rank, not whole "
                             f"4-bit blocks of {GROUP}")


def check_latent_options(config) -> None:
    """A latent-attention model (DeepSeek's MLA) runs here on one rank, without speculation (a verify step's rows
    would need the prefill path inside a graph), its weights and its cache in the model's dtype: any other choice is
    a ValueError that names it."""
    refused = {"tensor_parallel_size": config.tensor_parallel_size != 1, "quantization": config.quantization is not None,
               "kv_cache_dtype": config.kv_cache_dtype != "auto",
               "speculative_config": config.speculative_config is not None}
    for name, bad in refused.items():
        if bad:
            raise ValueError(f"{name}={getattr(config, name)!r}: {config.model} has latent attention (kv_lora_rank="
                             f"{config.model_config.kv_lora_rank}), which this step runs on one rank, without "
                             "speculation, its weights and cache in the model's dtype")


def check_pipeline_options(config) -> None:
    """What this step runs with several pipeline stages, and what it refuses by name: speculation (a verify step
    would need the drafts' logits on the last stage and the verdict back before the next step is scheduled), the host
    tier (each stage holds a different share of a block's bytes, so the stages' host pools would not agree on their
    slots). The rest (prefix caching, chunked prefill, preemption, int4 / fp8 weights, an int8 / fp8 cache, a
    mixture of experts, latent attention, the core process, the server) works with them."""
    refused = {"speculative_config": config.speculative_config is not None,
               "kv_offloading_size": bool(config.kv_offloading_size)}
    for name, bad in refused.items():
        if bad:
            raise ValueError(f"{name}={getattr(config, name)!r} with pipeline_parallel_size="
                             f"{config.pipeline_parallel_size}: this step runs several stages without it")


def check_transfer_options(config) -> None:
    """An engine with a kv_transfer_config runs on one rank (its cache is the one the transfer reads or writes), without
    speculation, with prefix caching (a consumer's own hits are not sent again), its steps synchronous or pipelined
    as the rest: what it refuses is a ValueError that names the pair."""
    refused = {"tensor_parallel_size": config.tensor_parallel_size != 1,
               "pipeline_parallel_size": config.pipeline_parallel_size != 1,
               "speculative_config": config.speculative_config is not None,
               "enable_prefix_caching": not config.enable_prefix_caching,
               "kv_offloading_size": bool(config.kv_offloading_size)}
    for name, bad in refused.items():
        if bad:
            raise ValueError(f"{name}={getattr(config, name)!r} with kv_transfer_config: this step moves the KV cache "
                             "of one rank, without speculation or a host tier, with prefix caching on")


def check_executor_backend(backend) -> str:
    """distributed_executor_backend: "mp" (rank 0 spawns the others) or "external_launcher" (torchrun started every
    rank); None: external_launcher when this process was started by torchrun, else mp."""
    if backend is None:
        return "external_launcher" if "TORCHELASTIC_RUN_ID" in os.environ else "mp"
    if backend not in ("mp", "external_launcher"):
        raise ValueError(f"distributed_executor_backend must be 'mp' or 'external_launcher', got {backend!r}")
    return backend


def check_quantization(quantization):
    """quantization: None (the linear weights as the checkpoint ships them) or one of QUANTIZATIONS."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None (the checkpoint's weights as shipped) or one of "
                         f"{list(QUANTIZATIONS)}, got {quantization!r}")
    return quantization


@dataclass
class EngineConfig(EngineArgs):
    """Every engine option (engine_args.py's EngineArgs: vLLM's names, LLM's defaults), checked and resolved at
    construction: device becomes a torch.device, dtype a torch.dtype, model the str of its name, and the None that
    leaves an option to the engine its value."""

    # found from `model` during the checks: its folder and its config.json
    model_dir: Path = field(init=False)
    model_config: ModelConfig = field(init=False, repr=False)
    gguf_file: Path | None = field(init=False, default=None)  # the GGUF whose blocks are read, if any

    def __post_init__(self):
        self.kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype)
        # n-gram drafts, on one rank; a step that drafts is synchronous
        if not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.tensor_parallel_size != 1:
            raise ValueError("speculative_config: not with tensor_parallel_size > 1 in this step")
        check_pipeline_parallel_size(self.pipeline_parallel_size)  # its type now; the model's layers below
        if self.pipeline_parallel_size > 1:
            check_pipeline_options(self)
        self.distributed_executor_backend = check_executor_backend(self.distributed_executor_backend)
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.kv_transfer_config is not None:
            check_transfer_options(self)
        self.enforce_eager = check_enforce_eager(self.enforce_eager)
        check_tensor_parallel_size(self.tensor_parallel_size)  # its type now; how it splits the model below
        self.device, self.dtype = resolve_device_dtype(self.device, self.dtype)
        self.async_scheduling = choose_async_scheduling(self.async_scheduling, self.device)
        if self.max_kv_tokens is None and self.device.type == "cpu":
            self.max_kv_tokens = CPU_DEFAULT_KV_TOKENS  # the CPU knob; on CUDA, None = size the pool from free memory
        check_engine_options(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                             gpu_memory_utilization=self.gpu_memory_utilization, max_kv_tokens=self.max_kv_tokens,
                             block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                             max_logprobs=self.max_logprobs, may_be_none=("max_kv_tokens",))
        self.attention_backend = choose_attention_backend(self.attention_backend, self.device)
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be True or False, got {self.enable_expert_parallel!r}")
        self.kv_offloading_size = check_kv_offloading_size(self.kv_offloading_size)
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size: the host tier holds evicted prefix-cache blocks, so it needs "
                             "enable_prefix_caching=True")
        self.quantization = check_quantization(self.quantization)
        # every option is checked: only now is the model found (a random one is built, the default converted)
        self.model_dir = resolve_model(self.model)
        self.model = str(self.model)
        # where the 4-bit blocks come from: the shipped GGUF file (read as stored), or int4 on load
        self.gguf_file = shipped_gguf(self.model) if self.quantization is None else None
        self.model_config = ModelConfig.from_json(self.model_dir / "config.json")
        if self.model_config.kv_lora_rank:  # latent attention: what this step runs it with
            check_latent_options(self)
        check_max_logprobs(self.max_logprobs, self.model_config.vocab_size)
        # the split must fit the model's heads: checked on its config, before any process starts
        check_tensor_parallel_size(self.tensor_parallel_size, self.model_config, self.device,
                                   self.enable_expert_parallel)
        check_pipeline_parallel_size(self.pipeline_parallel_size, self.model_config.num_layers)
        stage_layers(self.model_config.num_layers, self.pipeline_parallel_size, self.pp_layer_partition)  # checked
        if self.device.type == "cuda" and self.world_size > torch.cuda.device_count() and \
                self.distributed_executor_backend == "mp":
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks need as many "
                             f"GPUs on this machine (one per rank); it has {torch.cuda.device_count()}")
        if self.quantization == "int4" or self.gguf_file is not None:  # whole 4-bit blocks on every rank
            check_int4_widths(self.model_config, self.tensor_parallel_size,
                              "quantization='int4'" if self.quantization else "the checkpoint's 4-bit Q4_1 blocks")

    @property
    def max_running_seqs(self) -> int:
        """The requests that hold a seat (and a block-table row) at once: max_num_seqs in each batch, and with several
        stages up to `pipeline_parallel_size` batches of distinct requests in flight (async_scheduling), so that many
        times max_num_seqs (vLLM's pipeline gave each of its virtual engines a scheduler of max_num_seqs)."""
        return self.max_num_seqs * self.batches_in_flight

    @property
    def batches_in_flight(self) -> int:
        """The batches the core keeps in flight: one per stage with async_scheduling, else one."""
        return self.pipeline_parallel_size if self.async_scheduling else 1

    @property
    def world_size(self) -> int:
        """Every rank: tensor_parallel_size in each of pipeline_parallel_size stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def max_model_len(self) -> int:
        """The model's context: a prompt and its max_tokens fit in it."""
        return self.model_config.max_position_embeddings

    @property
    def verify_graphs(self) -> tuple[int, int] | None:
        """The verify steps' CUDA graphs, (k + 1 tokens per row, the largest batch that drafts with a graph),
        for the batches that draft; None without speculation."""
        spec = self.speculative_config
        if spec is None:
            return None
        limit = spec.disable_by_batch_size  # a step drafts below it: limit - 1 requests at most
        largest = VERIFY_GRAPH_MAX_SEQS if limit is None else max(1, min(limit - 1, VERIFY_GRAPH_MAX_SEQS))
        return spec.num_speculative_tokens + 1, largest
