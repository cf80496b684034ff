#!/bin/bash
# Part 8 on the H200, one device call: step24's serving table on random:qwen3-0.6b (docs/data/bench_serving.py:
# the server at several request rates up to saturation, then the offline engine on the same requests), the gpu
# tests of steps 23-24 and their run.py on the GPU. (Steps 22-24 joined the all-steps mixed run in an earlier call:
#   python3 docs/data/bench_all_steps.py --model random:smollm2-135m --workload mixed --steps step22 step23 step24
#   --hf --calibrate --out h200_mixed_step22_24_call4.jsonl)
#   bash docs/data/bench_h200_part8.sh "$OUT"
# The serving packages the machine lacks travel as wheels in .whl (fastapi, starlette, uvicorn, pydantic and theirs):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl fastapi==... (see the
#   device notes), carried with the call and installed into /tmp/site first.
out=${1:?output folder}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site LLM_STEPS_CACHE=$PWD/.cache
start=$(date +%s)
left() { echo $(( ${BUDGET_S:-560} - ($(date +%s) - start) )); }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  python3 -c 'import torch, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)'
  git rev-parse --short HEAD 2>/dev/null; } > "$out/h200_part8_env.txt"
timeout 240 python3 -u docs/data/bench_serving.py --model random:qwen3-0.6b --rates 16 32 64 128 --repeats 3 --num-prompts 512 \
  --input-len 256 --output-len 128 --max-num-seqs 256 --out "$out/h200_step24_serving.jsonl" > "$out/h200_step24_serving.txt" 2>&1
echo "serving rc=$? left=$(left)" >> "$out/h200_part8_env.txt"
timeout $(( $(left) < 150 ? $(left) : 150 )) python3 -m pytest -m gpu -q -rA -p no:cacheprovider -k "step23 or step24" \
  tests/test_gpu.py tests/test_part4.py > "$out/h200_gpu_tests_step23_24.txt" 2>&1
echo "gpu tests rc=$? left=$(left)" >> "$out/h200_part8_env.txt"
timeout $(( $(left) < 60 ? $(left) : 60 )) python3 -m pytest -m gpu -q -rA -p no:cacheprovider -k "pool and step23" \
  tests/test_part4.py > "$out/h200_gpu_tests_step23_pool_alone.txt" 2>&1
echo "pool test alone rc=$? left=$(left)" >> "$out/h200_part8_env.txt"
for s in step23 step24; do
  timeout $(( $(left) < 60 ? $(left) : 60 )) python3 -u steps/$s/run.py --model random:qwen3-0.6b > "$out/h200_${s}_run.txt" 2>&1
  echo "$s run.py rc=$? left=$(left)" >> "$out/h200_part8_env.txt"
done
date -u +%FT%TZ >> "$out/h200_part8_env.txt"
