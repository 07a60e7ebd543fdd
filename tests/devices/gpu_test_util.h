// Shared by the GPU kernel tests (gpu_kernels_test.cc, gpu_training_kernels_test.cc,
// gpu_precision_test.cc, gpu_bf16_steps_test.cc): the devices, random inputs, the CPU-vs-GPU
// comparisons (close to float32 rounding, or bit for bit), and the precision scope and bfloat16
// helpers.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "devices/cuda_testing.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/error.h"
#include "dtrain/core/precision.h"
#include "dtrain/core/random.h"
#include "dtrain/core/tensor.h"
#include "dtrain/devices/device.h"

namespace dtrain::gpu_test {

const DeviceSpec kCpu = DeviceSpec::cpu(0);
const DeviceSpec kGpu = DeviceSpec::gpu(0);

inline Kernels& cpu() { return get_device(kCpu).kernels(); }
inline Kernels& gpu() { return get_device(kGpu).kernels(); }

// Uniform values in [lo, hi) from a Philox stream (host tensor).
inline Tensor random_tensor(const Shape& s, uint64_t stream, float lo = -1.f, float hi = 1.f) {
  Philox rng(2024, stream);
  std::vector<float> v(static_cast<size_t>(s.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = lo + (hi - lo) * rng.uniform(i);
  return Tensor::from_vector(v, s, kCpu);
}

inline Tensor random_labels(int64_t n, int32_t classes, uint64_t stream) {
  Philox rng(7, stream);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<int32_t>(rng.uniform(i) * static_cast<float>(classes)) % classes;
  return Tensor::from_vector(v, Shape{n}, kCpu);
}

// A copy on GPU:0. The device is created first: it registers the CUDA allocator.
inline Tensor G(const Tensor& t) {
  get_device(kGpu);
  return t.to(kGpu);
}

// |cpu - gpu| <= atol + rtol * |cpu| elementwise (NaNs must match NaNs, infinities exactly).
inline void expect_close(const Tensor& c, const Tensor& g, float rtol = 1e-4f, float atol = 1e-4f,
                         const std::string& what = "") {
  ASSERT_TRUE(c.defined() && g.defined()) << what;
  ASSERT_EQ(c.shape().to_string(), g.shape().to_string()) << what;
  ASSERT_EQ(c.dtype(), g.dtype()) << what;
  EXPECT_EQ(g.device(), kGpu) << what;
  const std::vector<float> a = c.to_vector<float>(), b = g.to_vector<float>();
  size_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool ok = (std::isnan(a[i]) && std::isnan(b[i])) || a[i] == b[i] ||
                    std::fabs(a[i] - b[i]) <= atol + rtol * std::fabs(a[i]);
    if (!ok && bad++ < 8)
      ADD_FAILURE() << what << " element " << i << ": cpu " << a[i] << " gpu " << b[i];
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << a.size() << " elements differ";
}

// An element's bytes as hex (most significant first), for messages.
inline std::string hex_bits(const unsigned char* p, size_t n) {
  std::ostringstream o;
  o << "0x" << std::hex << std::setfill('0');
  for (size_t i = n; i-- > 0;) o << std::setw(2) << static_cast<int>(p[i]);
  return o.str();
}

// Whether an element of a floating-point dtype is +0 or -0.
inline bool is_float_zero(const unsigned char* p, DType t) {
  switch (t) {
    case DType::kFloat16:
    case DType::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return (b & 0x7fffu) == 0;
    }
    case DType::kFloat32: {
      uint32_t b;
      std::memcpy(&b, p, 4);
      return (b & 0x7fffffffu) == 0;
    }
    case DType::kFloat64: {
      uint64_t b;
      std::memcpy(&b, p, 8);
      return (b & 0x7fffffffffffffffull) == 0;
    }
    default:
      return false;
  }
}

// Bitwise equality of two tensors' contents (after copying to the host). With
// signed_zeros_equal, +0 and -0 match (the CPU device's oneDNN float32 -> float16 reorder
// returns +0 for -0; see the Cast test).
inline void expect_bitwise_equal(const Tensor& c, const Tensor& g, const std::string& what = "",
                                 bool signed_zeros_equal = false) {
  ASSERT_EQ(c.shape().to_string(), g.shape().to_string()) << what;
  ASSERT_EQ(c.dtype(), g.dtype()) << what;
  const Tensor hc = c.to(kCpu), hg = g.to(kCpu);
  ASSERT_EQ(hc.nbytes(), hg.nbytes());
  const auto* pa = static_cast<const unsigned char*>(hc.raw_data());
  const auto* pb = static_cast<const unsigned char*>(hg.raw_data());
  const size_t elem = dtype_size(c.dtype());
  size_t bad = 0;
  for (size_t i = 0; i < hc.nbytes(); i += elem) {
    if (std::memcmp(pa + i, pb + i, elem) == 0) continue;
    if (signed_zeros_equal && is_float_zero(pa + i, c.dtype()) && is_float_zero(pb + i, c.dtype()))
      continue;
    if (bad++ < 8)
      ADD_FAILURE() << what << " element " << i / elem << " differs bitwise: cpu "
                    << hex_bits(pa + i, elem) << " gpu " << hex_bits(pb + i, elem);
  }
  EXPECT_EQ(bad, 0u) << what;
}

// Convolution problems the GPU tests share (gpu_kernels_test.cc, gpu_precision_test.cc): padding
// symmetric and not, strides, 1x1 (cuBLAS) and larger windows.
struct ConvCase {
  Shape x, w;
  Conv2dParams p;
};

inline std::vector<ConvCase> conv_cases() {
  std::vector<ConvCase> cases;
  cases.push_back({Shape{2, 7, 9, 3}, Shape{3, 3, 3, 5}, {1, 1, 1, 1, 1, 1}});  // same, symmetric
  cases.push_back({Shape{2, 8, 8, 4}, Shape{3, 3, 4, 6}, {2, 2, 0, 1, 0, 1}});  // same, stride 2
  cases.push_back({Shape{3, 6, 5, 2}, Shape{1, 1, 2, 7}, {1, 1, 0, 0, 0, 0}});  // 1x1 (a GEMM)
  cases.push_back(
      {Shape{2, 7, 8, 5}, Shape{1, 1, 5, 6}, {2, 2, 0, 0, 0, 0}});  // 1x1 stride 2, odd H
  cases.push_back({Shape{2, 9, 7, 3}, Shape{1, 1, 3, 4}, {3, 2, 0, 0, 0, 0}});  // 1x1 strides 3x2
  cases.push_back({Shape{1, 11, 10, 3}, Shape{5, 5, 3, 4}, {2, 2, 2, 2, 2, 2}});
  cases.push_back({Shape{2, 9, 9, 1}, Shape{2, 2, 1, 3}, {1, 2, 1, 0, 0, 1}});  // asymmetric both
  cases.push_back({Shape{4, 12, 12, 8}, Shape{3, 3, 8, 16}, {1, 1, 0, 0, 0, 0}});  // valid
  return cases;
}

inline std::string conv_name(const ConvCase& c) {
  return "x " + c.x.to_string() + " w " + c.w.to_string() + " stride " +
         std::to_string(c.p.stride_h) + "x" + std::to_string(c.p.stride_w) + " pad " +
         std::to_string(c.p.pad_top) + std::to_string(c.p.pad_bottom) +
         std::to_string(c.p.pad_left) + std::to_string(c.p.pad_right);
}

// --- precision: shared by gpu_precision_test.cc and gpu_bf16_steps_test.cc ---

// Sets the precision policy and TF32 for a scope; float32 without TF32 again at its end.
struct PrecisionScope {
  PrecisionScope(Precision p, bool tf32) {
    set_precision_policy(p);
    enable_tensor_float_32_execution(tf32);
  }
  ~PrecisionScope() {
    set_precision_policy(Precision::kFloat32);
    enable_tensor_float_32_execution(false);
  }
  PrecisionScope(const PrecisionScope&) = delete;
  PrecisionScope& operator=(const PrecisionScope&) = delete;
};

// The convolutions so far whose float32 output cuDNN wrote in bfloat16 (no plan with a float32
// output for bfloat16 inputs) and the GPU widened after.
inline int64_t widened_count() { return cuda_testing::conv_outputs_widened_from_bfloat16(); }

// The relative tolerance of a GPU product from bfloat16 operands against the CPU's, given
// widened_count() before it: float32 rounding of the sums (1e-4), or one bfloat16 step twice over
// where its output was written in bfloat16 and widened (as PyTorch's autocast leaves it).
inline float product_rtol(int64_t widened_before) {
  return widened_count() > widened_before ? 1.f / 128 : 1e-4f;
}

inline Tensor widened(Kernels& k, const Tensor& t) {
  return t.dtype() == DType::kFloat32 ? t : k.cast(t, DType::kFloat32);
}
// A host tensor's values rounded to bfloat16 and kept so.
inline Tensor bf16(const Tensor& t) { return cpu().cast(t, DType::kBFloat16); }

}  // namespace dtrain::gpu_test
