// CpuKernels::matmul runs a row-major B wider than its column block as several primitive calls on
// views of B and C (cpu_kernels.cc: oneDNN 2.6 is three times slower on it whole). Every column of
// every block, the uneven last block included, against float64 sums, for each transpose and under
// mixed_bfloat16 (its row-major copies always take the blocked path).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/precision.h"
#include "dtrain/model/ops.h"

namespace dtrain {
namespace {

std::vector<float> wave(int64_t n, float f) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = std::sin(f * static_cast<float>(i));
  return v;
}

// max |got - a b| over every element, and the largest |a b|, with a = op(A), b = op(B) as stored.
struct Error {
  double worst = 0, scale = 0;
};
Error compare(const std::vector<float>& av, const std::vector<float>& bv, int64_t m, int64_t k,
              int64_t n, bool ta, bool tb, const std::vector<float>& got, bool round) {
  const auto r = [&](float f) { return round ? bf16_to_float(float_to_bf16(f)) : f; };
  Error e;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double want = 0;
      for (int64_t p = 0; p < k; ++p) {
        const float a = av[static_cast<size_t>(ta ? p * m + i : i * k + p)];
        const float b = bv[static_cast<size_t>(tb ? j * k + p : p * n + j)];
        want += static_cast<double>(r(a)) * r(b);
      }
      e.worst = std::max(e.worst, std::abs(want - got[static_cast<size_t>(i * n + j)]));
      e.scale = std::max(e.scale, std::abs(want));
    }
  return e;
}

void check_all_transposes(int64_t n, bool bf16) {
  const int64_t m = 9, k = 23;
  for (const bool ta : {false, true})
    for (const bool tb : {false, true}) {
      SCOPED_TRACE("n " + std::to_string(n) + (ta ? " A^T" : " A") + (tb ? " B^T" : " B") +
                   (bf16 ? " mixed_bfloat16" : " float32"));
      const std::vector<float> av = wave(m * k, 0.37f), bv = wave(k * n, 0.011f);
      const Tensor a = Tensor::from_vector(av, ta ? Shape{k, m} : Shape{m, k});
      const Tensor b = Tensor::from_vector(bv, tb ? Shape{n, k} : Shape{k, n});
      const Tensor c = ops::matmul(a, b, ta, tb);
      ASSERT_EQ(c.shape(), (Shape{m, n}));
      const Error e = compare(av, bv, m, k, n, ta, tb, c.to_vector<float>(), bf16);
      EXPECT_GT(e.scale, 0.3);
      EXPECT_LT(e.worst, 1e-5 * e.scale);  // float32 sums of 23 products (exact ones under bf16)
    }
}

// 1,536 columns: one call; 1,537: two blocks of 784 and 753; 3,013: two blocks of 1,520 and 1,493;
// 4,700: four blocks of 1,184 and a last of 1,148.
TEST(CpuMatmul, WideRowMajorProductsEqualFloat64InEveryColumnBlock) {
  for (const int64_t n : {1536, 1537, 3013, 4700}) check_all_transposes(n, false);
}

// Restores float32 and the process's kernel choice however the test leaves.
struct MixedBf16 {
  MixedBf16() { set_precision_policy(Precision::kMixedBFloat16); }
  ~MixedBf16() {
    cpu::force_bf16_emulation_for_testing(false);
    cpu::force_bf16_native_for_testing(false);
    set_precision_policy(Precision::kFloat32);
  }
};

// Emulated (float32 kernels on rounded copies) everywhere; oneDNN's bfloat16 kernels where the CPU
// has them.
TEST(CpuMatmul, WideProductsUnderMixedBfloat16EqualSumsOfRoundedOperands) {
  MixedBf16 policy;
  for (const bool emulated : {true, false}) {
    if (!emulated && !cpu::bf16_kernel_choice().available) continue;
    cpu::force_bf16_emulation_for_testing(emulated);
    cpu::force_bf16_native_for_testing(!emulated);
    for (const int64_t n : {1537, 3013}) check_all_transposes(n, true);
  }
}

}  // namespace
}  // namespace dtrain
