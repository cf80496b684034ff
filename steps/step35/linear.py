"""How a projection multiplies by its weight: one linear method per weight format.

A projection's weight is a float tensor or one of quant.py's formats (METHODS, at the end). The model, the fused
kernels and the engine never ask which: they ask the weight's method (method_of), and each format answers its own
way. A new format is one more method here, not a branch in each of them (vLLM's QuantizeMethodBase: the same idea).

    apply(x, w, ops)             x @ w.T on the torch path (model.py's TorchLayerOps.linear, the reference)
    gemv_rows(ops), gemv(...)    the fused path's few rows: the most its GEMV kernel takes, and that kernel
    matmul(x, w, ops, residual)  the fused path's other rows: x @ w.T (+ residual), cuBLAS or the format's own
    nbytes, key, cat_rows        the bytes w takes, what its storage is (a tied weight counted once), rows stacked
    shard, to                    a rank's share of w (a cut from parallel.py's shard), w on the device
    describe, describe_fused     the engine's line: the format, and what the fused path does with it
"""
from __future__ import annotations

import torch

from .kernels.gemv import gemv
from .kernels.gemv4 import dequantize4, gemv4
from .quant import FP8, FP8_MAX, Fp8Weight, Q4Weight, quantize_fp8


class DenseMethod:
    """A float tensor [N, K] in the model's dtype, read as it is; the other formats' methods override what they do
    differently."""

    name = "floats"
    quantized = False

    def apply(self, x, w, ops):
        return x @ w.T

    def gemv_rows(self, ops) -> int:
        return ops.gemv_max_rows

    def gemv(self, x, w, norm_weight, eps, residual, silu_mul, pdl):
        return gemv(x, w, norm_weight, eps, residual, silu_mul, pdl=pdl)

    def matmul(self, x, w, ops, residual=None):
        """On CUDA the residual is added by cuBLAS itself (addmm: no kernel of its own)."""
        if residual is None:
            return x @ w.T
        return torch.addmm(residual, x, w.T) if x.is_cuda else x @ w.T + residual

    def nbytes(self, w) -> int:
        return w.numel() * w.element_size()

    def key(self, w) -> int:
        return id(w)

    def cat_rows(self, ws):
        return torch.cat(ws)

    def shard(self, w, cut):
        return w[cut[1]:cut[2]] if cut[0] == 0 else w[:, cut[1]:cut[2]]

    def to(self, w, device, dtype):
        return w.to(device=device, dtype=dtype)

    def describe(self, config) -> str:
        return f"{config.dtype}".replace("torch.", "")

    def describe_fused(self, ops) -> str:
        return ""


class Q4Method(DenseMethod):
    """quant.py's Q4Weight, 4-bit blocks: dequantised for each matmul (d * q + m), or in the GEMV's registers."""

    name = "4-bit blocks"
    quantized = True

    def apply(self, x, w, ops):
        return x @ w.dequantize(x.dtype, out=ops.dequantize_buffer(w)).T  # for this matmul only

    def gemv_rows(self, ops) -> int:
        return ops.gemv4_max_rows

    def gemv(self, x, w, norm_weight, eps, residual, silu_mul, pdl):
        return gemv4(x, w, norm_weight, eps, residual, silu_mul, pdl=pdl)

    def matmul(self, x, w, ops, residual=None):
        ops.launches += 1  # the layer dequantised for this matmul (one launch), then cuBLAS
        return super().matmul(x, dequantize4(w, x.dtype), ops, residual)

    def nbytes(self, w) -> int:
        return w.nbytes

    def key(self, w) -> int:
        return id(w.packed)

    def cat_rows(self, ws):
        """Blocks never cross a row: each of the three tensors stacked."""
        return Q4Weight(*(torch.cat([getattr(w, f) for w in ws]) for f in ("packed", "scale", "minimum")))

    def shard(self, w, cut):
        return w.rows(cut[1], cut[2]) if cut[0] == 0 else w.columns(cut[1], cut[2])

    def to(self, w, device, dtype):
        return w.to(device)  # the blocks keep their dtypes

    def describe(self, config) -> str:
        return ("4-bit Q4_1 blocks as the GGUF ships them" if config.gguf_file is not None else
                "int4 blocks rounded on load (groups of 32)")

    def describe_fused(self, ops) -> str:
        rows = ops.gemv4_max_rows
        return (f"; the 4-bit blocks: the 4-bit GEMV up to {rows} rows, above them dequantised for each matmul, then "
                f"cuBLAS" if rows else "")


class Fp8Method(DenseMethod):
    """quant.py's Fp8Weight, float8 e4m3 rows with a scale each: converted in the GEMV's registers, or fp8_linear.
    Made from float weights once they are loaded, so no loader cuts or moves one (shard, to)."""

    name = "float8 e4m3 rows"
    quantized = True

    def apply(self, x, w, ops):
        return x @ w.dequantize(x.dtype).T  # data * scale, for this matmul only

    def gemv(self, x, w, norm_weight, eps, residual, silu_mul, pdl):
        """Each output times its row's scale, once, after the sum over K."""
        return gemv(x, w.data, norm_weight, eps, residual, silu_mul, pdl=pdl, weight_scale=w.scale)

    def matmul(self, x, w, ops, residual=None):
        y = fp8_linear(x, w)
        return y + residual if residual is not None else y

    def nbytes(self, w) -> int:
        return w.nbytes

    def key(self, w) -> int:
        return id(w.data)

    def cat_rows(self, ws):
        """Each row keeps its scale: the rows' bytes stacked, and their scales."""
        data = torch.cat([w.data.view(torch.uint8) for w in ws]).view(FP8)
        return Fp8Weight(data, torch.cat([w.scale for w in ws]))

    def describe(self, config) -> str:
        return "float8 e4m3 rounded on load, a scale per output row" + (
            " (dequantised for each matmul on this device)" if config.device.type != "cuda" else "")


def scaled_mm_supported(device) -> bool:
    """torch._scaled_mm with a scale per row of each operand: CUDA of compute capability 8.9 or more."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


def fp8_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [M, K] @ weight.T for an Fp8Weight, M larger than the GEMV takes. On Hopper: x quantised to e4m3
    with one scale per row (its max |x| / 448, computed now: dynamic, per token), then one fp8 matmul on the tensor
    cores with both sets of scales applied to its fp32 sums (torch._scaled_mm). Elsewhere: the weight dequantised
    to x's dtype, then a matmul."""
    if not scaled_mm_supported(x.device):
        return x @ weight.dequantize(x.dtype).T
    x_scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    x8 = quantize_fp8(x, x_scale)
    return torch._scaled_mm(x8, weight.data.t(), scale_a=x_scale, scale_b=weight.scale[None, :], out_dtype=x.dtype)


DENSE = DenseMethod()
METHODS = {  # a weight's type -> its method; any other weight is a float tensor
    Q4Weight: Q4Method(),
    Fp8Weight: Fp8Method(),
}


def method_of(weight) -> DenseMethod:
    """The linear method of a weight, by its type."""
    return METHODS.get(type(weight), DENSE)
