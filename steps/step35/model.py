"""Three model families, Llama, Qwen3 and Qwen3-MoE, in one transformer written from scratch in plain PyTorch.

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

A mixture of experts (Qwen3-MoE, HF's Qwen3MoeForCausalLM). A sparse layer's MLP is E experts, each a SwiGLU
MLP of moe_intermediate_size, and a router (mlp.gate, [E, hidden]): each token's router logits -> softmax -> its
top k experts, their probabilities renormalised to sum to 1 when norm_topk_prob says so; the layer's output is the
k experts' outputs weighted by those probabilities. ops.experts runs them: TorchLayerOps loops over the experts (one
matmul pair per expert that got tokens: the reference), kernels/moe.py's fused path sorts the (token, expert) pairs
by expert and runs every expert in one grouped GEMM per projection. The experts load from HF's checkpoint names
(mlp.experts.<e>.gate_proj / up_proj / down_proj) stacked into two 3-D tensors per layer. Layers named in
mlp_only_layers (and those off decoder_sparse_step) keep a dense MLP.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from itertools import accumulate, chain
from pathlib import Path
from types import SimpleNamespace

import torch

from .kv_spec import KV_CACHE_DTYPES, KVSpec  # noqa: F401  (KV_CACHE_DTYPES: imported from here too)
from .parallel import Pipeline, TensorParallel, expert_of, is_vocab_parallel, local_experts, shard, vocab_rows
from .linear import method_of
from .quant import FP8, quantize_fp8, quantize_fp8_weight, quantize_int4, read_gguf


SUPPORTED = ("llama", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3")  # qwen3_moe, a mixture of experts;
# deepseek_v2 / deepseek_v3: multi-head latent attention and DeepSeek's router (deepseek_fields)
DEEPSEEK = ("deepseek_v2", "deepseek_v3")


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
    # a mixture of experts (qwen3_moe); num_experts 0: every layer's MLP is dense
    num_experts: int = 0  # E: the experts of a sparse layer
    num_experts_per_tok: int = 0  # k: the experts each token runs
    moe_intermediate_size: int = 0  # each expert's width
    norm_topk_prob: bool = False  # the k chosen probabilities renormalised to sum to 1
    decoder_sparse_step: int = 1  # layer L is sparse when (L + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: tuple = ()  # ... and L is not one of these
    # DeepSeek's multi-head latent attention: each token's keys and values come from one latent of kv_lora_rank
    # values, normalised, and qk_rope_head_dim roped dims shared by every head; that is what the cache holds.
    # kv_lora_rank 0: K and V heads (GQA). head_dim is qk_rope_head_dim then (the roped part: its tables)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # the query through a low-rank pair and a norm (V3); 0: one q_proj (V2-Lite)
    qk_nope_head_dim: int = 0  # each head's query and key dims without position
    qk_rope_head_dim: int = 0  # ... and with it (RoPE)
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE turns adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek), not the halves
    attention_scale: float = 0.0  # the softmax's scale: 1 / sqrt(qk_nope + qk_rope) for MLA; 0: 1 / sqrt(head_dim)
    # DeepSeek's router: sigmoid (V3) or softmax (V2) scores; the experts chosen among the topk_group best of
    # n_group groups (noaux_tc, group_limited_greedy) or among all (greedy); V3 adds a correction bias to the scores
    # it chooses by, never to the weights; the weights times routed_scaling_factor; n_shared_experts' MLP beside
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0  # DeepSeek: layers 0 .. first_k_dense_replace - 1 are dense
    # YaRN (DeepSeek's long context): (factor, original_max_position_embeddings, beta_fast, beta_slow, the cos/sin's
    # attention factor); None: plain RoPE
    yarn: tuple | None = None
    # pipeline parallel: the layers this rank's stage holds, (first, stop); None: all of them
    layer_range: tuple | None = None

    @property
    def layers(self) -> range:
        """The layers this rank runs (and caches): its stage's, or all."""
        return range(*self.layer_range) if self.layer_range else range(self.num_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (HF's rule), not a dense MLP."""
        if self.model_type in DEEPSEEK:
            return self.num_experts > 0 and layer >= self.first_k_dense_replace
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_json(cls, path: Path) -> "ModelConfig":
        c = json.loads(Path(path).read_text())
        model_type = c.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(f"model: model_type {model_type!r} is not supported by this step (one of {SUPPORTED})")
        rope = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}  # the old name, or HF 5's
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn") or (rope_type == "yarn" and model_type not in DEEPSEEK):
            raise ValueError(f"model: rope type {rope_type!r} is not supported (plain RoPE; YaRN for DeepSeek)")
        if c.get("attention_bias") or c.get("mlp_bias"):
            raise ValueError("model: attention_bias / mlp_bias is not supported (projections without bias only)")
        if c.get("use_sliding_window"):
            raise ValueError("model: use_sliding_window is not supported (full attention only)")
        moe = moe_fields(c) if model_type == "qwen3_moe" else deepseek_fields(c) if model_type in DEEPSEEK else {}
        if model_type in DEEPSEEK:
            c = {**c, "num_key_value_heads": 1, "head_dim": moe["qk_rope_head_dim"]}  # one latent a token
            if rope_type == "yarn":
                moe.update(yarn_fields(rope, c.get("max_position_embeddings", 2048), moe["attention_scale"]))
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
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **moe,
        )


