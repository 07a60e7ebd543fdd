#!/usr/bin/env bash
# Second look after bench/gpu/run.sh: a failing kernel test in full, and where a ResNet-50 step's time
# goes on the GPU (GPU utilisation sampled by nvidia-smi for dtrain and PyTorch, and dtrain's timeline).
set -uo pipefail
. "$(dirname "$0")/stage.sh"
timeout 60 "$b/gpu_kernels_test" --gtest_filter="${KERNEL_FILTER:-GpuKernels.Unary}" >"$out/kernels.txt" 2>&1
util() {  # util LABEL CMD...: GPU utilisation (%) every 50 ms while CMD runs
  local label=$1; shift
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 50 >"$out/util_$label.csv" &
  local smi=$!
  timeout 100 "$@" >"$out/out_$label.txt" 2>&1
  kill $smi; wait $smi 2>/dev/null
}
DTRAIN_TIMELINE=$out/timeline_resnet50_b32.json util dtrain "$b/synthetic_benchmark" --batch-size 32 \
  --num-warmup-batches 5 --num-batches-per-iter 10 --num-iters 2 --devices=gpu --json
util torch python3 bench/gpu/torch_peers.py resnet50 --batch-size 32 --math fp32 --iters 2
ls -la "$out"; gzip -9 "$out"/timeline_*.json; ls -la "$out"
