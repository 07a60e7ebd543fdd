// The CPU's max pooling loops (devices/cpu/cpu_pool.h), AVX-512 and portable, against a plain
// reference written from the definition: every output, arg-max and gradient bit for bit, over
// channel counts that leave vector tails, padding, overlapping windows, strides wider than the
// window, windows of more than 255 positions (the 4-byte workspace), ties and NaNs; and through
// CpuKernels, the errors a wrong padding or workspace gets. The gradient also rounded to bfloat16
// as it is written (round_dx, for float32 kernels under mixed bfloat16).
#include "devices/cpu/cpu_pool.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/error.h"
#include "dtrain/devices/device.h"
#include "dtrain/devices/kernels.h"

namespace dtrain {
namespace {

using cpu::PoolGeometry;

std::string name(const PoolGeometry& g) {
  return std::to_string(g.n) + "x" + std::to_string(g.h) + "x" + std::to_string(g.w) + "x" +
         std::to_string(g.c) + " window " + std::to_string(g.kh) + "x" + std::to_string(g.kw) +
         " stride " + std::to_string(g.sh) + "x" + std::to_string(g.sw) + " pad " +
         std::to_string(g.pt) + "," + std::to_string(g.pl) + (g.relu ? " then ReLU" : "");
}

// The geometry with bottom/right padding pb, pr (the output size as conv_output_size gives it).
PoolGeometry geometry(int64_t n, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw,
                      int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr) {
  return {n,  h,  w,  c, (h + pt + pb - kh) / sh + 1, (w + pl + pr - kw) / sw + 1, kh, kw,
          sh, sw, pt, pl};
}

// From the definition: the window's positions inside the image in row-major order; the first of
// the greatest wins, and the first NaN wins over everything. With the ReLU, a max not above 0
// gives 0 (a NaN stays NaN) and passes no gradient, as ReLU's gradient there is 0.
struct Reference {
  std::vector<float> y;
  std::vector<int64_t> arg;  // the input index of each output's max; -1: no gradient
};
Reference reference_forward(const PoolGeometry& g, const std::vector<float>& x) {
  Reference r;
  for (int64_t n = 0; n < g.n; ++n)
    for (int64_t oy = 0; oy < g.oh; ++oy)
      for (int64_t ox = 0; ox < g.ow; ++ox)
        for (int64_t c = 0; c < g.c; ++c) {
          int64_t best = -1;
          for (int64_t i = 0; i < g.kh; ++i)
            for (int64_t j = 0; j < g.kw; ++j) {
              const int64_t y = oy * g.sh - g.pt + i, xx = ox * g.sw - g.pl + j;
              if (y < 0 || y >= g.h || xx < 0 || xx >= g.w) continue;
              const int64_t at = ((n * g.h + y) * g.w + xx) * g.c + c;
              if (best < 0) {
                best = at;
                continue;
              }
              const float v = x[static_cast<size_t>(at)], m = x[static_cast<size_t>(best)];
              if (std::isnan(m)) continue;
              if (std::isnan(v) || v > m) best = at;
            }
          const float m = x[static_cast<size_t>(best)];
          if (g.relu && !(m > 0.f)) {
            r.y.push_back(std::isnan(m) ? m : 0.f);
            r.arg.push_back(-1);
          } else {
            r.y.push_back(m);
            r.arg.push_back(best);
          }
        }
  return r;
}

std::vector<float> reference_backward(const PoolGeometry& g, const Reference& r,
                                      const std::vector<float>& dy) {
  std::vector<float> dx(static_cast<size_t>(g.n * g.h * g.w * g.c), 0.f);
  for (size_t o = 0; o < dy.size(); ++o)
    if (r.arg[o] >= 0) dx[static_cast<size_t>(r.arg[o])] += dy[o];
  return dx;
}

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b));
}

// Inputs with many ties (a few levels) and, when `nans`, a NaN in about one value in 40.
std::vector<float> inputs(const PoolGeometry& g, unsigned seed, bool nans) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> level(-3, 3), pick(0, 39);
  std::vector<float> x(static_cast<size_t>(g.n * g.h * g.w * g.c));
  for (float& v : x)
    v = nans && pick(rng) == 0 ? std::numeric_limits<float>::quiet_NaN()
                               : 0.5f * static_cast<float>(level(rng));
  return x;
}

