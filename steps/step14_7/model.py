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
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import accumulate, chain
from pathlib import Path

import torch
from safetensors.torch import load_file


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


@dataclass
class AttentionMetadata:
    """What attention needs besides q, k and v, for one flat batch: the new tokens of S sequences side by side
    (prefill chunks and decodes alike), sequence i's tokens at [cu_seqlens_q[i], cu_seqlens_q[i + 1])."""

    cu_seqlens_q: list[int]  # [S + 1]: where each sequence's new tokens start in the flat batch (0, ..., N)
    slot_mapping: torch.Tensor  # [N]: where each new token's K/V go, as a flat slot: block * block_size + offset
    context_slots: list[torch.Tensor]  # per sequence: the flat slots of all its tokens so far, in order
    masks: list[torch.Tensor | None]  # per sequence: the causal mask of a prefill chunk; None for a decode

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens_q) - 1


class CausalLM:
    """A Llama or a Qwen3: the same code, with q/k norms when config.qk_norm."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        self.config = config
        self.w = weights
        self.kv_cache: KVCache | None = None  # bound by the model runner once the cache is allocated

    @classmethod
    def from_pretrained(cls, model_dir: Path, device: torch.device, dtype: torch.dtype) -> "CausalLM":
        config = ModelConfig.from_json(Path(model_dir) / "config.json")
        weights: dict[str, torch.Tensor] = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            weights.update(load_file(f))
        weights = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        if "lm_head.weight" not in weights:  # tied: the output projection is the embedding matrix
            if not config.tie_word_embeddings:
                raise ValueError(f"model: {model_dir} has no lm_head.weight and tie_word_embeddings is false")
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        return cls(config, fuse_projections(weights, config))

    def attention(self, x: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor,
                  attn: AttentionMetadata) -> torch.Tensor:
        c, p = self.config, f"model.layers.{layer}.self_attn."
        N = x.shape[0]
        qkv = x @ self.w[p + "qkv_proj.weight"].T  # one matmul for every token of the step: [N, (heads + 2 * kv_heads) * head_dim]
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1)
        q = q.reshape(N, c.num_heads, c.head_dim)  # [N, heads, head_dim]
        k = k.reshape(N, c.num_kv_heads, c.head_dim)  # [N, kv_heads, head_dim]
        v = v.reshape(N, c.num_kv_heads, c.head_dim)  # [N, kv_heads, head_dim]
        if c.qk_norm:  # Qwen3: each head of q and k is RMS-normalised over head_dim before RoPE
            q = rms_norm(q, self.w[p + "q_norm.weight"], c.rms_norm_eps)
            k = rms_norm(k, self.w[p + "k_norm.weight"], c.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = self.kv_cache.k[layer], self.kv_cache.v[layer]  # views of the one KV tensor
        write_kv(k_cache, attn.slot_mapping, k)  # one scatter for every new token of every sequence
        write_kv(v_cache, attn.slot_mapping, v)
        # Each sequence has its own context: attention still runs sequence by sequence (step15 makes it one kernel).
        outputs = []
        for i in range(attn.num_seqs):
            keys = gather_kv(k_cache, attn.context_slots[i])  # [context, kv_heads, head_dim]
            values = gather_kv(v_cache, attn.context_slots[i])
            q_i = q[attn.cu_seqlens_q[i]:attn.cu_seqlens_q[i + 1]]  # this sequence's new tokens: [T_i, heads, head_dim]
            outputs.append(grouped_attention(q_i, keys, values, attn.masks[i]))
        return torch.cat(outputs) @ self.w[p + "o_proj.weight"].T  # [N, hidden]

    def mlp(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        p = f"model.layers.{layer}.mlp."
        gate, up = (x @ self.w[p + "gate_up_proj.weight"].T).chunk(2, dim=-1)  # one matmul; each [N, intermediate]
        return (torch.nn.functional.silu(gate) * up) @ self.w[p + "down_proj.weight"].T

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Every scheduled token of every sequence in one flat batch -> the next-token logits of each sequence.

        input_ids, positions: [N], the new tokens of S sequences side by side (a prefill chunk contributes its
        T tokens, a decode one) and their positions. attn: where each sequence's tokens are in the batch and
        where its K/V go and come from. -> [S, vocab], from each sequence's last token only.
        """
        c = self.config
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, self.w["model.norm.weight"].dtype)  # [N, head_dim]
        x = self.w["model.embed_tokens.weight"][input_ids]  # [N, hidden]
        for layer in range(c.num_layers):
            p = f"model.layers.{layer}."
            x = x + self.attention(rms_norm(x, self.w[p + "input_layernorm.weight"], c.rms_norm_eps), layer, cos, sin,
                                   attn)
            x = x + self.mlp(rms_norm(x, self.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps), layer)
        last = torch.tensor(attn.cu_seqlens_q[1:], device=x.device) - 1  # each sequence's last token
        x = rms_norm(x[last], self.w["model.norm.weight"], c.rms_norm_eps)  # [S, hidden]: lm_head on S rows, not N
        return (x @ self.w["lm_head.weight"].T).float()  # [S, vocab]


def fuse_projections(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF checkpoints store q, k, v and gate, up as separate matrices. Stack them once, at load time:
    [q; k; v] -> qkv_proj, [gate; up] -> gate_up_proj. x @ W.T of a stacked W is the three (two) products
    side by side, so one matmul replaces three (two): fewer kernel launches, one larger matmul.
    In place, layer by layer: each layer's separate matrices are freed as soon as its stacked ones exist."""
    for layer in range(config.num_layers):
        a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        weights[a + "qkv_proj.weight"] = torch.cat([weights.pop(a + n + "_proj.weight") for n in "qkv"])
        weights[m + "gate_up_proj.weight"] = torch.cat([weights.pop(m + "gate_proj.weight"),
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


def write_kv(cache_layer: torch.Tensor, slot_mapping: torch.Tensor, new: torch.Tensor) -> None:
    """Store new K (or V) rows, [N, kv_heads, head_dim], at their flat slots [N]: one scatter, whatever N.
    cache_layer [num_blocks, block_size, kv_heads, head_dim] is viewed as [num_blocks * block_size, ...]."""
    cache_layer.view(-1, *cache_layer.shape[2:]).index_copy_(0, slot_mapping, new)


def context_slots(block_table: list[int], num_tokens: int, block_size: int, device) -> torch.Tensor:
    """The flat cache slots of a sequence's first num_tokens tokens, in order, [num_tokens]: each block's
    block_size slots (block * block_size + 0 .. block_size - 1), block after block, cut to num_tokens."""
    blocks = torch.tensor(block_table[:-(-num_tokens // block_size)], device=device)
    return (blocks[:, None] * block_size + torch.arange(block_size, device=device)).flatten()[:num_tokens]


def gather_kv(cache_layer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """K (or V) rows at the given flat slots, [len(slots), kv_heads, head_dim]: one index_select."""
    return cache_layer.view(-1, *cache_layer.shape[2:]).index_select(0, slots)


class KVCache:
    """The KV cache of every layer in one tensor, allocated once and cut into blocks of block_size tokens:
    data[0] holds K and data[1] holds V, each [layers, num_blocks, block_size, kv_heads, head_dim].
    k[layer] and v[layer] are views of it (no copies)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        self.data = torch.empty((2, config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim),
                                device=device, dtype=dtype)
        self.k = list(self.data[0])  # per layer: [num_blocks, block_size, kv_heads, head_dim]
        self.v = list(self.data[1])
