// DeviceGuard: makes a GPU the calling thread's current CUDA device for a scope and restores the
// previous one afterwards. Kernels may be called from any thread (a replica's worker, the main
// thread, a data loader), so every entry point that issues CUDA work opens one; both calls are
// cheap thread-local operations when the device does not change.
#pragma once

#include <cuda_runtime.h>

#include "devices/cuda/cuda_check.h"

namespace dtrain::cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    DTRAIN_CUDA_CALL(cudaGetDevice(&prev_));
    if (prev_ != index)
      DTRAIN_CUDA_CALL(cudaSetDevice(index));
    else
      prev_ = -1;
  }
  ~DeviceGuard() {
    // Restoring cannot fail for a device that was current a moment ago; a destructor must not
    // throw, so a failure here is left for the next checked call to report.
    if (prev_ >= 0) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;  // the device to restore, or -1 when nothing changed
};

}  // namespace dtrain::cuda
