// mixed_bfloat16 on the CPU device where oneDNN has no bfloat16 kernels (devices/cpu/dnnl_util.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "devices/cpu/cpu_conv_prims.h"
#include "devices/cpu/cpu_kernels.h"
#include "devices/cpu/dnnl_util.h"
#include "devices/cpu_test_util.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/error.h"
#include "dtrain/core/precision.h"
#include "dtrain/devices/device.h"
#include "dtrain/devices/kernels.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"

namespace dtrain {
namespace {

TEST(CpuBf16, WithoutBf16KernelsMixedBfloat16RoundsEveryKernelInput) {
  // On a CPU without oneDNN bfloat16 kernels (AVX2; forced here, so this runs everywhere),
  // mixed_bfloat16 runs the float32 kernels on inputs rounded to bfloat16. So conv2d and matmul
  // and their gradients equal float32 on pre-rounded inputs (the incoming gradients below are
  // bfloat16 values already), and differ from float32 on the raw inputs.
  auto rounded = [](std::vector<float> v) {
    for (float& f : v) f = bf16_to_float(float_to_bf16(f));
    return v;
  };
  std::vector<float> xs(2 * 6 * 6 * 3), ws(3 * 3 * 3 * 4), as(5 * 7), bs(7 * 3);
  for (size_t i = 0; i < xs.size(); ++i) xs[i] = std::sin(0.37f * static_cast<float>(i));
  for (size_t i = 0; i < ws.size(); ++i) ws[i] = std::cos(0.91f * static_cast<float>(i)) * 0.5f;
  for (size_t i = 0; i < as.size(); ++i) as[i] = std::sin(1.3f * static_cast<float>(i));
  for (size_t i = 0; i < bs.size(); ++i) bs[i] = std::cos(0.7f * static_cast<float>(i));
  std::vector<float> dys(2 * 4 * 4 * 4), dzs(5 * 3);
  for (size_t i = 0; i < dys.size(); ++i)
    dys[i] = static_cast<float>(static_cast<int>(i % 7) - 3) / 8.f;
  for (size_t i = 0; i < dzs.size(); ++i)
    dzs[i] = static_cast<float>(static_cast<int>(i % 5) - 2) / 4.f;
  auto run = [&](const std::vector<float>& xv, const std::vector<float>& wv,
                 const std::vector<float>& av, const std::vector<float>& bv) {
    Tensor x = Tensor::from_vector(xv, Shape{2, 6, 6, 3}),
           w = Tensor::from_vector(wv, Shape{3, 3, 3, 4});
    Tensor a = Tensor::from_vector(av, Shape{5, 7}), b = Tensor::from_vector(bv, Shape{7, 3});
    GradientTape tape;
    for (Tensor* t : {&x, &w, &a, &b}) tape.watch(*t);
    const Tensor y = ops::conv2d(x, w, Tensor(), 1, 1, ops::Padding::kValid);
    const Tensor z = ops::matmul(a, b);
    const Tensor loss = ops::add(ops::sum(ops::mul(y, Tensor::from_vector(dys, y.shape()))),
                                 ops::sum(ops::mul(z, Tensor::from_vector(dzs, z.shape()))));
    const auto g = tape.gradient(loss, {x, w, a, b});
    std::vector<std::vector<float>> out{y.to_vector<float>(), z.to_vector<float>()};
    for (const Tensor& t : g) out.push_back(t.to_vector<float>());
    return out;
  };
  const auto raw = run(xs, ws, as, bs),
             on_rounded = run(rounded(xs), rounded(ws), rounded(as), rounded(bs));
  cpu::force_bf16_emulation_for_testing(true);
  set_precision_policy(Precision::kMixedBFloat16);
  std::vector<std::vector<float>> emulated;
  try {
    emulated = run(xs, ws, as, bs);
  } catch (...) {
    set_precision_policy(Precision::kFloat32);
    cpu::force_bf16_emulation_for_testing(false);
    throw;
  }
  set_precision_policy(Precision::kFloat32);
  cpu::force_bf16_emulation_for_testing(false);
  const char* what[] = {"conv2d", "matmul", "conv2d dx", "conv2d dw", "matmul da", "matmul db"};
  ASSERT_EQ(emulated.size(), raw.size());
  for (size_t k = 0; k < raw.size(); ++k) {
    double scale = 0, to_rounded = 0, to_raw = 0;
    for (size_t i = 0; i < raw[k].size(); ++i) {
      scale = std::max(scale, std::abs(static_cast<double>(raw[k][i])));
      to_rounded =
          std::max(to_rounded, std::abs(static_cast<double>(emulated[k][i]) - on_rounded[k][i]));
      to_raw = std::max(to_raw, std::abs(static_cast<double>(emulated[k][i]) - raw[k][i]));
    }
    // float32 kernels on the same values: equal but for the summation order of a transposed copy
    EXPECT_LE(to_rounded, 1e-6 * scale) << what[k];
    EXPECT_GT(to_raw, 1e-4 * scale) << what[k] << ": not rounded to bfloat16";
    EXPECT_LT(to_raw, 3e-2 * scale) << what[k];
  }
  EXPECT_EQ(run(xs, ws, as, bs), raw);  // float32 again, bit for bit
  float odd[] = {1.f + 1.f / 256.f, 1.f + 3.f / 256.f, -2.5f,
                 std::nanf(""),     INFINITY,          std::numeric_limits<float>::max()};
  cpu::round_to_bf16(odd,
                     6);  // ties to even; NaN stays NaN; the largest float rounds up to infinity
  EXPECT_EQ(odd[0], 1.f);
  EXPECT_EQ(odd[1], 1.f + 4.f / 256.f);
  EXPECT_EQ(odd[2], -2.5f);
  EXPECT_TRUE(std::isnan(odd[3]));
  EXPECT_EQ(odd[4], INFINITY);
  EXPECT_EQ(odd[5], INFINITY);
}

// Convolutions on the bfloat16 kernels (where oneDNN has them; else the emulated path): the forward
// pass reads the bfloat16 copy ops::conv2d keeps of x, and both backward kernels one bfloat16
// copy of the incoming gradient. Forward and both gradients equal float32 on the rounded operands
// (the same products, accumulated in float32), for a 3x3 and a 1x1 convolution (the latter's
// backward passes run as matrix products), with and without a bias (summed from the same copy), a
// 1x1 at strides 2 and 3 on bfloat16 kernels (the rows it reads gathered for a matrix product;
// the float32 reference runs the convolution primitives), and for a 3x3 layer of 3 input
// channels, which runs float32 kernels on the rounded operands.
TEST(CpuBf16, ConvolutionsReadBfloat16CopiesOfTheirInputAndGradient) {
  auto rounded = [](std::vector<float> v) {
    for (float& f : v) f = bf16_to_float(float_to_bf16(f));
    return v;
  };
  auto absolute = [](std::vector<float> v) {
    for (float& f : v) f = std::abs(f);
    return v;
  };
  struct Case {
    int64_t k;
    bool bias;
    int64_t cin;
    int stride = 1;
    int64_t h = 6, w = 6;
  };
  for (const Case c : {Case{3, false, 16}, Case{3, true, 16}, Case{1, false, 16}, Case{1, true, 16},
                       Case{1, false, 32, 2}, Case{1, true, 32, 2, 7, 5},
                       Case{1, false, 32, 3, 7, 8}, Case{3, false, 3}}) {
    const Shape xs{2, c.h, c.w, c.cin}, ws{c.k, c.k, c.cin, 32};
    const auto xv = wave(static_cast<size_t>(xs.numel()), 0.37f),
               wv = wave(static_cast<size_t>(ws.numel()), 0.91f), bv = wave(32, 0.5f);
    auto run = [&](const std::vector<float>& x_values, const std::vector<float>& w_values,
                   const std::vector<float>& g_values, const std::vector<float>& b_values) {
      Tensor x = Tensor::from_vector(x_values, xs), w = Tensor::from_vector(w_values, ws);
      Tensor b = c.bias ? Tensor::from_vector(b_values, Shape{32}) : Tensor();
      GradientTape tape;
      tape.watch(x);
      tape.watch(w);
      if (c.bias) tape.watch(b);
      const Tensor y = ops::conv2d(x, w, b, c.stride, c.stride, ops::Padding::kValid);
      const Tensor g = Tensor::from_vector(g_values, y.shape());
      const auto grads =
          tape.gradient(ops::sum(ops::mul(y, g)),
                        c.bias ? std::vector<Tensor>{x, w, b} : std::vector<Tensor>{x, w});
      std::vector<std::vector<float>> out;
      for (const Tensor& t : grads) out.push_back(t.to_vector<float>());
      out.insert(out.begin(), y.to_vector<float>());  // y, dx, dw (, db)
      return out;
    };
    const int64_t oh = (c.h - c.k) / c.stride + 1, ow = (c.w - c.k) / c.stride + 1;
    const auto gv = wave(static_cast<size_t>(2 * oh * ow * 32), 1.3f);
    const auto reference = run(rounded(xv), rounded(wv), rounded(gv), bv);
    // Each output's sum of |products|: the same sums on the operands' magnitudes. Two kernels
    // that add the same products in different orders differ by a few float32 roundings of the
    // partial sums, so each element is held to 4e-6 of its own sum of magnitudes (about 67 of
    // float32's unit roundoff, 2^-24; on Zen 5 every element is within 1/50 of that). It holds
    // for the sums in any order as errors grow here (about sqrt(terms)), not in the worst case
    // (2 x 288 x 2^-24 = 3.4e-5 for dx of the 3x3). An operand read unrounded moves a product by
    // up to 2^-8 of itself (bfloat16's unit roundoff): x read unrounded fails by 60-280x. The
    // inputs are too small for Winograd (one tile), whose transforms the bound would not cover.
    // (A bound of 2e-6 of the largest output, as before, failed on Zen 5's bfloat16 kernels: a
    // 24-term weight gradient off by half an ulp of its partial sums. The new bound is at least
    // 2x looser for the largest output, tighter for the small ones.)
    const auto magnitude =
        run(absolute(rounded(xv)), absolute(rounded(wv)), absolute(rounded(gv)), absolute(bv));
    std::vector<std::vector<float>> mixed;
    {
      MixedBf16 policy;
      mixed = run(xv, wv, gv, bv);
    }
    const char* what[] = {"y", "dx", "dw", "db"};
    for (size_t k = 0; k < reference.size(); ++k) {
      double worst = 0;  // the largest difference over its bound
      size_t at = 0;
      for (size_t i = 0; i < reference[k].size(); ++i) {
        const double diff = std::abs(static_cast<double>(mixed[k][i]) - reference[k][i]);
        const double bound = 4e-6 * magnitude[k][i] + 1e-30;
        if (diff / bound > worst) worst = diff / bound, at = i;
      }
      // (The product's y is not rounded: its output stays float32.)
      EXPECT_LE(worst, 1.0) << what[k] << "[" << at << "]: " << mixed[k][at] << " against "
                            << reference[k][at] << " (sum of magnitudes " << magnitude[k][at]
                            << "), " << c.k << "x" << c.k << ", " << c.cin << " channels, stride "
                            << c.stride << ", " << c.h << "x" << c.w
                            << (c.bias ? ", with a bias" : "");
    }
  }
}

// Which layers run the bfloat16 kernels: those summing 32 products an output or more (3x3x16,
// ResNet's 7x7x3 stem; not 3x3x3 or the reference CNN's 3x3x1), where the CPU has the kernels;
// never outside mixed_bfloat16.
TEST(CpuBf16, LayersWithShortSumsRunFloat32Kernels) {
  Conv2dParams p;
  const bool kernels = cpu::bf16_kernel_choice().available;
  MixedBf16 policy;
  for (const int64_t cin : {1, 3})
    EXPECT_FALSE(
        cpu::conv_reads_bf16(cpu::conv_shapes(Shape{2, 8, 8, cin}, Shape{3, 3, cin, 16}, p), true))
        << cin;
  const cpu::ConvShapes many = cpu::conv_shapes(Shape{2, 8, 8, 16}, Shape{3, 3, 16, 16}, p),
                        stem = cpu::conv_shapes(Shape{2, 16, 16, 3}, Shape{7, 7, 3, 64}, p);
  EXPECT_EQ(cpu::conv_reads_bf16(many, true), kernels);
  EXPECT_EQ(cpu::conv_reads_bf16(stem, true), kernels);
  EXPECT_FALSE(cpu::conv_reads_bf16(many, false));
}

// Those layers' float32 kernels read their operands rounded to bfloat16 (copies rounded as they
// are made): under the policy, the output and the filter's gradient of a 1-channel convolution
// are, bit for bit, those of float32 on rounded x, w and dy.
TEST(CpuBf16, Float32KernelsReadOperandsRoundedToBfloat16) {
  Kernels& k = get_device(DeviceSpec::cpu(0)).kernels();
  const Conv2dParams p;
  const Tensor x = Tensor::from_vector(wave(2 * 9 * 9, 0.37f), Shape{2, 9, 9, 1}),
               w = Tensor::from_vector(wave(3 * 3 * 16, 0.71f), Shape{3, 3, 1, 16}),
               dy = Tensor::from_vector(wave(2 * 7 * 7 * 16, 1.3f), Shape{2, 7, 7, 16});
  const auto rounded = [](const Tensor& t) {
    Tensor r = t.clone();
    cpu::round_to_bf16(static_cast<float*>(r.raw_data()), static_cast<size_t>(r.numel()));
    return r;
  };
  const Tensor y_ref = k.conv2d(rounded(x), rounded(w), Tensor(), p);
  const Tensor dw_ref =
      k.conv2d_backward_filter(rounded(x), rounded(dy), w.shape(), p, false, nullptr);
  ASSERT_NE(y_ref.to_vector<float>(), k.conv2d(x, w, Tensor(), p).to_vector<float>())
      << "rounding changes nothing here: the test would prove nothing";
  MixedBf16 policy;
  EXPECT_EQ(k.conv2d(x, w, Tensor(), p).to_vector<float>(), y_ref.to_vector<float>());
  EXPECT_EQ(k.conv2d_backward_filter(x, dy, w.shape(), p, false, nullptr).to_vector<float>(),
            dw_ref.to_vector<float>());
}

// The fused conv+pool op in chunks under mixed bfloat16, on a 1-channel convolution (float32
// kernels on rounded operands: the reference CNN's first layer), whose pooling's backward pass
// writes the gradient already rounded for them: every output and gradient as conv2d, max_pool2d
// and ReLU apart under the same policy (the forward pass and dx exactly, dw and db to the order
// of the chunks' sums). Fails when the gradient the kernels read is not rounded.
TEST(CpuBf16, FusedConvPoolInChunksRoundsTheGradientItsKernelsRead) {
  MixedBf16 policy;
  const int64_t n = 13;  // 28x28x32 float32 outputs, 100 KB an image: chunks of 5, 5 and 3
  const Tensor x = Tensor::from_vector(wave(n * 30 * 30, 0.37f), Shape{n, 30, 30, 1}),
               w = Tensor::from_vector(wave(3 * 3 * 32, 0.71f), Shape{3, 3, 1, 32}),
               b = Tensor::from_vector(wave(32, 1.9f), Shape{32}),
               dyw = Tensor::from_vector(wave(n * 14 * 14 * 32, 1.3f), Shape{n, 14, 14, 32});
  auto run = [&](bool fused) {
    GradientTape tape;
    Tensor xv = x, wv = w, bv = b;
    tape.watch(xv);
    tape.watch(wv);
    tape.watch(bv);
    const Tensor y =
        fused ? ops::conv2d_max_pool2d(xv, wv, bv, 1, ops::Padding::kValid, 2, 2,
                                       ops::Padding::kValid, /*relu=*/true)
              : ops::relu(ops::max_pool2d(ops::conv2d(xv, wv, bv, 1, 1, ops::Padding::kValid)));
    std::vector<Tensor> out{y};
    for (const Tensor& g : tape.gradient(ops::sum(ops::mul(y, dyw)), {xv, wv, bv}))
      out.push_back(g);
    return out;
  };
  const auto fused = run(true), apart = run(false);
  EXPECT_EQ(fused[0].to_vector<float>(), apart[0].to_vector<float>()) << "forward";
  EXPECT_EQ(fused[1].to_vector<float>(), apart[1].to_vector<float>()) << "dx";
  for (size_t i = 2; i < 4; ++i) {
    const auto f = fused[i].to_vector<float>(), a = apart[i].to_vector<float>();
    ASSERT_EQ(f.size(), a.size());
    double scale = 1e-30, err = 0;
    for (size_t j = 0; j < f.size(); ++j) {
      scale = std::max(scale, std::abs(static_cast<double>(a[j])));
      err = std::max(err, std::abs(static_cast<double>(f[j]) - a[j]));
    }
    EXPECT_LT(err / scale, 1e-5) << (i == 2 ? "dw" : "db");
  }
}

// The convolution's input gradient refuses a bfloat16 filter (its primitive read it as float32)
// and gives zeros where there are no output channels (the matrix-product path divided by zero),
// for a 1x1 filter (a matrix product) and a 3x3 one (the primitive); found by a second reading of
// the kernels.
TEST(CpuBf16, ConvolutionInputGradientRefusesABfloat16FilterAndTakesNoOutputChannels) {
  cpu::CpuKernels k(DeviceSpec::cpu(0), 1);
  const Shape xs{2, 3, 5, 8};
  const Tensor x = Tensor::from_vector(wave(static_cast<size_t>(xs.numel()), 0.37f), xs);
  const Conv2dParams p;
  for (const int64_t kh : {int64_t{1}, int64_t{3}}) {
    SCOPED_TRACE("kernel " + std::to_string(kh));
    const Shape ws{kh, kh, 8, 4};
    const Tensor w = Tensor::from_vector(wave(static_cast<size_t>(ws.numel()), 0.91f), ws);
    const Shape ys{2, 3 - kh + 1, 5 - kh + 1, 4};
    const Tensor g = Tensor::from_vector(wave(static_cast<size_t>(ys.numel()), 0.71f), ys);
    EXPECT_EQ(k.conv2d_backward_input(g, w, xs, p).shape(), xs);
    EXPECT_THROW(k.conv2d_backward_input(g, k.cast(w, DType::kBFloat16), xs, p), InvalidArgument);
    const Tensor w0 = Tensor::from_vector(std::vector<float>{}, Shape{kh, kh, 8, 0});
    const Tensor g0 =
        Tensor::from_vector(std::vector<float>{}, Shape{2, 3 - kh + 1, 5 - kh + 1, 0});
    const std::vector<float> dx0 = k.conv2d_backward_input(g0, w0, xs, p).to_vector<float>();
    EXPECT_EQ(dx0, std::vector<float>(static_cast<size_t>(xs.numel()), 0.f));
    EXPECT_EQ(k.conv2d(x, w0, Tensor(), p).shape(), (Shape{2, 3 - kh + 1, 5 - kh + 1, 0}));
    EXPECT_EQ(k.conv2d_backward_filter(x, g0, w0.shape(), p, false, nullptr).shape(), w0.shape());
  }
}

// Batched products (attention's scores and weighted values) on the bfloat16 kernels: against
// float64 on the operands rounded to bfloat16, for every transpose (the kernel once ran float32
// kernels on rounded float32 copies; now bfloat16 ones on bfloat16 copies), and their gradients
// through ops::matmul against the kernel itself.
TEST(CpuBf16, NativeBatchMatmulReadsBfloat16Operands) {
  if (!cpu::bf16_kernel_choice().available)
    GTEST_SKIP() << "no oneDNN bfloat16 kernels on this CPU";
  MixedBf16 policy;
  Kernels& k = get_device(DeviceSpec::cpu(0)).kernels();
  for (const bool ta : {false, true})
    for (const bool tb : {false, true}) {
      const int64_t bt = 3, m = 17, kk = 33, n = 9;
      Tensor a =
          Tensor::from_vector(wave(bt * m * kk, 0.37f), ta ? Shape{bt, kk, m} : Shape{bt, m, kk});
      Tensor b =
          Tensor::from_vector(wave(bt * kk * n, 0.71f), tb ? Shape{bt, n, kk} : Shape{bt, kk, n});
      const Tensor dz = Tensor::from_vector(wave(bt * m * n, 1.3f), Shape{bt, m, n});
      GradientTape tape;
      tape.watch(a);
      tape.watch(b);
      const Tensor z = ops::matmul(a, b, ta, tb);
      const auto g = tape.gradient(ops::sum(ops::mul(z, dz)), {a, b});
      const Tensor z_ref = k.batch_matmul(a, b, ta, tb);
      const Tensor ga_ref =
          ta ? k.batch_matmul(b, dz, tb, true) : k.batch_matmul(dz, b, false, !tb);
      const Tensor gb_ref =
          tb ? k.batch_matmul(dz, a, true, ta) : k.batch_matmul(a, dz, !ta, false);
      const std::string where = std::string("ta=") + (ta ? "1" : "0") + " tb=" + (tb ? "1" : "0");
      EXPECT_EQ(z.to_vector<float>(), z_ref.to_vector<float>()) << where;
      EXPECT_EQ(g[0].to_vector<float>(), ga_ref.to_vector<float>()) << where;
      EXPECT_EQ(g[1].to_vector<float>(), gb_ref.to_vector<float>()) << where;
      // and against float64 on the rounded operands: bfloat16 products, not float32 ones
      const std::vector<float> av = a.to_vector<float>(), bv = b.to_vector<float>(),
                               zv = z.to_vector<float>();
      double worst = 0;
      for (int64_t p = 0; p < bt; ++p)
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            double want = 0;
            for (int64_t q = 0; q < kk; ++q) {
              const float x =
                  av[static_cast<size_t>(ta ? (p * kk + q) * m + i : (p * m + i) * kk + q)];
              const float y =
                  bv[static_cast<size_t>(tb ? (p * n + j) * kk + q : (p * kk + q) * n + j)];
              want += static_cast<double>(bf16_to_float(float_to_bf16(x))) *
                      bf16_to_float(float_to_bf16(y));
            }
            worst = std::max(worst, std::abs(want - zv[static_cast<size_t>((p * m + i) * n + j)]));
          }
      EXPECT_LT(worst, 1e-4) << where;
    }
}

// Second derivatives through matrix products on the bfloat16 kernels: for L = |a b|^2 / 2,
// dL/db = a^T a b, and d/da of sum(dL/db * v) against float64.
TEST(CpuBf16, NativeMatmulKeepsSecondDerivatives) {
  if (!cpu::bf16_kernel_choice().available)
    GTEST_SKIP() << "no oneDNN bfloat16 kernels on this CPU";
  MixedBf16 policy;
  const int64_t m = 6, kk = 5, n = 4;
  const std::vector<float> av = wave(m * kk, 0.5f), bv = wave(kk * n, 0.9f),
                           vv = wave(kk * n, 1.7f);
  Tensor a = Tensor::from_vector(av, Shape{m, kk}), b = Tensor::from_vector(bv, Shape{kk, n});
  GradientTape outer;
  outer.watch(a);
  Tensor gb;
  {
    GradientTape inner;
    inner.watch(b);
    const Tensor z = ops::matmul(a, b);
    gb = inner.gradient(ops::scale(ops::sum(ops::mul(z, z)), 0.5f), {b})[0];
  }
  const Tensor h = ops::sum(ops::mul(gb, Tensor::from_vector(vv, Shape{kk, n})));
  const Tensor ga = outer.gradient(h, {a})[0];
  ASSERT_TRUE(ga.defined());
  // h = sum_{k,j} v_kj sum_i a_ik (a b)_ij; dh/da_pq = sum_j v_qj (a b)_pj + sum_k,j a_pk v_kj
  // b_qj.
  const auto A = [&](int64_t i, int64_t j) { return static_cast<double>(av[i * kk + j]); };
  const auto B = [&](int64_t i, int64_t j) { return static_cast<double>(bv[i * n + j]); };
  const auto V = [&](int64_t i, int64_t j) { return static_cast<double>(vv[i * n + j]); };
  const std::vector<float> got = ga.to_vector<float>();
  double worst = 0, scale = 0;
  for (int64_t p = 0; p < m; ++p)
    for (int64_t q = 0; q < kk; ++q) {
      double want = 0;
      for (int64_t j = 0; j < n; ++j) {
        double ab = 0;
        for (int64_t k = 0; k < kk; ++k) ab += A(p, k) * B(k, j);
        want += V(q, j) * ab;
        for (int64_t k = 0; k < kk; ++k) want += A(p, k) * V(k, j) * B(q, j);
      }
      worst = std::max(worst, std::abs(want - got[static_cast<size_t>(p * kk + q)]));
      scale = std::max(scale, std::abs(want));
    }
  EXPECT_LT(worst, 3e-2 * scale);  // bfloat16 operands, float32 sums
  EXPECT_GT(scale, 0.1);
}

// DTRAIN_BF16_KERNELS: auto runs the bfloat16 kernels unless they measured under kBf16MinSpeed of
// float32 (then the emulated path: the same numerics at float32's speed); native and emulated
// decide; anything else is a typed error naming the accepted values.
TEST(CpuBf16, TheBfloat16KernelsRunWhereTheyAreFaster) {
  EXPECT_TRUE(cpu::decide_bf16_kernels("auto", true, 1.95).native);                // Zen 4
  EXPECT_TRUE(cpu::decide_bf16_kernels("auto", true, 0).native);                   // not measured
  const cpu::Bf16KernelChoice slow = cpu::decide_bf16_kernels("auto", true, 0.5);  // the Xeon
  EXPECT_FALSE(slow.native);
  EXPECT_NE(slow.why.find("ran at 0.50x float32's speed"), std::string::npos) << slow.why;
  EXPECT_NE(slow.why.find("DTRAIN_BF16_KERNELS=native"), std::string::npos) << slow.why;
  EXPECT_TRUE(cpu::decide_bf16_kernels("native", true, 0.5).native);
  EXPECT_FALSE(cpu::decide_bf16_kernels("emulated", true, 1.95).native);
  const cpu::Bf16KernelChoice none = cpu::decide_bf16_kernels("native", false, 0);
  EXPECT_FALSE(none.native);  // asked for, but oneDNN has none here
  EXPECT_NE(none.why.find("no bfloat16 kernels"), std::string::npos) << none.why;
  try {
    cpu::decide_bf16_kernels("fast", true, 1.0);
    ADD_FAILURE() << "no error for DTRAIN_BF16_KERNELS=fast";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("DTRAIN_BF16_KERNELS=fast: expected auto"),
              std::string::npos)
        << e.what();
  }
  // This process's choice, as the device reports it.
  const cpu::Bf16KernelChoice& here = cpu::bf16_kernel_choice();
  if (here.available && !std::getenv("DTRAIN_BF16_KERNELS")) {
    EXPECT_GT(here.bf16_speed, 0.0);
    EXPECT_EQ(here.native, here.bf16_speed >= cpu::kBf16MinSpeed) << here.bf16_speed;
  }
}

TEST(CpuBf16, TheDeviceSaysHowItRunsMixedBfloat16) {
  // What ran is in the device's description (the examples print it at start-up), per policy.
  Device& d = get_device(DeviceSpec::cpu(0));
  EXPECT_EQ(d.description().find("bfloat16"), std::string::npos) << d.description();
  set_precision_policy(Precision::kMixedBFloat16);
  const std::string native = d.description();
  cpu::force_bf16_emulation_for_testing(true);
  const std::string emulated = d.description();
  cpu::force_bf16_emulation_for_testing(false);
  set_precision_policy(Precision::kFloat32);
  EXPECT_NE(emulated.find("mixed_bfloat16 emulated: "), std::string::npos) << emulated;
  EXPECT_NE(emulated.find("so float32 kernels run on inputs rounded to bfloat16"),
            std::string::npos)
      << emulated;
  EXPECT_NE(native.find(cpu::bf16_kernels_native() ? "on oneDNN's bfloat16 kernels"
                                                   : "mixed_bfloat16 emulated"),
            std::string::npos)
      << native;
}

}  // namespace
}  // namespace dtrain
