"""The step34 chapter's table of bytes a token sends, computed from the published configs of two models (their
config.json fields, written out below), no model loaded: pipeline parallelism sends a token's residual stream once
across each stage boundary (hidden_size values), where tensor parallelism all-reduces it twice a layer (after
attention's o_proj and after the MLP's down_proj) and once for the embedding. A ring all-reduce over N ranks sends
2 (N - 1) / N times the tensor from each rank. bf16 (2 bytes a value).

    python docs/data/pp_bytes.py > docs/data/raw/cpu_pp_bytes.txt
"""

MODELS = {  # hidden_size, num_hidden_layers
    "Qwen3-0.6B": dict(hidden=1024, layers=28),
    "DeepSeek-V2-Lite": dict(hidden=2048, layers=27),
}
BF16 = 2


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(v).rjust(w) if i >= 2 else str(v).ljust(w) for i, (v, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def main() -> None:
    rows = []
    for name, m in MODELS.items():
        stream = m["hidden"] * BF16  # one token's residual stream
        for n in (2, 4):
            pp = stream  # a stage sends the stream once, to the next (the last sends a token id back)
            all_reduces = 2 * m["layers"] + 1
            tp = all_reduces * stream * 2 * (n - 1) / n  # each rank's share of the ring
            rows.append([name, str(n), f"{pp:,}", f"{all_reduces}", f"{tp:,.0f}", f"{tp / pp:.0f}x"])
    print("Bytes one GPU sends for one token in bf16, per forward (from each model's published config):")
    print(table(["model", "GPUs", "pp: bytes a stage sends", "tp: all-reduces", "tp: bytes a rank sends",
                 "tp / pp"], rows))
    for name, m in MODELS.items():
        stream = m["hidden"] * BF16
        print(f"{name}: a stage boundary carries {stream:,} bytes a token; tensor parallelism over 2 GPUs sends "
              f"{2 * m['layers'] + 1}x that from each rank")


if __name__ == "__main__":
    main()
