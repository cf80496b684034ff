#!/bin/bash
# The engine's host-side hot path on the H200, old tree against new, in one device call, with the GPU tests first:
#   git archive <old commit> steps | tar -x -C .cache/hot_path_old      (here, before the call; carry that folder)
#   bash docs/data/bench_h200_hot_path.sh "$OUT"
# writes $OUT/gpu_tests.txt (python -m pytest -m gpu) and $OUT/hot_path_qwen3.jsonl (docs/data/bench_hot_path.py:
# batch-1 decode, 8 prompts and the mixed workload through step17 of each tree, random:qwen3-0.6b, bf16).
out=${1:?output folder}
export PYTHONUNBUFFERED=1 LLM_STEPS_CACHE=$PWD/.cache PYTHONPATH=$PWD
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__)'; } > "$out/env.txt"
timeout ${HOT_PATH_S:-200} python3 docs/data/bench_hot_path.py --steps-root .cache/hot_path_old/steps --steps-root steps \
  --model random:qwen3-0.6b --device cuda --repeats 3 2>>"$out/hot_path.log" | tee "$out/hot_path_qwen3.jsonl"
timeout ${GPU_TESTS_S:-240} python3 -m pytest -m gpu tests -q -s -p no:cacheprovider -rs 2>&1 | grep -v '^$' | tail -80 > "$out/gpu_tests.txt"
echo "gpu tests exit: ${PIPESTATUS[0]}" >> "$out/gpu_tests.txt"
date -u +%FT%TZ >> "$out/env.txt"
