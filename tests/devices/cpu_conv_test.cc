// Winograd convolutions on the CPU device (precision.h: enable_winograd_convolutions): where they
// apply (float32, 3x3, stride 1, channels in multiples of 16, at least 16 output tiles of 4x4 per
// image, whatever the batch) conv2d and both gradients stay within float32-like error of float64
// sums and differ from the direct convolution's, so a Winograd path ran: oneDNN's on CPUs whose
// oneDNN has Winograd kernels (AVX-512), dtrain's own (cpu_winograd.h) elsewhere, and dtrain's own
// on every CPU when a test asks for it; where they do not apply, and in the fused conv+pool op, the
// results are the direct convolution's bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "devices/cpu/cpu_conv_prims.h"
#include "devices/cpu/cpu_winograd.h"
#include "dtrain/core/precision.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"

namespace dtrain {
namespace {

struct Case {
  int64_t n, h, w, cin, cout, stride;
  ops::Padding padding;
  // Explicit zero padding (top, bottom, left, right) instead of `padding`, where pads[0] >= 0.
  int pads[4] = {-1, -1, -1, -1};
  bool explicit_pads() const { return pads[0] >= 0; }
  std::string name() const {
    std::string p = padding == ops::Padding::kSame ? " same" : " valid";
    if (explicit_pads())
      p = " pads " + std::to_string(pads[0]) + "," + std::to_string(pads[1]) + "," +
          std::to_string(pads[2]) + "," + std::to_string(pads[3]);
    return std::to_string(n) + "x" + std::to_string(h) + "x" + std::to_string(w) + "x" +
           std::to_string(cin) + " -> " + std::to_string(cout) + " stride " +
           std::to_string(stride) + p;
  }
};

// A stride-1 case with explicit padding (top, bottom, left, right).
Case padded(int64_t n, int64_t h, int64_t w, int64_t cin, int64_t cout, int t, int b, int l,
            int r) {
  Case c{n, h, w, cin, cout, 1, ops::Padding::kValid};
  c.pads[0] = t;
  c.pads[1] = b;
  c.pads[2] = l;
  c.pads[3] = r;
  return c;
}

std::vector<float> wave(int64_t n, float f, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = scale * std::sin(f * static_cast<float>(i) + 0.3f);
  return v;
}

struct Data {
  Case c;
  int64_t oh, ow;
  Conv2dParams p;
  std::vector<float> x, w, b, dy;
  explicit Data(const Case& k) : c(k) {
    const int pad = k.padding == ops::Padding::kSame ? 1 : 0;
    p.stride_h = p.stride_w = static_cast<int>(k.stride);
    p.pad_top = k.explicit_pads() ? k.pads[0] : pad;
    p.pad_bottom = k.explicit_pads() ? k.pads[1] : pad;
    p.pad_left = k.explicit_pads() ? k.pads[2] : pad;
    p.pad_right = k.explicit_pads() ? k.pads[3] : pad;
    oh = (k.h + p.pad_top + p.pad_bottom - 3) / k.stride + 1;
    ow = (k.w + p.pad_left + p.pad_right - 3) / k.stride + 1;
    x = wave(k.n * k.h * k.w * k.cin, 0.37f, 1.f);
    w = wave(9 * k.cin * k.cout, 0.91f, 0.2f);
    b = wave(k.cout, 1.7f, 0.1f);
    dy = wave(k.n * oh * ow * k.cout, 0.53f, 1.f);
  }
};

// y, dx, dw, db of conv2d (NHWC, HWIO) on the device, with the loss sum(y * dy).
std::vector<std::vector<float>> run(const Data& d) {
  const Case& c = d.c;
  Tensor x = Tensor::from_vector(d.x, Shape{c.n, c.h, c.w, c.cin});
  Tensor w = Tensor::from_vector(d.w, Shape{3, 3, c.cin, c.cout});
  Tensor b = Tensor::from_vector(d.b, Shape{c.cout});
  GradientTape tape;
  for (Tensor* t : {&x, &w, &b}) tape.watch(*t);
  const Tensor y = c.explicit_pads() ? ops::conv2d(x, w, b, d.p)
                                     : ops::conv2d(x, w, b, static_cast<int>(c.stride),
                                                   static_cast<int>(c.stride), c.padding);
  const Tensor loss = ops::sum(ops::mul(y, Tensor::from_vector(d.dy, y.shape())));
  const auto g = tape.gradient(loss, {x, w, b});
  return {y.to_vector<float>(), g[0].to_vector<float>(), g[1].to_vector<float>(),
          g[2].to_vector<float>()};
}

// The same four in float64, each with the largest sum of |terms| (what bounds a float32 sum's
// rounding error).
struct Reference {
  std::vector<double> value[4];
  double scale[4] = {0, 0, 0, 0};
};
Reference reference(const Data& d) {
  const Case& c = d.c;
  Reference r;
  for (auto& v : r.value) v.clear();
  r.value[0].assign(static_cast<size_t>(c.n * d.oh * d.ow * c.cout), 0);
  r.value[1].assign(d.x.size(), 0);
  r.value[2].assign(d.w.size(), 0);
  r.value[3].assign(static_cast<size_t>(c.cout), 0);
  std::vector<double> mag[4];
  for (int k = 0; k < 4; ++k) mag[k].assign(r.value[k].size(), 0);
  const auto xi = [&](int64_t n, int64_t i, int64_t j, int64_t ci) {
    return static_cast<size_t>(((n * c.h + i) * c.w + j) * c.cin + ci);
  };
  const auto wi = [&](int64_t ki, int64_t kj, int64_t ci, int64_t co) {
    return static_cast<size_t>(((ki * 3 + kj) * c.cin + ci) * c.cout + co);
  };
  for (int64_t n = 0; n < c.n; ++n)
    for (int64_t i = 0; i < d.oh; ++i)
      for (int64_t j = 0; j < d.ow; ++j)
        for (int64_t co = 0; co < c.cout; ++co) {
          const size_t yi = static_cast<size_t>(((n * d.oh + i) * d.ow + j) * c.cout + co);
          const double g = d.dy[yi];
          r.value[0][yi] += d.b[static_cast<size_t>(co)];
          mag[0][yi] += std::abs(static_cast<double>(d.b[static_cast<size_t>(co)]));
          r.value[3][static_cast<size_t>(co)] += g;
          mag[3][static_cast<size_t>(co)] += std::abs(g);
          for (int64_t ki = 0; ki < 3; ++ki)
            for (int64_t kj = 0; kj < 3; ++kj) {
              const int64_t si = i * c.stride + ki - d.p.pad_top,
                            sj = j * c.stride + kj - d.p.pad_left;
              if (si < 0 || sj < 0 || si >= c.h || sj >= c.w) continue;
              for (int64_t ci = 0; ci < c.cin; ++ci) {
                const double xv = d.x[xi(n, si, sj, ci)], wv = d.w[wi(ki, kj, ci, co)];
                r.value[0][yi] += xv * wv;
                mag[0][yi] += std::abs(xv * wv);
                r.value[1][xi(n, si, sj, ci)] += g * wv;
                mag[1][xi(n, si, sj, ci)] += std::abs(g * wv);
                r.value[2][wi(ki, kj, ci, co)] += g * xv;
                mag[2][wi(ki, kj, ci, co)] += std::abs(g * xv);
              }
            }
        }
  for (int k = 0; k < 4; ++k) r.scale[k] = *std::max_element(mag[k].begin(), mag[k].end());
  return r;
}

// Switches Winograd convolutions on or off for a scope, and back as they were after it.
struct Winograd {
  explicit Winograd(bool on) : was(winograd_convolutions_enabled()) {
    enable_winograd_convolutions(on);
  }
  ~Winograd() { enable_winograd_convolutions(was); }
  bool was;
};

const char* kWhat[] = {"y", "dx", "dw", "db"};

// *worst = the larger of it and e, a NaN kept once seen (a value never written, under
// OwnWinogradEverywhere's NaN fill).
void keep_worst(double* worst, double e) {
  if (!std::isnan(*worst) && !(e <= *worst)) *worst = e;
}

// The case's results with Winograd off, then on (with dtrain's own kernels wherever Winograd
// applies if `own`), and how many of dtrain's own Winograd kernels ran for the latter.
struct OffAndOn {
  std::vector<std::vector<float>> direct, wino;
  uint64_t own_runs = 0;
};
OffAndOn off_and_on(const Data& d, bool own) {
  OffAndOn r;
  {
    Winograd off(false);
    r.direct = run(d);
  }
  const uint64_t runs_before = cpu_testing::own_winograd_runs();
  {
    std::optional<cpu_testing::OwnWinogradEverywhere> everywhere;
    if (own) everywhere.emplace();
    r.wino = run(d);
  }
  r.own_runs = cpu_testing::own_winograd_runs() - runs_before;
  return r;
}

// Runs each case with Winograd off and on and checks the on results against float64; `own`: with
// dtrain's own Winograd kernels wherever Winograd applies (else oneDNN's where it has them).
void check_winograd(bool own) {
  for (const Case& c : {Case{4, 16, 16, 32, 48, 1, ops::Padding::kSame},
                        Case{1, 16, 16, 32, 48, 1, ops::Padding::kSame},   // one image
                        Case{3, 19, 15, 16, 16, 1, ops::Padding::kValid},  // partial tiles
                        Case{2, 18, 17, 16, 32, 1, ops::Padding::kSame},   // partial tiles
                        padded(2, 17, 18, 16, 16, 1, 0, 0, 1),             // one side only
                        padded(2, 18, 17, 16, 16, 0, 1, 1, 0),
                        Case{16, 14, 14, 32, 64, 1, ops::Padding::kSame}}) {  // 7 x 7 after pooling
    SCOPED_TRACE(c.name() + (own ? ", dtrain's own Winograd" : ""));
    const Data d(c);
    const OffAndOn r0 = off_and_on(d, own);
    const auto& direct = r0.direct;
    const auto& wino = r0.wino;
    // y, dx and dw: three passes, each dtrain's own unless oneDNN's Winograd ran (which gave
    // wrong input gradients with one-sided padding: those run dtrain's)
    const bool one_sided = d.p.pad_top != d.p.pad_bottom || d.p.pad_left != d.p.pad_right;
    const bool ours = own || one_sided || !cpu::onednn_has_winograd();
    EXPECT_EQ(r0.own_runs, ours ? 3u : 0u);
    const Reference r = reference(d);
    for (int k = 0; k < 4; ++k) {
      double to_direct = 0, to_wino = 0;
      ASSERT_EQ(wino[static_cast<size_t>(k)].size(), r.value[k].size()) << kWhat[k];
      for (size_t i = 0; i < r.value[k].size(); ++i) {
        keep_worst(&to_direct, std::abs(direct[static_cast<size_t>(k)][i] - r.value[k][i]));
        keep_worst(&to_wino, std::abs(wino[static_cast<size_t>(k)][i] - r.value[k][i]));
      }
      // float32 direct sums: well within 1e-6 of the terms' magnitude; Winograd about 5x that
      // (transforms of the operands before the products)
      EXPECT_LE(to_direct, 1e-6 * r.scale[k]) << kWhat[k];
      EXPECT_LE(to_wino, 2e-5 * r.scale[k]) << kWhat[k];
      // y, dx and dw each come from a Winograd kernel (db is a plain sum of dy)
      if (k < 3) {
        EXPECT_NE(wino[static_cast<size_t>(k)], direct[static_cast<size_t>(k)])
            << kWhat[k] << ": no Winograd kernel ran";
      }
    }
    std::optional<cpu_testing::OwnWinogradEverywhere> everywhere;
    if (own) everywhere.emplace();
    EXPECT_EQ(run(d), wino);  // repeatable, bit for bit
    if (!ours) continue;
    // dtrain's kernels in chunks of 12 tiles (2 to 22 chunks here, the last one short in all
    // cases but one): within the same bound of float64 (not bit for bit: oneDNN's AVX2 products
    // round differently with the number of rows, and dw sums the chunks' products, so its bits
    // differ: the chunks were taken)
    std::vector<std::vector<float>> chunked;
    {
      cpu_testing::WinogradChunkTiles twelve(12);
      chunked = run(d);
    }
    EXPECT_NE(chunked[2], wino[2]) << "dw: the chunks were not taken";
    for (int k = 0; k < 3; ++k) {
      double to_chunked = 0;
      for (size_t i = 0; i < r.value[k].size(); ++i)
        keep_worst(&to_chunked, std::abs(chunked[static_cast<size_t>(k)][i] - r.value[k][i]));
      EXPECT_LE(to_chunked, 2e-5 * r.scale[k]) << kWhat[k] << " in chunks";
    }
  }
}

TEST(CpuConv, WinogradConvolutionsStayNearFloat64AndRunWhereTheyApply) { check_winograd(false); }

TEST(CpuConv, DtrainsOwnWinogradStaysNearFloat64OnAnyCpu) { check_winograd(true); }

TEST(CpuConv, WhereWinogradDoesNotApplyTheDirectConvolutionRuns) {
  for (const Case& c : {Case{32, 7, 7, 32, 32, 1, ops::Padding::kSame},   // 4 tiles an image
                        Case{4, 16, 16, 32, 48, 2, ops::Padding::kSame},  // stride 2
                        Case{4, 16, 16, 24, 48, 1, ops::Padding::kSame},  // 24 channels
                        padded(4, 16, 16, 32, 48, 2, 2, 2, 2)})           // 2 pixels of padding
  {
    SCOPED_TRACE(c.name());
    const Data d(c);
    std::vector<std::vector<float>> direct;
    {
      Winograd off(false);
      direct = run(d);
    }
    EXPECT_EQ(run(d), direct);
    const uint64_t runs_before = cpu_testing::own_winograd_runs();
    cpu_testing::OwnWinogradEverywhere own;
    EXPECT_EQ(run(d), direct);
    EXPECT_EQ(cpu_testing::own_winograd_runs(), runs_before);
  }
}

// Under mixed_bfloat16 for a scope, on oneDNN's bfloat16 kernels or (emulated) on float32 kernels
// with operands rounded to bfloat16; float32 and the measured choice again after it.
struct MixedBfloat16 {
  explicit MixedBfloat16(bool emulated) : emulated(emulated) {
    if (emulated)
      cpu::force_bf16_emulation_for_testing(true);
    else
      cpu::force_bf16_native_for_testing(true);
    set_precision_policy(Precision::kMixedBFloat16);
  }
  ~MixedBfloat16() {
    set_precision_policy(Precision::kFloat32);
    if (emulated)
      cpu::force_bf16_emulation_for_testing(false);
    else
      cpu::force_bf16_native_for_testing(false);
  }
  bool emulated;
};

// mixed_bfloat16: on oneDNN's bfloat16 kernels (their products are bfloat16 ones) never Winograd.
// On float32 kernels (CPUs without bfloat16 kernels; forced here on any CPU), Winograd on the
// operands rounded to bfloat16: within Winograd's bound of float64 on the rounded operands, as the
// direct convolution is within float32's, and far from float64 on the raw ones.
TEST(CpuConv, MixedBfloat16RunsWinogradOnFloat32KernelsOnly) {
  const Data d(Case{4, 16, 16, 32, 48, 1, ops::Padding::kSame});
  if (cpu::bf16_kernel_choice().available) {
    SCOPED_TRACE("bfloat16 kernels");
    MixedBfloat16 mixed(false);
    std::vector<std::vector<float>> direct;
    {
      Winograd off(false);
      direct = run(d);
    }
    const uint64_t runs_before = cpu_testing::own_winograd_runs();
    cpu_testing::OwnWinogradEverywhere own;
    EXPECT_EQ(run(d), direct);
    EXPECT_EQ(cpu_testing::own_winograd_runs(), runs_before);
  }
  Data rounded = d;  // what the kernels read: x, w and the incoming gradient rounded (not the bias)
  for (std::vector<float>* v : {&rounded.x, &rounded.w, &rounded.dy})
    cpu::round_to_bf16(v->data(), v->size());
  const Reference on_rounded = reference(rounded), on_raw = reference(d);
  for (const bool own : {false, true}) {
    SCOPED_TRACE(own ? "float32 kernels, dtrain's own Winograd" : "float32 kernels");
    MixedBfloat16 mixed(true);
    const OffAndOn r0 = off_and_on(d, own);
    const auto& direct = r0.direct;
    const auto& wino = r0.wino;
    EXPECT_EQ(r0.own_runs, own || !cpu::onednn_has_winograd() ? 3u : 0u);
    for (int k = 0; k < 4; ++k) {
      double to_direct = 0, to_wino = 0, to_raw = 0;
      for (size_t i = 0; i < on_rounded.value[k].size(); ++i) {
        const double want = on_rounded.value[k][i];
        keep_worst(&to_direct, std::abs(direct[static_cast<size_t>(k)][i] - want));
        keep_worst(&to_wino, std::abs(wino[static_cast<size_t>(k)][i] - want));
        keep_worst(&to_raw, std::abs(wino[static_cast<size_t>(k)][i] - on_raw.value[k][i]));
      }
      EXPECT_LE(to_direct, 1e-6 * on_rounded.scale[k]) << kWhat[k];
      EXPECT_LE(to_wino, 2e-5 * on_rounded.scale[k]) << kWhat[k];
      if (k < 3) {  // (db sums dy alone: its roundings mostly cancel)
        EXPECT_GT(to_raw, 1e-4 * on_raw.scale[k]) << kWhat[k] << ": operands not rounded";
        EXPECT_NE(wino[static_cast<size_t>(k)], direct[static_cast<size_t>(k)])
            << kWhat[k] << ": no Winograd kernel ran";
      }
    }
    // Under the tape above x and dy reach the kernels as the bfloat16 copies the ops keep; here
    // as float32, rounded by the kernels: a forward pass without a tape, and the filter's and
    // bias's gradients alone (dy is then not copied).
    std::optional<cpu_testing::OwnWinogradEverywhere> everywhere;
    if (own) everywhere.emplace();
    const Case& c = d.c;
    Tensor x = Tensor::from_vector(d.x, Shape{c.n, c.h, c.w, c.cin});
    Tensor w = Tensor::from_vector(d.w, Shape{3, 3, c.cin, c.cout});
    Tensor b = Tensor::from_vector(d.b, Shape{c.cout});
    const std::vector<float> y = ops::conv2d(x, w, b, 1, 1, ops::Padding::kSame).to_vector<float>();
    GradientTape tape;
    tape.watch(w);
    tape.watch(b);
    const Tensor yt = ops::conv2d(x, w, b, 1, 1, ops::Padding::kSame);
    const auto g =
        tape.gradient(ops::sum(ops::mul(yt, Tensor::from_vector(d.dy, yt.shape()))), {w, b});
    const std::vector<float>* got[4] = {&y, nullptr, nullptr, nullptr};
    const std::vector<float> dw = g[0].to_vector<float>(), db = g[1].to_vector<float>();
    got[2] = &dw;
    got[3] = &db;
    for (int k : {0, 2, 3}) {
      double to_wino = 0;
      for (size_t i = 0; i < on_rounded.value[k].size(); ++i)
        keep_worst(&to_wino, std::abs((*got[k])[i] - on_rounded.value[k][i]));
      EXPECT_LE(to_wino, 2e-5 * on_rounded.scale[k]) << kWhat[k] << " from float32 operands";
    }
  }
}

// The fused conv+pool op runs direct convolutions whatever the batch: its chunked path (large
// batches) and its unchunked one (small batches: a replica's share) compute the same, so that
// strategies that split the batch agree with one device to rounding.
TEST(CpuConv, TheFusedConvolutionAndPoolingRunsDirectConvolutions) {
  for (const int64_t n : {2, 64}) {
    SCOPED_TRACE(std::to_string(n) + " images");
    const Tensor x = Tensor::from_vector(wave(n * 16 * 16 * 32, 0.37f, 1.f), Shape{n, 16, 16, 32});
    const Tensor w = Tensor::from_vector(wave(9 * 32 * 64, 0.91f, 0.2f), Shape{3, 3, 32, 64});
    const Tensor b = Tensor::from_vector(wave(64, 1.7f, 0.1f), Shape{64});
    auto run_fused = [&] {
      Tensor xv = x, wv = w, bv = b;
      GradientTape tape;
      for (Tensor* t : {&xv, &wv, &bv}) tape.watch(*t);
      const Tensor y =
          ops::conv2d_max_pool2d(xv, wv, bv, 1, ops::Padding::kSame, 2, 2, ops::Padding::kValid);
      const Tensor loss = ops::sum(ops::mul(y, y));
      const auto g = tape.gradient(loss, {xv, wv, bv});
      return std::vector<std::vector<float>>{y.to_vector<float>(), g[0].to_vector<float>(),
                                             g[1].to_vector<float>(), g[2].to_vector<float>()};
    };
    std::vector<std::vector<float>> direct;
    {
      Winograd off(false);
      direct = run_fused();
    }
    EXPECT_EQ(run_fused(), direct);
    const uint64_t runs_before = cpu_testing::own_winograd_runs();
    cpu_testing::OwnWinogradEverywhere own;
    EXPECT_EQ(run_fused(), direct);
    EXPECT_EQ(cpu_testing::own_winograd_runs(), runs_before);
  }
}

}  // namespace
}  // namespace dtrain
