// RAII wrappers for the cuDNN descriptors used by convolution and pooling. Activations are NHWC
// float32; filters are KRSC ([out, kh, kw, in], cuDNN's NHWC filter format), which is why
// cuda_conv.cc transposes TensorFlow's HWIO filters. Descriptors are cheap host objects, made per
// call. Destroy failures cannot be reported from a destructor and leak nothing worth a crash.
#pragma once

#include <cudnn.h>

#include <climits>
#include <cstdint>

#include "devices/cuda/cuda_check.h"
#include "dtrain/core/error.h"

namespace dtrain::cuda {

// cuDNN's legacy API takes int dimensions.
inline int cudnn_dim(int64_t v, const char* op) {
  if (v < 0 || v > INT_MAX)
    throw InvalidArgument(detail::str_cat(op, ": dimension ", v,
                                          " does not fit cuDNN's 32-bit sizes; split the batch"));
  return static_cast<int>(v);
}

class TensorDesc {
 public:
  TensorDesc() { DTRAIN_CUDNN_CALL(cudnnCreateTensorDescriptor(&d_)); }
  ~TensorDesc() { (void)cudnnDestroyTensorDescriptor(d_); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
  // A float32 NHWC tensor [n, h, w, c].
  void set_nhwc(int64_t n, int64_t h, int64_t w, int64_t c, const char* op) {
    DTRAIN_CUDNN_CALL(cudnnSetTensor4dDescriptor(d_, CUDNN_TENSOR_NHWC, CUDNN_DATA_FLOAT,
                                                 cudnn_dim(n, op), cudnn_dim(c, op),
                                                 cudnn_dim(h, op), cudnn_dim(w, op)));
  }
  cudnnTensorDescriptor_t get() const { return d_; }

 private:
  cudnnTensorDescriptor_t d_ = nullptr;
};

class FilterDesc {
 public:
  FilterDesc() { DTRAIN_CUDNN_CALL(cudnnCreateFilterDescriptor(&d_)); }
  ~FilterDesc() { (void)cudnnDestroyFilterDescriptor(d_); }
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
  // A float32 KRSC filter: memory [out, kh, kw, in].
  void set_krsc(int64_t out, int64_t kh, int64_t kw, int64_t in, const char* op) {
    DTRAIN_CUDNN_CALL(cudnnSetFilter4dDescriptor(d_, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NHWC,
                                                 cudnn_dim(out, op), cudnn_dim(in, op),
                                                 cudnn_dim(kh, op), cudnn_dim(kw, op)));
  }
  cudnnFilterDescriptor_t get() const { return d_; }

 private:
  cudnnFilterDescriptor_t d_ = nullptr;
};

class ConvDesc {
 public:
  ConvDesc() { DTRAIN_CUDNN_CALL(cudnnCreateConvolutionDescriptor(&d_)); }
  ~ConvDesc() { (void)cudnnDestroyConvolutionDescriptor(d_); }
  ConvDesc(const ConvDesc&) = delete;
  ConvDesc& operator=(const ConvDesc&) = delete;
  // TensorFlow's convolution is cross-correlation. FMA math keeps FP32 convolutions off TF32 tensor
  // cores, whose ~1e-3 relative error would break equivalence with the CPU device.
  void set(int pad_h, int pad_w, int stride_h, int stride_w) {
    DTRAIN_CUDNN_CALL(cudnnSetConvolution2dDescriptor(d_, pad_h, pad_w, stride_h, stride_w, 1, 1,
                                                      CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    set_math(CUDNN_FMA_MATH);
  }
  void set_math(cudnnMathType_t math) { DTRAIN_CUDNN_CALL(cudnnSetConvolutionMathType(d_, math)); }
  cudnnConvolutionDescriptor_t get() const { return d_; }

 private:
  cudnnConvolutionDescriptor_t d_ = nullptr;
};

class PoolDesc {
 public:
  PoolDesc() { DTRAIN_CUDNN_CALL(cudnnCreatePoolingDescriptor(&d_)); }
  ~PoolDesc() { (void)cudnnDestroyPoolingDescriptor(d_); }
  PoolDesc(const PoolDesc&) = delete;
  PoolDesc& operator=(const PoolDesc&) = delete;
  // Max pooling without padding (callers pad explicitly with -inf, see cuda_pool.cc); `mode` is
  // CUDNN_POOLING_MAX_DETERMINISTIC or CUDNN_POOLING_MAX.
  void set_max(cudnnPoolingMode_t mode, int window_h, int window_w, int stride_h, int stride_w) {
    DTRAIN_CUDNN_CALL(cudnnSetPooling2dDescriptor(d_, mode, CUDNN_PROPAGATE_NAN, window_h, window_w,
                                                  0, 0, stride_h, stride_w));
  }
  cudnnPoolingDescriptor_t get() const { return d_; }

 private:
  cudnnPoolingDescriptor_t d_ = nullptr;
};

}  // namespace dtrain::cuda
