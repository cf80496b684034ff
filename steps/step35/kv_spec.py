"""What the KV cache holds for one token, as one value: KVSpec, chosen by the engine's kv_cache_dtype option.

The model allocates the cache from it (model.py's KVCache), the runner sizes the pool from its bytes_per_token
(model_runner.py), and the engine's line names it with describe(). The option's values are the keys of one table,
FORMATS: a new format is one more entry there, not one more branch in each of those places. No torch here, so that a
front end can offer KV_CACHE_DTYPES without importing the model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KVSpec:
    """One token's cache in one layer, the same in each of `layers` layers: rows_per_token rows of row_elements
    elements of `dtype` (element_bytes each), and scale_bytes of scale beside each row. The cache of K and V heads
    has 2 x kv_heads rows of head_dim elements (kv_spec); a cache of another shape counts its own rows."""

    dtype: str | None  # the elements' dtype, by torch's name ("bfloat16", "int8"); None: the model's (FORMATS)
    element_bytes: int | None  # None: the model's dtype's
    scale_bytes: int = 0  # per row: int8 keeps one fp32 scale (4 bytes) for each (token, KV head) row
    layer_scales: bool = False  # fp8: each layer keeps a scale for K and one for V (floats; nothing per token)
    rows_per_token: int = 0  # per layer
    row_elements: int = 0
    layers: int = 0
    latent: bool = False  # one row a token: a latent-attention model's latent and roped dims, not K and V heads
    stands_for: int = 0  # a latent row: the elements of the keys and values per head it is turned into (per layer)

    @property
    def bytes_per_token(self) -> int:
        """One token in every layer: layers x rows x (row_elements x element_bytes + scale_bytes)."""
        return self.layers * self.rows_per_token * (self.row_elements * self.element_bytes + self.scale_bytes)

    def describe(self) -> str:
        """The elements' dtype and their scales, as the engine's line says them ("int8 + an fp32 scale per token
        and KV head")."""
        if self.latent:
            return (f"{self.dtype}, one latent row of {self.row_elements} a token: "
                    f"{self.stands_for / self.row_elements:.1f}x the tokens of keys and values per head")
        return self.dtype + (" + an fp32 scale per token and KV head" if self.scale_bytes else
                             " + a scale per layer for K and for V" if self.layer_scales else "")


# kv_cache_dtype's values (vLLM's option name and values) -> what an element of the cache is
FORMATS = {
    "auto": KVSpec(dtype=None, element_bytes=None),  # the model's dtype, no scales
    "int8": KVSpec(dtype="int8", element_bytes=1, scale_bytes=4),  # one byte per element + a scale per row
    # vLLM's two names for one format: float8 e4m3, one byte per element, with one scale per layer for K and one for V
    "fp8": KVSpec(dtype="float8_e4m3fn", element_bytes=1, layer_scales=True),
    "fp8_e4m3": KVSpec(dtype="float8_e4m3fn", element_bytes=1, layer_scales=True),
}
KV_CACHE_DTYPES = tuple(FORMATS)


def check_kv_cache_dtype(kv_cache_dtype) -> str:
    """kv_cache_dtype must be one of KV_CACHE_DTYPES, spelled exactly (vLLM's option name and values)."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    return kv_cache_dtype


def kv_spec(kv_cache_dtype: str, model_config, model_dtype_name: str, model_element_bytes: int) -> KVSpec:
    """The KV cache of a model under kv_cache_dtype: K and V of each KV head, 2 x num_kv_heads rows of head_dim
    elements per token, in each of its layers (num_layers; a pipeline stage's config: its own, config.layers) (the
    fields of model_config it reads); a latent-attention
    model's (kv_lora_rank), one row of kv_lora_rank + qk_rope_head_dim. The model's dtype comes
    as its name and its bytes per element ("bfloat16", 2), for "auto"."""
    fmt = FORMATS[check_kv_cache_dtype(kv_cache_dtype)]
    fmt = replace(fmt, dtype=fmt.dtype or model_dtype_name, element_bytes=fmt.element_bytes or model_element_bytes,
                  layers=len(getattr(model_config, "layers", range(model_config.num_layers))))
    latent = getattr(model_config, "kv_lora_rank", 0)
    if latent:  # latent attention: one row of kv_lora_rank + qk_rope_head_dim elements a token
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: a latent-attention model's cache is kept in its "
                             "dtype in this step (kv_cache_dtype='auto')")
        c = model_config
        return replace(fmt, rows_per_token=1, row_elements=latent + c.qk_rope_head_dim, latent=True,
                       stands_for=c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim))
    return replace(fmt, rows_per_token=2 * model_config.num_kv_heads, row_elements=model_config.head_dim)
