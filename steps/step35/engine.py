"""The offline engine, LLM: requests in, RequestOutputs out. It is the front end of an EngineCore (core.py) that
runs in this process: it checks each request before anything is queued (its prompt, its sampling parameters, its
length, its logprobs, whether it could ever fit in the KV pool), names it, gives it an incremental detokenizer (its
text, and its stop strings checked as it grows) and queues it in the core; step() is one step of the core.
generate() and chat() are add_request plus step() until every request is done. What the core owns (llm.scheduler,
llm.block_manager, llm.runner, llm.stats, ...) reads through the LLM as its own.

Streaming: step(partial=True) also returns the requests that got a token and go on, their text held back by the
longest stop string's length minus one, so that a later stop string never takes back text already sent.
max_logprobs (vLLM's option, default 20) bounds the logprobs a request asks for, checked with the request.

Options: LLM(model, **options) takes every option of engine_args.py's EngineArgs by vLLM's name (its default, its
meaning and its group are written there once); config.py checks them. How the engine grew, step by step, is in the
step's README.
"""
from __future__ import annotations

from shared import (DEFAULT_MODEL, RequestOutput, SamplingParams, Tokenizer, check_conversations, check_length,
                    check_logprobs, normalize_prompts, normalize_sampling_params)

from .config import EngineConfig, check_enforce_eager, choose_async_scheduling, choose_attention_backend  # noqa: F401
from .config import VERIFY_GRAPH_MAX_SEQS  # noqa: F401  (the verify graphs' largest batch)
from .core import EngineCore
from .detokenizer import IncrementalDetokenizer
from .engine_args import check_option_names
from .kv_spec import KV_CACHE_DTYPES, check_kv_cache_dtype  # noqa: F401
from .model import weight_bytes, ModelConfig, describe_projections, describe_weights, describe_experts  # noqa: F401
from .model_runner import CPU_DEFAULT_KV_TOKENS, kv_bytes_per_token, kv_pool_blocks  # noqa: F401
from .offload import describe_host_tier
from .parallel import TensorParallel
from .sequence import Sequence
from .speculative import describe_speculation


def describe_graphs(cuda_graphs: dict) -> str:
    """The CUDA graphs' part of the engine's line: the decode batches captured, or why none."""
    if not cuda_graphs["enabled"]:
        return f"CUDA graphs: off, eager ({cuda_graphs['reason']})"
    sizes = cuda_graphs["sizes"]
    return (f"CUDA graphs: {len(sizes)} captured (decode batches of {', '.join(map(str, sizes[:5]))}"
            f"{' .. ' + str(sizes[-1]) if len(sizes) > 5 else ''}), replayed for steps of decodes")


def describe_scheduling(config: EngineConfig) -> str:
    """The scheduling's part of the engine's line: overlapped (async) or not."""
    if not config.async_scheduling:
        return "scheduling: sync (each step's tokens read before the next step is scheduled)"
    if config.pipeline_parallel_size > 1:  # the stages are processes of their own: they overlap on a CPU too
        return (f"scheduling: async (up to {config.pipeline_parallel_size} batches of distinct requests in flight, "
                "one a stage)")
    return ("scheduling: async (step N + 1 launched before step N's tokens are read"
            f"{'; one stream on the CPU: the order, no overlap' if config.device.type != 'cuda' else ''})")


def describe_engine(config: EngineConfig, model, memory: dict, cuda_graphs: dict, tp: TensorParallel) -> str:
    """The engine in one line (llm.backend, which run.py prints): what the config asked for and what the build found
    (the KV pool's blocks and dtype and what sized it, the CUDA graphs captured or why none, the tensor split;
    the drafts, and the verify steps' graphs; a mixture of experts' experts and how they run)."""
    c = model.config
    split = (f"tensor parallel: {tp.size} ranks ({tp.backend}), each {c.num_heads} heads / "
             f"{c.num_kv_heads} KV heads / {c.intermediate_size} MLP columns"
             if tp.size > 1 else "tensor parallel: off (1 rank)")
    pool = (f"paged KV ({memory['num_blocks']} blocks of {config.block_size}, KV dtype "
            f"{memory['kv_spec'].describe()}, sized by {memory['sized_by']})")
    parts = [f"plain PyTorch, {c.model_type} (fused qkv / gate-up)",
             describe_experts(model),
             describe_weights(model, config),
             "continuous batching + chunked prefill + preemption", pool,
             f"prefix caching {'on' if config.enable_prefix_caching else 'off'}",
             describe_host_tier(memory, config.device),
             f"attention: {model.attention_backend.name}",
             f"elementwise: {'fused kernels' if model.ops.name == 'triton' else 'torch operators'}",
             f"projections: {describe_projections(model, config.device)}",
             describe_graphs(cuda_graphs), split, describe_pipeline(config, model), describe_scheduling(config),
             describe_speculation(config.speculative_config, cuda_graphs)]
    return ", ".join(part for part in parts if part)  # each component describes itself


