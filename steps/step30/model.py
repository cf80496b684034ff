"""Two model families, Llama and Qwen3, in one transformer written from scratch in plain PyTorch.

embedding -> N x [RMSNorm -> attention (RoPE, grouped-query) -> add -> RMSNorm -> SwiGLU MLP -> add]
          -> RMSNorm -> lm_head (often tied to the embedding)

Qwen3 differs from Llama in two places: an RMSNorm over each head of q and k before RoPE (qk_norm), and a
head_dim of its own (num_heads * head_dim need not equal hidden_size). Weights load from HF checkpoint
names; q/k/v are fused into one matrix and gate/up into another at load time, so a layer runs two
projection matmuls instead of five.

The model sees three things: the token ids, their positions, and one AttentionMetadata object that says
where each row's K/V live in the KV cache (one tensor for all layers, bound to the model by the runner).
Everything else (requests, blocks, sampling) belongs to the engine around it.

The layer's elementwise groups (residual add + RMSNorm, SiLU * up, q/k norm + RoPE) go through self.ops: the torch
operators of TorchLayerOps, or one Triton kernel each (kernels/fused.py's TritonLayerOps), picked by the engine.

An int8 KV cache (kv_cache_dtype="int8"): KVCache holds K and V as int8 with one fp32 scale per
(token, KV head), write_kv quantises the new rows as it stores them (quantize_kv) and gather_kv restores them
(dequantize_kv) for the torch path; the kernels dequantise inside their loops.

A forward a CUDA graph can record. RoPE's tables are computed once (CausalLM.rope_cos / rope_sin) and a
step of decodes (one new token per sequence) builds no tensor from host data, so its forward is the same kernels
on the same buffers every time (cuda_graphs.py captures it).

Each projection is one call, ops.linear(x, weight, norm_weight=, residual=, silu_mul=), that takes the RMSNorm
before it and the residual add or the SiLU * up after it. The layer reads as its data flows: the residual stream x
goes into a projection that normalises it (qkv, gate_up), and comes out of one that adds to it (o_proj, down_proj).
The torch path runs the unfused operators, in the same order; on CUDA a step of one row (batch 1) runs each call as
one kernel (kernels/gemv.py), and a larger step runs cuBLAS with the norm, the activation and the add beside it.
The q/k norm + RoPE call also writes the step's K and V into the cache (ops.qk_norm_rope_write).

Tensor parallelism (parallel.py). With N ranks each rank's CausalLM holds its share of every weight (the
loader reads only those slices) and its config says so: heads, KV heads and the MLP's width divided by N. The
forward is step21's with three additions, each the identity when N = 1: the embedding looks up only its rank's
vocab rows and one all-reduce sums the ranks' lookups; o_proj and down_proj (row-parallel) give partial sums, each
completed by one all-reduce; lm_head's logits (the rank's vocab rows) are gathered on rank 0.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from itertools import accumulate, chain
from pathlib import Path

import torch

from .kv_spec import KV_CACHE_DTYPES, KVSpec  # noqa: F401  (KV_CACHE_DTYPES: imported from here too)
from .parallel import TensorParallel, is_vocab_parallel, shard, vocab_rows
from .linear import method_of
from .quant import FP8, quantize_fp8, quantize_fp8_weight, quantize_int4, read_gguf


SUPPORTED = ("llama", "qwen3")


@dataclass
class ModelConfig:
    model_type: str  # "llama" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # explicit in Qwen3 (128 for every size); hidden_size // num_heads when absent
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k, before RoPE

    @classmethod
    def from_json(cls, path: Path) -> "ModelConfig":
        c = json.loads(Path(path).read_text())
        model_type = c.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(f"model: model_type {model_type!r} is not supported by this step (one of {SUPPORTED})")
        rope = c.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default" or c.get("rope_scaling"):
            raise ValueError(f"model: rope type {rope_type!r} / rope_scaling is not supported (plain RoPE only)")
        if c.get("attention_bias") or c.get("mlp_bias"):
            raise ValueError("model: attention_bias / mlp_bias is not supported (projections without bias only)")
        if c.get("use_sliding_window"):
            raise ValueError("model: use_sliding_window is not supported (full attention only)")
        return cls(
            model_type=model_type,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"],
            num_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            qk_norm=model_type == "qwen3",
        )


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor built on the CPU -> device. On CUDA: one copy from pinned (page-locked) memory, queued without
    making the CPU wait (the GPU runs it before the kernels that read the tensor). On the CPU: no copy at all."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 (as HF does), then scale by the learned weight.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for rotary embeddings. positions: [...] -> cos, sin: [..., head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [..., head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [..., head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, head_dim], cos/sin: [..., head_dim]. Rotate each (first half, second half) pair by its
    position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


class TorchLayerOps:
    """The elementwise groups of a layer, in torch operators: what kernels/fused.py's TritonLayerOps does in one
    kernel each, and the reference it is tested against."""

    name = "torch"

    def write_kv_int8(self, k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        """An int8 cache's write: K and V quantised (write_kv's quantize_kv) and stored with their scales."""
        write_kv(k_cache, slot_mapping, k, k_scale)
        write_kv(v_cache, slot_mapping, v, v_scale)

    def add_rms_norm(self, x, residual, weight, eps):
        """-> (rms_norm(x + residual), x + residual); without a residual, (rms_norm(x), x): the reference of
        kernels/fused.py's add_rms_norm (the model calls linear, whose norm is this without a residual)."""
        if residual is not None:
            x = x + residual
        return rms_norm(x, weight, eps), x

    def dequantize_buffer(self, weight) -> torch.Tensor:
        """The float32 buffer a 4-bit weight is dequantised into for its matmul, one for all the model's
        projections (the largest one's N * K floats: gate_up's), so that each matmul does not allocate its weight
        anew. The matmul reads it before the next projection writes it (in order, on one device's stream)."""
        size = weight.shape[0] * weight.shape[1]
        buffer = getattr(self, "_dequantized", None)
        if buffer is None or buffer.numel() < size or buffer.device != weight.device:
            buffer = self._dequantized = torch.empty(size, dtype=torch.float32, device=weight.device)
        return buffer[:size]

    def linear(self, x, weight, norm_weight=None, eps=1e-6, residual=None, silu_mul=False):
        """One projection with what surrounds it: x [M, K] -> x @ weight.T [M, N]; with norm_weight, x is
        RMS-normalised first; with silu_mul, weight is [gate; up] and the result silu(gate) * up [M, N / 2]; with
        residual [M, N], it is added to the result (the new residual stream)."""
        h = rms_norm(x, norm_weight, eps) if norm_weight is not None else x
        y = method_of(weight).apply(h, weight, self)  # h @ weight.T, as the weight's format computes it (linear.py)
        if silu_mul:
            y = self.silu_mul(y)
        return y + residual if residual is not None else y

    def qk_norm_rope_write(self, qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim,
                           k_cache, v_cache, k_scale, v_scale, slot_mapping):
        """qk_norm_rope, then the step's K and V written into the cache at slot_mapping -> q [N, heads,
        head_dim]. One kernel on the fused path (kernels/fused.py); int8 caches quantise as they are written."""
        N = qkv.shape[0]
        q, k = self.qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(N, num_kv_heads, head_dim)
        # one scatter for every new token of every sequence; int8 and fp8 caches quantise as they store
        write_kv(k_cache, slot_mapping, k, k_scale)
        write_kv(v_cache, slot_mapping, v, v_scale)
        return q

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)  # each [N, intermediate]
        return torch.nn.functional.silu(gate) * up

    def qk_norm_rope(self, qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim):
        """qkv [N, (heads + 2 * kv_heads) * head_dim] -> q [N, heads, head_dim], k [N, kv_heads, head_dim]: each head
        RMS-normalised over head_dim (Qwen3: when the weights are given), then rotated by its token's angles."""
        N = qkv.shape[0]
        q = qkv[:, :num_heads * head_dim].reshape(N, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].reshape(N, num_kv_heads, head_dim)
        if q_weight is not None:
            q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


