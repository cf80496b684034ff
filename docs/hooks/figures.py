"""mkdocs hook: every measured figure of the site comes from the JSON files in docs/data/.

    docs/data/cpu.json, docs/data/h200.json   benchmark results, one file per device (collect_bench.py)
    docs/data/figures.json                    the data of the chapter figures (make_figures.py)
    docs/data/test_suite.json                 the test suite's times (measure_test_suite.py)

Markers a page may use (each is replaced when the site is built):
    <!-- bench-table: cpu standard step01 step02 step03 -->       one device and workload: tokens/s, ratios,
                                                                   time to first token, peak memory; a table
                                                                   naming "hf" also shows "hf-cb" if measured
    <!-- bench-matrix: cpu:standard h200:standard | step03 step04 -->   tokens/s, one column per device:workload
    <!-- bench-source: cpu standard mixed -->                     where a device's numbers come from (commands, date)
    <!-- bench-value: cpu standard step03 tokens_per_s -->        one number inline (tokens_per_s, ttft_s,
                                                                   ttft_ms, peak_mib, roofline, weight_mib,
                                                                   bandwidth_tbs, generated_tokens)
    <!-- bench-ratio: cpu mixed step05 step04 -->                  tokens/s of the first step over the second
    <!-- figure: tokens-per-s -->                                  an SVG plot drawn here with matplotlib
    <!-- figure: roofline-decode -->                               a kernel roofline, from h200.json's "kernels"
                                                                   (docs/data/bench_kernels.py's JSON)
    <!-- fig-table: timeline-continuous -->                        a table traced by make_figures.py
    <!-- fig-value: hash_chain.second_request.hits -->             one value of figures.json inline
    <!-- suite-value: full.minutes -->                             one value of test_suite.json inline
    <!-- suite-table: projection -->                               the suite's time at more steps (a table)
    <!-- bench-calibration: h200 mixed -->                         a run's steps measured alone and in lanes
    <!-- data: h200 kernels.decode[batch=64,context=2048].v2_gpu_frac_copy .0% -->   any value of a docs/data JSON
                                                                   file (cpu, h200, figures, test_suite; host_path:
                                                                   raw/h200_host_path/summary.json), by a dotted
                                                                   path; [k=v,...] picks the list item that matches,
                                                                   [3] by index; then a format spec (.1f, ,.0f, .0%)
    <!-- calc: {h200:kernels.copy.gb_per_s} / 8 as .1f -->          arithmetic (+ - * / ** parentheses) on such values
    <!-- raw: h200_step17_run.txt "GPU busy ([0-9.]+) ms" -->       the first group of a regex in docs/data/raw/FILE
    <!-- raw-block: cpu_step12_run.txt 3-20 -->                    lines of docs/data/raw/FILE as a text code block
                                                                   (a program's output, shown as it printed it)
A workload key may also be a base workload with a suffix ("standard-step10", "mixed-step10-qwen3", "mixed-part4"): the
numbers of one chapter's own run, kept apart so that each table compares numbers of one run. Such an entry may
carry its own "model", "date" and "git_commit" (the caption then names them); the all-steps plot draws the runs of
SUMMARY_RUNS only.
    <!-- bench-runs: h200 -->                                      the runs of one device: name, workload, model,
                                                                   date, steps (their commands stay in the JSON)
A marker that names data which does not exist fails the build, so no page can quote a number that
is not in docs/data/.

Every number a marker prints goes through one formatter, fmt(): a format spec in the marker (data, calc; a raw
marker takes one as `<!-- raw: FILE "pattern" as .1f -->`) wins; without one the unit decides (from the data key,
the raw pattern or the word after the marker): rates such as tokens/s to one decimal, ratios ("x") to two, times
and other figures to 4 significant figures; a raw capture never gains decimals. So a page never shows a float as
the JSON holds it (tests/test_docs.py scans the built pages for one).

One number, one source: each workload entry names its run ("run": "Part 4's run (16 seats)"), and one run per
device, workload and model is the site's own ("canonical": true). Every figure a marker quotes from a run is
written down with the measurement it is of (device, base workload, model, new tokens, seats, code variant, step,
field). Where the site quotes one measurement with two different values, each value that does not come from the
canonical run must say which run it is from (a raw marker joins the ledger with `= STEP FIELD` after its pattern: docs/data/raw/runs.json says which run, device, workload, model, new tokens and seats its file holds): tables and captions always do (they print the run's name); an inline
value must have the run's name in its paragraph. Otherwise the build fails, naming the pages. The ledger of every
quoted figure is written to the built site as quotes.json (tests/test_docs.py reads it). Plots are written into the built site only (site/figures/*.svg), never committed.
"""
from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("LLM_DOCS_DATA", ROOT / "docs" / "data"))  # another folder: to try the pages on other data

DEVICE_LABEL = {"cpu": "CPU", "h200": "H200"}
WORKLOADS = ("standard", "single", "mixed", "shared-prefix", "nano-vllm")
_bench: dict = {}
_fig: dict = {}
_suite: dict = {}
_host_path: dict = {}  # docs/data/raw/h200_host_path/summary.json (collect_host_path.py): the `host_path` data file
NOT_DEVICES = ("figures.json", "test_suite.json")
QUOTES: list[dict] = []  # every figure quoted from a benchmark run, with the page and whether it names its run
_page: dict = {"uri": "", "markdown": ""}  # the page being rendered (for the ledger and the paragraph check)


def _load() -> None:
    _bench.clear()
    for path in sorted(DATA.glob("*.json")):
        if path.name not in NOT_DEVICES:
            _bench[path.stem] = json.loads(path.read_text())
    _fig.clear()
    if (DATA / "figures.json").is_file():
        _fig.update(json.loads((DATA / "figures.json").read_text()))
    _suite.clear()
    if (DATA / "test_suite.json").is_file():
        _suite.update(json.loads((DATA / "test_suite.json").read_text()))
    _host_path.clear()
    if (DATA / "raw" / "h200_host_path" / "summary.json").is_file():
        _host_path.update(json.loads((DATA / "raw" / "h200_host_path" / "summary.json").read_text()))


# ---------------------------------------------------------------- the one number formatter

# Decimals per unit, where a marker gives no format spec: a figure is printed to the precision its measurement
# carries, never as the float the JSON holds. Times and rates keep 3-4 significant figures; counts are whole.
UNIT_WORDS = {"ms": "ms", "s": "s", "us": "us", "µs": "us", "tokens/s": "rate", "tok/s": "rate", "req/s": "rate",
              "GB/s": "rate", "TB/s": "rate", "TFLOP/s": "rate", "MiB": "mib", "GiB": "GiB", "%": "%", "x": "x"}
_NUMBER = re.compile(r"(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?)(.*)", re.S)


def fmt(value, spec: str = "", unit: str = "") -> str:
    """Every number the pages print goes through here. `spec` (a format spec from the marker, e.g. ".1f", ",.0f",
    ".0%") wins. Without one, the unit decides: rates (tokens/s, GB/s) to one decimal, ratios ("x") to two, every
    other figure (ms, s, %, plain numbers) to 4 significant figures, without trailing zeros, and from 1,000 on
    whole; whole numbers with thousands separators. A string (a raw marker's capture, as a program printed it)
    is read as a number first, with a suffix such as "%" or "x" kept, and never gets more decimals than it had;
    text that is no number is returned as it is."""
    if isinstance(value, str):
        m = _NUMBER.fullmatch(value.strip())
        if not m or (m.group(2) and m.group(2).strip() not in ("%", "x", "ms", "s")):
            return value
        number, suffix = m.group(1).replace(",", ""), m.group(2)
        if "e" in number.lower():
            return value  # 1.56e-02: a difference printed in scientific notation stays so
        parsed = float(number) if any(c in number for c in ".eE") else int(number)
        text = fmt(parsed, spec, unit or UNIT_WORDS.get(suffix.strip(), ""))
        given = len(number.partition(".")[2])
        if not spec and isinstance(parsed, float):  # the program's own decimals, unless there are too many
            text = f"{float(text.replace(',', '')):,.{min(given, _decimals(parsed, unit or suffix.strip()))}f}"
        return text + suffix
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if spec:
        return format(value, spec)
    if isinstance(value, int):
        return f"{value:,}"
    text = f"{value:,.{_decimals(value, unit)}f}"
    if UNIT_WORDS.get(unit, unit) not in ("rate", "x") and "." in text:
        text = text.rstrip("0").rstrip(".")  # 12.5 min, not 12.50
    return text