void check_one(const PoolGeometry& g, bool nans) {
  SCOPED_TRACE(name(g) + (nans ? " with NaNs" : ""));
  const std::vector<float> x = inputs(g, static_cast<unsigned>(g.c * 31 + g.kh * 7 + g.sw), nans);
  const Reference ref = reference_forward(g, x);
  std::vector<float> dy(ref.y.size());
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (float& v : dy) v = u(rng);
  const std::vector<float> dx_ref = reference_backward(g, ref, dy);
  for (const bool avx512 : {true, false})
    for (const int threads : {1, 2}) {
      SCOPED_TRACE(std::string(avx512 ? "AVX-512 where the CPU has it" : "portable") + ", " +
                   std::to_string(threads) + " thread(s)");
      std::vector<float> y(ref.y.size(), 7.f);
      std::vector<char> ws(cpu::max_pool_workspace_bytes(g) + 1, 0x5A);
      cpu::max_pool_forward(g, x.data(), y.data(), ws.data(), threads, avx512);
      for (size_t i = 0; i < y.size(); ++i)
        ASSERT_TRUE(same_bits(y[i], ref.y[i])) << "y[" << i << "] " << y[i] << " vs " << ref.y[i];
      ASSERT_EQ(ws.back(), 0x5A) << "the workspace was written past its size";
      // dx starts as garbage: every position must be written.
      std::vector<float> dx(dx_ref.size(), 12345.f);
      cpu::max_pool_backward(g, dy.data(), ws.data(), dx.data(), threads, avx512);
      for (size_t i = 0; i < dx.size(); ++i)
        ASSERT_TRUE(same_bits(dx[i], dx_ref[i]))
            << "dx[" << i << "] " << dx[i] << " vs " << dx_ref[i];
      // round_dx: the same gradient rounded to bfloat16 (overlapping windows' sums after adding).
      PoolGeometry rounded = g;
      rounded.round_dx = true;
      std::vector<float> dx16(dx_ref.size(), 12345.f), want16 = dx_ref;
      cpu::round_to_bf16(want16.data(), want16.size());
      cpu::max_pool_backward(rounded, dy.data(), ws.data(), dx16.data(), threads, avx512);
      for (size_t i = 0; i < dx16.size(); ++i)
        ASSERT_TRUE(same_bits(dx16[i], want16[i]))
            << "rounded dx[" << i << "] " << dx16[i] << " vs " << want16[i];
    }
}

void check(PoolGeometry g, bool nans) {
  for (const bool relu : {false, true}) {
    g.relu = relu;
    check_one(g, nans);
  }
}

TEST(CpuPool, LoopsMatchTheDefinitionBitForBit) {
  for (const int64_t c : {1, 3, 16, 17, 32, 40, 64}) {
    for (const bool nans : {false, true}) {
      check(geometry(3, 26, 26, c, 2, 2, 2, 2, 0, 0, 0, 0), nans);  // the reference CNN's
      check(geometry(2, 11, 11, c, 2, 2, 2, 2, 0, 0, 0, 0), nans);  // an edge no window reaches
      check(geometry(2, 9, 10, c, 3, 3, 2, 2, 1, 1, 1, 1), nans);   // ResNet's stem: overlapping
      check(geometry(2, 8, 7, c, 3, 3, 1, 1, 1, 1, 0, 2), nans);    // stride 1, uneven padding
      check(geometry(2, 10, 9, c, 2, 3, 3, 3, 1, 0, 0, 2), nans);   // gaps between windows
    }
  }
  // 16x16 windows: 256 positions, past one byte's arg-max.
  check(geometry(2, 17, 18, 5, 16, 16, 1, 2, 0, 0, 0, 0), true);
  check(geometry(2, 16, 16, 33, 16, 16, 16, 16, 0, 0, 0, 0), false);
  // 15x17 windows: 255 positions, the most a byte holds beside the ReLU's "no gradient" (255).
  check(geometry(2, 16, 18, 7, 15, 17, 1, 1, 0, 0, 0, 0), true);
}