def describe_pipeline(config: EngineConfig, model) -> str:
    """The engine line's part for pipeline parallelism: the stages, the rank -> (stage, tp rank) mapping and each
    stage's layers, how the ranks started, and the batches in flight."""
    if config.pipeline_parallel_size == 1:
        return "pipeline parallel: off (1 stage)"
    layout = model.pipe.layout
    depth = config.pipeline_parallel_size if config.async_scheduling else 1
    return (f"pipeline parallel: {layout.pp} stages x {layout.tp} tp ranks, started by "
            f"{config.distributed_executor_backend}, up to {depth} batches in flight [{layout.describe()}]")


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **options):
        # Every option (engine_args.py's EngineArgs) checked, the auto ones resolved and the model found (config.py),
        # before anything loads.
        check_option_names(options)
        self.config = config = EngineConfig(model=model, **options)
        self.model_name, self.dtype = config.model, config.dtype
        self.tokenizer = Tokenizer(config.model_dir)
        self.core = EngineCore(config, self.tokenizer)  # the workers start, then every rank builds its share
        self.device = self.core.device  # with tensor parallelism, rank 0's
        self.max_model_len = config.max_model_len
        self.max_logprobs = config.max_logprobs  # a request's most logprobs
        self.backend = describe_engine(config, self.model, self.memory, self.cuda_graphs, self.tp)
        self.next_request_id = 0
        self.finished_outputs: list[RequestOutput] = []  # finished, not handed out yet (see generate)

    def __getattr__(self, name: str):
        """What the core owns reads through the LLM as its own: llm.scheduler, llm.stats, llm.runner, ..."""
        core = self.__dict__.get("core")
        if core is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(core, name)

    @property
    def async_scheduling(self) -> bool:
        """The overlapped order, on or off: read at every step (run.py switches it)."""
        return self.core.async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        self.core.async_scheduling = on

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the group, and free the KV cache and the CUDA graphs' memory
        now (EngineCore.shutdown): the engine serves nothing after this. Idempotent. The workers are also stopped
        when the engine is garbage-collected and when the process exits."""
        self.core.shutdown()

    def _check_running(self) -> None:
        if self.core.is_shut_down:
            raise RuntimeError("LLM: this engine was shut down (shutdown() freed its KV cache): make a new LLM")

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 kv_transfer_params: list[dict | None] | None = None) -> list[RequestOutput]:
        """kv_transfer_params (with a kv_transfer_config): one per prompt, as add_request takes them (the core's
        add_request checks them): {"do_remote_decode": True} on a kv_producer, a producer's answer on a consumer."""
        prompts = normalize_prompts(prompts, self.tokenizer, self.model.config.vocab_size)
        params = normalize_sampling_params(sampling_params, len(prompts), SamplingParams(temperature=0))
        transfers = kv_transfer_params if kv_transfer_params is not None else [None] * len(prompts)
        if len(transfers) != len(prompts):
            raise ValueError(f"kv_transfer_params: {len(transfers)} for {len(prompts)} prompts (one each, or None)")
        for i, ((_, ids), sp) in enumerate(zip(prompts, params)):
            check_length(i, len(ids), sp, self.max_model_len)
            check_logprobs(i, sp, self.max_logprobs)
            self.core.check_fits_kv_budget(i, len(ids), sp)
        # Everything is checked above, before anything is queued.
        request_ids = [self._add(text, ids, sp, transfer=transfer)
                       for (text, ids), sp, transfer in zip(prompts, params, transfers)]
        mine: dict[str, RequestOutput | None] = dict.fromkeys(request_ids)
        try:
            while None in mine.values():  # until all of ours have finished
                if not self.has_unfinished_requests():
                    raise RuntimeError("generate(): the scheduler lost a request")  # a bug, never a silent hang
                for out in self.core.step():
                    if out.request_id in mine:
                        mine[out.request_id] = out
                    else:  # a request queued with add_request(): a later step() hands it out
                        self.finished_outputs.append(out)
        except BaseException:  # the caller gets the error, not our outputs: drop what is left of ours
            for request_id, out in mine.items():
                if out is None:
                    self.abort_request(request_id)
            raise
        return list(mine.values())

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue one request (a string or token ids); it joins the running batch at a coming step().
        request_id names it (any string no queued or running request has; None: the engine numbers it)."""
        text, ids, sp = self.check_request(prompt, sampling_params)
        return self._add(text, ids, sp, request_id)

    def check_request(self, prompt, sampling_params: SamplingParams | None = None):
        """One request's checks, before anything is queued: -> (its text, its token ids, its SamplingParams).
        ValueError names what is wrong. Reads no engine state that a step changes (safe beside a running step)."""
        (text, ids), = normalize_prompts([prompt], self.tokenizer, self.model.config.vocab_size, one=True)
        sp = normalize_sampling_params(sampling_params, 1, SamplingParams(temperature=0))[0]
        check_length(0, len(ids), sp, self.max_model_len)
        check_logprobs(0, sp, self.max_logprobs)
        self.core.check_fits_kv_budget(0, len(ids), sp)
        return text, ids, sp

    def _add(self, text: str | None, ids: list[int], sp: SamplingParams, request_id: str | None = None,
             transfer: dict | None = None) -> str:
        self._check_running()
        if request_id is None:
            request_id = str(self.next_request_id)
            self.next_request_id += 1
        self.core.add_request(request_id, text, ids, sp, IncrementalDetokenizer(self.tokenizer), transfer)
        return request_id

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def abort_request(self, request_id: str) -> Sequence | None:
        """Drop a waiting or running request: it leaves the queues, releases its KV memory and is never returned.
        -> the dropped sequence (None: no such request is queued or running)."""
        return self.core.abort_request(request_id)

    def step(self, partial: bool = False) -> list[RequestOutput]:
        """One iteration: every running request computes the tokens the scheduler gave it (one for a decode, a
        chunk of its prompt otherwise), all in one forward within the token budget. Returns the requests that finished in this iteration,
        and any that finished earlier without being handed out (while another caller's generate() ran).
        partial=True also returns each request that got a token and goes on (finished=False, its text so
        far). An idle engine returns []."""
        self._check_running()
        handed_out, self.finished_outputs = self.finished_outputs, []
        return handed_out + self.core.step(partial)

    def chat(self, conversations, sampling_params=None) -> list[RequestOutput]:
        prompts = [self.tokenizer.apply_chat_template(c) for c in check_conversations(conversations)]
        return self.generate(prompts, sampling_params)