def _decimals(value: float, unit: str) -> int:
    import math

    kind = UNIT_WORDS.get(unit, unit)
    if kind == "rate":
        return 1
    if kind == "x":
        return 2
    if kind == "mib":
        return 0
    if value == 0:
        return 3  # 0.0% as printed stays 0.0%; a float 0.0 prints as 0
    if not math.isfinite(value) or abs(value) >= 1000:
        return 0
    return max(0, 3 - math.floor(math.log10(abs(value))))  # 4 significant figures


def unit_of(key: str = "", after: str = "") -> str:
    """The unit of a figure: the word that follows the marker on the page ("<!-- raw: ... --> ms", "-->x"), else
    its data key or a raw marker's pattern (tokens_per_s, ttft_median_ms, weights_read_ms, gb_per_s, ...)."""
    word = re.match(r"\s*(tokens/s|tok/s|req/s|GB/s|TB/s|TFLOP/s|MiB|GiB|ms|µs|us|s|%)(?![\w/])|(x)(?![\w/])", after)
    if word:
        return "x" if word.group(2) else UNIT_WORDS[word.group(1)]
    key = key.lower()
    if re.search(r"tokens_per_s|gb_per_s|tokens/s|gb/s|_tflops", key):
        return "rate"
    if re.search(r"_ms\b|_ms_|\bms_", key):
        return "ms"
    if re.search(r"_mb\b|_mib\b", key):
        return "mib"
    return ""


def _result(device: str, workload: str, step: str) -> dict | None:
    if device not in _bench:
        raise ValueError(f"bench marker: no docs/data/{device}.json")
    if not any(workload == w or workload.startswith(w + "-") for w in WORKLOADS):
        raise ValueError(f"bench marker: unknown workload {workload!r}; known: {WORKLOADS} (or <workload>-<suffix>)")
    if workload not in WORKLOADS and workload not in _bench[device]["workloads"]:
        raise ValueError(f"bench marker: docs/data/{device}.json has no workload {workload!r}")
    wl = _bench[device]["workloads"].get(workload)
    return None if wl is None else wl["steps"].get(step)  # not measured: shown as such


def _value(r: dict | None, field: str) -> str:
    if r is None:
        return "-"
    if field == "tokens_per_s":
        return fmt(r["tokens_per_s"], unit="rate")
    if field == "ttft_s":
        return fmt(r["ttft_median_ms"] / 1000, ".1f") + " s"
    if field == "ttft_ms":
        return fmt(r["ttft_median_ms"], ",.0f") + " ms"
    if field == "peak_mib":
        return fmt(r["peak_memory_mb"], unit="mib") + " MiB"
    if field == "roofline":
        return fmt(r["roofline_tokens_per_s_batch1"], ",.0f")
    if field == "weight_mib":
        return fmt(r["weight_mb"], unit="mib") + " MiB"
    if field == "bandwidth_tbs":
        return fmt(r["bandwidth_gbs"] / 1000, ".1f") + " TB/s"
    if field == "generated_tokens":
        return fmt(r["generated_tokens"])
    raise ValueError(f"bench-value: unknown field {field!r}")


def base_workload(workload: str) -> str:
    return max((w for w in WORKLOADS if workload == w or workload.startswith(w + "-")), key=len)


def measurement(device: str, workload: str, step: str, field: str) -> tuple:
    """What a quoted figure is a measurement of: the same tuple from two runs is the same thing measured twice."""
    d = _bench[device]
    e = d["workloads"][workload]
    r = e["steps"][step]
    return (device, base_workload(workload), e.get("model", d["model"]), e.get("max_tokens", 128),
            r.get("max_num_seqs"), e.get("variant", ""), step, field)


def run_name(device: str, workload: str) -> str:
    return _bench[device]["workloads"][workload].get("run", f"the run {workload!r}")


# A marker's field -> the key of the result it shows (ttft_s and ttft_ms show one number two ways).
FIELD_KEY = {"tokens_per_s": "tokens_per_s", "ttft": "ttft_median_ms", "ttft_s": "ttft_median_ms",
             "ttft_ms": "ttft_median_ms", "peak_mib": "peak_memory_mb", "roofline": "roofline_tokens_per_s_batch1",
             "weight_mib": "weight_mb", "bandwidth_tbs": "bandwidth_gbs", "generated_tokens": "generated_tokens"}


def _quote(device: str, workload: str, step: str, field: str, text: str, labelled: bool) -> None:
    """Write down one quoted figure: `value` is the number in the data (two formats of it are one value)."""
    r = _result(device, workload, step)
    if r is None:
        return
    key = FIELD_KEY.get(field, field)
    e = _bench[device]["workloads"][workload]
    QUOTES.append({"page": _page["uri"], "measurement": list(measurement(device, workload, step, key)),
                   "run": run_name(device, workload), "workload": workload, "canonical": bool(e.get("canonical")),
                   "value": r.get(key), "shown": text, "labelled": labelled})


def _names_its_run(device: str, workload: str, marker_at: int) -> bool:
    """Is the run's name in the paragraph around the marker (the page's markdown, blank line to blank line)?"""
    md = _page["markdown"]
    start = md.rfind("\n\n", 0, marker_at)
    end = md.find("\n\n", marker_at)
    paragraph = re.sub(r"<!--.*?-->", "", md[start + 1:end if end >= 0 else len(md)], flags=re.S)
    return run_name(device, workload).lower() in " ".join(paragraph.lower().split())


def check_quotes(quotes: list[dict]) -> list[str]:
    """-> one line per measurement quoted with two values where a value from a run other than the site's own does
    not say which run it is from (tables always do; inline values by the run's name in their paragraph)."""
    by: dict = {}
    for q in quotes:
        by.setdefault(tuple(q["measurement"]), []).append(q)
    problems = []
    for m, qs in sorted(by.items(), key=lambda kv: str(kv[0])):
        if len({q["value"] for q in qs}) < 2:
            continue
        canon = {q["value"] for q in qs if q["canonical"]}
        bad = [q for q in qs if not q["labelled"] and not q["canonical"]]
        if len(canon) > 1:
            bad += [q for q in qs if q["canonical"]]
        if bad:
            device, wl, model, max_tokens, seats, variant, step, field = m
            seen = "; ".join(sorted({f"{q.get('shown', q['value'])} on {q['page']} ({q['run']})" for q in qs}))
            problems.append(f"{device} {wl} {model} {step} {field} (seats {seats}, {max_tokens} new tokens"
                            f"{', ' + variant if variant else ''}) is quoted as {seen}: name the run beside "
                            f"{', '.join(sorted({q['page'] for q in bad}))}'s value, or quote the site's run")
    return problems


def _ttft(r: dict) -> str:
    ms = r["ttft_median_ms"]
    return fmt(ms / 1000, ".1f") + " s" if ms >= 1000 else fmt(ms, ".0f") + " ms"