@dataclass
class MixedMetadata:
    """Every row of a step as the mixed-batch kernel reads them: decodes and prefill chunks alike, sequence i's new
    tokens at rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1] (a decode has one). Tensors on the device, int32."""

    block_tables: torch.Tensor  # [S, max_blocks]
    cu_seqlens_q: torch.Tensor  # [S + 1]
    seq_lens_k: torch.Tensor  # [S]: each sequence's context after this step
    max_query_len: int  # the longest row: 1 for a step of decodes
    tile_seq: torch.Tensor  # [T]: the sequence of each tile of new tokens (kernels/attention.py's tile_map)
    tile_first: torch.Tensor  # [T]: the tile's first token within its sequence's new tokens
    block_m: int  # rows per program the tiles were cut for (tokens x query heads per KV head)


@dataclass
class DecodeMetadata:
    """A step of decodes only, as flash decoding reads them: D sequences, one query each (rows 0 .. D - 1).
    Tensors on the device, int32."""

    num: int  # D
    block_tables: torch.Tensor  # [D, max_blocks]
    seq_lens: torch.Tensor  # [D]: each sequence's context, its new token included
    num_splits: int  # flash decoding: parts each context is split into (kernels/decode.py's choose_num_splits)


@dataclass
class AttentionMetadata:
    """What attention needs besides q, k and v, for one flat batch: the new tokens of S sequences side by side
    (prefill chunks and decodes alike), sequence i's tokens at [cu_seqlens_q[i], cu_seqlens_q[i + 1])."""

    cu_seqlens_q: list[int]  # [S + 1]: where each sequence's new tokens start in the flat batch (0, ..., N)
    slot_mapping: torch.Tensor  # [N]: where each new token's K/V go, as a flat slot: block * block_size + offset
    context_slots: list[torch.Tensor]  # per looped sequence: the flat slots of all its tokens so far, in order
    masks: list[torch.Tensor | None]  # per looped sequence: a prefill chunk's causal mask; None for a decode
    mixed: MixedMetadata | None = None  # every row, for the one mixed-batch kernel (None: the loop or split)
    decode: DecodeMetadata | None = None  # a step of decodes only, long enough to split: flash decoding

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens_q) - 1


