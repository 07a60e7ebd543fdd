#include "devices/cuda/cuda_check.h"

#include <cstring>
#include <string>

#include "dtrain/core/error.h"

namespace dtrain::cuda {
namespace {

const char* base_name(const char* file) {
  const char* slash = std::strrchr(file, '/');
  return slash ? slash + 1 : file;
}

std::string where(const char* call, const char* file, int line) {
  return detail::str_cat(call, " (", base_name(file), ":", line, ")");
}

}  // namespace

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  // Clear the runtime's "last error" so that a later launch check does not report this one again
  // (sticky errors stay set whatever we do; those poison the context anyway).
  (void)cudaGetLastError();
  const std::string msg =
      detail::str_cat("CUDA call ", where(call, file, line), " failed: ", cudaGetErrorString(err),
                      " (", cudaGetErrorName(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation:
      throw Unavailable(msg + "; the GPU is out of memory: reduce the batch size or the model");
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInvalidDevice:
      throw Unavailable(msg +
                        "; check nvidia-smi and CUDA_VISIBLE_DEVICES, or run with --devices=cpu");
    default:
      throw Internal(msg);
  }
}

void throw_cublas_error(cublasStatus_t st, const char* call, const char* file, int line) {
  const std::string msg = detail::str_cat("cuBLAS call ", where(call, file, line),
                                          " failed: ", cublasGetStatusString(st));
  if (st == CUBLAS_STATUS_ALLOC_FAILED)
    throw Unavailable(msg + "; the GPU is out of memory: reduce the batch size or the model");
  if (st == CUBLAS_STATUS_NOT_INITIALIZED)
    throw Unavailable(msg +
                      "; the CUDA driver or device could not be initialised (check nvidia-smi)");
  throw Internal(msg);
}

void throw_cudnn_error(cudnnStatus_t st, const char* call, const char* file, int line) {
  const std::string msg =
      detail::str_cat("cuDNN call ", where(call, file, line), " failed: ", cudnnGetErrorString(st),
                      " (status ", static_cast<int>(st), ")");
  if (st == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED ||
      st == CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED)
    throw Unavailable(msg + "; out of memory: reduce the batch size or the model");
  if (st == CUDNN_STATUS_NOT_INITIALIZED || st == CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED)
    throw Unavailable(msg + "; check that cuDNN 9 and a CUDA driver are installed (nvidia-smi)");
  throw Internal(msg);
}

void check_launch(const char* kernel_name, const char* file, int line) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    const std::string call = std::string("launch of ") + kernel_name;
    throw_cuda_error(err, call.c_str(), file, line);
  }
}

}  // namespace dtrain::cuda
