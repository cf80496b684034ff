#!/bin/bash
# The H200 benchmark behind docs/data/h200.json, run once on one NVIDIA H200 through the device tool:
#   bash docs/data/bench_h200.sh "$OUT"      (then: python docs/data/collect_bench.py h200 ...)
# Each line is what `python run_all.py --bench` runs for one step (a fresh process per step), called
# directly so that every finished step's result is kept even if a later one runs out of time.
# The embedded model cannot travel to the GPU machine: random:smollm2-135m has its shape, random weights.
out=${1:?output folder}
export PYTHONUNBUFFERED=1 LLM_STEPS_CACHE=$PWD/.cache
MODEL=random:smollm2-135m
start=$(date +%s)
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'; } > "$out/h200_env.txt"
bench() {  # workload repeat steps...
  local workload=$1 repeat=$2; shift 2
  for step in "$@"; do
    if (( $(date +%s) - start > 470 )); then echo "skipped $workload $step: out of time" | tee -a "$out/h200_bench.log"; continue; fi
    echo "== $workload $step repeat $repeat" >> "$out/h200_bench.log"
    python3 -m shared.bench --step "$step" --model $MODEL --workload "$workload" --repeat "$repeat" 2>>"$out/h200_bench.log" \
      | grep '^BENCH_JSON ' | sed 's/^BENCH_JSON //' | tee -a "$out/h200_bench.jsonl"
  done
}
bench standard 1 step01 step02 step03
bench standard 3 step04 step05 step06 step07 step08 step09
bench shared-prefix 1 step07 step08 step09
bench mixed 1 step04 step05 step06 step07 step08 step09
bench mixed 1 step03
date -u +%FT%TZ >> "$out/h200_env.txt"