def rank_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape one of `size` ranks holds: its share of the query heads, KV heads and MLP width (the vocab, the
    hidden size and the rest are the model's). size 1: the model's config."""
    if size == 1:
        return config
    return replace(config, num_heads=config.num_heads // size, num_kv_heads=config.num_kv_heads // size,
                   intermediate_size=config.intermediate_size // size)


def load_shard(files, rank: int, size: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Rank `rank`'s share of the checkpoint's tensors (HF names), read slice by slice from the safetensors files:
    a rank reads only its rows (columns) of each sharded tensor, never the whole. The vocab-parallel tensors are
    padded with zero rows to ceil(vocab / N). With size 1 every tensor is read whole, as step21 loads them."""
    from safetensors import safe_open

    weights = {}
    for f in files:
        with safe_open(f, framework="pt") as handle:
            for name in handle.keys():
                part = handle.get_slice(name)
                full_shape = part.get_shape()
                cut = shard(name, full_shape, rank, size)
                if cut is None:
                    tensor = handle.get_tensor(name)
                elif cut[0] == 0:
                    tensor = part[cut[1]:cut[2]]
                else:
                    tensor = part[:, cut[1]:cut[2]]
                if cut is not None and is_vocab_parallel(name):
                    rows = vocab_rows(full_shape[0], size)
                    if tensor.shape[0] < rows:  # the last rank's share: zero rows past the vocab
                        tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
                weights[name] = tensor.to(device=device, dtype=dtype)
    return weights


def weight_bytes(weights: dict) -> tuple[int, int]:
    """-> (bytes of the projections' weights, bytes of every weight), each tensor counted once (a tied lm_head
    is the embedding)."""
    seen, linear, total = set(), 0, 0
    for name, w in weights.items():
        method = method_of(w)
        if method.key(w) in seen:
            continue
        seen.add(method.key(w))
        n = method.nbytes(w)
        total += n
        linear += n if ("_proj." in name and name.startswith("model.layers.")) else 0
    return linear, total


def is_linear(name: str) -> bool:
    """A layer's projection (q, k, v, o, gate, up, down): the weights kept as 4-bit blocks."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def load_gguf_shard(path: Path, config: "ModelConfig", rank: int, size: int, device: torch.device,
                    dtype: torch.dtype) -> dict:
    """Rank `rank`'s share of a GGUF checkpoint (quant.py's read_gguf): the projections as Q4Weight blocks
    on the device (their rows or their inputs, as load_shard cuts a float tensor), every other tensor in dtype."""
    weights = {}
    for name, tensor in read_gguf(path, config.num_heads, config.num_kv_heads).items():
        cut, method = shard(name, tensor.shape, rank, size), method_of(tensor)
        if cut is not None:
            full_rows = tensor.shape[0]
            tensor = method.shard(tensor, cut)
            if is_vocab_parallel(name) and tensor.shape[0] < vocab_rows(full_rows, size):
                tensor = torch.cat([tensor, tensor.new_zeros(vocab_rows(full_rows, size) - tensor.shape[0],
                                                             *tensor.shape[1:])])
        weights[name] = method.to(tensor, device, dtype)  # 4-bit blocks stay blocks, the rest becomes dtype
    return weights


class CausalLM:
    """A Llama or a Qwen3: the same code, with q/k norms when config.qk_norm. Its config and weights are this
    rank's share (rank_config), tp its place in the group (parallel.py; rank 0 of 1 when not split)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tp: TensorParallel | None = None):
        self.config = config
        self.w = weights
        self.tp = tp or TensorParallel()
        self.kv_cache: KVCache | None = None  # bound by the model runner once the cache is allocated
        self.attention_backend = None  # attention.py's TorchAttention or TritonAttention, bound by the engine
        self.ops = TorchLayerOps()  # the elementwise groups: torch operators, or kernels/fused.py's (the engine picks)
        # RoPE's cos/sin for every position, computed once: a step indexes them by its positions (one
        # gather, nothing computed from host data), which a CUDA graph can replay. Equal to rope_cos_sin's per step.
        dtype, device = weights["model.norm.weight"].dtype, weights["model.norm.weight"].device
        self.rope_cos, self.rope_sin = rope_cos_sin(torch.arange(config.max_position_embeddings, device=device),
                                                    config.head_dim, config.rope_theta, dtype)

    @classmethod
    def from_pretrained(cls, model_dir: Path, device: torch.device, dtype: torch.dtype,
                        tp: TensorParallel | None = None, gguf_file: Path | None = None,
                        quantization: str | None = None) -> "CausalLM":
        """Load this rank's share of the checkpoint (load_shard reads only its slices). With gguf_file, the
        weights come from it, the linear layers' as their 4-bit blocks (load_gguf_shard); quantization="int4"
        rounds a float checkpoint's linear layers to the same blocks as they are loaded."""
        tp = tp or TensorParallel()
        full = ModelConfig.from_json(Path(model_dir) / "config.json")
        config = rank_config(full, tp.size)
        if gguf_file is not None:
            weights = load_gguf_shard(gguf_file, full, tp.rank, tp.size, device, dtype)
        else:
            weights = load_shard(sorted(Path(model_dir).glob("*.safetensors")), tp.rank, tp.size, device, dtype)
        if quantization == "int4":
            weights = {name: quantize_int4(w) if is_linear(name) and not method_of(w).quantized else w
                       for name, w in weights.items()}
        elif quantization == "fp8":  # e4m3 with a scale per output row
            weights = {name: quantize_fp8_weight(w) if is_linear(name) else w for name, w in weights.items()}
        if "lm_head.weight" not in weights:  # tied: the output projection is the embedding matrix
            if not config.tie_word_embeddings:
                raise ValueError(f"model: {model_dir} has no lm_head.weight and tie_word_embeddings is false")
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        return cls(config, fuse_projections(weights, config), tp)

    def attention(self, x: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor,
                  attn: AttentionMetadata) -> torch.Tensor:
        """The residual stream x [N, hidden] -> x + attention(input_layernorm(x)), the new residual stream."""
        c, p, ops = self.config, f"model.layers.{layer}.", self.ops
        # the input norm and one matmul for every token of the step: [N, (heads + 2 * kv_heads) * head_dim]
        qkv = ops.linear(x, self.w[p + "self_attn.qkv_proj.weight"], self.w[p + "input_layernorm.weight"],
                         c.rms_norm_eps)
        norms = (self.w[p + "self_attn.q_norm.weight"], self.w[p + "self_attn.k_norm.weight"]) if c.qk_norm else (None, None)
        k_cache, v_cache = self.kv_cache.k[layer], self.kv_cache.v[layer]  # views of the one KV tensor
        # None for a cache in the model's dtype; int8: the per-token scale tensors; fp8: the layer's floats
        k_scale, v_scale = self.kv_cache.k_scale[layer], self.kv_cache.v_scale[layer]
        # q's and k's heads normalised (Qwen3) and rotated, K and V stored at their slots: one kernel when fused
        q = ops.qk_norm_rope_write(qkv, cos, sin, *norms, c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim,
                                   k_cache, v_cache, k_scale, v_scale, attn.slot_mapping)
        out = self.attention_backend.forward(q, k_cache, v_cache, attn, k_scale, v_scale)  # [N, heads * head_dim]
        return self.add_projection(out, self.w[p + "self_attn.o_proj.weight"], x)

    def mlp(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """The residual stream x -> x + mlp(post_attention_layernorm(x))."""
        p, ops = f"model.layers.{layer}.", self.ops
        # the norm, one matmul [N, 2 * intermediate] and SiLU(gate) * up: one call, one kernel at a few rows
        act = ops.linear(x, self.w[p + "mlp.gate_up_proj.weight"], self.w[p + "post_attention_layernorm.weight"],
                         self.config.rms_norm_eps, silu_mul=True)
        return self.add_projection(act, self.w[p + "mlp.down_proj.weight"], x)

    def add_projection(self, a: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + a @ weight.T, for o_proj and down_proj. Row-parallel: each rank's product is a partial sum, which the
        all-reduce completes before the residual is added (so the residual is added once, not once per rank)."""
        if self.tp.size == 1:
            return self.ops.linear(a, weight, residual=x)
        return x + self.tp.all_reduce(self.ops.linear(a, weight))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                logits_rows: list[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Every scheduled token of every sequence in one flat batch -> the next-token logits of each sequence.

        input_ids, positions: [N], the new tokens of S sequences side by side (a prefill chunk contributes its
        T tokens, a decode one) and their positions. attn: where each sequence's tokens are in the batch and
        where its K/V go and come from. -> [S, vocab], from each sequence's last token only.
        logits_rows, the flat indices of the tokens whose logits are wanted (a speculative step: each of a
        request's drafts and the token before them; a list, or a device tensor: a captured verify step's) ->
        [len(logits_rows), vocab], in that order.
        """
        c = self.config
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [N, head_dim], from the precomputed tables
        x = self.embed(input_ids)  # [N, hidden]: the residual stream
        for layer in range(c.num_layers):  # each block reads the stream and adds to it
            x = self.mlp(self.attention(x, layer, cos, sin, attn), layer)
        if logits_rows is not None:  # the rows asked for
            rows = logits_rows if isinstance(logits_rows, torch.Tensor) else to_device(torch.tensor(logits_rows), x.device)
            x = x[rows]
        elif x.shape[0] != attn.num_seqs:  # some sequence has several new tokens: keep each one's last
            last = to_device(torch.tensor(attn.cu_seqlens_q[1:]) - 1, x.device)  # each sequence's last token
            x = x[last]  # (a step of decodes has one row per sequence: nothing to pick, no copy)
        # The final norm and lm_head on S rows, not N: lm_head reads each sequence's last token only.
        # This rank's vocab rows [S, vocab / N], gathered on rank 0 into [S, vocab]
        logits = self.ops.linear(x, self.w["lm_head.weight"], self.w["model.norm.weight"], c.rms_norm_eps)
        return self.tp.gather_logits(logits, c.vocab_size).float()  # [S, vocab]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [N] -> their embeddings [N, hidden]. Split over N ranks, each holds the rows of its vocab range:
        it looks up the ids in that range, zeros for the others, and one all-reduce adds the ranks' lookups (one of
        them holds each id: the sum is exact)."""
        table = self.w["model.embed_tokens.weight"]
        if self.tp.size == 1:
            return table[input_ids]
        local = input_ids - self.tp.rank * table.shape[0]  # this rank's rows start at rank x rows
        outside = (local < 0) | (local >= table.shape[0])
        x = table[local.masked_fill(outside, 0)].masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(x)


def fuse_projections(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF checkpoints store q, k, v and gate, up as separate matrices. Stack them once, at load time:
    [q; k; v] -> qkv_proj, [gate; up] -> gate_up_proj. x @ W.T of a stacked W is the three (two) products
    side by side, so one matmul replaces three (two): fewer kernel launches, one larger matmul.
    In place, layer by layer: each layer's separate matrices are freed as soon as its stacked ones exist."""
    for layer in range(config.num_layers):
        a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        stack = lambda ws: method_of(ws[0]).cat_rows(ws)  # noqa: E731
        weights[a + "qkv_proj.weight"] = stack([weights.pop(a + n + "_proj.weight") for n in "qkv"])
        weights[m + "gate_up_proj.weight"] = stack([weights.pop(m + "gate_proj.weight"),
                                                    weights.pop(m + "up_proj.weight")])
    return weights


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None):
    """Attention of one sequence, every head at once. q: [T, heads, head_dim]; keys, values: [S, kv_heads, head_dim];
    mask: [T, S] (True = may attend) or None. -> [T, heads * head_dim].

    Grouped-query attention by a view: the query heads that share a KV head are consecutive, so q viewed as
    [kv_heads, group * T, head_dim] meets K as [kv_heads, head_dim, S] in one batched matmul per sequence,
    each KV head read once for its whole group; K and V are never copied per query head."""
    T, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = q.view(T, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, group * T, head_dim)
    scores = torch.matmul(q, keys.permute(1, 2, 0)) / head_dim**0.5  # [kv_heads, group * T, S]: one bmm
    scores = scores.view(kv_heads, group, T, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # [T, S] broadcast over every head
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).view(kv_heads, group * T, -1)  # fp32 inside
    out = torch.matmul(probs, values.permute(1, 0, 2))  # [kv_heads, group * T, head_dim]: one bmm
    return out.view(kv_heads, group, T, head_dim).permute(2, 0, 1, 3).reshape(T, heads * head_dim)


