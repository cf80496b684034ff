#!/bin/bash
# The Part 4 H200 benchmark behind the h200.json keys mixed-part4-* (issue 8): HF transformers `generate` and
# every step 09-13 on the mixed workload, one fresh process each, in one device call per model:
#   bash docs/data/bench_h200_part4.sh "$OUT" random:smollm2-135m step09 step10 step11 step12 step13
#   bash docs/data/bench_h200_part4.sh "$OUT" random:qwen3-0.6b step10 step11 step12 step13
# (step09 runs Llama only.) MAX_NUM_SEQS=64 gives every engine 64 seats (HF's padded batch holds all 64 requests). Each line is what `python run_all.py --bench --hf` runs for one step, called
# directly so that every finished result is kept even if a later one runs out of time.
out=${1:?output folder}; model=${2:?model}; shift 2
export PYTHONUNBUFFERED=1 LLM_STEPS_CACHE=$PWD/.cache
tag=$(echo "$model" | tr ':/' '__')
start=$(date +%s)
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)'; } > "$out/env_$tag.txt"
for which in --hf "$@"; do
  if (( $(date +%s) - start > ${BUDGET_S:-420} )); then echo "skipped $which: out of time" | tee -a "$out/bench_$tag.log"; continue; fi
  if [ "$which" = --hf ]; then args=(--hf); else args=(--step "$which"); fi
  echo "== $which" >> "$out/bench_$tag.log"
  if [ "$which" != --hf ] && [ -n "${MAX_NUM_SEQS:-}" ]; then args+=(--max-num-seqs "$MAX_NUM_SEQS"); fi
  python3 -m shared.bench "${args[@]}" --model "$model" --workload mixed --repeat 1 2>>"$out/bench_$tag.log" \
    | grep '^BENCH_JSON ' | sed 's/^BENCH_JSON //' | tee -a "$out/bench_$tag.jsonl"
done
date -u +%FT%TZ >> "$out/env_$tag.txt"
