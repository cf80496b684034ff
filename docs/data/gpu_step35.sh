#!/bin/bash
# step35 on a machine with two GPUs, in one device call (NCCL_NVLS_ENABLE=0 stays set):
#   bash docs/data/gpu_step35.sh "$OUT"    the gpu tests of step35, then docs/data/pd_latency.py on random:qwen3-0.6b:
#                                          64 decoding streams, 8 prompts of about 6,000 tokens among them; one engine on
#                                          GPU 0 against a kv_producer on GPU 0 and a kv_consumer on GPU 1 (NCCL between
#                                          them) behind router.py
# Carry .cache/tokenizers and .whl (fastapi, uvicorn, pyzmq, msgspec, httpx... as wheels). Files are named after the card.
out=${1:?output folder}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site LLM_STEPS_CACHE=$PWD/.cache NCCL_NVLS_ENABLE=0
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo h200 || echo h100)
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  nvidia-smi topo -m
} > "$out/${card}x${gpus}_step35_env.txt"
timeout 200 python3 -m pytest -m gpu --step step35 tests/test_part11_pd.py -q -p no:cacheprovider -rfE \
  > "$out/${card}x${gpus}_step35_gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" >> "$out/${card}x${gpus}_step35_env.txt"
timeout 360 python3 -u docs/data/pd_latency.py --device cuda --model random:qwen3-0.6b --streams 64 --long 8 \
  --long-tokens 6000 --decode-tokens 512 > "$out/${card}x${gpus}_step35_pd_latency.txt" 2>&1
echo "pd_latency rc=$?" >> "$out/${card}x${gpus}_step35_env.txt"
