"""step33: DeepSeek's multi-head latent attention (MLA) and its router.

What is proven here, on the CPU (float32):
- the engine's greedy tokens and their logprobs equal HF's DeepseekV3ForCausalLM and DeepseekV2ForCausalLM on
  random:tiny-deepseek-v3 (q_lora_rank, sigmoid scores, a correction bias, 4 groups, a shared expert) and
  random:tiny-deepseek-v2-lite (a plain q_proj, softmax scores, greedy top-k, two shared experts), batched, in
  chunks, with prefix hits and with preemption (their counters); on the V3 model the correction bias changed the
  experts chosen for some tokens in that very run (it never weighs them);
- a decode's absorbed path equals the decompressed path on the same cache entries;
- the cache holds one row of kv_lora_rank + qk_rope_head_dim elements a token and layer (the allocated tensor), and
  the pool holds as many times more tokens than keys and values per head would;
- bad input: a checkpoint without kv_b_proj, topk_group > n_group, kv_lora_rank 0, the options this step does not
  run a latent model with: a ValueError that names it.
"""
import pytest
import torch

from helpers import edited_model, load_engine, step_module
from registry import introducing
from shared import SamplingParams, resolve_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")

MLA_STEP = introducing("mla")
V3, V2 = "random:tiny-deepseek-v3", "random:tiny-deepseek-v2-lite"
OPTIONS = dict(device="cpu", dtype="float32", attention_backend="torch")


def prompts_with_a_shared_prefix(num: int = 4) -> list[list[int]]:
    """Prompts that share a 32-token prefix (two blocks of 16: prefix-cache hits), each with its own tail."""
    g = torch.Generator().manual_seed(33)
    prefix = torch.randint(0, 49152, (32,), generator=g).tolist()
    return [prefix + torch.randint(0, 49152, (3 + 7 * i,), generator=g).tolist() for i in range(num)]


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy continuation of `prompt` (n tokens) and each token's logprob under HF's own forward."""
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0]
        logprobs = torch.log_softmax(hf(ids[None]).logits[0].float(), dim=-1)
    new = ids[len(prompt):]
    return new.tolist(), logprobs[len(prompt) - 1:-1].gather(1, new[:, None])[:, 0].tolist()


@pytest.mark.parametrize("model,arch", [(V3, "DeepseekV3ForCausalLM"), (V2, "DeepseekV2ForCausalLM")])
def test_engine_equals_hf_deepseek_batched_chunked_cached_and_preempted(model, arch, monkeypatch):
    """One prompt, then three at once, in a budget of 24 tokens (every prompt in chunks) and a pool so small that the
    newest request is preempted: each greedy answer and its logprobs equal HF's, and the counters say every path ran.
    On V3, the correction bias changed which experts some token chose (the weights never see it)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    model_mod = step_module(MLA_STEP, "model")
    routed, route = [], model_mod.route_deepseek

    def recorded(h, router, bias, c):
        routed.append((h.clone(), router, bias, c))
        return route(h, router, bias, c)
    monkeypatch.setattr(model_mod, "route_deepseek", recorded)
    prompts = prompts_with_a_shared_prefix()
    llm = load_engine(MLA_STEP).LLM(model, **OPTIONS, max_kv_tokens=128, max_num_batched_tokens=24, max_num_seqs=4,
                                    block_size=16)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts[:1], sp) + llm.generate(prompts[1:], sp)
    assert llm.stats["prefill_chunks"] > len(prompts) and llm.block_manager.stats["hits"] > 0
    assert llm.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy(hf, prompt, 16)
        assert out.outputs[0].token_ids == tokens
        ours = [top[t] for top, t in zip(out.outputs[0].logprobs, tokens)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=2e-4, rtol=0)
    if model == V3:  # the bias changed a choice in this run
        changed = 0
        for h, router, bias, c in routed:
            assert bias is not None
            _, with_bias = route(h, router, bias, c)
            _, without = route(h, router, None, c)
            changed += sum(set(a) != set(b) for a, b in zip(with_bias.tolist(), without.tolist()))
        assert changed > 0


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


