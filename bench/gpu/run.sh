#!/usr/bin/env bash
# The GPU checks of one device lease, as one script (docs/gpu-performance.md): run on the
# GPU machine from the repository root with .gpu/bundle.tar.xz made by bench/gpu/bundle.sh. Writes
# logs and results.jsonl to $OUT (or ./gpu-out). Each step has its own time limit so that one hang cannot eat the lease.
#   bench/gpu/run.sh [quick]          ONLY=REGEX runs only the steps whose label matches (bash =~)
# Files under $OUT: machine.txt, log.txt (each step's last 25 lines), results.jsonl (a step's last
# JSON line, with its label, rc, wall_s and smi_peak_mb) and outputs.log (every step's whole output,
# the last 384 KiB of each, under the tool's 16 MiB a file for all 26 steps): four, within the
# device tool's eight (bench/gpu/lease.sh adds three).
set -uo pipefail
. "$(dirname "$0")/stage.sh"
py=$(command -v python3)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; echo "libs: $libs"; } | tee "$out/machine.txt"
ldd "$stage/bin/synthetic_benchmark" | grep -E "not found|cudnn|nccl|cublas" | tee -a "$out/machine.txt"
res=$out/results.jsonl; : >"$res"; : >"$out/outputs.log"
rm -f "$stage"/out.* "$stage"/mem.*  # (a warm machine's earlier call left its own)
# peak GPU memory of the process under test, from nvidia-smi every 100 ms (the same measure for both systems)
peak() {  # peak LABEL TIMEOUT CMD...
  local label=$1 limit=$2; shift 2
  [[ $label =~ ${ONLY:-.} ]] || return 0
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$stage/mem.$label" &
  local smi=$!
  echo "== $label: $*" | tee -a "$out/log.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$stage/out.$label" 2>&1; local rc=$?
  local wall=$((SECONDS - t0))
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  tail -n 25 "$stage/out.$label" >>"$out/log.txt"
  { echo "== $label (rc $rc, ${wall} s): $*"; tail -c 393216 "$stage/out.$label"; } >>"$out/outputs.log"
  local mb; mb=$(sort -n "$stage/mem.$label" | tail -1)
  local last; last=$(grep '^{' "$stage/out.$label" | tail -1)
  [ -n "$last" ] || last='{}'
  "$py" -c 'import json,sys; j=json.loads(sys.argv[1]); j.update(label=sys.argv[2], rc=int(sys.argv[3]), wall_s=int(sys.argv[5]), smi_peak_mb=float(sys.argv[4] or 0)); print(json.dumps(j))' \
    "$last" "$label" "$rc" "${mb:-0}" "$wall" | tee -a "$res"
}
peak kernels 120 "$b/gpu_kernels_test"
# dtrain's ResNet-50 in torchvision's form (v1.5, no convolution biases): the model PyTorch's rows train.
# Each dtrain row is followed by its PyTorch peer, so that a lease cut short still has ratios; the
# variants and the kernel reruns come after the pairs.
TV="--resnet-style torchvision"
SB="--num-warmup-batches 5 --num-batches-per-iter 10 --num-iters 3 --devices=gpu --json"
peak dtrain_resnet50_b32 120 "$b/synthetic_benchmark" --batch-size 32 $SB $TV
peak torch_resnet50_b32_fp32 75 "$py" bench/gpu/torch_peers.py resnet50 --batch-size 32 --math fp32
peak dtrain_resnet50_b32_bf16 90 env DTRAIN_LOG_LEVEL=DEBUG "$b/synthetic_benchmark" --batch-size 32 --precision bf16 $SB $TV
# which cuDNN plans took bfloat16 data (cuda_conv_plan.cc's DEBUG lines name the three tensors' types)
bl="$stage/out.dtrain_resnet50_b32_bf16"
[ -f "$bl" ] && echo "bf16 cuDNN plans: $(grep -c 'bfloat16[^:]*): cuDNN engine [-0-9]' "$bl") engines for bfloat16 data, $(grep -c 'bfloat16[^:]*): .*no qualifying' "$bl") problems without one, $(grep -c 'bfloat16[^:]*): .*failed at its first run' "$bl") plans failing at their first run" | tee -a "$out/log.txt"
# by the tensors' types (x, w, y in cuDNN's roles): a float32 output without an engine is written in
# bfloat16 and widened where the all-bfloat16 types have one (cuda_conv.cc, bf16_conv)
[ -f "$bl" ] && for t in "bfloat16, bfloat16, bfloat16" "bfloat16, bfloat16, float32" "float32, bfloat16, bfloat16" "bfloat16, float32, bfloat16"; do
  echo "  ($t): $(grep -c "($t): cuDNN engine [-0-9]" "$bl") engines, $(grep -c "($t): .*no qualifying" "$bl") without one"