def _html_table(header: list[str], rows: list[list[str]], cls: str = "bench") -> str:
    """A markdown table (so the theme styles it like every other table); `cls` is kept for the reader of the source."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") or " " for c in cells) + " |"
    return "\n".join([line(header), line(["---"] * len(header))] + [line(r) for r in rows])


def bench_table(device: str, workload: str, *steps: str) -> str:
    steps = tuple(_steps_arg(list(steps)))
    # HF's two baselines go together: a table that shows "hf" (generate, one padded batch) also shows "hf-cb" (its
    # continuous batching) where that run measured it, in the row after it, with a column of ratios to it.
    if "hf" in steps and "hf-cb" not in steps and _result(device, workload, "hf-cb") is not None:
        steps = steps[:steps.index("hf") + 1] + ("hf-cb",) + steps[steps.index("hf") + 1:]
    cb = _result(device, workload, "hf-cb") if "hf-cb" in steps else None
    rows, first, prev = [], None, None
    kind = ""
    for step in steps:
        r = _result(device, workload, step)
        if r is None:
            why = _bench[device]["workloads"].get(workload, {}).get("pending", {}).get(step)
            rows.append([step, f"not measured: {why}" if why else "not measured", "", ""] + ([""] if cb else [])
                        + ["", ""])
            continue
        first = first or r
        for field, text in (("tokens_per_s", fmt(r["tokens_per_s"], unit="rate")), ("ttft", _ttft(r)),
                            ("peak_mib", fmt(r["peak_memory_mb"], unit="mib"))):
            _quote(device, workload, step, field, text, labelled=True)
        kind = "RSS" if r["peak_memory_kind"] == "process RSS" else "allocated"
        rows.append([step, fmt(r["tokens_per_s"], unit="rate"), fmt(r["tokens_per_s"] / first["tokens_per_s"], ".2f") + "x",
                     fmt(r["tokens_per_s"] / prev["tokens_per_s"], ".2f") + "x" if prev else "-"]
                    + ([fmt(r["tokens_per_s"] / cb["tokens_per_s"], ".2f") + "x"] if cb else [])
                    + [_ttft(r), fmt(r["peak_memory_mb"], unit="mib")])
        prev = r
    header = (["step", "tokens/s", f"vs {steps[0]}", "vs previous"] + (["vs hf-cb"] if cb else [])
              + ["TTFT median", f"peak MiB ({kind})"])
    nf = _bench[device]["workloads"].get(workload, {}).get("not_finished", {})
    for step in steps:
        if step in nf and _result(device, workload, step) is None:
            rows[steps.index(step)][1] = "not finished: stopped after " + fmt(nf[step], ",.0f") + " s"
    return _html_table(header, rows) + "\n\n" + _caption(device, workload)


def _caption(device: str, *workloads: str) -> str:
    d = _bench[device]
    parts = []
    workloads = [wl for wl in workloads if wl in d["workloads"]]
    for wl in workloads:
        parts.append(f"`{d['workloads'][wl]['command']}`")
    # A chapter's own run may name its own model and date; the file's apply otherwise.
    models = sorted({d["workloads"][wl].get("model", d["model"]) for wl in workloads}) or [d["model"]]
    dates = sorted({d["workloads"][wl].get("date", d["date"]) for wl in workloads}) or [d["date"]]
    runs = "; ".join(dict.fromkeys(
        d["workloads"][wl].get("run", wl) + (" (this site's run for it)" if d["workloads"][wl].get("canonical") else "")
        for wl in workloads))
    lanes = _lanes_text(d, workloads)
    return (f"<small>**{runs}**{lanes}. {d['description']}, model " + ", ".join(f"`{m}`" for m in models)
            + f"; measured {' and '.join(dates)} with "
            + "; ".join(parts) + f" (median of {_repeat_text(d, workloads)}). Data: `docs/data/{device}.json`.</small>")


def _lanes_text(d: dict, workloads) -> str:
    """Which steps of a run shared the machine (docs/data/bench_all_steps.py's lanes), and what that cost."""
    out = []
    for wl in workloads:
        e = d["workloads"][wl]
        laned = [s for s, r in e["steps"].items() if r.get("part") == "lanes"]
        if not laned:
            continue
        calls = sorted({r.get("call", 1) for r in e["steps"].values()})
        out.append(f": {', '.join(laned)} ran in lanes (up to {max(e['steps'][s]['lanes'] for s in laned)} processes "
                   f"sharing the GPU machine), the others alone" + (f", in {len(calls)} jobs" if len(calls) > 1
                                                                     else "") + "; " + _calibration_text(e))
    return "".join(out)


def _calibration_pairs(e: dict) -> list[tuple[int, str, float, float]]:
    """-> (call, step, tokens/s alone, tokens/s in lanes) for each step of a run measured both ways in one call."""
    rows = [dict(r) for r in e.get("calibration", [])] + [dict(r, step=s) for s, r in e["steps"].items()]
    pairs = []
    for r in rows:
        if r.get("part") == "calibration":
            lane = [x for x in rows if x["step"] == r["step"] and x.get("part") == "lanes"
                    and x.get("call") == r.get("call")]
            if lane:
                pairs.append((r.get("call", 1), r["step"], r["tokens_per_s"], lane[0]["tokens_per_s"]))
    return sorted(pairs)


def _calibration_text(e: dict) -> str:
    pairs = _calibration_pairs(e)
    return "in lanes " + ", ".join(f"{step} made {fmt(lane / alone, '.2f')}x its tokens/s alone (job {call})"
                                   for call, step, alone, lane in pairs) if pairs else "not calibrated"


def bench_calibration(device: str, workload: str) -> str:
    e = _bench[device]["workloads"][workload]
    pairs = _calibration_pairs(e)
    if not pairs:
        raise ValueError(f"bench-calibration: docs/data/{device}.json {workload!r} has no step measured alone and in lanes")
    rows = [[str(call), step, fmt(alone, unit="rate"), fmt(lane, unit="rate"), fmt(lane / alone, ".2f") + "x"]
            for call, step, alone, lane in pairs]
    return (_html_table(["job", "step", "tokens/s alone", "tokens/s in lanes", "lanes / alone"], rows)
            + f"\n\n<small>**{run_name(device, workload)}**, `docs/data/{device}.json`.</small>")


def _repeat_text(d: dict, workloads) -> str:
    repeats = sorted({r["repeat"] for wl in workloads for r in d["workloads"][wl]["steps"].values()})
    return " or ".join(str(r) for r in repeats) + (" run" if repeats == [1] else " runs")


def all_steps() -> list[str]:
    """Every step folder, in the order of the chapters (step14 < step14_1 < step14_7 < step15)."""
    names = [p.name for p in (ROOT / "steps").iterdir() if p.is_dir() and re.fullmatch(r"step\d+(_\d+)?", p.name)]
    return sorted(names, key=lambda n: [int(x) for x in re.findall(r"\d+", n)])


def _steps_arg(words: list[str]) -> list[str]:
    """`all` stands for HF's two baselines and every step, so that a new step gets its row by itself."""
    out = []
    for w in words:
        out += ["hf", "hf-cb", *all_steps()] if w == "all" else [w]
    return out


def bench_matrix(spec: str) -> str:
    cols_text, _, steps_text = spec.partition("|")
    cols = [c.split(":") for c in cols_text.split()]
    steps = _steps_arg(steps_text.split())
    def col_name(d, wl):
        e = _bench[d]["workloads"].get(wl, {})
        model = e.get("model", _bench[d]["model"]).replace("random:", "")
        return f"{DEVICE_LABEL.get(d, d)} {base_workload(wl)}, {model}"

    header = ["step"] + [col_name(d, wl) for d, wl in cols]
    rows = [[s] + [_value(_result(d, wl, s), "tokens_per_s") for d, wl in cols] for s in steps]
    for s in steps:
        for d, wl in cols:
            _quote(d, wl, s, "tokens_per_s", _value(_result(d, wl, s), "tokens_per_s"), labelled=True)
    devices = []
    for d, _ in cols:
        if d not in devices:
            devices.append(d)
    captions = [_caption(d, *dict.fromkeys(wl for dd, wl in cols if dd == d)) for d in devices]
    by_why: dict = {}  # one note per reason: "step18, step19, step20: newer than this run"
    for d, wl in cols:
        for step, why in _bench[d]["workloads"].get(wl, {}).get("pending", {}).items():
            if step in steps and step not in by_why.setdefault(why, []):
                by_why[why].append(step)
    pending = [f"{', '.join(sorted(s, key=_step_order))}: {why}" for why, s in sorted(by_why.items())]
    return (_html_table(header, rows) + "\n\n<small>tokens/s; - = not measured"
            + (f" ({'; '.join(pending)})" if pending else "") + ".</small>\n\n"
            + "\n\n".join(captions))


def bench_runs(device: str) -> str:
    d = _bench[device]
    rows = []
    for wl, e in d["workloads"].items():
        steps = [s for s in e["steps"] if not s.startswith("hf")]
        hf = [s for s in e["steps"] if s.startswith("hf")]
        span = (f"{steps[0]}" if len(steps) == 1 else f"{len(steps)} steps, {min(steps, key=_step_order)} to "
                f"{max(steps, key=_step_order)}") if steps else "-"
        rows.append([e.get("run", wl) + (" (the site's run)" if e.get("canonical") else ""), f"`{wl}`",
                     e.get("model", d["model"]).replace("random:", ""), e.get("date", d["date"]),
                     span + (f" + {', '.join(hf)}" if hf else "")])
    return (_html_table(["run", "workload key", "model", "date", "what it measured"], rows)
            + f"\n\n<small>{d['description']}. Each run's exact command, commit and per-step results: "
            f"[`docs/data/{device}.json`](../data/{device}.json).</small>")


def _step_order(name: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", name)]


def bench_source(device: str, *workloads: str) -> str:
    return _caption(device, *(workloads or tuple(_bench[device]["workloads"])))


def bench_ratio(device: str, workload: str, a: str, b: str, labelled: bool = True) -> str:
    ra, rb = _result(device, workload, a), _result(device, workload, b)
    if ra is None or rb is None:
        return "(not measured)"
    for step, r in ((a, ra), (b, rb)):
        _quote(device, workload, step, "tokens_per_s", fmt(r["tokens_per_s"], unit="rate"), labelled)
    return fmt(ra["tokens_per_s"] / rb["tokens_per_s"], ".2f") + "x"


def fig_value(path: str) -> str:
    node = _fig
    for key in path.split("."):
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, float):
        return fmt(node, ".0%") if node <= 1 else fmt(node, ".1f")
    return fmt(node)


def suite_value(path: str) -> str:
    """One value of test_suite.json (a dotted path, list items by index), as written there."""
    node = _suite
    for key in path.split("."):
        node = node[int(key)] if isinstance(node, list) else node[key]
    return fmt(node)


def suite_table(name: str) -> str:
    if name != "projection":
        raise ValueError(f"suite-table: unknown table {name!r} (known: projection)")
    s = _suite
    rows = ["| steps | Parts | `make test` (2 workers) | CI on a fresh clone | |", "|---|---|---|---|---|"]
    for p in s["projection"]:
        kind = "measured" if p["steps"] == s["steps"] else "projected"
        ci = f"{fmt(p['ci_minutes'])} min" if p.get("ci_minutes") else "-"
        rows.append(f"| {fmt(p['steps'])} | {fmt(p['parts'])} | {fmt(p['full_minutes'])} min | {ci} | {kind} |")
    return ("\n".join(rows) + f"\n\n<small>Measured with `{s['command']}` ({s['machine']}, {s['date']}): a new "
            f"step's tests take {fmt(s['new_step_seconds'], unit='s')} s (a new step is a copy of the newest; this is what "
            f"{s['new_step_like']}, the step before the newest, costs), the real-model tests of a Part's last step "
            f"{fmt(s['part_end_extra_seconds'], unit='s')} s more; a projection adds them, shared by the two workers, and CI adds "
            f"its set-up of {fmt(s['ci']['setup_s'], ',.0f')} s.</small>")


def _files() -> dict:
    return {**_bench, "figures": _fig, "test_suite": _suite, "host_path": _host_path}


def data_path(file: str, path: str):
    """A value of docs/data/FILE.json by a dotted path: `a.b[3].c`, `a[k=v,k2=v2].c` (the list item whose keys
    match: numbers compare as numbers, `true`/`false` as booleans)."""
    files = _files()
    if file not in files:
        raise ValueError(f"data marker: no docs/data/{file}.json (known: {sorted(files)})")
    node = files[file]
    for part in re.findall(r"[^.\[\]]+|\[[^\]]*\]", path):
        where = f"docs/data/{file}.json {path!r} at {part!r}"
        if part.startswith("["):
            inner = part[1:-1]
            if not isinstance(node, list):
                raise ValueError(f"data marker: {where}: not a list")
            if inner.lstrip("-").isdigit():
                node = node[int(inner)]
                continue
            want = dict(kv.split("=", 1) for kv in inner.split(","))

            def same(item, k, v):
                x = item.get(k)
                if isinstance(x, bool) or v in ("true", "false"):
                    return str(x).lower() == v
                if isinstance(x, (int, float)):
                    return float(v) == x
                return str(x) == v

            hits = [item for item in node if all(same(item, k, v) for k, v in want.items())]
            if len(hits) != 1:
                raise ValueError(f"data marker: {where}: {len(hits)} items match, not one")
            node = hits[0]
        else:
            if not isinstance(node, dict) or part not in node:
                raise ValueError(f"data marker: {where}: no such key")
            node = node[part]
    return node




def _bench_path_quote(file: str, path: str, text: str, marker_at: int) -> None:
    """A data marker that reads a run's step (`workloads.W.steps.S.field`) is a quote of that run, like bench-value."""
    m = re.fullmatch(r"workloads\.([^.]+)\.steps\.([^.]+)\.([a-z_]+)", path)
    if m and file in _bench:
        wl, step, field = m.groups()
        _quote(file, wl, step, field, text, _names_its_run(file, wl, marker_at))


def data_value(file: str, path: str, spec: str, marker_at: int, after: str = "") -> str:
    text = fmt(data_path(file, path), spec, unit_of(path.rsplit(".", 1)[-1], after))
    _bench_path_quote(file, path, text, marker_at)
    return text


def calc_value(expr: str, marker_at: int, after: str = "") -> str:
    """`{file:path}` values in an arithmetic expression, then ` as SPEC` (a format spec) if given."""
    expr, _, spec = expr.partition(" as ")
    values = []

    def sub(m):
        file, path = m.group(1).split(":", 1)
        values.append(data_path(file, path))
        _bench_path_quote(file, path, _value_text(values[-1]), marker_at)
        return f"_v[{len(values) - 1}]"

    code = re.sub(r"\{([^}]+)\}", sub, expr)
    if not re.fullmatch(r"[\s0-9.+\-*/()_v\[\]]*", code):
        raise ValueError(f"calc marker: only numbers, {{file:path}} values and + - * / ** ( ) are allowed: {expr!r}")
    return fmt(eval(code, {"__builtins__": {}}, {"_v": values}), spec.strip(), unit_of(after=after))  # noqa: S307 (checked above)


def _value_text(v) -> str:
    return fmt(v)


def _raw_runs() -> dict:
    path = DATA / "raw" / "runs.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def raw_quote(file: str, step: str, field: str, captured: str, text: str, marker_at: int) -> None:
    """A raw marker's `= STEP FIELD`: the figure is STEP's FIELD in the run docs/data/raw/runs.json names for FILE;
    it joins the ledger like a bench-value of that run (labelled when the run's name is in its paragraph)."""
    runs = _raw_runs()
    if file not in runs:
        raise ValueError(f"raw marker: '= {step} {field}' on docs/data/raw/{file}, which docs/data/raw/runs.json "
                         f"does not describe (its run, device, workload, model, new tokens, seats)")
    r = runs[file]
    seats = r.get("seats_of", {}).get(step, r.get("seats"))
    number = float(captured.replace(",", "").rstrip("%x"))
    md = _page["markdown"]
    start, end = md.rfind("\n\n", 0, marker_at), md.find("\n\n", marker_at)
    paragraph = " ".join(re.sub(r"<!--.*?-->", "", md[start + 1:end if end >= 0 else len(md)], flags=re.S).lower().split())
    QUOTES.append({"page": _page["uri"], "run": r["run"], "workload": r["workload"], "canonical": False,
                   "measurement": [r["device"], r["workload"], r["model"], r.get("max_tokens", 128), seats,
                                   r.get("variant", ""), step, FIELD_KEY.get(field, field)],
                   "value": number, "shown": text, "labelled": r["run"].lower() in paragraph})


def raw_value(file: str, pattern: str, spec: str = "", after: str = "", quote: str = "", marker_at: int = 0) -> str:
    path = DATA / "raw" / file
    if not path.is_file():
        raise ValueError(f"raw marker: no docs/data/raw/{file}")
    m = re.search(pattern, path.read_text())
    if not m:
        raise ValueError(f"raw marker: {pattern!r} not found in docs/data/raw/{file}")
    captured = m.group(1) if m.groups() else m.group(0)
    text = fmt(captured, spec, unit_of(pattern, after))
    if quote:
        raw_quote(file, *quote.split(), captured, text, marker_at)
    return text


def raw_block(file: str, lines: str = "") -> str:
    path = DATA / "raw" / file
    if not path.is_file():
        raise ValueError(f"raw-block marker: no docs/data/raw/{file}")
    text = path.read_text().rstrip("\n").splitlines()
    if lines:
        first, _, last = lines.partition("-")
        if not (first.isdigit() and last.isdigit()) or not 1 <= int(first) <= int(last) <= len(text):
            raise ValueError(f"raw-block marker: lines {lines!r} of docs/data/raw/{file} ({len(text)} lines)")
        text = text[int(first) - 1:int(last)]
    return "```text\n" + "\n".join(text) + "\n```"


# ---------------------------------------------------------------- traced tables (figures.json)

def _meta(name: str) -> str:
    m = _fig[name]["meta"]
    return f"<small>Traced with `{m['command']}` ({m['device']}, {m['model']}, {m['date']}).</small>"


def _seats(iterations: list[dict], num_seats: int) -> list[list[str]]:
    """Give each request the lowest free seat when it joins; one character per seat and iteration:
    lower case = its prefill, upper case = a decode, '.' = seated but not computed, ' ' = empty."""
    seat_of, grid = {}, [[] for _ in range(num_seats)]
    for it in iterations:
        for name in it["seated"]:
            if name not in seat_of:
                taken = set(seat_of.values())
                seat_of[name] = min(s for s in range(num_seats) if s not in taken)
        for s in range(num_seats):
            who = next((n for n, seat in seat_of.items() if seat == s), None)
            if who is None:
                grid[s].append(" ")
            elif who in it["computed"]:
                grid[s].append(who.lower() if it["kind"] == "prefill" else who)
            else:
                grid[s].append(".")
        for name in it["finished"]:
            seat_of.pop(name, None)
    return grid


def timeline_grid() -> str:
    t = _fig["timeline"]
    by_len: dict[int, list[str]] = {}
    for name, n in t["requests"].items():
        by_len.setdefault(n, []).append(name)
    lines = [f"{len(t['requests'])} requests, {t['seats']} seats: " + "; ".join(
                 (names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}") + (f" wants {n} tokens" if len(names) == 1 else f" want {n} tokens each")
                 for n, names in by_len.items()), "one column = one iteration; a = A's prefill, A = a decode of A, "
             "'.' = seated but idle", ""]
    for policy, label in (("static", "static groups (step04's policy)"), ("continuous", "continuous batching (step05)")):
        its = t[policy]
        lines.append(f"{label}: {len(its)} iterations")
        for s, row in enumerate(_seats(its, t["seats"])):
            lines.append(f"  seat {s}  " + "".join(row).rstrip())
        lines.append("")
    return "```text\n" + "\n".join(lines).rstrip() + "\n```\n\n" + _meta("timeline")


def timeline_table(policy: str) -> str:
    rows = []
    for i, it in enumerate(_fig["timeline"][policy], 1):
        rows.append([str(i), it["kind"], " ".join(it["computed"]), " ".join(it["finished"]) or "-",
                     " ".join(n for n in it["seated"] if n not in it["finished"]) or "-"])
    return (_html_table(["iteration", "kind", "computed (rows of the forward)", "finished", "running after"],
                        rows, "trace") + "\n\n" + _meta("timeline"))


def slot_table() -> str:
    s = _fig["slot_mapping"]
    bs = s["block_size"]
    head = (f"Blocks of {bs}; prompts A {s['prompts']['A']}, B {s['prompts']['B']}, C {s['prompts']['C']} tokens, "
            f"{s['max_tokens']} new tokens each. Block tables as last seen while running: "
            + ", ".join(f"{k} = `{v}`" for k, v in sorted(s["tables"].items())) + ".\n\n")
    rows = [[str(r["pos"]), f"{r['pos']} // {bs} = {r['logical']}", str(r["physical"]), f"{r['pos']} % {bs} = {r['offset']}",
             f"`{r['physical']} * {bs} + {r['offset']}` = {r['slot']}"] for r in s["rows"]]
    return head + _html_table(["position of A", "logical block", "block_table[logical]", "offset", "slot in the pool"],
                              rows, "trace") + "\n\n" + _meta("slot_mapping")


def hash_table() -> str:
    h = _fig["hash_chain"]
    rows = []
    for r in h["rows"]:
        toks = r["tokens"]
        rows.append([str(r["block"]), f"{r['block'] * h['block_size']}-{(r['block'] + 1) * h['block_size'] - 1}",
                     f"({', '.join(map(str, toks[:3]))}, ..., {toks[-1]})", "-" if r["parent"] is None else str(r["parent"]),
                     str(r["hash"])])
    return (_html_table(["block", "positions", "token ids", "parent hash", "hash = block_hash(parent, token ids)"],
                        rows, "trace") + "\n\n" + _meta("hash_chain"))


def fig_table(name: str) -> str:
    tables = {"timeline-grid": timeline_grid, "timeline-static": lambda: timeline_table("static"),
              "timeline-continuous": lambda: timeline_table("continuous"), "slot-mapping": slot_table,
              "hash-chain": hash_table, "utilisation": utilisation_table, "ms-per-token": ms_table, "batch-size": batch_table}
    if name not in tables:
        raise ValueError(f"fig-table: unknown {name!r}; known: {sorted(tables)}")
    return tables[name]()


def ms_table() -> str:
    m = _fig["ms_per_token"]
    marks = [n for n in (2, 8, 16, 32, 64, 128, 160, 256) if n <= len(m["step01"])]
    rows = [[str(n), str(m["prompt_tokens"] + n - 1)] + [fmt(m[s][n - 1], ".1f") for s in ("step01", "step02", "step03")]
            for n in marks]
    return (_html_table(["token #", "sequence length", "step01 ms", "step02 ms", "step03 ms"], rows)
            + "\n\n" + _meta("ms_per_token"))


def utilisation_table() -> str:
    u = _fig["utilisation"]
    rows = [[r["policy"], fmt(r["utilisation"], ".0%")] for r in u["rows"]]
    return _html_table(["KV memory", "utilisation (tokens stored / slots reserved)"], rows) + "\n\n" + _meta("utilisation")


def batch_table() -> str:
    b = _fig["batch_size"]
    rows = [[fmt(r["batch"]), fmt(r["tokens"]), fmt(r["seconds"], ".2f"), fmt(r["tokens_per_s"], unit="rate")]
            for r in b["rows"]]
    return _html_table(["batch", "tokens", "seconds", "tokens/s"], rows) + "\n\n" + _meta("batch_size")


# ---------------------------------------------------------------- plots (matplotlib, SVG)

def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _setup():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "llm-steps", "svg.fonttype": "path", "font.size": 10,
                         "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
                         "grid.alpha": 0.3})
    return plt


