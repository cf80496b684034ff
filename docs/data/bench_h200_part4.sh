#!/bin/bash
# The Part 4 H200 benchmark behind the h200.json keys mixed-part4-* (issue 8): HF transformers' two baselines
# (`generate` on one padded batch, "hf", and its continuous batching, "hf-cb") and every step named, on the mixed
# workload, one fresh process each, in one device call per model:
#   bash docs/data/bench_h200_part4.sh "$OUT" random:smollm2-135m step09 step10 step11 step12 step13
#   bash docs/data/bench_h200_part4.sh "$OUT" random:qwen3-0.6b step10 step11 step12 step13
#   MAX_NUM_SEQS=64 bash docs/data/bench_h200_part4.sh "$OUT" random:smollm2-135m step14_7 step15 step16 step17
# HF_BASELINES="generate cb" (the default) picks the HF baselines run first; HF_BASELINES=cb runs only the new one.
# HF's continuous batching runs 3 times (HF_CB_REPEAT), the median kept: on the H200 (transformers 5.17) its first run
# after the warm-up captured CUDA graphs for new shapes and took 10.9 s, the next two 4.2 s and 5.9 s.
# (step09 runs Llama only.) MAX_NUM_SEQS=64 gives every engine 64 seats (HF's padded batch holds all 64 requests). Each line is what `python run_all.py --bench --hf both` runs for one step, called
# directly so that every finished result is kept even if a later one runs out of time.
out=${1:?output folder}; model=${2:?model}; shift 2
export PYTHONUNBUFFERED=1 LLM_STEPS_CACHE=$PWD/.cache
tag=$(echo "$model" | tr ':/' '__')
start=$(date +%s)
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)'; } > "$out/env_$tag.txt"
for which in $(for hf in ${HF_BASELINES-generate cb}; do echo "hf:$hf"; done) "$@"; do
  if (( $(date +%s) - start > ${BUDGET_S:-420} )); then echo "skipped $which: out of time" | tee -a "$out/bench_$tag.log"; continue; fi
  case $which in hf:cb) args=(--hf cb --repeat "${HF_CB_REPEAT:-3}");; hf:*) args=(--hf "${which#hf:}" --repeat 1);;
                 *) args=(--step "$which" --repeat 1);; esac
  echo "== $which" >> "$out/bench_$tag.log"
  if [[ $which != hf:* ]] && [ -n "${MAX_NUM_SEQS:-}" ]; then args+=(--max-num-seqs "$MAX_NUM_SEQS"); fi
  python3 -m shared.bench "${args[@]}" --model "$model" --workload mixed 2>>"$out/bench_$tag.log" \
    | grep '^BENCH_JSON ' | sed 's/^BENCH_JSON //' | tee -a "$out/bench_$tag.jsonl"
done
date -u +%FT%TZ >> "$out/env_$tag.txt"