@pytest.mark.parametrize("model", [V3, V2])
def test_yarn_equals_hf(model, tmp_path):
    """DeepSeek's YaRN (its long-context RoPE, DeepSeek-V2-Lite's and V3's configs): the frequencies ramped between
    kept and divided by the factor, cos and sin times the attention factor, the softmax scale times
    mscale(factor, mscale_all_dim) squared: greedy tokens and logprobs equal HF's on the model with YaRN."""
    from transformers import AutoModelForCausalLM

    folder = edited_model(tmp_path, model, edit_config=lambda cfg: cfg.update(rope_parameters=YARN))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = load_engine(MLA_STEP).LLM(folder, **OPTIONS, max_kv_tokens=1024)
    assert llm.model.config.yarn is not None and llm.model.config.attention_scale != (16 + 8) ** -0.5
    prompt = prompts_with_a_shared_prefix(2)[1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))[0]
    tokens, logprobs = hf_greedy(hf, prompt, 12)
    assert out.outputs[0].token_ids == tokens
    ours = [top[t] for top, t in zip(out.outputs[0].logprobs, tokens)]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=2e-4, rtol=0)


@pytest.mark.parametrize("splits", [1, 3])
def test_the_latent_kernel_equals_its_reference(splits):
    """kernels/latent.py in the interpreter against latent_decode_reference: padded heads (4 and 20 of blocks of 16),
    contexts of 1 to 70 tokens over shuffled blocks, one split or three (more splits than a short context has tiles:
    empty parts), fp32 and fp16."""
    latent = step_module(MLA_STEP, "kernels.latent")
    g = torch.Generator().manual_seed(splits)
    for heads, C, R, dtype, atol in [(4, 32, 8, torch.float32, 1e-5), (20, 64, 16, torch.float32, 1e-5),
                                     (16, 32, 8, torch.float16, 2e-3)]:
        cache = torch.randn(12, 16, 1, C + R, generator=g).to(dtype)
        lens = torch.tensor([1, 37, 70], dtype=torch.int32)
        tables = torch.stack([torch.randperm(12, generator=g)[:6] for _ in range(3)]).to(torch.int32)
        q_latent, q_rope = torch.randn(3, heads, C, generator=g).to(dtype), torch.randn(3, heads, R, generator=g).to(dtype)
        want = latent.latent_decode_reference(q_latent, q_rope, cache, tables, lens, 0.2)
        got = latent.latent_decode(q_latent, q_rope, cache, tables, lens, 0.2, num_splits=splits, block_n=16)
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


def test_the_triton_backend_follows_the_torch_path():
    """The triton backend on the CPU (the kernels in the interpreter), prompts in chunks of a 24-token budget beside
    the decodes of the ones already answered: decode rows through the latent kernel, chunks through the mixed kernel
    over their decompressed keys and values, in steps that hold both too (counted); the greedy tokens equal the torch
    backend's on V3, and their logprobs within 1e-5."""
    prompts = prompts_with_a_shared_prefix(3)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = {}
    for backend in ("torch", "triton"):
        llm = load_engine(MLA_STEP).LLM(V3, **{**OPTIONS, "attention_backend": backend}, max_kv_tokens=1024,
                                        max_num_batched_tokens=24)
        outs[backend] = [o.outputs[0] for o in llm.generate(prompts, sp)]
        if backend == "triton":
            launches = llm.model.attention_backend.latent_launches
            assert launches["decodes"] > 0 and launches["chunks"] > 0 and launches["beside decodes"] > 0, launches
    for a, b in zip(outs["triton"], outs["torch"]):
        assert a.token_ids == b.token_ids
        chosen = lambda out: torch.tensor([top[t] for top, t in zip(out.logprobs, out.token_ids)])  # noqa: E731
        torch.testing.assert_close(chosen(a), chosen(b), atol=1e-5, rtol=0)


