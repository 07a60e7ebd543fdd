// CpuKernels::matmul runs some large products as blocks, one primitive call each on views of the
// operands (cpu_kernels.cc: oneDNN 2.6 is up to three times slower on them whole): C's columns over
// a wide row-major B, the inner dimension over an untransposed A and a row-major B (later blocks
// adding into C), C's rows over a tall transposed A (float32). Every element of every block, uneven
// last blocks included, against float64 sums, for each transpose and under mixed_bfloat16 (whose
// row-major copies take the column blocks whatever the transposes).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/precision.h"
#include "dtrain/devices/device.h"
#include "dtrain/devices/kernels.h"
#include "dtrain/model/ops.h"

namespace dtrain {
namespace {

std::vector<float> wave(int64_t n, float f) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = std::sin(f * static_cast<float>(i));
  return v;
}

// max |got - a b| over every element, and the largest sum |a_ip b_pj| (what bounds the rounding
// error of a float32 sum), with a = op(A), b = op(B) as stored.
struct Error {
  double worst = 0, scale = 0;
};
Error compare(const std::vector<float>& av, const std::vector<float>& bv, int64_t m, int64_t k,
              int64_t n, bool ta, bool tb, const std::vector<float>& got, bool round) {
  const auto r = [&](float f) { return round ? bf16_to_float(float_to_bf16(f)) : f; };
  Error e;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double want = 0, magnitude = 0;
      for (int64_t p = 0; p < k; ++p) {
        const float a = av[static_cast<size_t>(ta ? p * m + i : i * k + p)];
        const float b = bv[static_cast<size_t>(tb ? j * k + p : p * n + j)];
        want += static_cast<double>(r(a)) * r(b);
        magnitude += std::abs(static_cast<double>(r(a)) * r(b));
      }
      e.worst = std::max(e.worst, std::abs(want - got[static_cast<size_t>(i * n + j)]));
      e.scale = std::max(e.scale, magnitude);
    }
  return e;
}

// all_transposes false: A and B untransposed only (where every block kind but rows applies).
void check_all_transposes(int64_t m, int64_t k, int64_t n, bool bf16, bool all_transposes = true) {
  for (const bool ta : {false, true})
    for (const bool tb : {false, true}) {
      if ((ta || tb) && !all_transposes) continue;
      SCOPED_TRACE(std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n) +
                   (ta ? " A^T" : " A") + (tb ? " B^T" : " B") +
                   (bf16 ? " mixed_bfloat16" : " float32"));
      const std::vector<float> av = wave(m * k, 0.37f), bv = wave(k * n, 0.0113f);
      const Tensor a = Tensor::from_vector(av, ta ? Shape{k, m} : Shape{m, k});
      const Tensor b = Tensor::from_vector(bv, tb ? Shape{n, k} : Shape{k, n});
      const Tensor c = ops::matmul(a, b, ta, tb);
      ASSERT_EQ(c.shape(), (Shape{m, n}));
      const Error e = compare(av, bv, m, k, n, ta, tb, c.to_vector<float>(), bf16);
      EXPECT_GT(e.scale, 1.0);
      EXPECT_LT(e.worst, 1e-6 * e.scale);  // float32 sums (of exact products under bf16)
    }
}

// oneDNN 2.6 fixes many kernels' thread count when a primitive is made, so the device's primitive
// cache makes each one under the count it will run with (State::get's work): the device's threads
// for large work, one for small, whatever count the calling thread was left at (here, one after a
// small op: before, a primitive made then ran on one thread ever after).
TEST(CpuMatmul, PrimitivesAreMadeUnderTheThreadCountTheyRunWith) {
  cpu::CpuKernels::State st(3);
  const auto made_under = [&](const std::string& key, int64_t work) {
    int threads = -1;
    st.get<int>(
        key,
        [&] {
          threads = omp_get_max_threads();
          return std::make_shared<int>(0);
        },
        work);
    return threads;
  };
  st.set_threads(1);  // as a small op leaves the thread
  EXPECT_EQ(made_under("large", int64_t{1} << 30), 3);
  EXPECT_EQ(made_under("default", INT64_MAX), 3);
  EXPECT_EQ(made_under("small", cpu::CpuKernels::State::kSerialWork - 1), 1);
  st.set_threads(INT64_MAX);  // as a large op leaves it
  EXPECT_EQ(made_under("small again", 100), 1);
  EXPECT_EQ(made_under("large", int64_t{1} << 30), -1);  // cached: not made again
}

