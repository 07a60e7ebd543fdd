#!/usr/bin/env bash
# The GPU lease's scripts, run here without a GPU (a plumbing test: a wasted lease costs 15 minutes
# of device time that come rarely). bench/gpu/bundle.sh packs the CUDA build (skipped, 77, without
# one), then bench/gpu/lease.sh runs against it with a stand-in nvidia-smi: every step must start
# (the dtrain and PyTorch rows then fail at once, having no GPU or no torch), in the order the lease
# needs, and leave under $OUT the seven files the device tool brings back (at most eight, at most
# two folders down), each results.jsonl row with its label, rc and wall_s, and the bundle without
# glibc's libraries (the GPU machine's own must load).
#   tests/bench/gpu_lease_test.sh BUILD_DIR DTRAIN_HAVE_CUDA
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$1
[ "${2:-OFF}" = ON ] || { echo "a build without CUDA: skipped"; exit 77; }
for f in tests/gpu_kernels_test examples/synthetic_benchmark examples/gpt tools/conv_probe tools/dtrain-run; do
  [ -x "$build/$f" ] || { echo "no $build/$f (examples or tools not built): skipped"; exit 77; }
done
t=$(mktemp -d); trap 'rm -rf "$t"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
XZ_OPT=-0 GPU_BUNDLE=$t/bundle.tar.xz "$root/bench/gpu/bundle.sh" "$build" || fail "bundle.sh exited $?"
libs=$(tar -tJf "$t/bundle.tar.xz")
grep -q '^./lib/libdnnl' <<<"$libs" || fail "the bundle has no oneDNN: $libs"
if grep -E '^./lib/(libc|libm|libmvec|libstdc\+\+|libcudart|libcudnn)\.so' <<<"$libs"; then
  fail "the bundle carries glibc's, libstdc++'s or CUDA's own libraries"
fi
mkdir -p "$t/bin"
cat >"$t/bin/nvidia-smi" <<'SMI'
#!/bin/sh
case "$*" in
  *-lms*) while :; do echo 0; sleep 0.1; done ;;
  *) echo "stand-in GPU, 0, 0 MiB" ;;
esac
SMI
chmod +x "$t/bin/nvidia-smi"
# (no GPU visible even where the machine has one: the rows must fail at once, as here)
(cd "$t" && PATH=$t/bin:$PATH OUT=$t/out GPU_BUNDLE=$t/bundle.tar.xz GPU_STAGE=$t/stage \
  CUDA_VISIBLE_DEVICES= timeout 240 "$root/bench/gpu/lease.sh") >"$t/lease.txt" 2>&1
rc=$?
cat "$t/lease.txt"
[ $rc = 0 ] || fail "lease.sh exited $rc"
files=$(cd "$t/out" && find . -type f | LC_ALL=C sort | tr '\n' ' ')
want="./ab/ab.tgz ./ab/ab_summary.txt ./ab/machine.txt ./r/log.txt ./r/machine.txt ./r/outputs.log ./r/results.jsonl "
[ "$files" = "$want" ] || fail "files under OUT: $files (want $want)"
python3 - "$t/out/r/results.jsonl" "$t/out/r/outputs.log" <<'PY' || fail "results.jsonl"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
labels = [r["label"] for r in rows]
want = ["kernels", "dtrain_resnet50_b32", "torch_resnet50_b32_fp32", "dtrain_resnet50_b32_bf16",
        "torch_resnet50_b32_bf16", "dtrain_resnet50_b32_autotune", "dtrain_resnet50_b32_bn2pass",
        "kernels_bf16_fallbacks", "kernels_autotune", "dtrain_resnet50_b256",
        "torch_resnet50_b256_fp32", "dtrain_resnet50_b256_bf16", "torch_resnet50_b256_bf16",
        "dtrain_gpt2_c1024_b8", "dtrain_gpt2_c1024_b8_bf16", "torch_gpt2_c1024_b8_fp32",
        "torch_gpt2_c1024_b8_bf16"]
assert labels == want, labels
assert all(isinstance(r["rc"], int) and isinstance(r["wall_s"], int) for r in rows), rows
# without a GPU the kernel tests skip (rc 0) and the dtrain rows refuse --devices=gpu by name
assert [r["rc"] for r in rows if r["label"].startswith("kernels")] == [0, 0, 0], rows
log = open(sys.argv[2]).read()
assert log.count("== ") >= len(want) and "--devices=gpu asks for GPUs" in log, log[:2000]
print("results.jsonl:", len(rows), "rows in the lease's order")
PY
grep -q 'dtrain default round 2' "$t/out/ab/ab_summary.txt" || fail "ab_summary.txt: $(cat "$t/out/ab/ab_summary.txt")"
ab=$(tar -tzf "$t/out/ab/ab.tgz")
grep -q 'dtrain_nondet_2.txt' <<<"$ab" || fail "ab.tgz lacks the rounds' outputs: $ab"
echo "ok: the lease's scripts run, in order, and leave seven files"