def moe_fields(c: dict) -> dict:
    """A qwen3_moe config's expert fields, checked (HF's config.json names; the expert count is num_experts
    on the Hub, num_local_experts in what transformers 5 writes)."""
    experts = c.get("num_experts", c.get("num_local_experts"))
    top_k = c.get("num_experts_per_tok")
    if not isinstance(experts, int) or experts < 1:
        raise ValueError(f"model: a qwen3_moe config needs num_experts >= 1, got {experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"model: num_experts_per_tok must be 1 .. num_experts ({experts}), got {top_k!r}")
    if not c.get("moe_intermediate_size"):
        raise ValueError("model: a qwen3_moe config needs moe_intermediate_size (each expert's width)")
    if c.get("shared_expert_intermediate_size"):
        raise ValueError("model: a shared expert (shared_expert_intermediate_size) is not supported (Qwen3-MoE has none)")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=c["moe_intermediate_size"],
                norm_topk_prob=bool(c.get("norm_topk_prob", False)), decoder_sparse_step=c.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(c.get("mlp_only_layers") or ()))


def deepseek_fields(c: dict) -> dict:
    """A DeepSeek-V2/V3 config's latent attention and router fields, checked (HF's config.json names). What HF's
    DeepseekV2/V3 modules would not run as the fields say is refused by name, never run differently."""
    def positive(name):
        value = c.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model: {c['model_type']} needs {name} >= 1, got {value!r}")
        return value

    v3 = c["model_type"] == "deepseek_v3"
    kv_lora, nope, rope, vd = (positive(n) for n in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                      "v_head_dim"))
    if rope % 2:
        raise ValueError(f"model: qk_rope_head_dim must be even (RoPE turns pairs), got {rope}")
    q_lora = c.get("q_lora_rank")
    if q_lora is not None:
        positive("q_lora_rank")
    experts, top_k = c.get("n_routed_experts") or 0, c.get("num_experts_per_tok") or 0
    n_group, topk_group = c.get("n_group") or 1, c.get("topk_group") or 1
    method = c.get("topk_method", "noaux_tc" if v3 else "greedy")
    scoring = c.get("scoring_func", "sigmoid" if v3 else "softmax")
    if experts:
        if not 1 <= top_k <= experts:
            raise ValueError(f"model: num_experts_per_tok must be 1 .. n_routed_experts ({experts}), got {top_k!r}")
        if experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"model: {experts} experts in n_group={n_group} groups, topk_group={topk_group} of them: "
                             "the groups must split the experts evenly and topk_group be 1 .. n_group")
        if (v3, method, scoring) not in ((True, "noaux_tc", "sigmoid"), (False, "greedy", "softmax"),
                                         (False, "group_limited_greedy", "softmax")):
            raise ValueError(f"model: {c['model_type']} with topk_method={method!r} and scoring_func={scoring!r} is "
                             "not supported (V3: noaux_tc over sigmoid scores; V2: greedy or group_limited_greedy over "
                             "softmax scores, as HF's modules route)")
        if not v3 and c.get("norm_topk_prob"):
            raise ValueError("model: deepseek_v2 with norm_topk_prob=True is not supported (HF's DeepseekV2 router "
                             "does not renormalise the chosen weights)")
        if not v3 and c.get("moe_layer_freq", 1) != 1:
            raise ValueError(f"model: moe_layer_freq={c['moe_layer_freq']} is not supported (every layer from "
                             "first_k_dense_replace on is sparse, as HF's DeepseekV2 builds it)")
        positive("moe_intermediate_size")
        if top_k > (experts // n_group) * topk_group:
            raise ValueError(f"model: num_experts_per_tok={top_k} is more than the {topk_group} groups' experts")
    return dict(kv_lora_rank=kv_lora, q_lora_rank=q_lora or 0, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                v_head_dim=vd, rope_interleave=bool(c.get("rope_interleave", True)) if v3 else True,
                attention_scale=(nope + rope) ** -0.5, scoring_func=scoring, topk_method=method, n_group=n_group,
                topk_group=topk_group, routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
                n_shared_experts=c.get("n_shared_experts") or 0,
                first_k_dense_replace=c.get("first_k_dense_replace") or 0, num_experts=experts,
                num_experts_per_tok=top_k, moe_intermediate_size=c.get("moe_intermediate_size") or 0,
                norm_topk_prob=bool(c.get("norm_topk_prob", False)))


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


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, yarn: tuple | None = None):
    """cos/sin tables for rotary embeddings. positions: [...] -> cos, sin: [..., head_dim]. yarn (ModelConfig.yarn):
    YaRN's frequencies (yarn_inv_freq), and cos and sin times its attention factor."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    if yarn is not None:
        inv_freq = yarn_inv_freq(inv_freq, head_dim, theta, *yarn[:4])
    angles = positions.float()[..., None] * inv_freq  # [..., head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [..., head_dim]
    factor = 1.0 if yarn is None else yarn[4]
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context scale (its paper's 0.1 * m * ln(s) + 1; 1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_fields(rope: dict, max_positions: int, scale: float) -> dict:
    """A DeepSeek config's YaRN parameters -> ModelConfig's yarn and the softmax scale, which YaRN multiplies by
    mscale(factor, mscale_all_dim) squared (the scale covers every dim of q . k, the roped and the others alike)."""
    original = rope.get("original_max_position_embeddings")
    if not original:
        raise ValueError("model: YaRN needs original_max_position_embeddings (the context it was trained at)")
    factor = rope.get("factor") or max_positions / original
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    if mscale_all_dim:
        scale = scale * yarn_mscale(factor, mscale_all_dim) ** 2
    return dict(yarn=(float(factor), int(original), float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
                      float(attention_factor)), attention_scale=scale)


def yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, factor: float, original: int, beta_fast: float,
                  beta_slow: float) -> torch.Tensor:
    """YaRN's frequencies: the high ones (those that turn more than beta_fast times over the original context) kept,
    the low ones (fewer than beta_slow turns) divided by factor, a linear ramp between (NTK-by-parts)."""
    def dim_of(turns):  # the dim whose frequency turns `turns` times over the original context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / (high - low if high > low else 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, head_dim], cos/sin: [..., head_dim]. Rotate each (first half, second half) pair by its
    position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE: x [..., heads, d], each adjacent pair (x[2i], x[2i + 1]) turned by angle i (cos/sin as
    rope_cos_sin makes them: [..., d], the d / 2 angles twice). -> [..., heads, d], the turned pairs' first
    elements, then their second ones: a fixed order of the dims, the same for queries and keys, so their products
    are those of the pairs turned in place."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., None, :half], sin[..., None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


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

    def experts(self, h, weights, chosen, gate_up, down):
        """A mixture of experts' MLP after its router: expert_loop."""
        return self.expert_loop(h, weights, chosen, gate_up, down)

    def expert_loop(self, h, weights, chosen, gate_up, down):
        """The experts as a loop, the reference kernels/moe.py is tested against. h [N, hidden] (normalised)
        -> [N, hidden], each token's chosen experts' outputs weighted by their router weights. gate_up
        [E, 2 * width, hidden] and down [E, hidden, width] are the experts this rank holds. chosen [N, k]: each token's
        experts as this rank numbers them (outside 0 .. E - 1: another rank's, skipped); weights [N, k] their router
        weights. For each expert that got tokens: its tokens gathered, two matmuls, SiLU * up, the weights, and the
        rows added back into place, expert after expert: 2 matmuls per expert hit."""
        out = torch.zeros_like(h)
        for e in range(gate_up.shape[0]):
            rows, slot = torch.where(chosen == e)  # the tokens that chose expert e, and where in their top k
            if rows.numel() == 0:
                continue
            y = self.silu_mul(h[rows] @ gate_up[e].T) @ down[e].T  # [tokens of e, hidden]
            out.index_add_(0, rows, y * weights[rows, slot, None])
            self.expert_matmuls += 2
        return out

    expert_matmuls = 0  # the loop's matmuls (two per expert that got tokens), counted by expert_loop

    def qk_norm_rope(self, qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim):
        """qkv [N, (heads + 2 * kv_heads) * head_dim] -> q [N, heads, head_dim], k [N, kv_heads, head_dim]: each head
        RMS-normalised over head_dim (Qwen3: when the weights are given), then rotated by its token's angles."""
        N = qkv.shape[0]
        q = qkv[:, :num_heads * head_dim].reshape(N, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].reshape(N, num_kv_heads, head_dim)
        if q_weight is not None:
            q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def route_deepseek(h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, c: "ModelConfig"):
    """DeepSeek's router, in fp32 as HF's. h [N, hidden] -> (weights [N, k] in h's dtype, experts [N, k]).
    Scores: sigmoid (V3) or softmax (V2) of h @ router.T. The choice: V3 adds the correction bias to the scores it
    chooses by (never to the weights), scores each of n_group groups by its two best, keeps the topk_group best
    groups and takes the top k experts in them (noaux_tc); V2 takes the top k of all (greedy), or of the groups whose
    best expert is among the topk_group best (group_limited_greedy). The weights: the chosen experts' scores
    (unbiased), renormalised when norm_topk_prob, times routed_scaling_factor."""
    logits = h.float() @ router.float().T  # [N, E]
    scores = logits.sigmoid() if c.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if c.topk_method != "greedy":  # a choice among the best groups only
        grouped = choice.view(len(h), c.n_group, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1) if c.topk_method == "noaux_tc" else grouped.amax(-1)
        kept = torch.zeros_like(group_score).scatter_(1, group_score.topk(c.topk_group, dim=-1).indices, 1.0)
        outside = (kept[:, :, None] == 0).expand_as(grouped).reshape(len(h), -1)
        choice = choice.masked_fill(outside, float("-inf") if c.topk_method == "noaux_tc" else 0.0)
    experts = choice.topk(c.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, experts)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * c.routed_scaling_factor).to(h.dtype), experts


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool):
    """The router. h [N, hidden] -> (weights [N, k] in h's dtype, experts [N, k] int64): each token's k most
    probable experts under softmax(h @ router.T) (in fp32), most probable first, their probabilities renormalised
    to sum to 1 when `renormalize` (HF's norm_topk_prob)."""
    probs = torch.softmax((h @ router.T).float(), dim=-1)  # [N, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), experts


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


