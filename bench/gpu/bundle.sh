#!/usr/bin/env bash
# Packs what bench/gpu/run.sh needs on a GPU machine that has CUDA, cuDNN, NCCL and PyTorch but none of
# dtrain's other dependencies: the CUDA build's test and example binaries, the non-CUDA shared libraries
# they load (oneDNN, OpenMPI, ...), and a small text corpus for the GPT example, as one .gpu/bundle.tar.xz
# in the repository root (git-ignored through .git/info/exclude; about 12 MB, under the device tool's
# 64 MiB that travels).
#   bench/gpu/bundle.sh [BUILD_DIR]     (default build; it must be configured with CUDA)
# GPU_BUNDLE=FILE writes the archive there instead (tests/bench/gpu_lease_test.sh); xz honours XZ_OPT.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
out=$stage
# .gpu/ kept out of git, best effort (git's own path for the file: .git/info may not exist yet, and
# .git is a file in a worktree; no git, or no repository, leaves it); not with GPU_BUNDLE elsewhere.
if [ -z "${GPU_BUNDLE:-}" ] && e=$(git -C "$root" rev-parse --git-path info/exclude 2>/dev/null); then
  case $e in /*) ;; *) e=$root/$e ;; esac
  { mkdir -p "${e%/*}" && { grep -qx '/.gpu/' "$e" 2>/dev/null || echo '/.gpu/' >>"$e"; }; } || true
fi
mkdir -p "$out/bin" "$out/lib" "$out/corpus"
bins=("$build/tests/gpu_kernels_test" "$build/examples/synthetic_benchmark" "$build/examples/gpt" "$build/tools/conv_probe"
      "$build/tools/dtrain-run")
for b in "${bins[@]}"; do
  [ -x "$b" ] || { echo "bundle: $b is missing; build it with CUDA first" >&2; exit 1; }
  cp "$b" "$out/bin/"
  strip "$out/bin/$(basename "$b")"
done
# Libraries other than glibc's and the CUDA ones (the GPU machine has its own CUDA, cuDNN, NCCL).
# glibc's libmvec stays behind too: it needs the machine's own ld.so (GLIBC_PRIVATE symbols).
for b in "${bins[@]}"; do ldd "$b"; done | awk '/=> \//{print $1, $3}' | sort -u |
  while read -r name path; do
    case $name in
      libc.so*|libm.so*|libmvec.so*|libdl.so*|libpthread.so*|librt.so*|libstdc++*|libgcc_s*) ;;
      libcuda*|libcublas*|libcudnn*|libnccl*|libcudart*) ;;
      *) cp -L "$path" "$out/lib/$name" ;;
    esac
  done
# gperftools' CPU profiler for `bench/gpu/profile.sh host`, when installed here (google-perftools).
ldc=$(command -v ldconfig || echo /sbin/ldconfig)  # (not on a non-root user's PATH on Debian)
for l in libprofiler.so.0 libunwind.so.8 liblzma.so.5; do
  p=$("$ldc" -p | awk -v l="$l" '$1 == l && /x86-64/ && !f {print $NF; f = 1}')  # no early exit: SIGPIPE under pipefail
  if [ -n "$p" ]; then cp -L "$p" "$out/lib/$l"; fi
done
for f in "$root"/docs/*.md "$root"/README.md; do cp "$f" "$out/corpus/$(basename "$f" .md).txt"; done
dest=${GPU_BUNDLE:-$root/.gpu/bundle.tar.xz}
mkdir -p "$(dirname "$dest")"
tar -C "$out" -cJf "$dest" .
ls -la "$dest"
