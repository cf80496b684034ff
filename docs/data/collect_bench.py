"""Gather benchmark results into docs/data/<device>.json, the one file the docs read a device's numbers from.

    python docs/data/collect_bench.py --device cpu --description "..." --model smollm2-135m --date 2026-11-30 \
        --commit abc123 --results /tmp/cpu_standard.json --command standard="python run_all.py --bench" ...

--results takes files written by `run_all.py --bench --json` (a list) or lines of `python -m shared.bench`
output (one JSON object per line, BENCH_JSON prefix removed). Results are grouped by workload and step;
--command WORKLOAD=CMD records how each workload was run. Nothing is computed here: numbers are copied.

A chapter's own run goes in beside the others, under its own workload keys, without touching them:
    python docs/data/collect_bench.py --device h200 --merge --suffix step10 --model random:smollm2-135m ... \
        --results /tmp/mixed.jsonl --command "mixed=python -m shared.bench ..."     -> workload "mixed-step10"
With --merge the file's other workloads and its description stay; the new entries carry their own model, date
and commit (the docs' captions name them).

A step the run did not have (a newer step, measured later the same way) joins the run's entry as its next device
call, with its own date and commit, and leaves the entry's pending list (--pending names steps still waiting):
    python docs/data/collect_bench.py --device h200 --add-to mixed --model random:smollm2-135m --date ... \
        --commit ... --results /tmp/mixed_new.jsonl --command "mixed=python3 docs/data/bench_all_steps.py ..."

Each entry names its run (--run, shown with every figure quoted from it) and may be the site's run for its
workload and model (--canonical): the one the summaries and most chapters quote (docs/hooks/figures.py).
Results of docs/data/bench_all_steps.py carry the part of the call they ran in ("alone", "lanes",
"calibration"); with --calls each file is one job (numbered in order). A calibration result, and a step
measured again in a later file, go to the entry's "calibration" list instead of its steps: the same step alone
and in lanes, which says what sharing the machine cost.
"""
import argparse
import json
from pathlib import Path

KEEP = ("label", "tokens_per_s", "ttft_median_ms", "peak_memory_mb", "peak_memory_kind", "generated_tokens", "requests",
        "repeat", "wall_s", "backend", "device", "dtype", "roofline_tokens_per_s_batch1", "bandwidth_gbs", "weight_mb",
        "max_num_seqs", "options", "part", "lanes", "call")


def read_results(path: Path) -> list[dict]:
    text = path.read_text().strip()
    if text.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", required=True)
    p.add_argument("--description", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--date", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--note", default="")
    p.add_argument("--results", nargs="+", type=Path, required=True)
    p.add_argument("--command", nargs="+", default=[], help="WORKLOAD=COMMAND")
    p.add_argument("--suffix", default="", help="store each workload as WORKLOAD-SUFFIX (a chapter's own run)")
    p.add_argument("--merge", action="store_true", help="add to the existing file instead of rewriting it")
    p.add_argument("--run", default="", help="the run's name, quoted with its figures (e.g. \"the all-steps run\")")
    p.add_argument("--canonical", action="store_true", help="the site's run for this workload and model")
    p.add_argument("--calls", action="store_true", help="each --results file is one job, in order")
    p.add_argument("--max-tokens", type=int, default=128, help="the workload's --max-tokens")
    p.add_argument("--not-finished", nargs="*", default=[], help="STEP=SECONDS: stopped, unfinished, after SECONDS")
    p.add_argument("--add-to", default=None, help="WORKLOAD: add the results' steps to that entry, as its next call")
    p.add_argument("--pending", nargs="*", default=[], help="with --add-to: STEP=WHY, steps the run still lacks")
    args = p.parse_args()
    commands = dict(c.split("=", 1) for c in args.command)
    if args.add_to:
        add_to(args, commands)
        return
    workloads: dict = {}
    for call, path in enumerate(args.results, 1):
        for r in read_results(path):
            assert r["model"] == args.model, (r["model"], args.model)
            key = f"{r['workload']}-{args.suffix}" if args.suffix else r["workload"]
            wl = workloads.setdefault(key, {"command": commands.get(r["workload"], "?"), "steps": {}})
            if args.merge:
                wl.update(model=args.model, date=args.date, git_commit=args.commit)
            wl.update(max_tokens=args.max_tokens, **({"run": args.run} if args.run else {}),
                      **({"canonical": True} if args.canonical else {}))
            if args.not_finished:
                wl["not_finished"] = {k: float(v) for k, v in (x.split("=", 1) for x in args.not_finished)}
            if args.calls:
                r = dict(r, call=call)
            kept = {k: r[k] for k in KEEP if k in r}
            if r.get("part") == "calibration" or r["step"] in wl["steps"]:
                wl.setdefault("calibration", []).append(dict(kept, step=r["step"]))
            else:
                wl["steps"][r["step"]] = kept
    target = Path(__file__).resolve().parent / f"{args.device}.json"
    if args.merge:
        out = json.loads(target.read_text())
        out["workloads"].update(workloads)
        if args.note:
            out["note"] = (out.get("note", "") + " " + args.note).strip()
        workloads = out["workloads"]
    else:
        out = {"device": args.device, "description": args.description, "model": args.model, "date": args.date,
               "git_commit": args.commit, "note": args.note, "workloads": workloads}
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written {target}: " + ", ".join(f"{k} ({len(v['steps'])} steps)" for k, v in workloads.items()))


def add_to(args, commands: dict) -> None:
    """The results' steps into an existing run's entry, as its next job (see the module's docstring)."""
    target = Path(__file__).resolve().parent / f"{args.device}.json"
    out = json.loads(target.read_text())
    wl = out["workloads"][args.add_to]
    call = max(r.get("call", 1) for r in wl["steps"].values()) + 1
    added = []
    for path in args.results:
        for r in read_results(path):
            assert r["model"] == args.model == wl["model"], (r["model"], args.model, wl["model"])
            assert r["workload"] == args.add_to and r["step"] not in wl["steps"], (r["workload"], r["step"])
            wl["steps"][r["step"]] = dict({k: r[k] for k in KEEP if k in r}, call=call, date=args.date,
                                          git_commit=args.commit)
            wl.get("pending", {}).pop(r["step"], None)
            added.append(r["step"])
    wl.setdefault("pending", {}).update(dict(x.split("=", 1) for x in args.pending))
    if not wl["pending"]:
        del wl["pending"]
    wl["command"] += f"; {', '.join(added)} on {args.date} in call {call}: {commands.get(args.add_to, '?')}"
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written {target}: {args.add_to} + {', '.join(added)} (call {call})")


if __name__ == "__main__":
    main()
