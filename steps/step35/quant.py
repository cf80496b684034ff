"""4-bit weights, kept as the checkpoint ships them.

The embedded model is a GGUF file whose linear weights are Q4_1 blocks: every run of 32 consecutive inputs of a
weight row is one block of 20 bytes,

    d      float16   the block's scale
    m      float16   the block's minimum
    qs     16 bytes  32 unsigned 4-bit values: byte j holds value j in its low nibble and value j + 16 in its high one

and value i of the block is d * q_i + m. Every step before this one expanded the blocks to float32 when the model
was converted (shared/models.py, through transformers): 4 bytes a weight instead of 20 / 32 = 0.625. Here they stay
blocks: a Q4Weight holds one linear's [N, K] weight as three tensors, in the layout the kernels read,

    packed   uint8    [N, K / 2]    each block's 16 bytes of nibbles, as stored
    scale    float16  [N, K / 32]   d of each block
    minimum  float16  [N, K / 32]   m of each block

(0.625 bytes a weight, 0.3125x bfloat16's 2). The tensors that are not Q4_1 are read as what they are: the norms are
float32 (read as the model's dtype), the token embedding (tied to lm_head) is Q8_0 (32 signed 8-bit values and one
float16 scale a block), dequantised once on load: a gather reads one row of it per token, and lm_head's matmul reads
it whole (the 4-bit GEMV covers the layers' projections).

quantize_int4 makes the same blocks from any float weight (round to nearest, asymmetric, groups of 32 along K):
`quantization="int4"` for a checkpoint that ships floats, such as the random-weight models.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

GROUP = 32           # weights per block, along a row's inputs (K)
Q4_1_BYTES = 20      # a Q4_1 block: float16 d, float16 m, 16 bytes of nibbles
Q8_0_BYTES = 34      # a Q8_0 block: float16 d, 32 int8


@dataclass
class Q4Weight:
    """One linear's [N, K] weight as 4-bit blocks of GROUP inputs (the module docstring's layout)."""

    packed: torch.Tensor   # uint8 [N, K // 2]
    scale: torch.Tensor    # float16 [N, K // GROUP]
    minimum: torch.Tensor  # float16 [N, K // GROUP]

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.minimum))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def to(self, device) -> "Q4Weight":
        return Q4Weight(self.packed.to(device), self.scale.to(device), self.minimum.to(device))

    def values(self) -> torch.Tensor:
        """The 4-bit values q, uint8 [N, K]: per block the 16 low nibbles, then the 16 high ones."""
        n, k = self.shape
        blocks = self.packed.view(n, k // GROUP, GROUP // 2)
        return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).view(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] in dtype: d * q + m, computed in float32 (as gguf's own dequantiser computes it), then cast. The
        float32 values are written in place, one pass per operation: into `out` (float32, N * K elements, a buffer
        the caller reuses) when given, else into a new tensor."""
        n, k = self.shape
        w = out.view(n, k // GROUP, GROUP) if out is not None else torch.empty(n, k // GROUP, GROUP, device=self.device)
        blocks = self.packed.view(n, k // GROUP, GROUP // 2)
        w[..., :GROUP // 2] = blocks & 0x0F  # each block's values 0..15: its bytes' low nibbles
        w[..., GROUP // 2:] = blocks >> 4    # values 16..31: the high ones
        w.mul_(self.scale.float()[..., None]).add_(self.minimum.float()[..., None])
        return w.view(n, k).to(dtype)

    def rows(self, start: int, stop: int) -> "Q4Weight":
        """Output rows start..stop: whole rows of blocks (a tensor-parallel shard of a column-parallel layer)."""
        return Q4Weight(self.packed[start:stop], self.scale[start:stop], self.minimum[start:stop])

    def columns(self, start: int, stop: int) -> "Q4Weight":
        """Inputs start..stop (a row-parallel layer's shard): both ends must fall on a block boundary."""
        if start % GROUP or stop % GROUP:
            raise ValueError(f"a 4-bit weight's inputs split at multiples of {GROUP} only, not {start}..{stop}")
        return Q4Weight(self.packed[:, start // 2:stop // 2], self.scale[:, start // GROUP:stop // GROUP],
                        self.minimum[:, start // GROUP:stop // GROUP])


@dataclass
class Fp8Weight:
    """One linear's [N, K] weight in float8 e4m3 with one fp32 scale per output row (per channel): w is
    data * scale[:, None]. 1 byte a weight and 4 a row: about half of bfloat16's bytes."""

    data: torch.Tensor   # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel() * 4

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device) -> "Fp8Weight":
        return Fp8Weight(self.data.to(device), self.scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in dtype: data * scale, computed in float32, then cast."""
        return (self.data.float() * self.scale[:, None]).to(dtype)


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: e4m3 has no infinity; a larger value is stored as 448 (saturated)


def quantize_fp8(x: torch.Tensor, scale) -> torch.Tensor:
    """x / scale rounded to the nearest float8 e4m3 value, computed in fp32, saturated at +-448 (torch's own
    cast saturates the same way). scale: a float (a KV cache's layer) or a tensor that broadcasts (a weight's rows,
    activations' rows). Each element keeps 3 bits of mantissa: a relative error of at most 1/16, whatever its size,
    down to 2^-6 (below that, e4m3's subnormals: steps of 2^-9)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_fp8_weight(w: torch.Tensor) -> Fp8Weight:
    """quantization="fp8": per output row, scale = max|w| / 448 (a row of zeros: 1), data = w / scale
    rounded to the nearest e4m3 value (torch's cast). Each weight keeps 3 bits of mantissa: within 1/16 of its value
    down to 2^-6 of its row's largest."""
    if w.dim() != 2:
        raise ValueError(f"fp8: a linear weight must be [N, K], got {tuple(w.shape)}")
    w32 = w.detach().float()
    scale = w32.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return Fp8Weight(quantize_fp8(w32, scale[:, None]), scale.contiguous())


def q4_1_from_bytes(raw: np.ndarray, n: int, k: int) -> Q4Weight:
    """A GGUF Q4_1 tensor's bytes (uint8, n * k / 32 blocks of 20, row by row) -> its Q4Weight, no copy of a value
    changed: the nibbles as stored, d and m as their float16 bits."""
    if k % GROUP:
        raise ValueError(f"a Q4_1 tensor's rows must be whole blocks of {GROUP}, not {k}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP, Q4_1_BYTES)
    scale = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).reshape(n, k // GROUP))
    minimum = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).reshape(n, k // GROUP))
    packed = torch.from_numpy(blocks[..., 4:].copy().reshape(n, k // 2))
    return Q4Weight(packed, scale, minimum)


def q8_0_dequantize(raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """A GGUF Q8_0 tensor's bytes -> float32 [n, k]: d * q per block of 32 (q int8)."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP, Q8_0_BYTES)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).astype(np.float32))
    q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).astype(np.float32))
    return (d * q).view(n, k)


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> Q4Weight:
    """Round to nearest, asymmetric, groups of `group` (32: the Q4_1 layout, so the same kernels read it) along K:
    per group m = min, d = (max - min) / 15, both stored as float16, q = round((w - m) / d) in 0..15 computed with
    the stored (float16) d and m, so that d * q + m is the nearest of the 16 levels the blocks can express."""
    if group != GROUP:
        raise ValueError(f"int4 groups of {GROUP} only (the Q4_1 layout the kernels read), not {group}")
    if w.dim() != 2 or w.shape[1] % group:
        raise ValueError(f"int4: a weight's inputs ({tuple(w.shape)}) must be a multiple of the group size {group}")
    n, k = w.shape
    g = w.detach().float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    minimum = lo.half()
    scale = ((hi - lo) / 15).half()
    d = scale.float().clamp(min=torch.finfo(torch.float16).tiny)[..., None]
    q = torch.round((g - minimum.float()[..., None]) / d).clamp(0, 15).to(torch.uint8)
    packed = (q[..., :group // 2] | (q[..., group // 2:] << 4)).view(n, k // 2)
    return Q4Weight(packed.contiguous(), scale.contiguous(), minimum.contiguous())


def unpermute_rows(rows: np.ndarray | torch.Tensor, n_head: int):
    """llama.cpp's converter reorders the rows of a Llama q or k weight (each head's two RoPE halves interleaved);
    this puts them back in the checkpoint's order (what transformers' GGUF loader does). Whole rows move, so it
    applies to a Q4_1 tensor's rows of blocks as to floats."""
    dim = rows.shape[0] // n_head // 2
    w = rows.reshape(n_head, dim, 2, *rows.shape[1:])
    return w.swapaxes(2, 1).reshape(rows.shape) if isinstance(w, np.ndarray) else w.transpose(1, 2).reshape(rows.shape)


GGUF_NAMES = {  # llama.cpp's tensor names -> the checkpoint's (HF) names, {i} the layer
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{i}", *parts[2:]])
        if key in GGUF_NAMES:
            return GGUF_NAMES[key].format(i=parts[1])
    elif gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    raise ValueError(f"GGUF tensor {gguf_name!r}: not a tensor of a Llama checkpoint this engine reads")


def read_gguf(path: Path, num_heads: int, num_kv_heads: int) -> dict:
    """The GGUF file's tensors by their checkpoint (HF) names: Q4_1 tensors as Q4Weight (kept 4-bit), F32 / F16
    tensors as float32 tensors, Q8_0 dequantised to float32. Any other tensor type is a ValueError naming it."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        name = hf_name(t.name)
        k, n = (int(x) for x in t.shape[:2]) if len(t.shape) > 1 else (int(t.shape[0]), 1)
        kind = t.tensor_type.name
        if kind == "Q4_1":
            weight = q4_1_from_bytes(np.asarray(t.data), n, k)
            heads = num_heads if ".q_proj." in name else num_kv_heads if ".k_proj." in name else None
            if heads is not None:
                weight = Q4Weight(unpermute_rows(weight.packed, heads), unpermute_rows(weight.scale, heads),
                                  unpermute_rows(weight.minimum, heads))
            out[name] = Q4Weight(*(x.contiguous() for x in (weight.packed, weight.scale, weight.minimum)))
        elif kind == "Q8_0":
            out[name] = q8_0_dequantize(np.asarray(t.data), n, k)
        elif kind in ("F32", "F16"):
            data = torch.from_numpy(np.asarray(t.data).copy()).float()
            out[name] = data.reshape(n, k) if len(t.shape) > 1 else data
        else:
            raise ValueError(f"GGUF tensor {t.name!r} is {kind}: this engine reads Q4_1, Q8_0, F16 and F32 tensors")
    return out


def fake_quantize(w: torch.Tensor, group: int) -> torch.Tensor:
    """Round-to-nearest int4 of w in groups of `group` along K, dequantised again (float32): what the blocks would
    hold, for any group size (the kernels read groups of GROUP; other sizes are for measuring only)."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4: a weight's inputs ({k}) must be a multiple of the group size {group}")
    g = w.detach().float().view(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float().clamp(min=torch.finfo(torch.float16).tiny)
    m = lo.half().float()
    return (torch.round((g - m) / d).clamp(0, 15) * d + m).view(n, k)


def awq_scales(weight: torch.Tensor, x: torch.Tensor, group: int, grid: int = 20) -> tuple[torch.Tensor, float]:
    """Activation-aware scales (AWQ, Lin et al. 2023) for one linear: the inputs that carry large activations matter
    more, so scale them up before rounding (their weights then round more finely relative to their size) and the
    inputs down by the same factor. s = mean|x|^alpha per input channel, alpha from a grid in [0, 1], the one whose
    rounded product x (Q(W s) / s) is closest to x W (the mean squared error on the calibration rows x [T, K]).
    -> (s [K], alpha); alpha 0 is plain rounding (s = 1)."""
    w = weight.float()
    x = x.float()
    want = x @ w.T
    importance = x.abs().mean(0).clamp(min=1e-8)
    best = (float("inf"), torch.ones_like(importance), 0.0)
    for i in range(grid + 1):
        alpha = i / grid
        s = importance.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centred around 1, so the weights keep their range
        err = ((x / s) @ fake_quantize(w * s, group).T - want).pow(2).mean().item()
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]
