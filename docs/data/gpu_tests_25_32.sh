#!/bin/bash
# The gpu tests of steps 25-32 (overlap, the engine core, speculation, Part 10), one device call:
#   bash docs/data/gpu_tests_25_32.sh "$OUT"; echo "working tree: <commit>" >> "$OUT"/*_gpu_tests_25_32_env.txt
# Carry .cache/tokenizers (the random models need the tokenizer) and .whl: the engine core's and the server's packages
# the machine lacks, as wheels (msgspec, pyzmq, fastapi, uvicorn, openai and theirs; see bench_h200_part8.sh), installed
# into /tmp/site first. Files are named after the card (h200_ or h100_).
out=${1:?output folder}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site LLM_STEPS_CACHE=$PWD/.cache
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo h200 || echo h100)
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  python3 -c 'import torch, triton, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
} > "$out/${card}_gpu_tests_25_32_env.txt"
steps=""
for s in 25 26 27 28 29 30 31 32; do steps="$steps --step step$s"; done
timeout 570 python3 -m pytest -m gpu $steps -q -p no:cacheprovider -rfE --durations=15 \
  > "$out/${card}_gpu_tests_25_32.txt" 2>&1
echo "gpu tests rc=$?" >> "$out/${card}_gpu_tests_25_32_env.txt"
