"""The step33 chapter's two tables, computed from the published configs of four models (their config.json fields,
written out below), no model loaded:

1. What one token's KV cache takes over all layers: a key and a value per KV head in fp32, bf16, int8 (one byte an
   element and an fp32 scale per token and head, step20's) and fp8 (step30's); and a latent-attention model's one row
   of kv_lora_rank + qk_rope_head_dim (step33's), beside the keys and values per head it stands for.
2. One DeepSeek-V2-Lite layer's attention for T query tokens over a context of S: FLOPs and the bytes it reads or
   writes in bf16, decompressed (kv_b_proj turns the S latents into keys and values per head, then attention) against
   absorbed (W_UK into the queries, attention over the latents, W_UV after), at T = 1 (a decode) and T = 4,096 (a
   prefill chunk).

    python docs/data/mla_bytes.py > docs/data/raw/cpu_mla_bytes.txt
"""

# the fields of each model's config.json that the cache's size depends on
GQA = {  # layers, KV heads, head_dim
    "Qwen3-0.6B": dict(layers=28, kv_heads=8, head_dim=128),
    "Llama-3-8B": dict(layers=32, kv_heads=8, head_dim=128),
}
MLA = {  # layers, heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    "DeepSeek-V2-Lite": dict(layers=27, heads=16, kv_lora=512, nope=128, rope=64, v=128),
    "DeepSeek-V3": dict(layers=61, heads=128, kv_lora=512, nope=128, rope=64, v=128),
}
BF16 = 2


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(v).rjust(w) if i >= 2 else str(v).ljust(w) for i, (v, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def cache_rows() -> list[list[str]]:
    rows = []
    for name, c in GQA.items():
        elements = 2 * c["kv_heads"] * c["head_dim"]  # a key and a value per KV head, per layer
        for fmt, per, scale in (("fp32", 4, 0), ("bf16", 2, 0), ("int8 + scales", 1, 4), ("fp8", 1, 0)):
            nbytes = c["layers"] * (elements * per + 2 * c["kv_heads"] * scale)
            rows.append([name, f"K and V per KV head, {fmt}", f"{elements}", f"{nbytes:,}"])
    for name, c in MLA.items():
        per_head = c["heads"] * (c["nope"] + c["rope"] + c["v"])  # the keys and values it decompresses into
        row = c["kv_lora"] + c["rope"]
        rows.append([name, "K and V per head, bf16 (decompressed)", f"{per_head}",
                     f"{c['layers'] * per_head * BF16:,}"])
        rows.append([name, "one latent row, bf16 (step33)", f"{row}", f"{c['layers'] * row * BF16:,}"])
    return rows


def attention_cost(c: dict, T: int, S: int) -> dict:
    """FLOPs and bytes of one layer's attention for T queries over S context tokens, both ways (bf16 tensors)."""
    H, C, R, N, V = c["heads"], c["kv_lora"], c["rope"], c["nope"], c["v"]
    latents = S * (C + R) * BF16  # the cache rows read
    decompressed = dict(
        flops=2 * S * C * H * (N + V)  # kv_b_proj over every latent: each head's key part and value
        + 2 * T * S * H * (N + R) + 2 * T * S * H * V,  # scores and output, per head
        nbytes=latents + C * H * (N + V) * BF16 + 2 * S * H * (N + R + V) * BF16)  # + kv_b + K/V written, read
    absorbed = dict(
        flops=2 * T * H * N * C  # q_nope @ W_UK
        + 2 * T * S * H * (C + R) + 2 * T * S * H * C  # scores against the rows, output as a mix of latents
        + 2 * T * H * C * V,  # @ W_UV
        nbytes=latents + C * H * (N + V) * BF16)  # the rows and kv_b_proj, nothing per head
    return dict(decompressed=decompressed, absorbed=absorbed)


def main() -> None:
    print("One token's KV cache, over every layer (from each model's published config):")
    print(table(["model", "what a token stores", "elements a layer", "bytes a token"], cache_rows()))
    for name, c in MLA.items():
        print(f"{name}: one latent row is {c['heads'] * (c['nope'] + c['rope'] + c['v']) / (c['kv_lora'] + c['rope']):.1f}x "
              "fewer elements than the keys and values per head it stands for")
    c, S = MLA["DeepSeek-V2-Lite"], 4096
    print(f"\nOne DeepSeek-V2-Lite layer's attention over a context of {S:,} tokens, bf16:")
    rows = []
    for T in (1, 4096):
        cost = attention_cost(c, T, S)
        for path in ("decompressed", "absorbed"):
            rows.append([f"{T:,}", path, f"{cost[path]['flops'] / 1e9:,.2f}", f"{cost[path]['nbytes'] / 2**20:,.1f}"])
        ratio = cost["decompressed"]["flops"] / cost["absorbed"]["flops"]
        rows.append([f"{T:,}", "decompressed / absorbed", f"{ratio:.2f}x", ""])
    print(table(["query tokens", "path", "GFLOP", "MiB read or written"], rows))


if __name__ == "__main__":
    main()
