// Turning CUDA runtime, cuBLAS and cuDNN status codes into dtrain errors. Every call into those
// libraries goes through one of the DTRAIN_*_CALL macros, so a failure surfaces as a typed
// dtrain::Error naming the call and the library's own error string: Unavailable for "no device" and
// out-of-memory (the caller can act on those), Internal for everything else (a dtrain bug or a
// broken driver). Internal header of src/devices/cuda; never included from include/.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

namespace dtrain::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t st, const char* call, const char* file,
                                     int line);
[[noreturn]] void throw_cudnn_error(cudnnStatus_t st, const char* call, const char* file, int line);

// Checks the launch of the kernel just issued (bad configuration, missing sm_90 image, ...).
// Asynchronous execution errors surface at the next synchronising call.
void check_launch(const char* kernel_name, const char* file, int line);

}  // namespace dtrain::cuda

#define DTRAIN_CUDA_CALL(expr)                                                       \
  do {                                                                               \
    const cudaError_t dtrain_cuda_err_ = (expr);                                     \
    if (dtrain_cuda_err_ != cudaSuccess)                                             \
      ::dtrain::cuda::throw_cuda_error(dtrain_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define DTRAIN_CUBLAS_CALL(expr)                                                        \
  do {                                                                                  \
    const cublasStatus_t dtrain_cublas_st_ = (expr);                                    \
    if (dtrain_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                     \
      ::dtrain::cuda::throw_cublas_error(dtrain_cublas_st_, #expr, __FILE__, __LINE__); \
  } while (0)

#define DTRAIN_CUDNN_CALL(expr)                                                       \
  do {                                                                                \
    const cudnnStatus_t dtrain_cudnn_st_ = (expr);                                    \
    if (dtrain_cudnn_st_ != CUDNN_STATUS_SUCCESS)                                     \
      ::dtrain::cuda::throw_cudnn_error(dtrain_cudnn_st_, #expr, __FILE__, __LINE__); \
  } while (0)

#define DTRAIN_CHECK_LAUNCH(name) ::dtrain::cuda::check_launch(name, __FILE__, __LINE__)
