# Sourced by bench/gpu/*.sh on the GPU machine: unpacks .gpu/bundle.tar.xz (bench/gpu/bundle.sh; or
# $GPU_BUNDLE) into $stage (/tmp/dtrain-gpu, or $GPU_STAGE), points LD_LIBRARY_PATH at its libraries
# and at the machine's CUDA, cuDNN and NCCL (the toolkit's and the PyTorch wheels' lib folders), and
# sets out (=$OUT or ./gpu-out) and b (the binaries).
out=${OUT:-gpu-out}; mkdir -p "$out"
stage=${GPU_STAGE:-/tmp/dtrain-gpu}; mkdir -p "$stage" && tar -C "$stage" -xJf "${GPU_BUNDLE:-.gpu/bundle.tar.xz}"
libs=$(find /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib /opt/torch/.venv/lib/python3*/site-packages/nvidia \
  \( -name 'libcudnn.so.9' -o -name 'libnccl.so.2' -o -name 'libcublas.so.13' -o -name 'libcudart.so.13' \) \
  -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
export LD_LIBRARY_PATH=$stage/lib:$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
b=$stage/bin
