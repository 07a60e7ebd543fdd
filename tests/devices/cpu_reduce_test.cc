// The CPU device's reduce against a float64 reference, over every pattern of reduced axes of
// rank-1 to rank-4 shapes (size-1 axes included): the merged-dimension path, the in-house
// column loop ([A, R, B] -> [A, 1, B], which oneDNN 2.x runs on its slow reference kernel) and
// oneDNN's innermost reductions, for sum, mean and max, with and without keepdims; the fused
// softmax cross-entropy; softmax's backward pass (dtrain's loop where oneDNN has only its
// reference kernel: the @avx2 and @sse41 runs on any CPU); and GELU's AVX2 loop.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

#include "core/cpu_isa.h"
#include "devices/cpu/cpu_kernels.h"
#include "dtrain/core/random.h"
#include "dtrain/core/tensor.h"
#include "dtrain/devices/device.h"

namespace dtrain {
namespace {

Kernels& cpu() { return get_device(DeviceSpec::cpu(0)).kernels(); }

Tensor random_tensor(const Shape& s, uint64_t stream) {
  Philox rng(11, stream);
  std::vector<float> v(static_cast<size_t>(s.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = -1.f + 2.f * rng.uniform(i);
  return Tensor::from_vector(v, s, DeviceSpec::cpu(0));
}

// The reduction in float64, output laid out as the kept dimensions in order.
std::vector<double> reference(ReductionKind kind, const Tensor& x, const std::vector<bool>& red) {
  const Shape& s = x.shape();
  const std::vector<float> v = x.to_vector<float>();
  int64_t out_n = 1;
  for (int i = 0; i < s.rank(); ++i)
    if (!red[static_cast<size_t>(i)]) out_n *= s[i];
  std::vector<double> out(static_cast<size_t>(out_n),
                          kind == ReductionKind::kMax ? -INFINITY : 0.0);
  std::vector<int64_t> count(static_cast<size_t>(out_n), 0);
  for (int64_t flat = 0; flat < s.numel(); ++flat) {
    int64_t rest = flat, o = 0, stride = 1;
    for (int i = s.rank() - 1; i >= 0; --i) {
      const int64_t c = rest % s[i];
      rest /= s[i];
      if (!red[static_cast<size_t>(i)]) {
        o += c * stride;
        stride *= s[i];
      }
    }
    const double e = v[static_cast<size_t>(flat)];
    double& r = out[static_cast<size_t>(o)];
    r = kind == ReductionKind::kMax ? std::max(r, e) : r + e;
    ++count[static_cast<size_t>(o)];
  }
  if (kind == ReductionKind::kMean)
    for (size_t i = 0; i < out.size(); ++i) out[i] /= static_cast<double>(count[i]);
  return out;
}

TEST(CpuReduce, EveryAxisPatternMatchesFloat64) {
  const std::vector<Shape> shapes = {Shape{7},         Shape{6, 9},        Shape{1, 33},
                                     Shape{4, 1, 5},   Shape{3, 64, 24},   Shape{2, 3, 4, 5},
                                     Shape{1024, 768}, Shape{2, 1, 37, 1}, Shape{5, 300, 2}};
  uint64_t stream = 0;
  int checked = 0;
  for (const Shape& s : shapes) {
    const Tensor x = random_tensor(s, stream++);
    for (int mask = 1; mask < (1 << s.rank()); ++mask) {
      std::vector<int> axes;
      std::vector<bool> red(static_cast<size_t>(s.rank()), false);
      for (int i = 0; i < s.rank(); ++i)
        if (mask & (1 << i)) {
          axes.push_back(i);
          red[static_cast<size_t>(i)] = true;
        }
      for (ReductionKind kind : {ReductionKind::kSum, ReductionKind::kMean, ReductionKind::kMax})
        for (bool keepdims : {false, true}) {
          const Tensor y = cpu().reduce(kind, x, axes, keepdims);
          std::vector<int64_t> want_dims;
          for (int i = 0; i < s.rank(); ++i)
            if (!red[static_cast<size_t>(i)] || keepdims)
              want_dims.push_back(red[static_cast<size_t>(i)] ? 1 : s[i]);
          const std::string what = s.to_string() + " mask " + std::to_string(mask) + " kind " +
                                   std::to_string(static_cast<int>(kind)) +
                                   (keepdims ? " keepdims" : "");
          ASSERT_EQ(y.shape(), Shape(want_dims)) << what;
          const std::vector<double> ref = reference(kind, x, red);
          const std::vector<float> got = y.to_vector<float>();
          ASSERT_EQ(got.size(), ref.size()) << what;
          int64_t reduced_n = 1;
          for (int i = 0; i < s.rank(); ++i)
            if (red[static_cast<size_t>(i)]) reduced_n *= s[i];
          // float32 sums of n terms in [-1, 1]: within n * 2^-24 * n of the exact sum.
          const double tol =
              kind == ReductionKind::kMax ? 0.0 : 1e-6 * static_cast<double>(reduced_n);
          for (size_t i = 0; i < got.size(); ++i)
            ASSERT_NEAR(got[i], ref[i], tol + 1e-6) << what << " output " << i;
          ++checked;
        }
    }
  }
  EXPECT_GT(checked, 300);
}

// The fused softmax cross-entropy (a row reduction: max, sum of exponentials) against float64:
// widths around one AVX-512 register and GPT-2's vocabulary, logits up to +-60, a row with
// -inf logits (masked), a constant row, and a NaN that must reach the loss.
TEST(CpuReduce, SoftmaxCrossEntropyMatchesFloat64) {
  for (const int64_t c : {1, 5, 16, 17, 33, 50257}) {
    const int64_t n = 6;
    Philox rng(5, static_cast<uint64_t>(c));
    std::vector<float> x(static_cast<size_t>(n * c));
    for (size_t i = 0; i < x.size(); ++i) x[i] = 60.f * (2.f * rng.uniform(i) - 1.f);
    for (int64_t j = 0; j < c; ++j) x[static_cast<size_t>(2 * c + j)] = 1.5f;  // constant row
    for (int64_t j = 0; c > 1 && j < c; j += 3)
      x[static_cast<size_t>(3 * c + j)] = -INFINITY;  // masked; its label is column 1
    std::vector<int32_t> y(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) y[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7) % c);
    if (c > 1) y[3] = 1;
    const Tensor logits = Tensor::from_vector(x, Shape{n, c}, DeviceSpec::cpu(0));
    const Tensor labels = Tensor::from_vector(y, Shape{n}, DeviceSpec::cpu(0));
    Tensor loss, probs;
    cpu().softmax_cross_entropy(logits, labels, &loss, &probs);
    const std::vector<float> l = loss.to_vector<float>(), p = probs.to_vector<float>();
    for (int64_t i = 0; i < n; ++i) {
      const float* row = x.data() + i * c;
      double mx = -INFINITY, sum = 0;
      for (int64_t j = 0; j < c; ++j) mx = std::max(mx, double{row[j]});
      for (int64_t j = 0; j < c; ++j) sum += std::exp(double{row[j]} - mx);
      for (int64_t j = 0; j < c; ++j) {
        // Float's x - max is rounded (half an ulp of it), which exp turns into relative error.
        const double d = double{row[j]} - mx, want = std::exp(d) / sum;
        if (std::isinf(d)) {
          ASSERT_EQ(p[static_cast<size_t>(i * c + j)], 0.f) << "C " << c << " column " << j;
          continue;
        }
        ASSERT_NEAR(p[static_cast<size_t>(i * c + j)], want,
                    (2e-6 + 6e-8 * std::abs(d)) * want + 1e-44)
            << "C " << c << " row " << i << " column " << j;
      }
      const double want_loss = std::log(sum) - (row[y[static_cast<size_t>(i)]] - mx);
      EXPECT_NEAR(l[static_cast<size_t>(i)], want_loss, 2e-6 * std::abs(want_loss) + 2e-6)
          << "C " << c << " row " << i;
    }
    x[static_cast<size_t>(5 * c + c / 2)] = NAN;
    cpu().softmax_cross_entropy(Tensor::from_vector(x, Shape{n, c}, DeviceSpec::cpu(0)), labels,
                                &loss, &probs);
    EXPECT_TRUE(std::isnan(loss.to_vector<float>()[5])) << "C " << c;
    EXPECT_FALSE(std::isnan(loss.to_vector<float>()[4])) << "C " << c;
  }
}

// Softmax's backward pass, dx = y * (dy - sum(dy * y)), against float64: widths around the vector
// registers and an attention row's, enough rows to be split over threads, rows with masked
// (zero) probabilities, and a NaN in dy that must reach its whole row and no other. oneDNN 2.6
// has a vector kernel for it on AVX-512 only; elsewhere (the @avx2 and @sse41 runs) dtrain's loop
// runs (its AVX2 row where the CPU and DTRAIN_MAX_CPU_ISA allow it, else the scalar one), and the
// counter says which ran.
TEST(CpuReduce, SoftmaxBackwardMatchesFloat64) {
  (void)cpu();  // the device caps oneDNN's instruction sets (DTRAIN_MAX_CPU_ISA) before the query
  const bool onednn_vector =
      (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & 0x27u) == 0x27u;  // avx512_core
  EXPECT_STREQ(cpu_testing::own_softmax_backward_row(),
               detail::cpu_supports(detail::CpuFeature::kAvx2Fma) ? "avx2" : "scalar");
  for (const int64_t c : {1, 5, 8, 16, 17, 33, 256, 1000}) {
    for (const int64_t n : {int64_t{3}, 70000 / c + 1}) {
      Philox rng(9, static_cast<uint64_t>(c * 100000 + n));
      std::vector<float> logits(static_cast<size_t>(n * c)), g(logits.size());
      for (size_t i = 0; i < logits.size(); ++i) {
        logits[i] = 8.f * (2.f * rng.uniform(2 * i) - 1.f);
        g[i] = 2.f * rng.uniform(2 * i + 1) - 1.f;
      }
      for (int64_t j = 1; j < c; j += 2) logits[static_cast<size_t>(c + j)] = -INFINITY;
      const Tensor y =
          cpu().softmax(Tensor::from_vector(logits, Shape{n, c}, DeviceSpec::cpu(0)), false);
      if (n > 3) g[static_cast<size_t>(2 * c + c / 2)] = NAN;
      const uint64_t runs = cpu_testing::own_softmax_backward_runs();
      const Tensor dx =
          cpu().softmax_backward(y, Tensor::from_vector(g, Shape{n, c}, DeviceSpec::cpu(0)), false);
      EXPECT_EQ(cpu_testing::own_softmax_backward_runs() - runs, onednn_vector ? 0u : 1u);
      const std::vector<float> p = y.to_vector<float>(), d = dx.to_vector<float>();
      for (int64_t i = 0; i < n; ++i) {
        const size_t r = static_cast<size_t>(i * c);
        double s = 0, s_abs = 0;
        for (int64_t j = 0; j < c; ++j) {
          s += double{g[r + j]} * p[r + j];
          s_abs += std::abs(double{g[r + j]} * p[r + j]);
        }
        for (int64_t j = 0; j < c; ++j) {
          const std::string what = "C " + std::to_string(c) + " N " + std::to_string(n) + " row " +
                                   std::to_string(i) + " column " + std::to_string(j);
          const float got = d[r + static_cast<size_t>(j)];
          if (std::isnan(s)) {
            ASSERT_TRUE(std::isnan(got)) << what;
            continue;
          }
          // A float32 sum of c products in any order: within (c + 1) 2^-24 of the sum of their
          // magnitudes; then a subtraction and a product, each rounded once.
          const double want = p[r + j] * (g[r + j] - s),
                       tol = std::abs(p[r + j]) *
                             ((c + 1) * 6e-8 * s_abs + 2.4e-7 * (std::abs(g[r + j]) + std::abs(s)));
          ASSERT_NEAR(got, want, tol + 1e-30) << what;
        }
      }
    }
  }
}

// GELU's tanh form on dtrain's AVX2 loop (where the CPU runs without AVX-512, and forced here on
// CPUs with it; skipped without AVX2) against float64, forward and backward: 4,001 points over
// [-12, 12], and 80,001 (past the device's serial work: two parts on 2 threads) on 1 and 2 threads,
// every tail length (n = 1 to 17), and the special values. The float64 reference is x / (1 +
// exp(-2u)), the tanh form without its cancellation for x << 0. It fails with the cubic's constant
// moved by 0.01%, or the derivative's 3 left out.
TEST(CpuReduce, GeluTanhOwnLoopMatchesFloat64) {
  if (!detail::cpu_supports(detail::CpuFeature::kAvx2Fma)) GTEST_SKIP() << "no AVX2 with FMA";
  struct Forced {
    Forced() { cpu_testing::force_own_gelu(true); }
    ~Forced() { cpu_testing::force_own_gelu(false); }
  } forced;
  ASSERT_TRUE(cpu::own_gelu_tanh());
  // y and y' = s + t; *terms = |s| + |t|, the scale of y''s rounding (the two cancel near x =
  // -0.75).
  const auto reference = [](double x, double* d, double* terms, double* two_u) {
    const double k = 0.7978845608028654, u = k * (x + 0.044715 * x * x * x);
    *two_u = 2 * u;
    const double e = std::exp(-2 * u), s = 1 / (1 + e);
    const double t = x * s * (e * s) * 2 * k * (1 + 3 * 0.044715 * x * x);
    *d = s + t;
    *terms = std::abs(s) + std::abs(t);
    return x * s;
  };
  cpu::CpuKernels one(DeviceSpec::cpu(0), 1), two(DeviceSpec::cpu(0), 2);
  std::vector<std::vector<float>> cases;
  std::vector<float> grid;
  for (int i = 0; i <= 4000; ++i) grid.push_back(-12.f + 24.f * static_cast<float>(i) / 4000.f);
  cases.push_back(grid);
  std::vector<float> fine;
  for (int i = 0; i <= 80000; ++i) fine.push_back(-12.f + 24.f * static_cast<float>(i) / 80000.f);
  cases.push_back(fine);
  for (size_t n = 1; n <= 17; ++n)
    cases.emplace_back(grid.begin() + 1500, grid.begin() + 1500 + static_cast<std::ptrdiff_t>(n));
  for (const auto& xs : cases)
    for (cpu::CpuKernels* k : {&one, &two}) {
      const Tensor x = Tensor::from_vector(xs, Shape{static_cast<int64_t>(xs.size())});
      std::vector<float> gv(xs.size());
      for (size_t i = 0; i < gv.size(); ++i) gv[i] = 0.5f + 0.25f * static_cast<float>(i % 5);
      const Tensor dy = Tensor::from_vector(gv, x.shape());
      const uint64_t runs = cpu_testing::own_gelu_runs();
      const std::vector<float> y = k->unary(UnaryOp::kGeluTanh, x).to_vector<float>();
      const uint64_t forward_runs = cpu_testing::own_gelu_runs();
      EXPECT_GT(forward_runs, runs) << "the forward pass did not run dtrain's loop";
      const std::vector<float> dx =
          k->activation_backward(UnaryOp::kGeluTanh, x, dy).to_vector<float>();
      EXPECT_GT(cpu_testing::own_gelu_runs(), forward_runs) << "nor the backward pass";
      for (size_t i = 0; i < xs.size(); ++i) {
        double d, terms, two_u;
        const double want = reference(xs[i], &d, &terms, &two_u), want_dx = gv[i] * d;
        // exp's argument carries its rounding into e multiplied by |2u| (up to ~90 here), then
        // the polynomial's, the division's and the products' few ulps: 16 ulps of float times
        // (1 + |2u|). Below x = -10.06, e overflows and y and y' flush to 0 (they are below 1e-35
        // there; float's normal range ends at 1.2e-38).
        const double ulps = 16 * 0x1p-24 * (1 + std::abs(two_u));
        EXPECT_NEAR(y[i], want, ulps * std::abs(want) + 1e-35) << "x " << xs[i];
        EXPECT_NEAR(dx[i], want_dx, ulps * gv[i] * terms + 1e-35) << "x " << xs[i];
      }
    }
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor special =
      Tensor::from_vector<float>({NAN, inf, -inf, -100.f, -1e20f, 1e20f, 0.f, -0.f}, Shape{8});
  const std::vector<float> y = one.unary(UnaryOp::kGeluTanh, special).to_vector<float>();
  const std::vector<float> dx =
      one.activation_backward(UnaryOp::kGeluTanh, special,
                              Tensor::from_vector(std::vector<float>(8, 1.f), Shape{8}))
          .to_vector<float>();
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_EQ(y[1], inf);
  EXPECT_TRUE(std::isnan(y[2]));  // -inf times 0, as oneDNN's
  EXPECT_EQ(y[3], 0.f);
  EXPECT_EQ(y[4], 0.f);
  EXPECT_EQ(y[5], 1e20f);
  EXPECT_EQ(y[6], 0.f);
  EXPECT_EQ(y[7], 0.f);
  EXPECT_TRUE(std::isnan(dx[0]) && std::isnan(dx[1]) && std::isnan(dx[2]));  // as oneDNN's
  EXPECT_EQ(dx[3], 0.f);
  EXPECT_EQ(dx[4], 0.f);  // x^2 overflows there: no 0 times inf
  EXPECT_EQ(dx[5], 1.f);
  EXPECT_EQ(dx[6], 0.5f);
  EXPECT_EQ(dx[7], 0.5f);
}

}  // namespace
}  // namespace dtrain