TEST(CpuPool, ManyImagesSplitOverThreadsAsOne) {
  // Above the serial threshold, so that two threads really split the rows and images.
  check(geometry(64, 26, 26, 32, 2, 2, 2, 2, 0, 0, 0, 0), false);
  check(geometry(16, 28, 28, 24, 3, 3, 2, 2, 1, 1, 1, 1), true);
}

TEST(CpuPool, KernelsNameAPaddingAsWideAsTheWindowAndAForeignWorkspace) {
  Kernels& k = get_device(DeviceSpec::cpu(0)).kernels();
  const Tensor x = Tensor::from_vector(std::vector<float>(2 * 6 * 6 * 3, 1.f), Shape{2, 6, 6, 3});
  Pool2dParams p;
  p.pad_top = 2;  // a 2x2 window wholly in the padding
  Tensor ws;
  try {
    k.max_pool2d(x, p, &ws);
    FAIL() << "a padding as wide as the window was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("smaller than the window"), std::string::npos) << e.what();
  }
  p.pad_top = 0;
  const Tensor y = k.max_pool2d(x, p, &ws);
  EXPECT_EQ(y.shape(), (Shape{2, 3, 3, 3}));
  const Tensor small = Tensor::from_vector(std::vector<float>(4, 0.f), Shape{4});
  EXPECT_THROW(k.max_pool2d_backward(y, x, small, p), InvalidArgument);
  const Tensor wrong_dy =
      Tensor::from_vector(std::vector<float>(2 * 2 * 3 * 3, 1.f), Shape{2, 2, 3, 3});
  EXPECT_THROW(k.max_pool2d_backward(wrong_dy, x, ws, p), InvalidArgument);
  const Tensor dx = k.max_pool2d_backward(y, x, ws, p);
  EXPECT_EQ(dx.shape(), x.shape());
}

// Through CpuKernels, as the ops reach it: the window, strides and the four paddings of
// Pool2dParams must reach the loops as the definition reads them (the loop tests above take a
// PoolGeometry directly), with and without the ReLU.
TEST(CpuPool, KernelsPoolAsTheDefinition) {
  Kernels& k = get_device(DeviceSpec::cpu(0)).kernels();
  for (const bool relu : {false, true}) {
    Pool2dParams p;
    p.window_h = 3, p.window_w = 2, p.stride_h = 2, p.stride_w = 1;
    p.pad_top = 1, p.pad_bottom = 2, p.pad_left = 0, p.pad_right = 1;
    p.relu = relu;
    const PoolGeometry g = geometry(2, 9, 7, 19, 3, 2, 2, 1, 1, 2, 0, 1);
    SCOPED_TRACE(name(g) + (relu ? " then ReLU" : ""));
    PoolGeometry gr = g;
    gr.relu = relu;
    const std::vector<float> xv = inputs(g, 11, true);
    const Reference ref = reference_forward(gr, xv);
    const Tensor x = Tensor::from_vector(xv, Shape{g.n, g.h, g.w, g.c});
    Tensor ws;
    const Tensor y = k.max_pool2d(x, p, &ws);
    ASSERT_EQ(y.shape(), (Shape{g.n, g.oh, g.ow, g.c}));
    const std::vector<float> yv = y.to_vector<float>();
    for (size_t i = 0; i < yv.size(); ++i)
      ASSERT_TRUE(same_bits(yv[i], ref.y[i])) << "y[" << i << "] " << yv[i] << " vs " << ref.y[i];
    std::vector<float> dyv(yv.size());
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (float& v : dyv) v = u(rng);
    const std::vector<float> want = reference_backward(gr, ref, dyv);
    const Tensor dy = Tensor::from_vector(dyv, y.shape());
    const std::vector<float> dx = k.max_pool2d_backward(dy, x, ws, p).to_vector<float>();
    for (size_t i = 0; i < dx.size(); ++i)
      ASSERT_TRUE(same_bits(dx[i], want[i])) << "dx[" << i << "] " << dx[i] << " vs " << want[i];
  }
}

}  // namespace
}  // namespace dtrain
