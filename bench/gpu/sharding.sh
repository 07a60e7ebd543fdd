#!/usr/bin/env bash
# The kernel tests again, and sharded training on the GPU: GPT under MultiWorkerMirrored, 2 processes
# on the one GPU over the TCP ring (NCCL takes one rank per GPU), unsharded, ZeRO-2 and ZeRO-3
# (transformer blocks' weights sharded and gathered per block), with recompute: the final losses
# must agree. Run on the GPU machine from the repository root after bench/gpu/bundle.sh.
set -uo pipefail
. "$(dirname "$0")/stage.sh"
timeout 120 "$b/gpu_kernels_test" >"$out/kernels.txt" 2>&1; echo "gpu_kernels_test rc $?"
grep -E "^\[  (PASSED|FAILED)" "$out/kernels.txt"
for sh in none gradients parameters; do
  DTRAIN_COLLECTIVE=ring timeout 150 "$b/dtrain-run" -np 2 "$b/gpt" --strategy=multi_worker_mirrored \
    --devices=gpu --preset gpt-mini --context 128 --batch-size 16 --steps 20 --steps-per-epoch 10 \
    --epochs 2 --val-windows 32 --warmup-steps 5 --recompute --sharding "$sh" \
    --corpus-dir "$stage/corpus" --json >"$out/gpt_$sh.txt" 2>&1
  echo "sharding $sh rc $?"; grep -E "worker:0\] \{" "$out/gpt_$sh.txt" | cut -c1-400
done
