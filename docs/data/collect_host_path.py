"""docs/data/raw/h200_host_path/*.jsonl (docs/data/bench_host_path.py's lines, HF's BENCH_JSON line) -> one summary,
docs/data/raw/h200_host_path/summary.json: per call, the medians by (workload, step), batch 1 by step and
temperature, the phases and the GPU's busy share by step, and HF's run. "latest" is the newest call (the figures
the chapters quote); the earlier calls ran earlier trees, named in "trees". A call's mixed_STEP_X.txt files
(python -m shared.bench --workload mixed, their BENCH_JSON lines; mixed_hf_cb_X.txt: --hf cb) are kept under
host_path_X's "mixed", by step.

    python docs/data/collect_host_path.py
"""
from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
RAW = HERE / "raw" / "h200_host_path"
# what each call ran, for the calls whose lines do not name their tree
TREES = {"host_path_a": "the steps of commit f0995c4 (the keyed torch sampler, one float64 running sum per row)",
         "host_path_b": "the steps of commit f0995c4 (the keyed torch sampler, one float64 running sum per row); step24-before: "
                        "commit 1f7a7d6, a torch.multinomial per row"}
# how each call's GPU-busy share was measured (docs/data/bench_host_path.py at the call's tree)
BUSY_METHOD = {"host_path_g": "kernels' time / unwatched steps' time, but each engine's unwatched steps ran after the "
                              "engines before it had run their profiler session in the process, which slows later "
                              "launches (step25's window took longer than in host_path_h)",
               "host_path_h": "kernels' time (a profiled re-run of the same steps) / the same steps' time unwatched, "
                              "every engine's unwatched steps timed before any profiler ran"}
WATCHED = "kernels' time / the time of the same steps with the profiler watching them (slows each launch on the host)"


def key(workload: str) -> str:
    """A workload's name as a key of the summary, without the dots a data marker's path would split at:
    batch1-0.6 -> batch1-sampled, batch1-0.0 -> batch1-greedy."""
    return {"batch1-0.6": "batch1-sampled", "batch1-0.0": "batch1-greedy"}.get(workload, workload)


def keep(call: dict, kind: str, record: dict, step: str, value: dict) -> None:
    """call[kind][step]: the sampled workload's (what the chapters first quoted); call[kind + "_by_workload"]
    [workload][step]: every workload's."""
    workload = key(record.get("workload", "nano-vllm"))
    if workload == "nano-vllm":
        call[kind][step] = value
    call.setdefault(f"{kind}_by_workload", {}).setdefault(workload, {})[step] = value


