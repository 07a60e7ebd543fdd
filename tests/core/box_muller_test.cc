// The initializers' normals through glibc's vector log and cos (src/core/box_muller.h) are the
// scalar path's floats bit for bit, on every path this CPU has, where cos and log are near 0 too;
// and Philox::normal_fill gives Philox::normal's values from any start.
#include "core/box_muller.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dtrain/core/random.h"

namespace dtrain {
namespace {

// 2^25 word pairs: random ones, and runs where the result is near 0 and hardest to get right
// relatively: u2 near 1/4 and 3/4 (cos near 0), u1 near 1 (log near 0), u1 near 0, the extremes.
void test_pairs(std::vector<uint32_t>* w0, std::vector<uint32_t>* w1) {
  constexpr size_t kPairs = size_t{1} << 25, kRun = size_t{1} << 21;
  w0->resize(kPairs);
  w1->resize(kPairs);
  std::mt19937_64 g(2026);
  for (size_t i = 0; i < kPairs; ++i) {
    const uint64_t v = g();
    (*w0)[i] = static_cast<uint32_t>(v);
    (*w1)[i] = static_cast<uint32_t>(v >> 32);
  }
  for (size_t i = 0; i < kRun; ++i) {
    const uint32_t k = static_cast<uint32_t>(i);
    (*w1)[i] = (1u << 30) - static_cast<uint32_t>(kRun / 2) + k;              // u2 ~ 1/4
    (*w1)[kRun + i] = 3u * (1u << 30) - static_cast<uint32_t>(kRun / 2) + k;  // u2 ~ 3/4
    (*w0)[2 * kRun + i] = 0xffffffffu - k;                                    // u1 ~ 1
    (*w0)[3 * kRun + i] = k;                                                  // u1 ~ 0
  }
  (*w0)[4 * kRun] = 0;
  (*w1)[4 * kRun] = 0;
  (*w0)[4 * kRun + 1] = 0xffffffffu;
  (*w1)[4 * kRun + 1] = 0xffffffffu;
}

TEST(BoxMuller, EveryPathGivesTheScalarFloatsBitForBit) {
  std::vector<uint32_t> w0, w1;
  test_pairs(&w0, &w1);
  const int64_t n = static_cast<int64_t>(w0.size()) - 3;  // not a multiple of 4 or 8: tails too
  std::vector<float> want(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) want[static_cast<size_t>(k)] = detail::box_muller(w0[k], w1[k]);
  std::cout << "this CPU's path: " << detail::box_muller_path() << "\n";
  int paths = 0;
  for (const char* path : {"avx512", "avx2", "scalar"}) {
    std::vector<float> got(static_cast<size_t>(n), -1.f);
    if (!detail::box_muller_fill_on(path, w0.data(), w1.data(), n, got.data())) {
      std::cout << path << ": not on this CPU or build\n";
      continue;
    }
    ++paths;
    int64_t differ = 0, first = -1;
    for (int64_t k = 0; k < n; ++k)
      if (std::memcmp(&want[static_cast<size_t>(k)], &got[static_cast<size_t>(k)], 4) != 0) {
        if (first < 0) first = k;
        ++differ;
      }
    EXPECT_EQ(differ, 0) << path << ": " << differ << " of " << n << " differ, the first at "
                         << first << " (words " << (first >= 0 ? w0[first] : 0) << ", "
                         << (first >= 0 ? w1[first] : 0) << ")";
  }
  EXPECT_GE(paths, 1);
}

TEST(BoxMuller, NormalFillIsNormalFromAnyStart) {
  const Philox rng(7, 3);
  // (the last two wrap past 2^64, as normal(i)'s element index does)
  for (const uint64_t first : {uint64_t{0}, uint64_t{1}, uint64_t{1} << 33, (uint64_t{1} << 33) + 5,
                               ~uint64_t{0} - 2, ~uint64_t{0} - 3})
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{255}, int64_t{256},
                            int64_t{257}, int64_t{100003}}) {
      std::vector<float> got(static_cast<size_t>(n) + 1, 12345.f);
      rng.normal_fill(first, n, got.data());
      for (int64_t j = 0; j < n; ++j) {
        const float want = rng.normal(first + static_cast<uint64_t>(j));
        ASSERT_EQ(std::memcmp(&want, &got[static_cast<size_t>(j)], 4), 0)
            << "first " << first << " n " << n << " j " << j << ": " << got[static_cast<size_t>(j)]
            << " against " << want;
      }
      EXPECT_EQ(got[static_cast<size_t>(n)], 12345.f) << "written past n " << n;
    }
}

}  // namespace
}  // namespace dtrain
