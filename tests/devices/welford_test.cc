// The GPU batch norm's one-pass statistics (src/devices/cuda/welford.h), the same formulas run on
// the CPU in the kernel's order (nvcc may fuse their multiply-adds, so not the GPU's exact bits):
// each of 8 threads of a channel takes every 8th row of a chunk of rows, the 8 are merged in order,
// then the chunks in order, all on x less the channel's first value (cuda_batch_norm.cu's
// bn_moments_kernel and bn_moments_finish). Against float64 two-pass statistics, on data where
// E[x^2] - mean^2 in float32 loses every digit. The kernels themselves run in gpu_kernels_test (a
// GPU machine).
#include "devices/cuda/welford.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace dtrain::cuda {
namespace {

constexpr int64_t kThreadRows = 8;  // reduce_detail::kColRows

// x less its first value (the kernel's shift), then the mean shifted back.
Moments kernel_order(const std::vector<float>& x, int64_t rows_per_chunk) {
  const int64_t rows = static_cast<int64_t>(x.size());
  const float shift = x[0];
  Moments total;
  for (int64_t r0 = 0; r0 < rows; r0 += rows_per_chunk) {
    const int64_t r1 = std::min(rows, r0 + rows_per_chunk);
    Moments block;
    for (int64_t t = 0; t < kThreadRows; ++t) {
      Moments a;
      for (int64_t r = r0 + t; r < r1; r += kThreadRows) welford_push(a, x[r] - shift);
      block = t == 0 ? a : welford_merge(block, a);
    }
    total = welford_merge(total, block);
  }
  total.mean += shift;
  return total;
}

struct Exact {
  double mean, var;
};
Exact exact(const std::vector<float>& x) {
  double s = 0;
  for (float v : x) s += v;
  const double mean = s / static_cast<double>(x.size());
  double q = 0;
  for (float v : x) q += (v - mean) * (v - mean);
  return {mean, q / static_cast<double>(x.size())};
}

std::vector<float> normal(int64_t n, float mean, float stddev, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(mean, stddev);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = d(gen);
  return x;
}

// ResNet-50's first batch norm at batch 32 (32 x 112 x 112 rows; on an H200, 264 chunks of 1,521
// rows for its 64 channels), its last (32 x 7 x 7; 8 chunks of 196), and a channel far from zero.
TEST(Welford, MatchesFloat64InTheKernelsOrder) {
  struct Case {
    int64_t rows, per;
    float mean, stddev;
  };
  for (const Case& c :
       {Case{401408, 1521, 0.3f, 1.f}, Case{1568, 196, -2.f, 0.5f},
        Case{100352, 392, 1000.f, 0.25f}, Case{50000, 50000, 3.f, 1e-3f}, Case{37, 5, 1.f, 1.f}}) {
    const std::vector<float> x =
        normal(c.rows, c.mean, c.stddev, 7 + static_cast<uint32_t>(c.rows));
    const Exact e = exact(x);
    const Moments m = kernel_order(x, c.per);
    EXPECT_EQ(m.n, static_cast<float>(c.rows));
    const double var = m.m2 / m.n;
    // The mean to a few of its float32 ulps, the variance to 2e-6 of itself (measured: at most
    // 6.1e-7; without the shift, 9e-5 where std is 1/3000 of the mean).
    EXPECT_NEAR(m.mean, e.mean, 4e-7 * std::fabs(e.mean) + 1e-6 * std::sqrt(e.var))
        << c.rows << " rows, mean " << c.mean;
    EXPECT_NEAR(var, e.var, 2e-6 * e.var) << c.rows << " rows, mean " << c.mean;
  }
}

// The data above is hard: one pass of E[x^2] - mean^2 in float32 (what Welford replaces) is off by
// far more than the tolerance there.
TEST(Welford, TheOffsetCaseDefeatsANaiveOnePass) {
  const std::vector<float> x = normal(100352, 1000.f, 0.25f, 7 + 100352);
  const Exact e = exact(x);
  float s = 0.f, q = 0.f;
  for (float v : x) {
    s += v;
    q += v * v;
  }
  const float mean = s / static_cast<float>(x.size());
  const double naive = q / static_cast<float>(x.size()) - mean * mean;
  EXPECT_GT(std::fabs(naive - e.var), 0.1 * e.var);
}

TEST(Welford, ConstantAndSingleValuesAreExact) {
  const std::vector<float> same(5000, 3.14159f);
  const Moments m = kernel_order(same, 700);
  EXPECT_EQ(m.mean, 3.14159f);
  EXPECT_EQ(m.m2, 0.f);
  const Moments one = kernel_order({-2.5f}, 64);  // 7 of the 8 threads see no row
  EXPECT_EQ(one.n, 1.f);
  EXPECT_EQ(one.mean, -2.5f);
  EXPECT_EQ(one.m2, 0.f);
}

TEST(Welford, MergeWithAnEmptySideIsThatSide) {
  Moments a;
  for (float v : {1.f, 2.f, 4.f}) welford_push(a, v);
  const Moments l = welford_merge(Moments{}, a), r = welford_merge(a, Moments{});
  for (const Moments& m : {l, r}) {
    EXPECT_EQ(m.n, a.n);
    EXPECT_EQ(m.mean, a.mean);
    EXPECT_EQ(m.m2, a.m2);
  }
  EXPECT_FLOAT_EQ(a.mean, 7.f / 3.f);
  EXPECT_FLOAT_EQ(a.m2 / a.n, 14.f / 9.f);
}

// NaN and infinity reach the statistics, as in the two-pass kernels.
TEST(Welford, NonFiniteValuesReachTheResult) {
  std::vector<float> x = normal(1000, 0.f, 1.f, 3);
  x[517] = NAN;
  Moments m = kernel_order(x, 128);
  EXPECT_TRUE(std::isnan(m.mean));
  x[517] = INFINITY;
  m = kernel_order(x, 128);
  EXPECT_TRUE(std::isinf(m.mean) || std::isnan(m.mean));
  EXPECT_TRUE(std::isnan(m.m2));
}

}  // namespace
}  // namespace dtrain::cuda