def causal_mask(start: int, num_new: int, device) -> torch.Tensor | None:
    """Which cached tokens each of num_new queries at positions start.. may attend to: [num_new, start + num_new],
    True where key position <= query position, built by one broadcast compare. None for a single query: a
    decode token is the newest and attends to every token, so it needs no mask at all."""
    if num_new == 1:
        return None
    keys = torch.arange(start + num_new, device=device)
    queries = torch.arange(start, start + num_new, device=device)
    return keys[None, :] <= queries[:, None]


def slot_mapping(start_positions: list[int], query_lens: list[int], block_tables: list[list[int]],
                 block_size: int) -> torch.Tensor:
    """The flat cache slot of every new token, sequence after sequence: position p of a sequence lives in its
    block block_table[p // block_size], at offset p % block_size; flat, that is block * block_size + offset.
    Computed once per step (by the model runner), read by every layer; by tensor ops, not a loop over tokens."""
    lens = torch.tensor(query_lens)  # [S]
    seq = torch.repeat_interleave(torch.arange(len(query_lens)), lens)  # [N]: the sequence of each new token
    offset = torch.arange(len(seq)) - (lens.cumsum(0) - lens)[seq]  # [N]: 0, 1, .. within its sequence
    positions = torch.tensor(start_positions)[seq] + offset  # [N]
    flat_tables = torch.tensor(list(chain.from_iterable(block_tables)))  # every sequence's blocks, one after another
    table_start = torch.tensor(list(accumulate(map(len, block_tables), initial=0))[:-1])  # [S]: its first block
    blocks = flat_tables[table_start[seq] + positions // block_size]  # [N]
    return blocks * block_size + positions % block_size  # int64 [N], on the CPU


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K (or V) rows [..., head_dim] -> int8 rows [..., head_dim] and one fp32 scale per row [...].

    Symmetric absmax quantisation: scale = max|x| / 127 over the row's head_dim elements, q = round(x / scale),
    clamped to [-127, 127]. Restoring q * scale is off by at most scale / 2 per element (the rounding). A row of
    zeros has scale 0: it stores q = 0 and restores 0 (no division by zero, no NaN)."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1) / 127  # [...]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero rows: 0 / 1 = 0
    q = torch.round(x32 / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., head_dim] and their scales [...] -> the rows in `dtype`: q * scale, computed in fp32."""
    return (q.float() * scale[..., None]).to(dtype)


def dequantize_fp8(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Float8 e4m3 rows and their layer's scale -> the rows in `dtype`: q * scale, computed in fp32."""
    return (q.float() * scale).to(dtype)


def write_kv(cache_layer: torch.Tensor, slot_mapping: torch.Tensor, new: torch.Tensor,
             scale_layer: torch.Tensor | float | None = None) -> None:
    """Store new K (or V) rows, [N, kv_heads, head_dim], at their flat slots [N]: one scatter, whatever N.
    cache_layer [num_blocks, block_size, kv_heads, head_dim] is viewed as [num_blocks * block_size, ...].
    int8 cache (scale_layer [num_blocks, block_size, kv_heads] given): quantise first, then one scatter of the
    int8 rows and one of their scales. fp8 cache (scale_layer: the layer's scale, a float): the rows
    quantised with it (quantize_fp8), one scatter."""
    if cache_layer.dtype == FP8:  # torch's scatter has no float8 kernel on every device: move the bytes
        cache_layer.view(torch.uint8).view(-1, *cache_layer.shape[2:]).index_copy_(
            0, slot_mapping, quantize_fp8(new, scale_layer).view(torch.uint8))
        return
    if scale_layer is not None:
        new, scales = quantize_kv(new)  # [N, kv_heads, head_dim] int8, [N, kv_heads] fp32
        scale_layer.view(-1, scale_layer.shape[2]).index_copy_(0, slot_mapping, scales)
    cache_layer.view(-1, *cache_layer.shape[2:]).index_copy_(0, slot_mapping, new)


def context_slots(block_table: list[int], num_tokens: int, block_size: int, device) -> torch.Tensor:
    """The flat cache slots of a sequence's first num_tokens tokens, in order, [num_tokens]: each block's
    block_size slots (block * block_size + 0 .. block_size - 1), block after block, cut to num_tokens."""
    blocks = torch.tensor(block_table[:-(-num_tokens // block_size)], device=device)
    return (blocks[:, None] * block_size + torch.arange(block_size, device=device)).flatten()[:num_tokens]


def gather_kv(cache_layer: torch.Tensor, slots: torch.Tensor, scale_layer: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """K (or V) rows at the given flat slots, [len(slots), kv_heads, head_dim]: one index_select. int8 cache
    (scale_layer given): the rows' scales too, and the rows come back dequantised, in `dtype`. An fp8
    cache's rows come back dequantised with the layer's scale (a float)."""
    if cache_layer.dtype == FP8:  # the bytes gathered (as write_kv moves them), dequantised with the scale
        rows = cache_layer.view(torch.uint8).view(-1, *cache_layer.shape[2:]).index_select(0, slots)
        return dequantize_fp8(rows.view(FP8), scale_layer, dtype)
    rows = cache_layer.view(-1, *cache_layer.shape[2:]).index_select(0, slots)
    if scale_layer is None:
        return rows
    return dequantize_kv(rows, scale_layer.view(-1, scale_layer.shape[2]).index_select(0, slots), dtype)


class KVCache:
    """The KV cache of every layer in one tensor, allocated once and cut into blocks of block_size tokens:
    data[0] holds K and data[1] holds V, each [layers, num_blocks, block_size, kv_heads, head_dim].
    k[layer] and v[layer] are views of it (no copies).

    data has the KVSpec's dtype. kv_cache_dtype "auto": the model's, and k_scale / v_scale are None. "int8":
    int8, and scales [2, layers, num_blocks, block_size, kv_heads] fp32 holds one scale per (token, KV head);
    k_scale[layer] and v_scale[layer] are its views, [num_blocks, block_size, kv_heads]. "fp8" /
    "fp8_e4m3": data is float8 e4m3, and k_scale[layer] and v_scale[layer] are floats, one per layer (kv_scales,
    or 1.0)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device, spec: KVSpec,
                 kv_scales: tuple[list[float], list[float]] | None = None):
        quantized = spec.scale_bytes > 0  # int8: a scale per row
        fp8 = spec.layer_scales  # fp8: a scale per layer for K and one for V
        # zeros, not empty. A verify graph's padding tokens attend past their request's tokens (cuda_graphs.py's
        # StaticVerifyInputs), and the kernel loads those keys and values for the real tokens of the same tile too,
        # weighted 0: a NaN in memory never written would make 0 x NaN = NaN there. Written memory is finite.
        self.data = torch.zeros((2, config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim),
                                device=device, dtype=getattr(torch, spec.dtype))
        self.k = list(self.data[0])  # per layer: [num_blocks, block_size, kv_heads, head_dim]
        self.v = list(self.data[1])
        self.scales = None
        self.k_scale = self.v_scale = [None] * config.num_layers
        if fp8:  # one scale per layer for K and one for V, floats (1.0 unless given: vLLM's default)
            self.k_scale, self.v_scale = (list(kv_scales[0]), list(kv_scales[1])) if kv_scales else (
                [1.0] * config.num_layers, [1.0] * config.num_layers)
        if quantized:  # zeros: a slot never written restores as 0, never as NaN
            self.scales = torch.zeros((2, config.num_layers, num_blocks, block_size, config.num_kv_heads),
                                      device=device, dtype=torch.float32)
            self.k_scale = list(self.scales[0])  # per layer: [num_blocks, block_size, kv_heads]
            self.v_scale = list(self.scales[1])


def describe_projections(model, device) -> str:
    """The engine line's part for the projections: the fused path's GEMV up to its rows and cuBLAS above, or torch's
    matmuls."""
    gemv_devices = getattr(model.ops, "gemv_devices", ())  # where few rows run the GEMV kernel
    if device.type not in gemv_devices:
        return "torch matmuls (norm, SiLU * up and residual beside them)"
    rows = model.ops.gemv_max_rows
    pdl = ", launched as programmatic dependents (PDL)" if model.ops.uses_pdl(device) else ""
    return (f"Triton GEMV at {rows} row{'s' if rows > 1 else ''} (norm, SiLU * up and residual fused){pdl}, cuBLAS "
            f"above{projection_method(model).describe_fused(model.ops)}")


def mib(nbytes: int) -> str:
    """A size on the engine's line: whole MiB, or two decimals under 10 MiB (a tiny model's weights)."""
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 10 * 2**20 else f"{nbytes / 2**20:.2f} MiB"


def projection_method(model):
    """The projections' linear method (linear.py): every projection has one format."""
    return method_of(model.w["model.layers.0.self_attn.qkv_proj.weight"])


def describe_weights(model, config) -> str:
    """The engine line's part for the weights: what they take as loaded (this rank's share), and the projections'
    format."""
    linear, total = weight_bytes(model.w)
    return f"weights: {mib(total)}, the projections' {mib(linear)} as {projection_method(model).describe(config)}"
