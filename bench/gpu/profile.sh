#!/usr/bin/env bash
# Where a ResNet-50 step's GPU time goes, for dtrain and PyTorch (docs/gpu-performance.md):
# run on the GPU machine from the repository root with .gpu/bundle.tar.xz (bench/gpu/bundle.sh).
#  1. conv_probe: cuDNN's algorithms for ResNet-50's convolutions, NHWC and NCHW, FMA and TF32 math;
#  2. dtrain's synthetic benchmark at batch 32 (the algorithm each convolution got, at DEBUG);
#  3. ncu: every kernel of dtrain's first two steps, its name and duration (CSV);
#  4. PyTorch fp32 (TF32 off): torch.profiler's kernels of one step.
# `profile.sh ab` compares dtrain's convolution paths (1x1 on cuBLAS + cuDNN graph-API plans, the
# default; everything on graph-API plans; everything on legacy calls) and its batch norm kernels
# (one pass, the default; DTRAIN_CUDA_BN=two_pass, the two-pass ones) in interleaved rounds
# with PyTorch fp32 (torchvision's form on both sides since 2026-11-30; PRECISION=bf16: mixed
# bfloat16 against autocast), runs gpu_kernels_test on each path, batch 256, and ncu (ROUNDS,
# KERNELS=0, B256=0, NCU=0). Its lines also go to $OUT/ab_summary.txt as they come; the runs' own
# outputs wait in $stage/ab and travel as one $OUT/ab.tgz at the end (a run cut short by the
# device tool's limit still brings back the summary: at most 8 files come back).
# `profile.sh host` instead samples where dtrain's host threads spend a step (gperftools' CPU
# profiler, bundled by bench/gpu/bundle.sh when libprofiler is installed here: `apt-get install
# google-perftools`; the GPU machine has no perf or nsys; symbolize here with
# `google-pprof --text build/examples/synthetic_benchmark dtrain_host.prof`), and times cuDNN's host
# side per call (conv_probe's host_us, NHWC FMA only).
# Each step has its own time limit; results go to $OUT (or ./gpu-out).
set -uo pipefail
. "$(dirname "$0")/stage.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; } | tee "$out/machine.txt"
if [ "${1:-}" = ab ]; then  # dtrain's CUDA convolution paths against each other and PyTorch
  # default: 1x1 convolutions on cuBLAS, the rest on cuDNN graph-API plans; bn2pass: the default
  # with batch norm's two-pass kernels; autotune: the default with cuDNN's engines timed at first
  # use; nondet: autotune among non-deterministic engines too (DTRAIN_CUDNN_DETERMINISTIC=0), as
  # PyTorch's rows run. CONFIGS replaces the list, e.g. with the rows of 2026-11-26: nogemm (every
  # convolution on cuDNN plans, DTRAIN_CUDA_CONV_GEMM=0) and legacy (cuDNN's legacy calls,
  # DTRAIN_CUDA_CONV_GEMM=0,DTRAIN_CUDNN_API=legacy).
  # PRECISION=bf16: every row under mixed bfloat16 (PyTorch's under autocast), and in place of
  # bn2pass: before (as on 2026-11-27: float32 activations and copies, cuDNN on TF32 operands;
  # DTRAIN_CUDA_BF16_HANDOFFS=0, DTRAIN_CUDNN_BF16=0).
  prec=${PRECISION:-fp32}
  second=bn2pass:DTRAIN_CUDA_BN=two_pass
  [ "$prec" = bf16 ] && second=before:DTRAIN_CUDA_BF16_HANDOFFS=0,DTRAIN_CUDNN_BF16=0
  configs=${CONFIGS:-"default:DTRAIN_CUDNN_API=graph $second autotune:DTRAIN_CUDNN_AUTOTUNE=1 nondet:DTRAIN_CUDNN_AUTOTUNE=1,DTRAIN_CUDNN_DETERMINISTIC=0"}
  raw=$stage/ab; rm -rf "$raw"; mkdir -p "$raw"; sum=$out/ab_summary.txt; : >"$sum"
  if [ "${KERNELS:-1}" = 1 ]; then  # (bench/gpu/run.sh's kernels row runs the first already)
    # (legacy: not AConvolutionPlanFailingAtItsFirstRun*, which needs the graph API's plans)
    for api in graph legacy; do
      filter='*'; [ $api = legacy ] && filter='-GpuKernels.AConvolutionPlanFailingAtItsFirstRun*'
      DTRAIN_CUDNN_API=$api timeout 120 "$b/gpu_kernels_test" --gtest_filter="$filter" >"$raw/kernels_$api.txt" 2>&1
      echo "gpu_kernels_test ($api) rc $? $(grep -E '^\[  (PASSED|FAILED)' "$raw/kernels_$api.txt" | tr '\n' ' ')" | tee -a "$sum"
    done
    DTRAIN_CUDA_CONV_GEMM=0 timeout 120 "$b/gpu_kernels_test" --gtest_filter='GpuKernels.Conv*' >"$raw/kernels_nogemm.txt" 2>&1
    echo "gpu_kernels_test (no gemm) rc $? $(grep -E '^\[  (PASSED|FAILED)' "$raw/kernels_nogemm.txt" | tr '\n' ' ')" | tee -a "$sum"
  fi
  for round in $(seq "${ROUNDS:-2}"); do
    for cfg in $configs; do
      name=${cfg%%:*}; vars=${cfg#*:}
      env ${vars//,/ } DTRAIN_LOG_LEVEL=${LOGLEVEL:-info} timeout 120 "$b/synthetic_benchmark" \
        --batch-size 32 --devices=gpu --json --num-warmup-batches 5 --num-batches-per-iter 10 \
        --num-iters 3 --precision "$prec" --resnet-style torchvision >"$raw/dtrain_${name}_$round.txt" 2>&1
      echo "dtrain $name round $round rc $? $(grep -o '"img_sec_per_device":[0-9.]*' "$raw/dtrain_${name}_$round.txt")" | tee -a "$sum"
    done
    echo "torch round $round: $(timeout 90 python3 bench/gpu/torch_peers.py resnet50 --batch-size 32 --math "$prec" 2>&1 | tail -n 1)" | tee -a "$sum"
  done
  if [ "${B256:-1}" = 1 ]; then
    timeout 120 "$b/synthetic_benchmark" --batch-size 256 --devices=gpu --json --num-warmup-batches 3 \
      --num-batches-per-iter 5 --num-iters 3 --precision "$prec" --resnet-style torchvision >"$raw/dtrain_default_b256.txt" 2>&1
    echo "dtrain default b256 rc $? $(grep -o '"img_sec_per_device":[0-9.]*' "$raw/dtrain_default_b256.txt")" | tee -a "$sum"
    echo "torch b256: $(timeout 90 python3 bench/gpu/torch_peers.py resnet50 --batch-size 256 --math "$prec" --batches 5 2>&1 | tail -n 1)" | tee -a "$sum"
  fi
  if [ "${NCU:-1}" = 1 ]; then
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    timeout 150 "$ncu" --csv --metrics gpu__time_duration.sum --clock-control none --cache-control none \
      --launch-count 6000 "$b/synthetic_benchmark" --batch-size 32 --devices=gpu --num-warmup-batches 1 \
      --num-batches-per-iter 1 --num-iters 1 --precision "$prec" --resnet-style torchvision \
      >"$raw/ncu_dtrain_b32.csv" 2>"$raw/ncu_dtrain_b32.err"
    echo "ncu rc $?" | tee -a "$sum"
  fi
  tar -C "$raw" -czf "$out/ab.tgz" .
  ls -la "$out"
  exit 0
fi
if [ "${1:-}" = host ]; then
  timeout 100 "$b/conv_probe" --batch 32 --math fma --layout nhwc >"$out/conv_probe_host.jsonl" 2>&1
  echo "conv_probe rc $?"
  LD_PRELOAD=$stage/lib/libprofiler.so.0 CPUPROFILE=$out/dtrain_host.prof CPUPROFILE_FREQUENCY=1000 \
    timeout 120 "$b/synthetic_benchmark" --batch-size 32 --devices=gpu --json --num-warmup-batches 3 \
    --num-batches-per-iter 10 --num-iters 2 >"$out/dtrain_host.txt" 2>&1
  echo "dtrain rc $?"; tail -n 2 "$out/dtrain_host.txt"; ls -la "$out"
  exit 0
fi
timeout 120 "$b/conv_probe" --batch 32 >"$out/conv_probe.jsonl" 2>&1; echo "conv_probe rc $?"
grep summary "$out/conv_probe.jsonl"
SB="--batch-size 32 --devices=gpu --json"
DTRAIN_LOG_LEVEL=debug timeout 90 "$b/synthetic_benchmark" $SB --num-warmup-batches 5 \
  --num-batches-per-iter 10 --num-iters 2 >"$out/dtrain_b32.txt" 2>&1; echo "dtrain rc $?"
tail -n 3 "$out/dtrain_b32.txt"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
timeout 240 "$ncu" --csv --metrics gpu__time_duration.sum --clock-control none --cache-control none \
  --launch-count 6000 "$b/synthetic_benchmark" $SB --num-warmup-batches 1 --num-batches-per-iter 1 \
  --num-iters 1 >"$out/ncu_dtrain_b32.csv" 2>"$out/ncu_dtrain_b32.err"; echo "ncu rc $?"
tail -n 3 "$out/ncu_dtrain_b32.err"; wc -l "$out/ncu_dtrain_b32.csv"
timeout 90 python3 bench/gpu/torch_peers.py resnet50 --batch-size 32 --math fp32 --iters 2 \
  --profile "$out/torch_b32_fp32_kernels.jsonl" 2>&1 | tail -n 2; echo "torch rc $?"
gzip -9 "$out/ncu_dtrain_b32.csv"; ls -la "$out"
