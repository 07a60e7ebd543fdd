// Helpers shared by the CPU device's internal tests (cpu_bf16_test, cpu_batch_norm_test).
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/precision.h"

namespace dtrain {

// mixed_bfloat16 on oneDNN's bfloat16 kernels (whatever they measured on this CPU) for a scope;
// float32 and the measured choice again however the test leaves.
struct MixedBf16 {
  MixedBf16() {
    set_precision_policy(Precision::kMixedBFloat16);
    cpu::force_bf16_native_for_testing(true);
  }
  ~MixedBf16() {
    cpu::force_bf16_native_for_testing(false);
    set_precision_policy(Precision::kFloat32);
  }
};

// mixed_bfloat16 for a scope, on whichever kernels the CPU device chose; float32 again however the
// test leaves.
struct MixedPolicy {
  MixedPolicy() { set_precision_policy(Precision::kMixedBFloat16); }
  ~MixedPolicy() { set_precision_policy(Precision::kFloat32); }
};

// n values of sin(f i + 0.3): test data without a random generator.
inline std::vector<float> wave(size_t n, float f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::sin(f * static_cast<float>(i) + 0.3f);
  return v;
}

}  // namespace dtrain
