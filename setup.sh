#!/usr/bin/env bash
# dtrain set-up: installs what is missing (Debian/Ubuntu packages), builds, then
#   ./setup.sh demo   trains the reference CNN on Fashion-MNIST
#   ./setup.sh test   runs the whole test suite (what CI runs)
#   ./setup.sh build  only builds
# Environment: BUILD_DIR (default build), JOBS (default: number of cores), DTRAIN_WITH_CUDA
# (AUTO/ON/OFF; AUTO compiles the CUDA device when nvcc and cuDNN are present).
set -euo pipefail
cd "$(dirname "$0")"
what=${1:-demo}
case "$what" in demo|test|build) ;; *) echo "usage: $0 demo|test|build" >&2; exit 2;; esac

packages=(build-essential cmake python3 libdnnl-dev nlohmann-json3-dev libboost-dev libgtest-dev
          libcli11-dev zlib1g-dev libssl-dev libopenmpi-dev openmpi-bin dataset-fashion-mnist)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WITH_CUDA="${DTRAIN_WITH_CUDA:-AUTO}" >/dev/null
cmake --build "$build" -j "$jobs"

case "$what" in
  demo)
    "$build/examples/fashion_mnist" --strategy=mirrored --devices=cpu:2 --epochs=5 ;;
  test)
    cd "$build" && ctest --output-on-failure -j "$jobs" ;;
esac