done | tee -a "$out/log.txt"
[ -f "$bl" ] && echo "  float32 outputs written in bfloat16 and widened: $(grep -c 'written in bfloat16 and widened' "$bl") problems" | tee -a "$out/log.txt"
peak torch_resnet50_b32_bf16 75 "$py" bench/gpu/torch_peers.py resnet50 --batch-size 32 --math bf16
peak dtrain_resnet50_b32_tf32 90 env DTRAIN_LOG_LEVEL=DEBUG "$b/synthetic_benchmark" --batch-size 32 --tf32 $SB $TV
# which cuDNN plans the TF32 run chose: tensor-core engines or not (cuda_conv_plan.cc's DEBUG lines)
tl="$stage/out.dtrain_resnet50_b32_tf32"
[ -f "$tl" ] && echo "tf32 cuDNN plans: $(grep -c 'tensor cores yes' "$tl") with tensor cores, $(grep -c 'tensor cores no' "$tl") without" | tee -a "$out/log.txt"
peak torch_resnet50_b32_tf32 75 "$py" bench/gpu/torch_peers.py resnet50 --batch-size 32 --math tf32
# cuDNN's engines timed at first use, as PyTorch's rows run (DTRAIN_CUDNN_AUTOTUNE=1)
peak dtrain_resnet50_b32_autotune 90 env DTRAIN_CUDNN_AUTOTUNE=1 "$b/synthetic_benchmark" --batch-size 32 $SB $TV
# batch norm's two-pass kernels (DTRAIN_CUDA_BN=two_pass): the one-pass kernels' A/B in float32
peak dtrain_resnet50_b32_bn2pass 90 env DTRAIN_CUDA_BN=two_pass "$b/synthetic_benchmark" --batch-size 32 $SB $TV
# mixed bfloat16 with float32 activations between the layers (cuDNN's bfloat16 plans kept), and
# as it ran on 2026-11-27 (float32 activations, cuDNN on TF32)
peak dtrain_resnet50_b32_bf16_nohandoff 90 env DTRAIN_CUDA_BF16_HANDOFFS=0 "$b/synthetic_benchmark" --batch-size 32 --precision bf16 $SB $TV
peak dtrain_resnet50_b32_bf16_before 90 env DTRAIN_CUDA_BF16_HANDOFFS=0 DTRAIN_CUDNN_BF16=0 "$b/synthetic_benchmark" --batch-size 32 --precision bf16 $SB $TV
# The Keras form (what TensorFlow trains, and what rows before 2026-11-28 measured) once, beside it.
peak dtrain_resnet50_b32_keras 120 "$b/synthetic_benchmark" --batch-size 32 $SB --resnet-style keras
# the bfloat16 hand-offs again on the fallbacks: batch norm's two-pass kernels (which widen bfloat16
# first) and cuDNN's legacy calls (no bfloat16 plans: the TF32 path on rounded operands)
peak kernels_bf16_fallbacks 90 env DTRAIN_CUDA_BN=two_pass DTRAIN_CUDNN_API=legacy "$b/gpu_kernels_test" --gtest_filter='GpuKernels.Bfloat16*:GpuKernels.ResNetStep*:GpuKernels.MixedBFloat16*'
# the convolutions again with cuDNN's engines timed at first use (DTRAIN_CUDNN_AUTOTUNE=1)
# (not TensorFloat32*: its check that TF32 changed a result may not hold where the timed TF32 plan
# is the float32 plan's engine)
peak kernels_autotune 60 env DTRAIN_CUDNN_AUTOTUNE=1 DTRAIN_LOG_LEVEL=DEBUG "$b/gpu_kernels_test" --gtest_filter='GpuKernels.Conv*:GpuKernels.AConvolutionPlan*:GpuKernels.Bfloat16*:GpuKernels.MixedBFloat16*'
ratios() { "$py" bench/gpu/ratios.py "$res" | tee -a "$out/log.txt"; }  # dtrain over PyTorch, each pair
[ "${1:-}" = quick ] && { ratios; exit 0; }
peak dtrain_resnet50_b256 120 "$b/synthetic_benchmark" --batch-size 256 --num-warmup-batches 3 --num-batches-per-iter 5 --num-iters 3 --devices=gpu --json $TV
peak dtrain_resnet50_b256_tf32 120 "$b/synthetic_benchmark" --batch-size 256 --tf32 --num-warmup-batches 3 --num-batches-per-iter 5 --num-iters 3 --devices=gpu --json $TV
peak torch_resnet50_b256_fp32 75 "$py" bench/gpu/torch_peers.py resnet50 --batch-size 256 --math fp32 --batches 5
peak dtrain_resnet50_b256_bf16 120 "$b/synthetic_benchmark" --batch-size 256 --precision bf16 --num-warmup-batches 3 --num-batches-per-iter 5 --num-iters 3 --devices=gpu --json $TV
peak torch_resnet50_b256_tf32 75 "$py" bench/gpu/torch_peers.py resnet50 --batch-size 256 --math tf32 --batches 5
peak torch_resnet50_b256_bf16 75 "$py" bench/gpu/torch_peers.py resnet50 --batch-size 256 --math bf16 --batches 5
peak dtrain_gpt2_c1024_b8 120 "$b/gpt" --preset gpt2 --context 1024 --batch-size 8 --devices=gpu --steps 25 --steps-per-epoch 25 --epochs 1 --val-windows 8 --warmup-steps 5 --corpus-dir "$stage/corpus" --json
peak dtrain_gpt2_c1024_b8_bf16 120 "$b/gpt" --preset gpt2 --context 1024 --batch-size 8 --devices=gpu --precision bf16 --steps 25 --steps-per-epoch 25 --epochs 1 --val-windows 8 --warmup-steps 5 --corpus-dir "$stage/corpus" --json
peak dtrain_gpt2_c1024_b8_tf32 120 "$b/gpt" --preset gpt2 --context 1024 --batch-size 8 --devices=gpu --tf32 --steps 25 --steps-per-epoch 25 --epochs 1 --val-windows 8 --warmup-steps 5 --corpus-dir "$stage/corpus" --json
peak torch_gpt2_c1024_b8_fp32 75 "$py" bench/gpu/torch_peers.py gpt --batch-size 8 --context 1024 --math fp32
peak torch_gpt2_c1024_b8_tf32 75 "$py" bench/gpu/torch_peers.py gpt --batch-size 8 --context 1024 --math tf32
peak torch_gpt2_c1024_b8_bf16 75 "$py" bench/gpu/torch_peers.py gpt --batch-size 8 --context 1024 --math bf16
ratios
