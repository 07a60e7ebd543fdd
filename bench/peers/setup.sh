#!/usr/bin/env bash
# Installs the peers `dtrain-bench compare` measures dtrain against, all on this machine:
#   - TensorFlow 2.21 (tensorflow-cpu), a current PyTorch 2.x with torchvision (bench/input) and numpy
#     (bench/gpt), from PyPI, in a virtual environment
#     (default build/peers-venv; the first argument overrides);
#   - Debian's PyTorch 1.13 (python3-torch), run with /usr/bin/python3;
#   - Gloo (libgloo-dev) for `dtrain-bench allreduce --peer=gloo` (re-run cmake afterwards to build
#     build/tools/gloo_allreduce); OpenMPI comes with the project's own set-up.
# Idempotent: a second run only checks. Needs root (or sudo) for the Debian package.
#
#   bench/peers/setup.sh [VENV]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-$root/build/peers-venv}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

need=()
/usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
/usr/bin/python3 -c 'import torch' 2>/dev/null || need+=(python3-torch)
[ -e /usr/include/gloo/allreduce_ring.h ] || need+=(libgloo-dev)
if [ "${#need[@]}" -gt 0 ]; then
  echo "peers: apt-get install ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "peers: creating $venv"
  /usr/bin/python3 -m venv "$venv"
fi
# TensorFlow and torch are checked in separate interpreters: importing both into one process aborts
# (their bundled LLVMs register the same options).
if ! "$venv/bin/python" -c 'import tensorflow, numpy' 2>/dev/null ||
   ! "$venv/bin/python" -c 'import torch, torchvision' 2>/dev/null; then
  echo "peers: pip install tensorflow-cpu 2.21, torch 2.x and torchvision into $venv (about 1.5 GB the first time)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "tensorflow-cpu==2.21.*" "torch>=2.5" torchvision numpy
fi
tf_version=$("$venv/bin/python" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null)
torch_version=$("$venv/bin/python" -c 'import torch, torchvision; print(torch.__version__, "with torchvision", torchvision.__version__)')
echo "peers: TensorFlow $tf_version, PyTorch $torch_version in $venv"
/usr/bin/python3 -c 'import torch; print(f"peers: Debian PyTorch {torch.__version__} (/usr/bin/python3)")'