def main() -> None:
    calls = {}
    for path in sorted(RAW.glob("host_path_*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        first = records[0]
        call = calls[path.stem] = {"command": first["command"], "device": first["gpu"], "model": first["model"],
                                   "tree": first.get("tree") or TREES.get(path.stem), "medians": {}, "batch1": {},
                                   "phases": {}, "gpu_busy": {}}
        for r in records:
            step = r.get("step")
            if r["kind"] == "median":
                call["medians"].setdefault(r["workload"], {})[step] = {"tokens_per_s": r["tokens_per_s"],
                                                                       "runs": r["all"]}
            elif r["kind"] == "batch1":
                call["batch1"].setdefault(step, {})["greedy" if r["temperature"] == 0 else "sampled"] = {
                    "temperature": r["temperature"],
                    "tokens_per_s": r["tokens_per_s"], "runs": r["all"], "new_tokens": r["new_tokens"]}
            elif r["kind"] == "phases":  # phases.STEP: the sampled workload; by_workload.WORKLOAD.STEP: every one
                phases = {"engine_steps": r["engine_steps"],  # phase names with _ for spaces
                          "ms_per_step": {k.replace(" ", "_"): v for k, v in r["ms_per_step"].items()}}
                if "phase_waits" in r:  # true: each phase waited for the GPU at its end; false: host time only
                    phases["phase_waits"] = r["phase_waits"]
                keep(call, "phases", r, step, phases)
            elif r["kind"] == "gpu_busy":
                busy = {k: r[k] for k in ("engine_steps", "running_rows", "ms_per_step", "gpu_busy_ms_per_step",
                                          "gpu_busy_share", "kernels_per_step", "ms_per_step_profiled") if k in r}
                keep(call, "gpu_busy", r, step, busy)
    # HF's continuous batching on the same workload: hf_cb.txt ran in host_path_b, hf_cb_X.txt in host_path_X.
    # Its BENCH_JSON line's fields are read by name (hf_cb.txt holds only the line's first 700 characters).
    for path in sorted(RAW.glob("hf_cb*.txt")):
        stem = "host_path_" + (path.stem.split("_")[-1] if path.stem != "hf_cb" else "b")
        line = next(line for line in path.read_text().splitlines() if line.startswith("BENCH_JSON"))
        calls[stem]["hf_cb"] = {"command": "python -m shared.bench --hf cb --model random:qwen3-0.6b "
                                           "--device cuda --workload nano-vllm --repeat 1",
                                "tokens_per_s": float(re.search(r'"tokens_per_s": ([0-9.]+)', line).group(1)),
                                "backend": re.search(r'"backend": "([^"]*)"', line).group(1)}
    # the mixed workload in call X: mixed_STEP_X.txt (python -m shared.bench --step STEP), mixed_hf_cb_X.txt (--hf cb)
    for path in sorted(RAW.glob("mixed_*_*.txt")):
        name, suffix = path.stem[len("mixed_"):].rsplit("_", 1)
        text = path.read_text()
        bench = json.loads(next(line for line in text.splitlines() if line.startswith("BENCH_JSON"))[len("BENCH_JSON"):])
        step = "hf-cb" if name == "hf_cb" else name
        runs = [float(x) for x in re.findall(r"run \d+/\d+: .* = ([0-9.]+) tokens/s", text)]
        command = (f"python -m shared.bench {'--hf cb' if step == 'hf-cb' else '--step ' + step} --model {bench['model']} "
                   f"--device {bench['device']} --workload {bench['workload']} --repeat {bench['repeat']}")
        mixed = calls[f"host_path_{suffix}"].setdefault("mixed", {})
        mixed[step] = {"command": command, "tokens_per_s": bench["tokens_per_s"], "runs": runs,  # the median run's
                       **{k: bench[k] for k in ("requests", "generated_tokens", "max_num_seqs", "ttft_median_ms",
                                                "backend") if k in bench}}
    env = (RAW / "env.txt").read_text().split()
    for stem, call in calls.items():  # a call's own device line, where it has one (env_c.txt for host_path_c)
        own = RAW / f"env_{stem.rsplit('_', 1)[-1]}.txt"
        if own.is_file():
            call["env"] = " ".join(own.read_text().split())
        sampler = RAW / f"sampler_{stem.rsplit('_', 1)[-1]}.jsonl"
        if sampler.is_file():  # bench_sampler.py in the same call: one sampling step alone, by path
            lines = [json.loads(line) for line in sampler.read_text().splitlines() if line.strip()]
            call["sampler"] = {"command": lines[0]["command"], "copy_bytes_per_s": next(
                r["copy_bytes_per_s"] for r in lines if r["kind"] == "limit"), "cases": [
                {k: r[k] for k in ("step", "path", "rows", "temperature", "ms", "gpu_busy_ms", "kernels_per_call")}
                for r in lines if r["kind"] == "sample"]}
    for stem, call in calls.items():
        if call["gpu_busy"]:
            call["gpu_busy_method"] = BUSY_METHOD.get(stem, WATCHED)
    latest = max(calls)
    summary = {"about": "nano-vllm's workload as its bench.py runs it (temperature 0.6, ignore_eos, 133,966 new "
                        "tokens; nano-vllm-greedy: the same draws, greedy), engines as its bench builds them, runs "
                        "alternated, median of the repeats; HF transformers' continuous batching on the same "
                        "workload ran in call host_path_b",
               "env": " ".join(env), "latest": latest, "calls": calls}
    (RAW / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v["medians"] for k, v in calls.items()}, indent=1))


if __name__ == "__main__":
    main()