def rank_config(config: ModelConfig, size: int, expert_parallel: bool = False) -> ModelConfig:
    """The shape one of `size` ranks holds: its share of the query heads, KV heads and MLP width (the vocab, the
    hidden size and the rest are the model's). size 1: the model's config. Its share of each expert's
    width, or (expert_parallel) every expert's whole width (it holds E / size whole experts: local_experts)."""
    if size == 1:
        return config
    return replace(config, num_heads=config.num_heads // size, num_kv_heads=config.num_kv_heads // size,
                   intermediate_size=config.intermediate_size // size,
                   moe_intermediate_size=config.moe_intermediate_size // (1 if expert_parallel else size))


def stage_keeps(name: str, layers: range | None, first: bool, last: bool, tied: bool) -> bool:
    """Whether a stage holds checkpoint tensor `name`: a layer's tensors if the layer is its own, the embedding on
    the first stage (and on the last when lm_head is tied to it), the final norm and lm_head on the last. layers
    None: one stage, everything."""
    if layers is None:
        return True
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) in layers
    if "embed_tokens" in name:
        return first or (last and tied)
    return last  # model.norm, lm_head


def load_shard(files, rank: int, size: int, device: torch.device, dtype: torch.dtype,
               experts: range | None = None, keep=None) -> dict:
    """Rank `rank`'s share of the checkpoint's tensors (HF names), read slice by slice from the safetensors files:
    a rank reads only its rows (columns) of each sharded tensor, never the whole. The vocab-parallel tensors are
    padded with zero rows to ceil(vocab / N). With size 1 every tensor is read whole, as step21 loads them.
    experts: the experts this rank holds whole (expert parallel): the others' tensors are not read. keep(name):
    whether this rank's stage holds the tensor (stage_keeps); the other stages' are not read."""
    from safetensors import safe_open

    weights = {}
    for f in files:
        with safe_open(f, framework="pt") as handle:
            for name in handle.keys():
                if experts is not None and expert_of(name) is not None and expert_of(name) not in experts:
                    continue  # another rank's expert
                if keep is not None and not keep(name):
                    continue  # another stage's
                part = handle.get_slice(name)
                full_shape = part.get_shape()
                cut = shard(name, full_shape, rank, size, experts is not None)
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
    """A layer's projection (q, k, v, o, gate, up, down): the weights kept as 4-bit blocks. Not an
    expert's (the experts stay in the model's dtype: the grouped GEMM reads floats)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight") and ".experts." not in name


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

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tp: TensorParallel | None = None,
                 experts: range | None = None, pipe: Pipeline | None = None):
        self.config = config
        self.w = weights
        self.tp = tp or TensorParallel()
        self.pipe = pipe or Pipeline()  # this rank's stage: its layers, whether it embeds and whether it has lm_head
        # the experts this rank's stacked expert tensors hold, in order (all of them unless expert parallel)
        self.experts = experts if experts is not None else range(config.num_experts)
        self.kv_cache: KVCache | None = None  # bound by the model runner once the cache is allocated
        # latent attention: each layer's kv_b_proj whole and cut per head (latent_matrices); [] without it
        self.mla = latent_matrices(weights, config) if config.kv_lora_rank else []
        self.attention_backend = None  # attention.py's TorchAttention or TritonAttention, bound by the engine
        self.ops = TorchLayerOps()  # the elementwise groups: torch operators, or kernels/fused.py's (the engine picks)
        # RoPE's cos/sin for every position, computed once: a step indexes them by its positions (one
        # gather, nothing computed from host data), which a CUDA graph can replay. Equal to rope_cos_sin's per step.
        norm = weights[f"model.layers.{config.layers.start}.input_layernorm.weight"]  # every stage has one layer
        dtype, device = norm.dtype, norm.device
        self.rope_cos, self.rope_sin = rope_cos_sin(torch.arange(config.max_position_embeddings, device=device),
                                                    config.head_dim, config.rope_theta, dtype, config.yarn)

    @classmethod
    def from_pretrained(cls, model_dir: Path, device: torch.device, dtype: torch.dtype,
                        tp: TensorParallel | None = None, gguf_file: Path | None = None,
                        quantization: str | None = None, expert_parallel: bool = False,
                        pipe: Pipeline | None = None) -> "CausalLM":
        """Load this rank's share of the checkpoint (load_shard reads only its slices). With gguf_file, the
        weights come from it, the linear layers' as their 4-bit blocks (load_gguf_shard); quantization="int4"
        rounds a float checkpoint's linear layers to the same blocks as they are loaded. expert_parallel, a
        mixture of experts' experts split whole over the ranks (this rank reads only its own). pipe: this rank's
        stage (its layers; the embedding if first, the final norm and lm_head if last): no other tensor is read."""
        tp, pipe = tp or TensorParallel(), pipe or Pipeline()
        full = ModelConfig.from_json(Path(model_dir) / "config.json")
        if pipe.layers is not None:  # pipeline parallel: this stage's layers only
            full = replace(full, layer_range=(pipe.layers.start, pipe.layers.stop))
        keep = None if pipe.layers is None else (lambda name: stage_keeps(name, pipe.layers, pipe.is_first,
                                                                          pipe.is_last, full.tie_word_embeddings))
        expert_parallel = expert_parallel and tp.size > 1 and full.num_experts > 0
        config = rank_config(full, tp.size, expert_parallel)
        experts = local_experts(full.num_experts, tp.rank, tp.size) if expert_parallel else range(full.num_experts)
        if gguf_file is not None:
            weights = load_gguf_shard(gguf_file, full, tp.rank, tp.size, device, dtype)
            weights = {name: w for name, w in weights.items() if keep is None or keep(name)}
        else:
            weights = load_shard(sorted(Path(model_dir).glob("*.safetensors")), tp.rank, tp.size, device, dtype,
                                 experts if expert_parallel else None, keep)
        if quantization == "int4":
            weights = {name: quantize_int4(w) if is_linear(name) and not method_of(w).quantized else w
                       for name, w in weights.items()}
        elif quantization == "fp8":  # e4m3 with a scale per output row
            weights = {name: quantize_fp8_weight(w) if is_linear(name) else w for name, w in weights.items()}
        if pipe.is_last and "lm_head.weight" not in weights:  # tied: the output projection is the embedding matrix
            if not config.tie_word_embeddings:
                raise ValueError(f"model: {model_dir} has no lm_head.weight and tie_word_embeddings is false")
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
            if not pipe.is_first:  # the last stage holds the matrix as lm_head only: it embeds nothing
                del weights["model.embed_tokens.weight"]
        return cls(config, fuse_projections(weights, config, experts), tp, experts, pipe)

    def attention(self, x: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor,
                  attn: AttentionMetadata) -> torch.Tensor:
        """The residual stream x [N, hidden] -> x + attention(input_layernorm(x)), the new residual stream."""
        if self.config.kv_lora_rank:
            return self.latent_attention(x, layer, cos, sin, attn)
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

    def latent_attention(self, x: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor,
                         attn: AttentionMetadata) -> torch.Tensor:
        """DeepSeek's multi-head latent attention: x [N, hidden] -> x + o_proj(attention). One matmul with the input
        norm gives each token its query (through q_a_proj and its norm first, when q_lora_rank) and its latent:
        kv_lora_rank values, normalised, and qk_rope_head_dim roped dims shared by every head. The latent and the
        roped dims are the token's whole cache entry (one row of kv_lora_rank + qk_rope_head_dim); the attention
        backend turns them into keys and values (attention.py's TorchAttention.latent)."""
        c, p, ops, w = self.config, f"model.layers.{layer}.", self.ops, self.w
        n, heads, nope, rope = x.shape[0], c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        a = ops.linear(x, w[p + "self_attn.qa_kva_proj.weight"], w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q, latent = a[:, :-(c.kv_lora_rank + rope)], a[:, -(c.kv_lora_rank + rope):]
        if c.q_lora_rank:  # the query's low-rank pair: its norm, then q_b_proj
            q = ops.linear(q, w[p + "self_attn.q_b_proj.weight"], w[p + "self_attn.q_a_layernorm.weight"],
                           c.rms_norm_eps)
        q = q.view(n, heads, nope + rope)
        turn = apply_rope_pairs if c.rope_interleave else apply_rope
        q_rope = turn(q[..., nope:], cos, sin)  # [N, heads, rope]
        k_rope = turn(latent[:, None, c.kv_lora_rank:], cos, sin)  # [N, 1, rope]: one for every head
        entry = torch.cat([rms_norm(latent[:, :c.kv_lora_rank], w[p + "self_attn.kv_a_layernorm.weight"],
                                    c.rms_norm_eps)[:, None], k_rope], dim=-1)  # [N, 1, kv_lora_rank + rope]
        write_kv(self.kv_cache.k[layer], attn.slot_mapping, entry)
        out = self.attention_backend.latent(q[..., :nope], q_rope, self.kv_cache.k[layer], attn, self.mla[layer],
                                            c.attention_scale)  # [N, heads * v_head_dim]
        return self.add_projection(out, w[p + "self_attn.o_proj.weight"], x)

    def mlp(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """The residual stream x -> x + mlp(post_attention_layernorm(x)). A sparse layer's MLP is
        its experts (moe)."""
        p, ops = f"model.layers.{layer}.", self.ops
        if self.config.is_moe_layer(layer):
            return self.moe(x, layer)
        # the norm, one matmul [N, 2 * intermediate] and SiLU(gate) * up: one call, one kernel at a few rows
        act = ops.linear(x, self.w[p + "mlp.gate_up_proj.weight"], self.w[p + "post_attention_layernorm.weight"],
                         self.config.rms_norm_eps, silu_mul=True)
        return self.add_projection(act, self.w[p + "mlp.down_proj.weight"], x)

    def moe(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """The residual stream x [N, hidden] -> x + the experts' weighted sum, each token through its top k
        experts of post_attention_layernorm(x). route chooses them (the router is whole on every rank) and ops.experts
        runs the experts this rank holds: all of them (a share of each one's width on each of N ranks), or with
        expert parallelism its own whole ones (self.experts), the others' (token, expert) pairs skipped. Either
        way a rank's output is a partial sum, completed by one all-reduce, as down_proj's is."""
        c, p = self.config, f"model.layers.{layer}."
        h, _ = self.ops.add_rms_norm(x, None, self.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        if c.model_type in DEEPSEEK:
            weights, chosen = route_deepseek(h, self.w[p + "mlp.gate.weight"],
                                             self.w.get(p + "mlp.gate.e_score_correction_bias"), c)
        else:
            weights, chosen = route(h, self.w[p + "mlp.gate.weight"], c.num_experts_per_tok, c.norm_topk_prob)
        # the experts as this rank numbers them (another rank's fall outside 0 .. E - 1 and are skipped)
        out = self.ops.experts(h, weights, chosen - self.experts.start, self.w[p + "mlp.experts.gate_up_proj.weight"],
                               self.w[p + "mlp.experts.down_proj.weight"])
        if c.n_shared_experts:  # DeepSeek's shared experts: a dense MLP every token runs, beside the routed ones
            shared = self.ops.linear(h, self.w[p + "mlp.shared_experts.gate_up_proj.weight"], silu_mul=True)
            out = out + self.ops.linear(shared, self.w[p + "mlp.shared_experts.down_proj.weight"])
        return x + (out if self.tp.size == 1 else self.tp.all_reduce(out))

    def add_projection(self, a: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + a @ weight.T, for o_proj and down_proj. Row-parallel: each rank's product is a partial sum, which the
        all-reduce completes before the residual is added (so the residual is added once, not once per rank)."""
        if self.tp.size == 1:
            return self.ops.linear(a, weight, residual=x)
        return x + self.tp.all_reduce(self.ops.linear(a, weight))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                logits_rows: list[int] | torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Every scheduled token of every sequence in one flat batch -> the next-token logits of each sequence.

        input_ids, positions: [N], the new tokens of S sequences side by side (a prefill chunk contributes its
        T tokens, a decode one) and their positions. attn: where each sequence's tokens are in the batch and
        where its K/V go and come from. -> [S, vocab], from each sequence's last token only.
        logits_rows, the flat indices of the tokens whose logits are wanted (a speculative step: each of a
        request's drafts and the token before them; a list, or a device tensor: a captured verify step's) ->
        [len(logits_rows), vocab], in that order.
        Pipeline parallel: a stage runs its own layers. The first embeds input_ids; a later one starts from hidden,
        the residual stream [N, hidden] the stage before gave. A stage before the last returns its stream, for
        the next; the last, the logits.
        """
        c = self.config
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [N, head_dim], from the precomputed tables
        x = self.embed(input_ids) if hidden is None else hidden  # [N, hidden]: the residual stream
        for layer in c.layers:  # each block reads the stream and adds to it
            x = self.mlp(self.attention(x, layer, cos, sin, attn), layer)
        if not self.pipe.is_last:  # the stream goes on to the next stage (every token: its layers need them all)
            return x
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


def fuse_projections(weights: dict[str, torch.Tensor], config: ModelConfig,
                     experts: range | None = None) -> dict[str, torch.Tensor]:
    """HF checkpoints store q, k, v and gate, up as separate matrices. Stack them once, at load time:
    [q; k; v] -> qkv_proj, [gate; up] -> gate_up_proj. x @ W.T of a stacked W is the three (two) products
    side by side, so one matmul replaces three (two): fewer kernel launches, one larger matmul.
    In place, layer by layer: each layer's separate matrices are freed as soon as its stacked ones exist.
    A sparse layer's experts (those in `experts`, in order) stacked into two 3-D tensors,
    mlp.experts.gate_up_proj.weight [E, 2 * width, hidden] (each expert's [gate; up]) and
    mlp.experts.down_proj.weight [E, hidden, width]: the grouped GEMM's operands, expert e at index e."""
    for layer in config.layers:
        a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        stack = lambda ws: method_of(ws[0]).cat_rows(ws)  # noqa: E731
        if config.kv_lora_rank:  # latent attention: the query's first matmul and the latent's, one matmul
            check_latent_weights(weights, a, config)
            query = "q_a_proj" if config.q_lora_rank else "q_proj"
            weights[a + "qa_kva_proj.weight"] = stack([weights.pop(a + query + ".weight"),
                                                      weights.pop(a + "kv_a_proj_with_mqa.weight")])
        else:
            weights[a + "qkv_proj.weight"] = stack([weights.pop(a + n + "_proj.weight") for n in "qkv"])
        if config.is_moe_layer(layer):
            stack_experts(weights, m, experts if experts is not None else range(config.num_experts))
            if config.n_shared_experts:
                if m + "shared_experts.gate_proj.weight" not in weights:
                    raise ValueError(f"model: the checkpoint has no {m}shared_experts.gate_proj.weight, and the config "
                                     f"names n_shared_experts={config.n_shared_experts}")
                weights[m + "shared_experts.gate_up_proj.weight"] = stack([
                    weights.pop(m + "shared_experts.gate_proj.weight"), weights.pop(m + "shared_experts.up_proj.weight")])
            continue
        weights[m + "gate_up_proj.weight"] = stack([weights.pop(m + "gate_proj.weight"),
                                                    weights.pop(m + "up_proj.weight")])
    return weights


def check_latent_weights(weights: dict, a: str, config: "ModelConfig") -> None:
    """A latent-attention layer's tensors (prefix a) are all there, kv_b_proj of the config's shape: else a
    ValueError that names the first one missing or the shape."""
    names = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if config.q_lora_rank else ["q_proj"]
    names += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    missing = [a + n + ".weight" for n in names if a + n + ".weight" not in weights]
    if missing:
        raise ValueError(f"model: a latent-attention checkpoint needs {missing[0]} (the config names kv_lora_rank="
                         f"{config.kv_lora_rank})")
    want = (config.num_heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank)
    got = tuple(weights[a + "kv_b_proj.weight"].shape)
    if got != want:
        raise ValueError(f"model: {a}kv_b_proj.weight is {got}, the config says {want}")


def latent_matrices(weights: dict, config: "ModelConfig") -> list[SimpleNamespace]:
    """Each layer's kv_b_proj [heads * (nope + v), kv_lora_rank], as the two paths read it: whole (kv_b: the
    prefill's keys and values from the latents) and cut per head (views, no copy): w_uk [heads, nope, kv_lora_rank],
    the keys' part, which a decode's query absorbs, and w_uv [heads, v, kv_lora_rank], the values' part, which its
    output absorbs after the attention. By layer: a pipeline stage's layers only (config.layers)."""
    out = {}
    for layer in config.layers:
        kv_b = weights[f"model.layers.{layer}.self_attn.kv_b_proj.weight"]
        per_head = kv_b.view(config.num_heads, config.qk_nope_head_dim + config.v_head_dim, config.kv_lora_rank)
        out[layer] = SimpleNamespace(kv_b=kv_b, w_uk=per_head[:, :config.qk_nope_head_dim],
                                     w_uv=per_head[:, config.qk_nope_head_dim:], nope=config.qk_nope_head_dim,
                                     kv_lora_rank=config.kv_lora_rank)
    return out


def stack_experts(weights: dict, m: str, experts: range) -> None:
    """Layer prefix m's experts (HF's names, one tensor per expert and projection) -> the two stacked
    tensors, in place. A missing router or expert tensor is a ValueError that names it."""
    if m + "gate.weight" not in weights:
        raise ValueError(f"model: the checkpoint has no router {m}gate.weight for this mixture-of-experts layer")
    names = [f"{m}experts.{e}.{proj}_proj.weight" for e in experts for proj in ("gate", "up", "down")]
    missing = [name for name in names if name not in weights]
    if missing:
        raise ValueError(f"model: the checkpoint lacks {len(missing)} expert tensor(s), the first {missing[0]}")
    gate_up, down = [], []
    for e in experts:
        g, u, d = (weights.pop(f"{m}experts.{e}.{proj}_proj.weight") for proj in ("gate", "up", "down"))
        gate_up.append(torch.cat([g, u]))
        down.append(d)
    weights[m + "experts.gate_up_proj.weight"] = torch.stack(gate_up)
    weights[m + "experts.down_proj.weight"] = torch.stack(down)


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
        # Pipeline parallel: the tensor holds this stage's layers only (config.layers); k[layer] and v[layer] are
        # indexed by the model's layer number all the same (None for another stage's layer).
        layers, total = config.layers, config.num_layers
        held = len(layers)
        pad = lambda views: [None] * layers.start + list(views) + [None] * (total - layers.stop)  # noqa: E731
        # zeros, not empty. A verify graph's padding tokens attend past their request's tokens (cuda_graphs.py's
        # StaticVerifyInputs), and the kernel loads those keys and values for the real tokens of the same tile too,
        # weighted 0: a NaN in memory never written would make 0 x NaN = NaN there. Written memory is finite.
        if spec.latent:  # latent attention: one row a token, the latent and the roped dims (no V of its own)
            self.data = torch.zeros((1, held, num_blocks, block_size, 1, spec.row_elements),
                                    device=device, dtype=getattr(torch, spec.dtype))
            self.k, self.v = pad(self.data[0]), [None] * total
        else:
            self.data = torch.zeros((2, held, num_blocks, block_size, config.num_kv_heads,
                                     config.head_dim), device=device, dtype=getattr(torch, spec.dtype))
            self.k = pad(self.data[0])  # per layer: [num_blocks, block_size, kv_heads, head_dim]
            self.v = pad(self.data[1])
        self.scales = None
        self.k_scale = self.v_scale = [None] * total
        if fp8:  # one scale per layer for K and one for V, floats (1.0 unless given: vLLM's default)
            self.k_scale, self.v_scale = (list(kv_scales[0]), list(kv_scales[1])) if kv_scales else (
                [1.0] * total, [1.0] * total)
        if quantized:  # zeros: a slot never written restores as 0, never as NaN
            self.scales = torch.zeros((2, held, num_blocks, block_size, config.num_kv_heads),
                                      device=device, dtype=torch.float32)
            self.k_scale = pad(self.scales[0])  # per layer: [num_blocks, block_size, kv_heads]
            self.v_scale = pad(self.scales[1])

    @property
    def nbytes(self) -> int:
        """The bytes this rank's cache holds (its scales too)."""
        return self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0)


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
    return method_of(model.w["model.layers.0.self_attn.o_proj.weight"])


def describe_weights(model, config) -> str:
    """The engine line's part for the weights: what they take as loaded (this rank's share), and the projections'
    format."""
    linear, total = weight_bytes(model.w)
    return f"weights: {mib(total)}, the projections' {mib(linear)} as {projection_method(model).describe(config)}"


def describe_experts(model) -> str:
    """The engine line's part for a mixture of experts: how many, how this rank runs them and which it holds; "" for
    a dense model."""
    c, held = model.config, model.experts
    if not c.num_experts:
        return ""
    run = "as two grouped GEMMs a layer (kernels/moe.py)" if model.ops.name == "triton" else \
        "as a loop over the experts hit (torch)"
    whole = (f", this rank holding experts {held.start}..{held.stop - 1} whole (expert parallel)"
             if len(held) < c.num_experts else "")
    return (f"{c.num_experts} experts of width {c.moe_intermediate_size}, {c.num_experts_per_tok} a token, "
            f"run {run}{whole}")
