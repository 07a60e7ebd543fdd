// CudaDevice: one GPU as a dtrain Device — a worker thread for submit(), and a CudaContext
// (stream, cuBLAS and cuDNN handles) shared with its CudaKernels. Also the two entry points
// device.h declares for CUDA builds: cuda_device_count() and make_cuda_device().
#include <future>
#include <mutex>

#include "devices/cuda/cuda_allocator.h"
#include "devices/cuda/cuda_check.h"
#include "devices/cuda/cuda_context.h"
#include "devices/cuda/cuda_kernels.h"
#include "devices/worker_thread.h"
#include "dtrain/core/error.h"
#include "dtrain/core/timeline.h"
#include "dtrain/devices/device.h"

namespace dtrain {
namespace cuda {
namespace {

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int index)
      : ctx_(index),
        kernels_(ctx_),
        // The CUDA context is per device; make it the worker's from the start, as device.h
        // promises. A failure here cannot be thrown from the thread; it surfaces with its message
        // in the first task's future, because every task sets the device again.
        worker_([index] {
          (void)cudaSetDevice(index);
          (void)cudaGetLastError();
          timeline::set_thread_name("GPU:" + std::to_string(index) + " device");
        }) {}

  DeviceSpec spec() const override { return ctx_.spec(); }

  std::string description() const override {
    return detail::str_cat(ctx_.spec().to_string(), " (", ctx_.name(), ", sm_", ctx_.cc_major(),
                           ctx_.cc_minor(), ", ", ctx_.total_memory() >> 30, " GiB, ",
                           ctx_.sm_count(), " SMs)");
  }

  Kernels& kernels() override { return kernels_; }

  std::future<void> submit(std::function<void()> fn) override {
    // Setting the device per task (a thread-local store) keeps it right even if an earlier task
    // switched devices.
    return worker_.submit([index = ctx_.index(), fn = std::move(fn)] {
      DTRAIN_CUDA_CALL(cudaSetDevice(index));
      fn();
    });
  }

  void synchronize() override { ctx_.synchronize(); }

 private:
  CudaContext ctx_;
  CudaKernels kernels_;
  WorkerThread worker_;  // last: destroyed (drained and joined) before what its tasks use
};

}  // namespace
}  // namespace cuda

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    // No driver, no device, or CUDA_VISIBLE_DEVICES hides them all: no GPUs, not an error.
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<Device> make_cuda_device(int index) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw Unavailable(detail::str_cat("GPU:", index, " requested but no CUDA device is usable: ",
                                      cudaGetErrorString(err), " (", cudaGetErrorName(err),
                                      "); check nvidia-smi and CUDA_VISIBLE_DEVICES, or use "
                                      "--devices=cpu"));
  }
  if (n == 0)
    throw Unavailable(detail::str_cat("GPU:", index,
                                      " requested but no CUDA device is visible; "
                                      "check nvidia-smi and CUDA_VISIBLE_DEVICES, or use "
                                      "--devices=cpu"));
  if (index < 0 || index >= n)
    throw NotFound(detail::str_cat("GPU:", index, " does not exist: ", n,
                                   " CUDA device(s) visible (GPU:0 to GPU:", n - 1,
                                   "); CUDA_VISIBLE_DEVICES renumbers them from 0"));
  static std::once_flag registered;
  std::call_once(registered,
                 [] { register_allocator(DeviceType::kCUDA, &cuda::CudaAllocator::instance()); });
  return std::make_unique<cuda::CudaDevice>(index);
}

}  // namespace dtrain
