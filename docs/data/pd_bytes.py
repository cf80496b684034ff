"""The step35 chapter's table: what prefill/decode disaggregation moves per prompt token, from the published configs of
three models (their config.json fields, written out below), no model loaded, and how long a prompt of 4,096 tokens
takes to cross NVLink and PCIe at their datasheet bandwidths (H100 SXM: NVLink 4, 450 GB/s each way; PCIe 5.0 x16,
64 GB/s each way). bf16 cache.

    python docs/data/pd_bytes.py > docs/data/raw/cpu_pd_bytes.txt
"""

MODELS = {  # what one token's cache holds per layer (elements), and the layers
    "Qwen3-0.6B": dict(layers=28, per_layer=2 * 8 * 128),  # K and V of 8 KV heads of 128
    "Qwen3-30B-A3B": dict(layers=48, per_layer=2 * 4 * 128),  # K and V of 4 KV heads of 128
    "DeepSeek-V2-Lite": dict(layers=27, per_layer=512 + 64),  # one latent row: kv_lora_rank + rope
}
LINKS = {"NVLink 4 (H100 SXM)": 450e9, "PCIe 5.0 x16": 64e9}
BF16, PROMPT = 2, 4096


def main() -> None:
    header = ["model", "bytes a prompt token", f"a {PROMPT:,}-token prompt"] + [f"over {name}" for name in LINKS]
    rows = []
    for name, m in MODELS.items():
        per_token = m["layers"] * m["per_layer"] * BF16
        total = per_token * PROMPT
        rows.append([name, f"{per_token:,}", f"{total / 2**20:.1f} MiB"] +
                    [f"{1000 * total / bw:.2f} ms" for bw in LINKS.values()])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))  # noqa: E731
    print("The KV cache a prompt sends from the prefill engine to the decode engine, in bf16 (published configs):")
    print("\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]))
    for name, m in MODELS.items():
        total = m["layers"] * m["per_layer"] * BF16 * PROMPT
        print(f"{name}: {PROMPT:,} prompt tokens cross PCIe 5.0 in {1000 * total / LINKS['PCIe 5.0 x16']:.1f} ms")


if __name__ == "__main__":
    main()
