// CudaContext: the per-GPU state that kernels need — the device index, a non-blocking stream, and
// cuBLAS and cuDNN handles bound to that stream. Owned by the CudaDevice; CudaKernels borrow it.
//
// Every kernel for this GPU is issued on stream(), so kernels are ordered among themselves and
// with the allocator's copies (see cuda_allocator.h) whatever host thread issues them.
// Thread-safety: index()/stream()/scratch() are safe from any thread. cuDNN forbids using one
// handle from two threads at once, so callers hold lock_cudnn() while using cudnn(); cuBLAS calls
// take lock_cublas() for the same reason.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <memory>
#include <mutex>
#include <string>

#include "dtrain/core/allocator.h"
#include "dtrain/core/device_spec.h"

namespace dtrain::cuda {

// An on/off switch of the CUDA device read from the environment: unset or empty gives `fallback`,
// "0" and "1" give off and on, anything else throws InvalidArgument naming the variable and `what`
// (what 0 and 1 mean). Callers read it once (a function-local static).
bool env_switch(const char* name, bool fallback, const char* what);

class CudaContext {
 public:
  // Creates the stream and handles on GPU `index`. Throws Unavailable / Internal.
  explicit CudaContext(int index);
  ~CudaContext();
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  int index() const { return index_; }
  DeviceSpec spec() const { return DeviceSpec::gpu(index_); }
  cudaStream_t stream() const { return stream_; }
  int sm_count() const { return sm_count_; }
  const std::string& name() const { return name_; }
  int cc_major() const { return cc_major_; }
  int cc_minor() const { return cc_minor_; }
  size_t total_memory() const { return total_memory_; }

  std::unique_lock<std::mutex> lock_cudnn() { return std::unique_lock<std::mutex>(cudnn_mu_); }
  cudnnHandle_t cudnn() const { return cudnn_; }
  std::unique_lock<std::mutex> lock_cublas() { return std::unique_lock<std::mutex>(cublas_mu_); }
  cublasHandle_t cublas() const { return cublas_; }

  // Temporary device memory from the caching allocator. It may be released as soon as the work
  // using it has been enqueued on stream(): the allocator reuses blocks in stream order.
  std::shared_ptr<Storage> scratch(size_t nbytes);
  // Blocks until everything issued on stream() has finished; throws for an asynchronous error.
  void synchronize();

 private:
  int index_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
  std::mutex cudnn_mu_, cublas_mu_;
  int sm_count_ = 1;
  int cc_major_ = 0, cc_minor_ = 0;
  size_t total_memory_ = 0;
  std::string name_;
};

}  // namespace dtrain::cuda