SUMMARY_RUNS = (("cpu", "standard"), ("h200", "mixed"), ("h200", "mixed-qwen3"))  # the site's all-steps runs


def plot_tokens_per_s() -> str:
    """Every step on the x axis (a step not measured yet leaves a gap), one line per all-steps run, and HF's two
    baselines of the same run as horizontal lines beside it. Hollow points: measured in lanes (bench_all_steps.py)."""
    plt = _setup()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    steps = all_steps()
    colors = {("cpu", "standard"): "tab:blue", ("h200", "mixed"): "tab:green", ("h200", "mixed-qwen3"): "tab:purple"}
    for device, wl in SUMMARY_RUNS:
        e = _bench.get(device, {}).get("workloads", {}).get(wl)
        if e is None:
            continue
        color = colors[(device, wl)]
        model = e.get("model", _bench[device]["model"]).replace("random:", "")
        label = f"{DEVICE_LABEL.get(device, device)}, {base_workload(wl)} workload, {model}"
        xs = [i for i, s in enumerate(steps) if s in e["steps"]]
        ys = [e["steps"][steps[i]]["tokens_per_s"] for i in xs]
        ax.plot(xs, ys, "-", color=color, lw=1.2, label=label)
        laned = [(x, y) for x, y in zip(xs, ys) if e["steps"][steps[x]].get("part") == "lanes"]
        alone = [(x, y) for x, y in zip(xs, ys) if e["steps"][steps[x]].get("part") != "lanes"]
        if alone:
            ax.plot(*zip(*alone), "o", color=color, ms=5)
        if laned:
            ax.plot(*zip(*laned), "o", color=color, ms=5, markerfacecolor="white")
        for hf, ls in (("hf", "--"), ("hf-cb", ":")):
            if hf in e["steps"]:
                y = e["steps"][hf]["tokens_per_s"]
                ax.axhline(y, color=color, ls=ls, lw=1, alpha=0.8)
    for ls, text in (("--", "HF generate (padded), same run: dashed, the run's colour"),
                     (":", "HF continuous batching, same run: dotted")):
        ax.plot([], [], ls=ls, color="gray", lw=1, label=text)
    ax.set_yscale("log")
    ax.set_xticks(range(len(steps)), [s.replace("step", "") for s in steps], fontsize=8, rotation=60)
    ax.set_xlim(-0.5, len(steps) - 0.5)
    ax.set_xlabel("step (filled: measured alone; hollow: in lanes, sharing the GPU machine)")
    ax.set_ylabel("tokens/s (log scale)")
    ax.legend(fontsize=8, ncol=2, frameon=False, loc="upper center", bbox_to_anchor=(0.45, -0.22))
    return _svg(fig)


