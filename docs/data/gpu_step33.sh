#!/bin/bash
# step33 on one GPU, in device calls of under 10 minutes each:
#   bash docs/data/gpu_step33.sh "$OUT" tests    the gpu tests of step33 (pytest -m gpu --step step33), then the latent
#                                                kernel at DeepSeek-V2-Lite's and V3's shapes against the copy bandwidth
#                                                and the decompressed path (docs/data/bench_step33.py)
#   bash docs/data/gpu_step33.sh "$OUT" model    random:deepseek-v2-lite (built on first use, 31 GB in bf16) on
#                                                nano-vllm's workload at 0.6 and batch 1 through step33 on the triton
#                                                backend (docs/data/bench_host_path.py), then HF transformers'
#                                                continuous batching on the same model
# Carry .cache/tokenizers and .whl (the engine core's packages as wheels; see bench_h200_part8.sh). Files are named
# after the card (h200_ or h100_).
out=${1:?output folder}
what=${2:?tests or model}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site LLM_STEPS_CACHE=$PWD/.cache
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo h200 || echo h100)
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  python3 -c 'import torch, triton, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
} > "$out/${card}_step33_env_$what.txt"
case "$what" in
  tests)
    timeout 200 python3 -m pytest -m gpu --step step33 -q -p no:cacheprovider -rfE > "$out/${card}_step33_gpu_tests.txt" 2>&1
    echo "gpu tests rc=$?" >> "$out/${card}_step33_env_$what.txt"
    timeout 330 python3 -u docs/data/bench_step33.py --out "$out/${card}_step33_latent.json" \
      > "$out/${card}_step33_latent.txt" 2>&1
    echo "bench_step33 rc=$?" >> "$out/${card}_step33_env_$what.txt" ;;
  model)
    start=$(date +%s)
    python3 -c 'from shared.models import resolve_model; print(resolve_model("random:deepseek-v2-lite"))' \
      > "$out/${card}_step33_model_build.txt" 2>&1
    echo "model build rc=$? in $(( $(date +%s) - start )) s" >> "$out/${card}_step33_env_$what.txt"
    timeout 250 python3 -u docs/data/bench_host_path.py --model random:deepseek-v2-lite \
      --steps step33:attention_backend=triton --share 0.6 --repeats 1 --out "$out/${card}_step33_host_path.jsonl" \
      > "$out/${card}_step33_host_path.log" 2>&1
    echo "host_path rc=$?" >> "$out/${card}_step33_env_$what.txt"
    timeout 200 python3 -m shared.bench --hf cb --model random:deepseek-v2-lite --workload nano-vllm --repeat 1 \
      > "$out/${card}_step33_hf_cb.txt" 2>&1
    echo "hf cb rc=$?" >> "$out/${card}_step33_env_$what.txt" ;;
  *) echo "unknown part: $what" >&2; exit 2 ;;
esac
