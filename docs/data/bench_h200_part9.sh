#!/bin/bash
# Part 9 (steps 25-27) on the H200, re-measured after the steps were reworked, in two device calls:
#   bash docs/data/bench_h200_part9.sh "$OUT" engines    nano-vllm's workload (0.6 and greedy) and batch 1 through
#       steps 25-27 and the step27 of an older tree (--before, unpacked from `git archive <commit> steps` into
#       scratch/before), runs alternated; then bench_spec.py: batch 1 with speculation (copy-heavy, and random ids at
#       0.6, where no step can draft) and nano-vllm's workload through step27 with its default disable_by_batch_size
#   bash docs/data/bench_h200_part9.sh "$OUT" serving    step26's and step27's servers at saturation against their
#       offline engines (docs/data/bench_serving.py, the step26 chapter's command)
#   bash docs/data/bench_h200_part9.sh "$OUT" servers    the same measurement for step24's, step25's and step26's
#       servers one after another in one run (h200_step2{4,5,6}_serving_split.*): the process split's gain over
#       step25's server (one process, overlapped) on its own
# The serving packages the machine lacks travel as wheels in .whl (see bench_h200_part8.sh).
out=${1:?output folder}
what=${2:?engines, serving or servers}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site LLM_STEPS_CACHE=$PWD/.cache
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  python3 -c 'import torch, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)'
} > "$out/h200_part9_env_$what.txt"
if [ "$what" = engines ]; then
  timeout 330 python3 -u docs/data/bench_host_path.py --steps step25 step26 step27 --share 0.22 --repeats 3 \
    --before scratch/before/steps --out "$out/h200_part9_host_path.jsonl" > "$out/h200_part9_host_path.log" 2>&1
  echo "host_path rc=$?" >> "$out/h200_part9_env_$what.txt"
  timeout 220 python3 -u docs/data/bench_spec.py --model random:qwen3-0.6b --max-tokens 256 --repeats 3 \
    --workloads copy-heavy random-0.6 --nano-vllm --gpu-memory-utilization 0.3 --out "$out/h200_step27_spec_part9" \
    > /dev/null 2>&1
  echo "bench_spec rc=$?" >> "$out/h200_part9_env_$what.txt"
elif [ "$what" = servers ]; then
  for s in step24 step25 step26; do
    timeout 190 python3 -u docs/data/bench_serving.py --step $s --model random:qwen3-0.6b --rates 128 --repeats 3 \
      --num-prompts 512 --input-len 256 --output-len 128 --max-num-seqs 256 --client-processes 4 \
      --out "$out/h200_${s}_serving_split.jsonl" > "$out/h200_${s}_serving_split.txt" 2>&1
    echo "$s serving rc=$?" >> "$out/h200_part9_env_$what.txt"
  done
else
  for s in step26 step27; do
    timeout 270 python3 -u docs/data/bench_serving.py --step $s --model random:qwen3-0.6b --rates 128 --repeats 3 \
      --num-prompts 512 --input-len 256 --output-len 128 --max-num-seqs 256 --client-processes 4 \
      --out "$out/h200_${s}_serving_part9.jsonl" > "$out/h200_${s}_serving_part9.txt" 2>&1
    echo "$s serving rc=$?" >> "$out/h200_part9_env_$what.txt"
  done
fi
date -u +%FT%TZ >> "$out/h200_part9_env_$what.txt"
