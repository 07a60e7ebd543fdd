#!/usr/bin/env bash
# dtrain set-up: installs what is missing (Debian/Ubuntu packages), builds, then
#   ./setup.sh demo   trains the reference CNN on Fashion-MNIST
#   ./setup.sh test   runs the whole test suite (what CI runs)
#   ./setup.sh build  only builds
#   ./setup.sh deps   only installs the missing packages
# Environment: BUILD_DIR (default build), JOBS (default: number of cores), DTRAIN_WITH_CUDA
# (AUTO/ON/OFF; AUTO compiles the CUDA device when nvcc and cuDNN are present), CTEST_ARGS (extra ctest
# arguments, e.g. "-L unit"; default -LE "acceptance|sanitize").
# Runs as root or as a user with sudo. A second run installs nothing and rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")"
what=${1:-demo}
case "$what" in demo|test|build|deps) ;; *) echo "usage: $0 demo|test|build|deps" >&2; exit 2;; esac

# Debian 12 package names. Debian's oneDNN (libdnnl-dev) is built with its OpenCL GPU runtime, so its
# CMake config (dnnl-config.cmake) needs the OpenCL headers and ICD loader to be found.
packages=(build-essential cmake python3 libdnnl-dev ocl-icd-opencl-dev opencl-headers nlohmann-json3-dev
          libboost-dev libgtest-dev libcli11-dev zlib1g-dev libssl-dev libopenmpi-dev
          openmpi-bin dataset-fashion-mnist libprotobuf-dev protobuf-compiler libjpeg62-turbo-dev libpng-dev python3-venv
          python3-matplotlib iproute2 clang-format doxygen perl-doc ccache)

if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup.sh: this system has no apt/dpkg, so nothing was installed." >&2
  echo "Install the equivalents of these Debian 12 packages with your package manager, then run" >&2
  echo "  cmake -S . -B build && cmake --build build -j && (cd build && ctest)" >&2
  printf '  %s\n' "${packages[@]}" >&2
  exit 1
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}"
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "setup.sh: not root and no sudo; as root, run:" >&2
      echo "  apt-get update && apt-get install -y --no-install-recommends ${missing[*]}" >&2
      exit 1
    fi
    sudo=(sudo)
  fi
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

[ "$what" = deps ] && { echo "setup.sh: all ${#packages[@]} packages are installed"; exit 0; }

build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
# Configure once; later runs let the build step re-run CMake only when a CMake file changed.
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WITH_CUDA="${DTRAIN_WITH_CUDA:-AUTO}" >/dev/null
fi
cmake --build "$build" -j "$jobs"

case "$what" in
  demo)
    "$build/examples/fashion_mnist" --strategy=mirrored --devices=cpu:2 --epochs=5 ;;
  test)
    # TensorBoard's own reader checks dtrain's event files (tensorboard_events_test); it comes from
    # PyPI into a virtual environment beside the build. Without network the test says it skipped.
    if [ ! -x "$build/venv/bin/python" ] || ! "$build/venv/bin/python" -c 'import tensorboard' 2>/dev/null; then
      python3 -m venv "$build/venv" &&
        "$build/venv/bin/pip" install -q --disable-pip-version-check tensorboard ||
        echo "setup.sh: could not install tensorboard from PyPI; tensorboard_events_test will skip" >&2
    fi
    # Labels acceptance (the 5-epoch accuracy bars of the multi-device strategies and bfloat16, about
    # 10 minutes) and sanitize (ASan+UBSan and TSan builds, tools/sanitize.sh) run only when asked:
    # CTEST_ARGS="-L acceptance" ./setup.sh test.
    cd "$build" && ctest --output-on-failure -j "$jobs" ${CTEST_ARGS:--LE "acceptance|sanitize"} ;;
esac