// Columns: 1,536 one call; 1,537 two blocks of 784 and 753; 3,013 two of 1,520 and 1,493; 4,700
// three of 1,184 and a last of 1,148. The inner dimension (untransposed A, 256 rows or more): 3,100
// two blocks of 1,040 and a last of 1,020; 1,537 blocks of 784 and 753. Rows (transposed A): 8,300
// two blocks of 2,768 and a last of 2,764; with 1,540 columns, each of those in two column blocks
// (784 and 756).
TEST(CpuMatmul, BlockedProductsEqualFloat64InEveryBlock) {
  for (const int64_t n : {1536, 1537, 3013, 4700}) check_all_transposes(9, 23, n, false);
  check_all_transposes(257, 3100, 40, false);
  check_all_transposes(256, 1537, 1537, false, false);  // column and inner blocks at once
  check_all_transposes(8300, 23, 40, false);
  check_all_transposes(8300, 7, 1540, false);  // row and column blocks at once
}

// Restores float32 and the process's kernel choice however the test leaves.
struct MixedBf16 {
  MixedBf16() { set_precision_policy(Precision::kMixedBFloat16); }
  ~MixedBf16() {
    cpu::force_bf16_emulation_for_testing(false);
    cpu::force_bf16_native_for_testing(false);
    cpu::force_bf16_amx_for_testing(-1);
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
    for (const int64_t n : {1537, 3013}) check_all_transposes(9, 23, n, true);
    check_all_transposes(257, 3100, 40, true);
  }
}

// On AMX's bfloat16 kernels, a transposed B of 16,384 columns or more (GPT-2's tied output
// layer) runs as column blocks of about 2,048 through a dense scratch block, for products of 256
// rows or more: 16,390 columns are 9 blocks, 8 of 1,824 and a last of 1,798. Every element against
// float64 sums of the rounded operands, with A as it is and transposed; 16,383 columns and 255 rows
// (one product) beside them. bfloat16 copies of the operands give the same result bit for bit.
// Each product counted as blocked or not. (On any CPU with bfloat16 kernels: the blocks are chosen
// as on AMX.)
TEST(CpuMatmul, WideTransposedProductsOnBfloat16KernelsRunInColumnBlocks) {
  if (!cpu::bf16_kernel_choice().available) GTEST_SKIP() << "no bfloat16 kernels on this CPU";
  MixedBf16 policy;
  cpu::force_bf16_native_for_testing(true);
  cpu::force_bf16_amx_for_testing(1);
  Kernels& kern = kernels_for(Tensor::full(Shape{1}, 0.f));
  struct Case {
    int64_t m, k, n;
    bool ta;
  };
  const auto rounded = [](std::vector<float> v) {
    for (float& f : v) f = bf16_to_float(float_to_bf16(f));
    return v;
  };
  for (const Case c :
       {Case{256, 19, 16390, false}, Case{256, 19, 16390, true}, Case{300, 33, 16384, false},
        Case{256, 19, 16383, false}, Case{255, 19, 16390, true}}) {
    SCOPED_TRACE(std::to_string(c.m) + "x" + std::to_string(c.k) + "x" + std::to_string(c.n) +
                 (c.ta ? " A^T" : " A"));
    // (Rounded here, so that the float64 sums need not round each operand again.)
    const std::vector<float> av = rounded(wave(c.m * c.k, 0.37f)),
                             bv = rounded(wave(c.k * c.n, 0.0113f));
    const Tensor a = Tensor::from_vector(av, c.ta ? Shape{c.k, c.m} : Shape{c.m, c.k});
    const Tensor b = Tensor::from_vector(bv, Shape{c.n, c.k});
    const int64_t before = cpu::bf16_blocked_products_for_testing().column_blocks;
    const Tensor got = ops::matmul(a, b, c.ta, true);
    ASSERT_EQ(got.shape(), (Shape{c.m, c.n}));
    const bool blocks = c.m >= 256 && c.n >= 16384;
    EXPECT_EQ(cpu::bf16_blocked_products_for_testing().column_blocks - before, blocks ? 1 : 0);
    const std::vector<float> gv = got.to_vector<float>();
    const Error e = compare(av, bv, c.m, c.k, c.n, c.ta, true, gv, false);
    EXPECT_GT(e.scale, 1.0);
    EXPECT_LT(e.worst, 1e-6 * e.scale);
    const Tensor from_bf16 =
        kern.matmul(kern.cast(a, DType::kBFloat16), kern.cast(b, DType::kBFloat16), c.ta, true);
    EXPECT_EQ(from_bf16.to_vector<float>(), gv);
  }
}