def test_the_absorbed_path_equals_the_decompressed_one():
    """A decode's query over the same cache entries: through W_UK and W_UV around a multi-query attention over the
    latents (absorbed) and through keys and values per head (decompressed): the same output."""
    attention = step_module(MLA_STEP, "attention")
    model_mod = step_module(MLA_STEP, "model")
    g = torch.Generator().manual_seed(5)
    heads, nope, rope, vd, kv, ctx = 4, 16, 8, 16, 32, 37
    kv_b = torch.randn(heads * (nope + vd), kv, generator=g) * 0.1
    config = latent_config(heads, nope, rope, vd, kv)
    m = model_mod.latent_matrices({"model.layers.0.self_attn.kv_b_proj.weight": kv_b}, config)[0]
    entries = torch.randn(ctx, kv + rope, generator=g)
    q_nope, q_rope = torch.randn(1, heads, nope, generator=g), torch.randn(1, heads, rope, generator=g)
    scale = (nope + rope) ** -0.5
    absorbed = attention.latent_absorbed(q_nope, q_rope, entries, m, scale)
    decompressed = attention.latent_decompressed(q_nope, q_rope, entries, m, scale)
    assert absorbed.shape == (1, heads * vd)
    torch.testing.assert_close(absorbed, decompressed, atol=1e-5, rtol=1e-5)


def latent_config(heads: int, nope: int, rope: int, vd: int, kv: int):
    """A one-layer latent-attention ModelConfig of these dims (only what latent_matrices reads matters)."""
    return step_module(MLA_STEP, "model").ModelConfig(
        model_type="deepseek_v3", vocab_size=1, hidden_size=1, intermediate_size=1, num_layers=1, num_heads=heads,
        num_kv_heads=1, head_dim=rope, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
        tie_word_embeddings=False, qk_norm=False, kv_lora_rank=kv, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=vd)


@pytest.mark.parametrize("start", [0, 21])
def test_a_chunk_over_its_cached_context_merges_two_parts_into_one_attention(start):
    """A prefill chunk of 7 queries after `start` cached tokens: its context and its own tokens attended apart and
    merged by log-sum-exp (latent_chunk) equal one decompressed attention over all of them with the causal mask."""
    attention, model_mod = step_module(MLA_STEP, "attention"), step_module(MLA_STEP, "model")
    g = torch.Generator().manual_seed(start)
    heads, nope, rope, vd, kv, T = 4, 16, 8, 16, 32, 7
    config = latent_config(heads, nope, rope, vd, kv)
    kv_b = torch.randn(heads * (nope + vd), kv, generator=g) * 0.1
    m = model_mod.latent_matrices({"model.layers.0.self_attn.kv_b_proj.weight": kv_b}, config)[0]
    entries = torch.randn(start + T, kv + rope, generator=g)
    q_nope, q_rope = torch.randn(T, heads, nope, generator=g), torch.randn(T, heads, rope, generator=g)
    whole = attention.latent_decompressed(q_nope, q_rope, entries, m, 0.3, model_mod.causal_mask(start, T, "cpu"))
    torch.testing.assert_close(attention.latent_chunk(q_nope, q_rope, entries, m, 0.3), whole, atol=1e-5, rtol=1e-5)


def test_the_cache_holds_one_latent_row_a_token():
    """The allocated cache: one row of kv_lora_rank + qk_rope_head_dim elements per token and layer, and no V; the
    bytes per token the pool is sized by are those; the same memory holds heads x (nope + rope + v) /
    (kv_lora_rank + rope) times the tokens a cache of keys and values per head would (the pool's block count), and
    the engine's line says so."""
    llm = load_engine(MLA_STEP).LLM(V3, **OPTIONS, max_kv_tokens=256)
    c, kv = llm.model.config, llm.model.kv_cache
    row = c.kv_lora_rank + c.qk_rope_head_dim
    assert kv.data.shape[0] == 1 and kv.data.shape[-2:] == (1, row) and kv.data.shape[1] == c.num_layers
    assert all(v is None for v in kv.v)
    spec = step_module(MLA_STEP, "model_runner").kv_spec_of(c, torch.float32)
    assert spec.bytes_per_token == c.num_layers * row * 4
    assert kv.data[0, 0].numel() // kv.data.shape[2] // kv.data.shape[3] == row  # per token and layer
    # the same memory in a cache of keys and values per head (what kv_b_proj turns each row into): fewer tokens
    runner = step_module(MLA_STEP, "model_runner")
    per_head = c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)  # elements a layer
    memory, block = 2**30, 16
    latent_blocks = runner.kv_pool_blocks(memory, 1.0, 0, block * spec.bytes_per_token)
    per_head_blocks = runner.kv_pool_blocks(memory, 1.0, 0, block * c.num_layers * per_head * 4)
    assert latent_blocks // per_head_blocks == per_head // row and spec.stands_for == per_head
    assert f"one latent row of 40 a token: {per_head / row:.1f}x the tokens of keys and values per head" in llm.backend


