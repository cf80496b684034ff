#!/bin/bash
# step34 on a machine with two or more GPUs, in device calls of under 10 minutes each (NCCL_NVLS_ENABLE=0 stays set):
#   bash docs/data/gpu_step34.sh "$OUT" tests    the gpu tests of step34 (pp=2, tp=2 and, with four GPUs, tp=2 x pp=2
#                                                against one GPU, bf16 rule), then torchrun --nproc-per-node 2 running
#                                                run.py (its tokens against step33's one GPU)
#   bash docs/data/gpu_step34.sh "$OUT" bench    docs/data/bench_step34.py: nano-vllm's workload at 0.6 and batch 1
#                                                on random:qwen3-0.6b for 1 GPU, tp=2, pp=2 (tp2 x pp2 and tp=4 where
#                                                four GPUs), idle shares and all-reduce times, NCCL's bandwidths
#   bash docs/data/gpu_step34.sh "$OUT" big      the same on Qwen3-8B's shape (random:qwen3-8b) for tp=2 and pp=2
# Carry .cache/tokenizers and .whl (the engine core's packages as wheels). Files are named after the card.
out=${1:?output folder}
what=${2:?tests, bench or big}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site LLM_STEPS_CACHE=$PWD/.cache NCCL_NVLS_ENABLE=0
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo h200 || echo h100)
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  nvidia-smi topo -m
  python3 -c 'import torch, triton, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "nccl", torch.cuda.nccl.version())'
} > "$out/${card}x${gpus}_step34_env_$what.txt"
case "$what" in
  tests)
    timeout 300 python3 -m pytest -m gpu --step step34 tests/test_part11_pp.py tests/test_part7_tp.py -q \
      -p no:cacheprovider -rfE > "$out/${card}x${gpus}_step34_gpu_tests.txt" 2>&1
    echo "gpu tests rc=$?" >> "$out/${card}x${gpus}_step34_env_$what.txt"
    timeout 200 python3 -m torch.distributed.run --nproc-per-node 2 steps/step34/run.py --model random:qwen3-0.6b \
      --requests 8 --lesson-tokens 64 > "$out/${card}x${gpus}_step34_torchrun.txt" 2>&1
    echo "torchrun rc=$?" >> "$out/${card}x${gpus}_step34_env_$what.txt" ;;
  bench)
    layouts="1 tp2 pp2"
    [ "$gpus" -ge 4 ] && layouts="$layouts tp2pp2 tp4"
    timeout 560 python3 -u docs/data/bench_step34.py --layouts $layouts --out "$out/${card}x${gpus}_step34_bench.jsonl" \
      > "$out/${card}x${gpus}_step34_bench.log" 2>&1
    echo "bench rc=$?" >> "$out/${card}x${gpus}_step34_env_$what.txt" ;;
  big)
    timeout 560 python3 -u docs/data/bench_step34.py --model random:qwen3-8b --layouts tp2 pp2 \
      --out "$out/${card}x${gpus}_step34_big.jsonl" > "$out/${card}x${gpus}_step34_big.log" 2>&1
    echo "bench rc=$?" >> "$out/${card}x${gpus}_step34_env_$what.txt" ;;
  *) echo "unknown part: $what" >&2; exit 2 ;;
esac