def plot_ms_per_token() -> str:
    plt = _setup()
    m = _fig["ms_per_token"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for step in ("step01", "step02", "step03"):
        ms = m[step]
        ax.plot([m["prompt_tokens"] + n for n in range(1, len(ms))], ms[1:], label=step)
    ax.set_xlabel("sequence length when the token is produced (prompt + tokens so far)")
    ax.set_ylabel("ms per token")
    ax.set_ylim(bottom=0)
    ax.legend(frameon=False)
    return _svg(fig)


def plot_batch_size() -> str:
    plt = _setup()
    b = _fig["batch_size"]
    fig, ax = plt.subplots(figsize=(7, 3.3))
    xs = [r["batch"] for r in b["rows"]]
    ax.plot(xs, [r["tokens_per_s"] for r in b["rows"]], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("requests in the batch")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    return _svg(fig)


def plot_timeline() -> str:
    plt = _setup()
    t = _fig["timeline"]
    n = max(len(t["static"]), len(t["continuous"]))
    fig, axes = plt.subplots(2, 1, figsize=(8, 3.6), sharex=True)
    names = list(t["requests"])
    cmap = plt.get_cmap("tab20")
    for ax, policy, label in ((axes[0], "static", "static groups (step04's policy)"),
                              (axes[1], "continuous", "continuous batching (step05)")):
        grid = _seats(t[policy], t["seats"])
        for s, row in enumerate(grid):
            for x, c in enumerate(row):
                if c.strip() and c != ".":
                    ax.barh(s, 1, left=x, color=cmap(names.index(c.upper()) % 20), edgecolor="white",
                            hatch="//" if c.islower() else None)
                    ax.text(x + 0.5, s, c.upper(), ha="center", va="center", fontsize=7)
                elif c == ".":
                    ax.barh(s, 1, left=x, color="#eeeeee", edgecolor="white")
        ax.set_yticks(range(t["seats"]), [f"seat {s}" for s in range(t["seats"])])
        ax.invert_yaxis()
        ax.set_title(f"{label}: {len(t[policy])} iterations", fontsize=9, loc="left")
        ax.grid(False)
        ax.set_xlim(0, n)
    axes[1].set_xlabel("iteration (hatched: prefill; grey: seated, idle)")
    return _svg(fig)


def plot_utilisation() -> str:
    plt = _setup()
    u = _fig["utilisation"]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    labels = [r["policy"] for r in u["rows"]]
    vals = [100 * r["utilisation"] for r in u["rows"]]
    ax.barh(range(len(vals)), vals, color=["tab:gray"] * 2 + ["tab:blue"] * (len(vals) - 2))
    for i, v in enumerate(vals):
        ax.text(v + 1, i, f"{v:.0f}%", va="center", fontsize=8)
    ax.set_yticks(range(len(vals)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, 110)
    ax.set_xlabel("KV slots holding a token, % (summed over all iterations)")
    return _svg(fig)


# ---------------------------------------------------------------- kernel rooflines (h200.json's "kernels")
# The JSON that docs/data/bench_kernels.py writes on the H200, pasted into docs/data/h200.json under "kernels".

KERNELS_DEVICE = "h200"
H200_BF16_DENSE_TFLOPS = 989  # NVIDIA's H200 datasheet: dense BF16 tensor-core peak (1,979 is with 2:4 sparsity)
ROOFLINE_NEEDS = {"roofline-prefill": ("prefill",), "roofline-decode": ("copy", "decode"),
                  "roofline-flash-decoding": ("copy", "flash_decoding")}


def _kernels(figure_name: str) -> dict:
    """h200.json's "kernels" entry, with the sections the figure draws; a clear error if any is missing."""
    where = f"figure {figure_name}: docs/data/{KERNELS_DEVICE}.json"
    if KERNELS_DEVICE not in _bench:
        raise ValueError(f"figure {figure_name}: no docs/data/{KERNELS_DEVICE}.json")
    k = _bench[KERNELS_DEVICE].get("kernels")
    if not k:
        raise ValueError(f"{where} has no \"kernels\" entry: run `python3 docs/data/bench_kernels.py --out "
                         f"kernels_h200.json` on the H200 and paste its JSON there under \"kernels\"")
    if k.get("smoke"):
        raise ValueError(f"{where}: \"kernels\" is a --smoke run (tiny sizes, Triton's interpreter), not a measurement")
    for section in ROOFLINE_NEEDS[figure_name]:
        if not k.get(section):
            why = (k.get("skipped") or {}).get({"flash_decoding": "flash"}.get(section, section), "")
            raise ValueError(f"{where}: \"kernels\" has no {section!r} rows" + (f" ({why})" if why else ""))
    return k


def _series(rows: list[dict], name: str, unit: str) -> tuple[list[float], bool]:
    """name's values per row: the kernels-only time's ("v2_gpu_gb_per_s") where the rows have it, else do_bench's
    ("v2_gb_per_s"), which counts the time the GPU waits for the CPU's launches too. -> (values, kernels_only)."""
    gpu = f"{name}_gpu_{unit}"
    if all(gpu in r for r in rows):
        return [r[gpu] for r in rows], True
    return [r[f"{name}_{unit}"] for r in rows], False


def _timing_note(kernels_only: bool) -> str:
    return ("kernel time only (CUDA profiler)" if kernels_only
            else "time per call (do_bench median)")


def _kernels_title(ax, k: dict, what: str) -> None:
    shapes = k.get("shapes", {})
    ax.set_title(f"{k['device']}, {k['dtype']}, {shapes.get('heads')} query / {shapes.get('kv_heads')} KV heads, "
                 f"head_dim {shapes.get('head_dim')}, {what}; measured {k['date']}", fontsize=8, loc="left")


def _log2_x(ax, xs, label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel(label)


def _copy_line(ax, k: dict) -> float:
    copy = k["copy"]["gb_per_s"]
    ax.axhline(copy, color="black", ls="--", lw=1)
    ax.text(0.01, copy, f" measured copy bandwidth, {copy / 1000:.2f} TB/s (read + write of 1 GiB)",
            transform=ax.get_yaxis_transform(), va="bottom", fontsize=8)
    return copy


def plot_roofline_prefill() -> str:
    plt = _setup()
    k = _kernels("roofline-prefill")
    rows = k["prefill"]
    block = min(r["block_size"] for r in rows)
    main = [r for r in rows if r["block_size"] == block]
    xs = [r["seq_len"] for r in main]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    sdpa = "torch SDPA" + (" (cuDNN flash attention)" if any("cudnn" in n for n in k.get("sdpa_kernels", []))
                           else " (FlashAttention)" if any("flash" in n for n in k.get("sdpa_kernels", [])) else "")
    ys, kernels_only = _series(main, "sdpa", "tflops")
    ax.plot(xs, ys, marker="o", color="tab:gray", label=sdpa)
    ax.plot(xs, _series(main, "kernel", "tflops")[0], marker="o", color="tab:blue",
            label=f"step15 paged_attention (blocks of {block})")
    other = [r for r in rows if r["block_size"] != block]
    if other:
        ax.plot([r["seq_len"] for r in other], _series(other, "kernel", "tflops")[0], "s", color="tab:orange",
                label="step15, blocks of " + "/".join(sorted({str(r["block_size"]) for r in other})))
    ax.axhline(H200_BF16_DENSE_TFLOPS, color="black", ls="--", lw=1)
    ax.text(0.01, H200_BF16_DENSE_TFLOPS, f" H200 dense bf16 peak, {H200_BF16_DENSE_TFLOPS} TFLOP/s (datasheet)",
            transform=ax.get_yaxis_transform(), va="bottom", fontsize=8)
    _log2_x(ax, xs, "sequence length S (one sequence, S new tokens, causal)")
    ax.set_ylabel(f"TFLOP/s ({'kernel time' if kernels_only else 'do_bench'})")
    ax.set_ylim(0, H200_BF16_DENSE_TFLOPS * 1.12)
    _kernels_title(ax, k, f"batch 1; {_timing_note(kernels_only)}")
    ax.legend(frameon=False, fontsize=8, loc="center right")
    return _svg(fig)


def plot_roofline_decode() -> str:
    plt = _setup()
    k = _kernels("roofline-decode")
    batch = max(r["batch"] for r in k["decode"])
    rows = sorted((r for r in k["decode"] if r["batch"] == batch), key=lambda r: r["context"])
    xs = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    copy = _copy_line(ax, k)
    for name, color, label in (("v1", "tab:red", "v1: a program per query head, scores through memory"),
                               ("v2", "tab:blue", "v2: a program per KV head, online softmax")):
        ys, kernels_only = _series(rows, name, "gb_per_s")
        ax.plot(xs, ys, marker="o", color=color, label=label)
    _log2_x(ax, xs, f"context length (tokens per sequence, batch {batch})")
    ax.set_ylabel("GB/s (K and V read once + q + out)")
    ax.set_ylim(0, copy * 1.15)
    _kernels_title(ax, k, f"batch {batch}; {_timing_note(kernels_only)}")
    ax.legend(frameon=False, fontsize=8, loc="center right")
    return _svg(fig)


def plot_roofline_flash_decoding() -> str:
    plt = _setup()
    k = _kernels("roofline-flash-decoding")
    rows = sorted(k["flash_decoding"], key=lambda r: r["context"])
    xs = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    copy = _copy_line(ax, k)
    ax.plot(xs, _series(rows, "v2", "gb_per_s")[0], marker="o", color="tab:blue", label="v2 (one program per KV head)")
    flash, kernels_only = _series(rows, "flash", "gb_per_s")
    ax.plot(xs, flash, marker="o", color="tab:green", label="flash decoding (labels: choose_num_splits' split count)")
    for x, y, r in zip(xs, flash, rows):
        ax.annotate(f"{r['num_splits']}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center",
                    fontsize=7, color="tab:green")
    if kernels_only:  # per call, the CPU's launches included: at batch 1 they can take longer than the kernels
        ax.plot(xs, [r["flash_gb_per_s"] for r in rows], ls=":", marker=".", color="tab:green",
                label="flash decoding, time per call with its launches (do_bench)")
    _log2_x(ax, xs, "context length (tokens, batch 1)")
    ax.set_ylabel("GB/s (K and V read once + q + out)")
    ax.set_ylim(0, copy * 1.15)
    _kernels_title(ax, k, f"batch 1; {_timing_note(kernels_only)}")
    ax.legend(frameon=False, fontsize=8, loc="center left", bbox_to_anchor=(0, 0.6))
    return _svg(fig)


def plot_roofline_intensity() -> str:
    """The roofline proper: TFLOP/s against arithmetic intensity (FLOP per byte), both log, under the two roofs
    (measured copy bandwidth x intensity; the datasheet's dense bf16 peak). Prefill: FLOPs from the rows, bytes
    = q, k, v read and o written once (2 bytes each). Decode: bytes from the rows, FLOPs = 4 x batch x heads x
    context x head_dim (q.k and p.v, a multiply and an add each). The kernels' own (gpu) times where the rows
    have them."""
    import math

    plt = _setup()
    k = _kernels("roofline-decode")
    _kernels("roofline-prefill")
    shapes = k.get("shapes", {})
    copy = k["copy"]["gb_per_s"]  # GB/s: x FLOP/byte -> GFLOP/s
    ridge = H200_BF16_DENSE_TFLOPS * 1000 / copy

    def per_s(flops: float, row: dict, name: str) -> tuple[float, bool]:
        gpu = row.get(f"{name}_gpu_ms")
        return flops / ((gpu if gpu else row[f"{name}_ms"]) * 1e-3) / 1e12, bool(gpu)

    fig, ax = plt.subplots(figsize=(8, 4.6))
    xs, ys = (0.5, 10000.0), (0.3, H200_BF16_DENSE_TFLOPS * 3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(*xs)
    ax.set_ylim(*ys)
    grid = [xs[0] * (xs[1] / xs[0]) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(copy * x / 1000, H200_BF16_DENSE_TFLOPS) for x in grid], color="black", lw=1.5)
    (x0, y0), (x1, y1) = ax.transData.transform([(3, copy * 3 / 1000), (30, copy * 30 / 1000)])
    ax.text(1.5, copy * 1.5 / 1000 * 1.3, f"memory roof: intensity x copy bandwidth ({copy / 1000:.2f} TB/s, measured)",
            rotation=math.degrees(math.atan2(y1 - y0, x1 - x0)), rotation_mode="anchor", fontsize=8)
    ax.text(ridge * 1.2, H200_BF16_DENSE_TFLOPS * 1.12,
            f"compute roof: dense bf16 peak, {H200_BF16_DENSE_TFLOPS} TFLOP/s (datasheet)", fontsize=8, va="bottom")
    ax.plot([ridge], [H200_BF16_DENSE_TFLOPS], "D", color="black", ms=6)
    ax.annotate(f"ridge point: {ridge:.0f} FLOP/byte", (ridge, H200_BF16_DENSE_TFLOPS), textcoords="offset points",
                xytext=(6, -6), ha="left", va="top", fontsize=8)
    ax.axvline(ridge, color="black", ls=":", lw=0.8, alpha=0.6)
    kernels_only = True

    block = min(r["block_size"] for r in k["prefill"])
    main = sorted((r for r in k["prefill"] if r["block_size"] == block), key=lambda r: r["seq_len"])
    for name, color, label in (("sdpa", "tab:gray", "prefill: torch SDPA"),
                               ("kernel", "tab:blue", f"prefill: step15 paged_attention (blocks of {block})")):
        pts = []
        for r in main:
            q_o = 2 * r["seq_len"] * r["heads"] * r["head_dim"] * 2  # q read, o written
            k_v = 2 * r["seq_len"] * r["kv_heads"] * r["head_dim"] * 2  # k and v read
            y, gpu = per_s(r["flops"], r, name)
            kernels_only &= gpu
            pts.append((r["flops"] / (q_o + k_v), y, r["seq_len"]))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, ms=5, lw=1, label=label)
        if name == "kernel":
            for x, y, s in pts:
                ax.annotate(f"S={s // 1024}K" if s >= 1024 else f"S={s}", (x, y), textcoords="offset points",
                            xytext=(0, -12), ha="center", fontsize=7, color=color)

    batch = max(r["batch"] for r in k["decode"])
    rows = sorted((r for r in k["decode"] if r["batch"] == batch), key=lambda r: r["context"])
    series = [(rows, batch, "v1", "tab:red", "s", f"decode: step16 v1, batch {batch}"),
              (rows, batch, "v2", "tab:blue", "^", f"decode: step16 v2, batch {batch}")]
    if k.get("flash_decoding"):
        fd = sorted(k["flash_decoding"], key=lambda r: r["context"])
        series.append((fd, 1, "flash", "tab:green", "v", "decode: step17 flash decoding, batch 1"))
    for rs, b, name, color, marker, label in series:
        pts = []
        for r in rs:
            flops = 4 * b * r.get("heads", shapes.get("heads")) * r["context"] * r.get("head_dim", shapes.get("head_dim"))
            y, gpu = per_s(flops, r, name)
            kernels_only &= gpu
            pts.append((flops / r["bytes"], y, r["context"]))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, color=color, ms=5, label=label,
                markerfacecolor="none" if name == "flash" else color)
        for x, y, c in (pts[0], pts[-1]) if name != "v1" else ():  # v1 is flat: its two ends would overlap
            ax.annotate(f"{c // 1024}K" if c >= 1024 else str(c), (x, y), textcoords="offset points",
                        xytext=(7, 0) if name == "v2" else (-7, 0), ha="left" if name == "v2" else "right",
                        va="center", fontsize=7, color=color)
    ax.set_xlabel("arithmetic intensity (FLOP per byte of HBM traffic, log scale)")
    ax.set_ylabel("TFLOP/s (log scale)")
    _kernels_title(ax, k, _timing_note(kernels_only))
    ax.legend(frameon=False, fontsize=8, loc="lower right", title="labels: prompt tokens S; decode context",
              title_fontsize=7)
    return _svg(fig)


PLOTS = {"tokens-per-s": (plot_tokens_per_s, "tokens/s of every step and of HF transformers, CPU and H200 (log scale)"),
         "ms-per-token": (plot_ms_per_token, "ms per token against sequence length, steps 01-03"),
         "batch-size": (plot_batch_size, "step04: tokens/s against batch size"),
         "timeline": (plot_timeline, "static groups against continuous batching, seat by seat"),
         "utilisation": (plot_utilisation, "step08: KV memory utilisation per policy"),
         "roofline-prefill": (plot_roofline_prefill, "prefill attention on the H200: TFLOP/s of torch SDPA and "
                              "step15's kernel against sequence length, under the dense bf16 peak"),
         "roofline-decode": (plot_roofline_decode, "decode attention on the H200 at batch 64: GB/s of v1 and v2 "
                             "against context length, under the measured copy bandwidth"),
         "roofline-flash-decoding": (plot_roofline_flash_decoding, "decode attention on the H200 at batch 1: GB/s "
                                     "of v2 and flash decoding against context length, under the copy bandwidth"),
         "roofline-intensity": (plot_roofline_intensity, "the H200 roofline: TFLOP/s against arithmetic intensity "
                                "(log-log) of prefill (step15's kernel, torch SDPA) and decode (step16's v1 and v2 at "
                                "batch 64, step17's flash decoding at batch 1), under the memory roof (measured copy "
                                "bandwidth x intensity) and the dense bf16 compute roof, the ridge marked")}
_used: set[str] = set()


def figure(name: str, page) -> str:
    if name not in PLOTS:
        raise ValueError(f"figure: unknown {name!r}; known: {sorted(PLOTS)}")
    if name in ROOFLINE_NEEDS:
        _kernels(name)  # missing data fails the build here, on the page that asks for it
    _used.add(name)
    depth = page.file.src_uri.count("/") + (0 if page.file.name == "index" else 1)
    src = "../" * depth + f"figures/{name}.svg"
    return f'<img class="figure" src="{src}" alt="{PLOTS[name][1]}">'


# ---------------------------------------------------------------- mkdocs events

MARKERS = [
    (re.compile(r"<!--\s*bench-table:\s*(.+?)\s*-->"), lambda m, p: bench_table(*m.group(1).split())),
    (re.compile(r"<!--\s*bench-matrix:\s*(.+?)\s*-->"), lambda m, p: bench_matrix(m.group(1))),
    (re.compile(r"<!--\s*bench-source:\s*(.+?)\s*-->"), lambda m, p: bench_source(*m.group(1).split())),
    (re.compile(r"<!--\s*bench-value:\s*(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*-->"), lambda m, p: bench_value(m)),
    (re.compile(r"<!--\s*bench-ratio:\s*(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*-->"),
     lambda m, p: bench_ratio(*m.groups(), labelled=_names_its_run(m.group(1), m.group(2), m.start()))),
    (re.compile(r"<!--\s*bench-runs:\s*(\S+)\s*-->"), lambda m, p: bench_runs(m.group(1))),
    (re.compile(r"<!--\s*bench-calibration:\s*(\S+)\s+(\S+)\s*-->"), lambda m, p: bench_calibration(*m.groups())),
    (re.compile(r"<!--\s*data:\s*(\S+)\s+(\S+)(?:\s+(\S+))?\s*-->"),
     lambda m, p: data_value(m.group(1), m.group(2), m.group(3) or "", m.start(), _after(m))),
    (re.compile(r"<!--\s*calc:\s*(.+?)\s*-->"), lambda m, p: calc_value(m.group(1), m.start(), _after(m))),
    (re.compile(r"<!--\s*raw:\s*(\S+)\s+\"(.+?)\"(?:\s+as\s+(\S+))?(?:\s+=\s+(\S+\s+\S+))?\s*-->"),
     lambda m, p: raw_value(m.group(1), m.group(2), m.group(3) or "", _after(m), m.group(4) or "", m.start())),
    (re.compile(r"<!--\s*raw-block:\s*(\S+)(?:\s+(\d+-\d+))?\s*-->"), lambda m, p: raw_block(m.group(1), m.group(2) or "")),
    (re.compile(r"<!--\s*figure:\s*(\S+)\s*-->"), lambda m, p: figure(m.group(1), p)),
    (re.compile(r"<!--\s*fig-table:\s*(\S+)\s*-->"), lambda m, p: fig_table(m.group(1))),
    (re.compile(r"<!--\s*fig-value:\s*(\S+)\s*-->"), lambda m, p: fig_value(m.group(1))),
    (re.compile(r"<!--\s*suite-value:\s*(\S+)\s*-->"), lambda m, p: suite_value(m.group(1))),
    (re.compile(r"<!--\s*suite-table:\s*(\S+)\s*-->"), lambda m, p: suite_table(m.group(1))),
]


def _after(m) -> str:
    """The page's text right after a marker (its unit, where the marker's data key does not say it)."""
    return m.string[m.end():m.end() + 12]


def bench_value(m) -> str:
    device, workload, step, field = m.groups()
    text = _value(_result(device, workload, step), field)
    _quote(device, workload, step, field, text, _names_its_run(device, workload, m.start()))
    return text


def on_config(config, **kwargs):
    _load()
    QUOTES.clear()
    return config


def render_markdown(markdown: str, page) -> str:
    """Replace every marker of one page's markdown (each pattern sees the page as the earlier ones left it)."""
    for pattern, render in MARKERS:
        _page.update(uri=page.file.src_uri, markdown=markdown)
        markdown = pattern.sub(lambda m: render(m, page), markdown)
    return markdown


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    return render_markdown(markdown, page)


def on_post_build(config, **kwargs) -> None:
    Path(config["site_dir"]).mkdir(parents=True, exist_ok=True)
    (Path(config["site_dir"]) / "quotes.json").write_text(json.dumps(QUOTES, indent=1) + "\n")
    problems = check_quotes(QUOTES)
    if problems:
        raise ValueError("figures: one measurement quoted with two values:\n  " + "\n  ".join(problems))
    out = Path(config["site_dir"]) / "figures"
    out.mkdir(parents=True, exist_ok=True)
    for name in sorted(_used):
        (out / f"{name}.svg").write_text(PLOTS[name][0]())