def test_a_checkpoint_without_kv_b_proj_is_a_value_error(tmp_path):
    folder = edited_model(tmp_path, V3, drop="model.layers.1.self_attn.kv_b_proj.weight")
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.kv_b_proj.weight"):
        load_engine(MLA_STEP).LLM(folder, **OPTIONS)


@pytest.mark.parametrize("edit,message", [
    ({"topk_group": 5}, r"n_group=4 groups, topk_group=5"),
    ({"kv_lora_rank": 0}, r"deepseek_v3 needs kv_lora_rank >= 1, got 0"),
    ({"topk_method": "greedy"}, r"topk_method='greedy' and scoring_func='sigmoid' is not supported"),
])
def test_a_bad_deepseek_config_is_a_value_error_naming_it(tmp_path, edit, message):
    folder = edited_model(tmp_path, V3, edit_config=lambda cfg: cfg.update(edit))
    with pytest.raises(ValueError, match=message):
        load_engine(MLA_STEP).LLM(folder, **OPTIONS)


@pytest.mark.parametrize("option,value", [("tensor_parallel_size", 2), ("quantization", "int4"),
                                          ("kv_cache_dtype", "int8"),
                                          ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2})])
def test_options_a_latent_model_does_not_run_with_are_refused_by_name(option, value):
    options = {**OPTIONS, option: value}
    with pytest.raises(ValueError, match=rf"{option}=.*latent attention"):
        load_engine(MLA_STEP).LLM(V3, **options)


# ---- on the GPU ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("heads", [16, 128])  # DeepSeek-V2-Lite's heads, V3's
def test_gpu_latent_kernel_compiled_bf16_at_deepseek_shapes(heads):
    """The kernel compiled, bf16, at DeepSeek's row (512 + 64) over contexts of 1 to 3,000 tokens, one split and
    eight: within bf16's rounding of the fp32 reference."""
    latent = step_module(MLA_STEP, "kernels.latent")
    g = torch.Generator().manual_seed(heads)
    C, R, S, blocks = 512, 64, 4, 200
    cache = torch.randn(blocks, 16, 1, C + R, generator=g).to("cuda", torch.bfloat16)
    lens = torch.tensor([1, 100, 1000, 3000], dtype=torch.int32, device="cuda")
    tables = torch.stack([torch.randperm(blocks, generator=g)[:188] for _ in range(S)]).to("cuda", torch.int32)
    q_latent = torch.randn(S, heads, C, generator=g).to("cuda", torch.bfloat16) * 0.05
    q_rope = torch.randn(S, heads, R, generator=g).to("cuda", torch.bfloat16) * 0.05
    want = latent.latent_decode_reference(q_latent.float(), q_rope.float(), cache.float(), tables, lens, 576 ** -0.5)
    for splits in (1, 8):
        got = latent.latent_decode(q_latent, q_rope, cache, tables, lens, 576 ** -0.5, num_splits=splits)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@cuda
def test_gpu_triton_engine_follows_the_torch_path_in_bf16():
    """The engine on CUDA, bf16, CUDA graphs on: the triton backend (decodes through the latent kernel, replayed
    from graphs) gives the torch backend's greedy tokens on both tiny models, up to bf16 near-ties: the first
    difference, if any, is a near-tie of the torch path's own logprobs."""
    prompts = prompts_with_a_shared_prefix(3)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    for model in (V3, V2):
        outs = {}
        for backend in ("torch", "triton"):
            llm = load_engine(MLA_STEP).LLM(model, device="cuda", dtype="bfloat16", attention_backend=backend,
                                            max_kv_tokens=4096)
            outs[backend] = [o.outputs[0] for o in llm.generate(prompts, sp)]
            if backend == "triton":
                assert llm.stats["graph_replays"] > 0 and llm.model.attention_backend.launches > 0
            llm.shutdown()
        for a, b in zip(outs["torch"], outs["triton"]):
            first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            if first is not None:  # a near-tie: the two best logprobs within bf16's rounding
                top = sorted(a.logprobs[first].values(), reverse=True)[:2]
                assert top[0] - top[1] < 0.05, (model, first, top)
