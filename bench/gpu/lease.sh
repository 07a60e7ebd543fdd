#!/usr/bin/env bash
# One device lease's GPU checks as one call (docs/gpu-performance.md): the 15 minutes of device time a
# lease has, the machine's start included, leave room for one call of at most 600 s and no second
# machine (a machine stays warm 30 s after a call). Run on the GPU machine from the repository root
# with .gpu/bundle.tar.xz made here by `bench/gpu/bundle.sh` (carry: [".gpu"]), timeout_s 590:
#   bench/gpu/lease.sh
# In order, each step with its own time limit (bench/gpu/run.sh's rows):
#  1. gpu_kernels_test, everything written since the last lease among it (never run on a GPU);
#  2. ResNet-50 at batch 32, float32 and mixed bfloat16, each dtrain row beside its PyTorch row;
#     cuDNN autotuned; batch norm's two-pass kernels; the bfloat16 fallbacks' and autotune's kernel
#     reruns;
#  3. ResNet-50 at batch 256 and GPT-2 small (context 1,024, batch 8), float32 and mixed bfloat16;
#  4. if under LEASE_AB_BY seconds (390) have gone: bench/gpu/profile.sh ab under mixed bfloat16
#     (the default, the rows of 2026-11-27 and cuDNN's non-deterministic engines; 2 rounds).
# Files under $OUT: r/ (machine.txt, log.txt, results.jsonl, outputs.log) and ab/ (machine.txt,
# ab_summary.txt, ab.tgz): seven, within the device tool's eight, two folders deep at most.
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$SECONDS
OUT=${OUT:-gpu-out}
rows='^(kernels.*|(dtrain|torch)_resnet50_b(32|256)(_fp32|_bf16)?|dtrain_resnet50_b32_(autotune|bn2pass)'
rows+='|(dtrain|torch)_gpt2_c1024_b8(_fp32|_bf16)?)$'
ONLY=${LEASE_ROWS:-$rows} OUT=$OUT/r bench/gpu/run.sh
echo "lease: run.sh took $((SECONDS - start)) s"
if [ $((SECONDS - start)) -lt "${LEASE_AB_BY:-390}" ]; then
  OUT=$OUT/ab PRECISION=bf16 ROUNDS=2 KERNELS=0 B256=0 NCU=0 \
    CONFIGS='default:DTRAIN_CUDNN_API=graph before:DTRAIN_CUDA_BF16_HANDOFFS=0,DTRAIN_CUDNN_BF16=0 nondet:DTRAIN_CUDNN_AUTOTUNE=1,DTRAIN_CUDNN_DETERMINISTIC=0' \
    bench/gpu/profile.sh ab
else
  echo "lease: profile.sh ab left out, $((SECONDS - start)) s gone (LEASE_AB_BY=${LEASE_AB_BY:-390})"
fi
echo "lease: $((SECONDS - start)) s in all"
