#include "devices/cuda/cuda_context.h"

#include <cstdlib>
#include <cstring>

#include "devices/cuda/cuda_allocator.h"
#include "devices/cuda/cuda_check.h"
#include "devices/cuda/cuda_guard.h"
#include "dtrain/core/error.h"

namespace dtrain::cuda {

bool env_switch(const char* name, bool fallback, const char* what) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  if (std::strcmp(v, "0") == 0) return false;
  if (std::strcmp(v, "1") == 0) return true;
  throw InvalidArgument(detail::str_cat(name, "=", v, " is not 0 or 1; ", what));
}

CudaContext::CudaContext(int index) : index_(index) {
  DeviceGuard guard(index);
  cudaDeviceProp prop{};
  DTRAIN_CUDA_CALL(cudaGetDeviceProperties(&prop, index));
  name_ = prop.name;
  sm_count_ = prop.multiProcessorCount > 0 ? prop.multiProcessorCount : 1;
  cc_major_ = prop.major;
  cc_minor_ = prop.minor;
  total_memory_ = prop.totalGlobalMem;
  try {
    // Non-blocking: the stream does not synchronise with the legacy default stream, so other
    // libraries' work on stream 0 cannot stall ours.
    DTRAIN_CUDA_CALL(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    DTRAIN_CUBLAS_CALL(cublasCreate(&cublas_));
    DTRAIN_CUBLAS_CALL(cublasSetStream(cublas_, stream_));
    // Plain FP32 GEMMs: TF32 tensor cores would give ~1e-3 relative error and break CPU/GPU
    // equivalence. No reduced-precision reductions: a product split along its inner dimension
    // must not add its partial sums in a bfloat16 output's type (the CPU sums in float32 and
    // rounds once; cuDNN's plans are filtered the same way, cuda_conv_plan.cc). PyTorch allows
    // them by default (allow_bf16_reduced_precision_reduction); dtrain keeps the CPU's numbers.
    DTRAIN_CUBLAS_CALL(cublasSetMathMode(
        cublas_, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                           CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    DTRAIN_CUDNN_CALL(cudnnCreate(&cudnn_));
    DTRAIN_CUDNN_CALL(cudnnSetStream(cudnn_, stream_));
  } catch (...) {
    if (cudnn_) (void)cudnnDestroy(cudnn_);
    if (cublas_) (void)cublasDestroy(cublas_);
    if (stream_) (void)cudaStreamDestroy(stream_);
    throw;
  }
  CudaAllocator::instance().set_stream(index_, stream_);
}

CudaContext::~CudaContext() {
  CudaAllocator::instance().set_stream(index_, nullptr);
  // Errors cannot be thrown from a destructor; at process exit the driver may already be shutting
  // down, and then these calls fail harmlessly.
  if (cudaSetDevice(index_) == cudaSuccess) (void)cudaStreamSynchronize(stream_);
  (void)cudnnDestroy(cudnn_);
  (void)cublasDestroy(cublas_);
  (void)cudaStreamDestroy(stream_);
  (void)cudaGetLastError();
}

std::shared_ptr<Storage> CudaContext::scratch(size_t nbytes) {
  return CudaAllocator::instance().allocate(nbytes, spec());
}

void CudaContext::synchronize() {
  DeviceGuard guard(index_);
  DTRAIN_CUDA_CALL(cudaStreamSynchronize(stream_));
}

}  // namespace dtrain::cuda