// On the bfloat16 kernels without AMX, an untransposed A with an inner dimension of 16,384 or more
// (g E, the gradient through GPT-2's tied output layer) runs in blocks of that dimension, and a
// transposed A of 16,384 rows or more (g^T x, the embedding's gradient) in blocks of C's rows, for
// a row-major B and at least 256 of the other dimension of A: each block of A cast (or copied) into
// a dense bfloat16 block. 16,390 is 9 blocks, 8 of 1,824 and a last of 1,798. Every element against
// float64 sums of the rounded operands; beside them products one short of either bound and with B
// transposed (one product each). bfloat16 copies of the operands give the same result bit for bit.
// Each product counted as blocked or not. (On any CPU with bfloat16 kernels: the blocks are chosen
// as without AMX.)
TEST(CpuMatmul, LongProductsOnBfloat16KernelsWithoutAmxRunInDenseBlocksOfA) {
  if (!cpu::bf16_kernel_choice().available) GTEST_SKIP() << "no bfloat16 kernels on this CPU";
  MixedBf16 policy;
  cpu::force_bf16_native_for_testing(true);
  cpu::force_bf16_amx_for_testing(0);
  Kernels& kern = kernels_for(Tensor::full(Shape{1}, 0.f));
  struct Case {
    int64_t m, k, n;
    bool ta, tb;
  };
  for (const Case c : {Case{256, 16390, 7, false, false}, Case{300, 16384, 3, false, false},
                       Case{16390, 256, 7, true, false}, Case{16384, 300, 3, true, false},
                       Case{255, 16390, 3, false, false}, Case{256, 16383, 3, false, false},
                       Case{16390, 255, 3, true, false}, Case{16383, 256, 3, true, false},
                       Case{256, 16390, 3, false, true}, Case{16390, 256, 3, true, true}}) {
    SCOPED_TRACE(std::to_string(c.m) + "x" + std::to_string(c.k) + "x" + std::to_string(c.n) +
                 (c.ta ? " A^T" : " A") + (c.tb ? " B^T" : " B"));
    // (Not rounded here: the blocks cast A from float32 themselves; the float64 sums round both.)
    const std::vector<float> av = wave(c.m * c.k, 0.37f), bv = wave(c.k * c.n, 0.0113f);
    const Tensor a = Tensor::from_vector(av, c.ta ? Shape{c.k, c.m} : Shape{c.m, c.k});
    const Tensor b = Tensor::from_vector(bv, c.tb ? Shape{c.n, c.k} : Shape{c.k, c.n});
    const cpu::Bf16BlockedProducts before = cpu::bf16_blocked_products_for_testing();
    const Tensor got = ops::matmul(a, b, c.ta, c.tb);
    ASSERT_EQ(got.shape(), (Shape{c.m, c.n}));
    const bool blocks = !c.tb && std::min(c.m, c.k) >= 256 && (c.ta ? c.m : c.k) >= 16384;
    const cpu::Bf16BlockedProducts after = cpu::bf16_blocked_products_for_testing();
    EXPECT_EQ(after.dense_a_blocks - before.dense_a_blocks, blocks ? 1 : 0);
    EXPECT_EQ(after.column_blocks, before.column_blocks);  // (none without AMX)
    const std::vector<float> gv = got.to_vector<float>();
    const Error e = compare(av, bv, c.m, c.k, c.n, c.ta, c.tb, gv, true);
    EXPECT_GT(e.scale, 1.0);
    EXPECT_LT(e.worst, 1e-6 * e.scale);
    const Tensor from_bf16 =
        kern.matmul(kern.cast(a, DType::kBFloat16), kern.cast(b, DType::kBFloat16), c.ta, c.tb);
    EXPECT_EQ(from_bf16.to_vector<float>(), gv);
  }
}

// bfloat16 operands (the copies ops keep for the backward pass) give the product of their float32
// originals bit for bit, for every transpose: the kernel reads them as they lie (native) or widens
// them (emulated), where it converts float32 ones itself.
TEST(CpuMatmul, BfloatOperandsGiveTheProductOfTheirOriginals) {
  MixedBf16 policy;
  Kernels& k = kernels_for(Tensor::full(Shape{1}, 0.f));
  for (const bool emulated : {true, false}) {
    if (!emulated && !cpu::bf16_kernel_choice().available) continue;
    cpu::force_bf16_emulation_for_testing(emulated);
    cpu::force_bf16_native_for_testing(!emulated);
    for (const bool ta : {false, true})
      for (const bool tb : {false, true}) {
        const int64_t m = 37, kk = 70, n = 29;
        std::vector<float> av(static_cast<size_t>(m * kk)), bv(static_cast<size_t>(kk * n));
        for (size_t i = 0; i < av.size(); ++i) av[i] = std::sin(0.37f * static_cast<float>(i));
        for (size_t i = 0; i < bv.size(); ++i) bv[i] = std::cos(0.91f * static_cast<float>(i));
        const Tensor a = Tensor::from_vector(av, ta ? Shape{kk, m} : Shape{m, kk}),
                     b = Tensor::from_vector(bv, tb ? Shape{n, kk} : Shape{kk, n});
        const Tensor from_f32 = k.matmul(a, b, ta, tb);
        const Tensor from_bf16 =
            k.matmul(k.cast(a, DType::kBFloat16), k.cast(b, DType::kBFloat16), ta, tb);
        EXPECT_EQ(from_bf16.to_vector<float>(), from_f32.to_vector<float>())
            << (emulated ? "emulated" : "native") << " ta " << ta << " tb " << tb;
      }
  }
}

}  // namespace
}  // namespace dtrain
