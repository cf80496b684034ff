#!/bin/bash
# Part 10's later steps (29-32) on the H200, one device call per part (each under the 10-minute limit of a call):
#   bash docs/data/bench_h200_part10.sh "$OUT" tests     the gpu tests of steps 29-32 (4-bit, FP8, MoE, host tier)
#   bash docs/data/bench_h200_part10.sh "$OUT" kernels   step31's MoE layer (loop, fused, roofline: bench_step31.py)
#                                                        and step30's attention on bf16/int8/fp8 caches (bench_step30.py)
#   bash docs/data/bench_h200_part10.sh "$OUT" chat      step32's multi-turn chat with and without the host tier
#   bash docs/data/bench_h200_part10.sh "$OUT" nano      nano-vllm's workload and batch 1, runs alternated
#                                                        (bench_host_path.py): step28; step29 with int4 weights; step30
#                                                        with an int8 cache, an fp8 cache, fp8 weights; then step29's
#                                                        4-bit GEMV at its tuned tiles (bench_step29.py)
#   bash docs/data/bench_h200_part10.sh "$OUT" profile   nano's engines once more (one run each), to reach the phase timers
#                                                        and the GPU-busy profile
#   bash docs/data/bench_h200_part10.sh "$OUT" moe       nano-vllm's workload on Qwen3-30B-A3B's layer shape (16
#                                                        layers, built on first use): step31, then HF's continuous
#                                                        batching on the same model
#   bash docs/data/bench_h200_part10.sh "$OUT" vs-hf     nano-vllm's workload through steps 28, 29 (int4), 30 (fp8
#                                                        cache) and 32, then HF's continuous batching on the same
#                                                        model (carry .whl too: the core's packages, as wheels)
# Carry .cache/tokenizers (the random models need the tokenizer). Files are named after the card (h200_ or h100_).
out=${1:?output folder}
mkdir -p "$out"
what=${2:?tests, kernels, chat, nano or moe}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD LLM_STEPS_CACHE=$PWD/.cache
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo h200 || echo h100)
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  python3 -c 'import torch, triton, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
} > "$out/${card}_part10_env_$what.txt"
case "$what" in
  tests)
    timeout 560 python3 -m pytest -m gpu tests/test_part10_int4.py tests/test_part10_fp8.py tests/test_part10_moe.py \
      tests/test_part10_offload.py -q -p no:cacheprovider -rfE > "$out/${card}_part10_gpu_tests.txt" 2>&1
    echo "gpu tests rc=$?" >> "$out/${card}_part10_env_$what.txt" ;;
  kernels)
    timeout 300 python3 -u docs/data/bench_step31.py --out "$out/${card}_step31_moe.json" > "$out/${card}_step31_moe.txt" 2>&1
    echo "bench_step31 rc=$?" >> "$out/${card}_part10_env_$what.txt"
    timeout 240 python3 -u docs/data/bench_step30.py --out "$out/${card}_step30_attention.json" \
      > "$out/${card}_step30_attention.txt" 2>&1
    echo "bench_step30 rc=$?" >> "$out/${card}_part10_env_$what.txt" ;;
  chat)
    timeout 560 python3 -u docs/data/bench_step32.py --out "$out/${card}_step32.json" > "$out/${card}_step32.txt" 2>&1
    echo "bench_step32 rc=$?" >> "$out/${card}_part10_env_$what.txt" ;;
  nano)
    timeout 420 python3 -u docs/data/bench_host_path.py --steps step28 step29:quantization=int4 \
      step30:kv_cache_dtype=int8 step30:kv_cache_dtype=fp8 step30:quantization=fp8 --share 0.17 --repeats 3 \
      --out "$out/${card}_part10_host_path.jsonl" > "$out/${card}_part10_host_path.log" 2>&1
    echo "host_path rc=$?" >> "$out/${card}_part10_env_$what.txt"
    timeout 130 python3 -u docs/data/bench_step29.py --skip batch1 --out "$out/${card}_step29_gemv.json" \
      > "$out/${card}_step29_gemv.txt" 2>&1
    echo "bench_step29 rc=$?" >> "$out/${card}_part10_env_$what.txt" ;;
  profile)  # nano's engines once more, for the phase timers and the GPU-busy profile (nano's call ran out of time)
    timeout 340 python3 -u docs/data/bench_host_path.py --steps step28 step29:quantization=int4 \
      step30:kv_cache_dtype=fp8 step30:quantization=fp8 --share 0.2 --repeats 1 \
      --out "$out/${card}_part10_profile.jsonl" > "$out/${card}_part10_profile.log" 2>&1
    echo "host_path rc=$?" >> "$out/${card}_part10_env_$what.txt" ;;
  moe)
    start=$(date +%s)
    python3 -c 'from shared.models import resolve_model; print(resolve_model("random:qwen3-30b-a3b-16-layers"))' \
      > "$out/${card}_step31_model_build.txt" 2>&1
    echo "model build rc=$? in $(( $(date +%s) - start )) s" >> "$out/${card}_part10_env_$what.txt"
    # step31 alone: the torch attention backend's loop needs a [heads, 16384, S] score tensor (16 GiB) in the
    # memory profile at max_num_batched_tokens 16384, and stops there on an 80 GB card
    timeout 230 python3 -u docs/data/bench_host_path.py --model random:qwen3-30b-a3b-16-layers \
      --steps step31 --share 0.5 --repeats 1 --out "$out/${card}_step31_host_path.jsonl" \
      > "$out/${card}_step31_host_path.log" 2>&1
    echo "host_path rc=$?" >> "$out/${card}_part10_env_$what.txt"
    timeout 290 python3 -m shared.bench --hf cb --model random:qwen3-30b-a3b-16-layers --workload nano-vllm \
      --repeat 1 > "$out/${card}_step31_hf_cb.txt" 2>&1
    echo "hf cb rc=$?" >> "$out/${card}_part10_env_$what.txt" ;;
  vs-hf)  # steps 28-30 and 32 beside HF transformers' continuous batching on the same model, in one call
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/site
    timeout 200 python3 -u docs/data/bench_host_path.py --steps step28 step29:quantization=int4 \
      step30:kv_cache_dtype=fp8 step32 --share 0.17 --repeats 1 \
      --out "$out/${card}_part10_vs_hf_host_path.jsonl" > "$out/${card}_part10_vs_hf_host_path.log" 2>&1
    echo "host_path rc=$?" >> "$out/${card}_part10_env_$what.txt"
    timeout 360 python3 -m shared.bench --hf cb --model random:qwen3-0.6b --workload nano-vllm --repeat 1 \
      > "$out/${card}_part10_vs_hf_cb.txt" 2>&1
    echo "hf cb rc=$?" >> "$out/${card}_part10_env_$what.txt" ;;
  *) echo "unknown part: $what" >&2; exit 2 ;;
esac
