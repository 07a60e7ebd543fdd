// The ResNets' bfloat16 hand-offs under mixed_bfloat16 on the CPU (Conv2dParams::bf16_output,
// batch_norm_relu_training's bf16_output, batch norm's bfloat16 dx): what each kernel writes
// against the float32 result rounded, the requests' conditions, and the chains a user may build.
// (Part of cpu_bf16_test.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "devices/cpu_test_util.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/precision.h"
#include "dtrain/devices/device.h"
#include "dtrain/devices/kernels.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"

namespace dtrain {
namespace {

// Every element of got within 2% of want's largest magnitude (bfloat16 rounding taken at another
// point of the sum), and want not all zero.
void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0, diff = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
  }
  EXPECT_GT(scale, 0) << what;
  EXPECT_LE(diff, 2e-2 * scale) << what;
}

// The ResNets' bfloat16 hand-offs (Conv2dParams::bf16_output, batch_norm_relu_training's
// bf16_output): under mixed_bfloat16, with one tape recording, a convolution's and a batch norm
// with ReLU's outputs are bfloat16, the bits of their float32 outputs rounded to nearest even, on
// the bfloat16 kernels and on float32 ones (a 3x3x3 layer's short sums); a bfloat16 input is read
// as it is. Without a tape, or without the policy, the request gives float32.
TEST(CpuBf16, ConvolutionsAndBatchNormsHandOffBfloat16Activations) {
  const auto bits = [](const Tensor& t) {
    std::vector<uint16_t> v(static_cast<size_t>(t.numel()));
    std::memcpy(v.data(), t.raw_data(), v.size() * 2);
    return v;
  };
  struct Case {
    int64_t k, cin;
    int stride;
    bool bias;
  };
  for (const Case c : {Case{3, 16, 1, false}, Case{1, 32, 2, true}, Case{3, 3, 1, true}}) {
    const Shape xs{2, 9, 9, c.cin}, ws{c.k, c.k, c.cin, 32};
    const Tensor x = Tensor::from_vector(wave(static_cast<size_t>(xs.numel()), 0.37f), xs);
    const Tensor w = Tensor::from_vector(wave(static_cast<size_t>(ws.numel()), 0.91f), ws);
    const Tensor b = c.bias ? Tensor::from_vector(wave(32, 0.5f), Shape{32}) : Tensor();
    const Tensor gamma = Tensor::from_vector(wave(32, 0.7f), Shape{32});
    const Tensor beta = Tensor::from_vector(wave(32, 1.1f), Shape{32});
    Conv2dParams p;
    p.stride_h = p.stride_w = c.stride;
    Conv2dParams p16 = p;
    p16.bf16_output = true;
    const std::string what = std::to_string(c.k) + "x" + std::to_string(c.k) + "x" +
                             std::to_string(c.cin) + ", stride " + std::to_string(c.stride);
    struct Policy {
      Policy() { set_precision_policy(Precision::kMixedBFloat16); }
      ~Policy() { set_precision_policy(Precision::kFloat32); }
    } policy;
    {
      GradientTape tape;
      tape.watch(x);
      const Tensor y16 = ops::conv2d(x, w, b, p16), y32 = ops::conv2d(x, w, b, p);
      ASSERT_EQ(y16.dtype(), DType::kBFloat16) << what;
      ASSERT_EQ(y32.dtype(), DType::kFloat32) << what;
      const auto got = bits(y16);
      const auto want = y32.to_vector<float>();
      size_t differ = 0;
      for (size_t i = 0; i < want.size(); ++i) differ += got[i] != float_to_bf16(want[i]);
      EXPECT_EQ(differ, 0u) << what << ": the convolution's bfloat16 output";
      Tensor m, v;
      const Tensor z16 = ops::batch_norm_relu_training(y16, gamma, beta, 1e-3f, &m, &v, true);
      const Tensor z32 = ops::batch_norm_relu_training(y16, gamma, beta, 1e-3f, &m, &v, false);
      ASSERT_EQ(z16.dtype(), DType::kBFloat16) << what;
      ASSERT_EQ(z32.dtype(), DType::kFloat32) << what;
      const auto zgot = bits(z16);
      const auto zwant = z32.to_vector<float>();
      differ = 0;
      for (size_t i = 0; i < zwant.size(); ++i) differ += zgot[i] != float_to_bf16(zwant[i]);
      EXPECT_EQ(differ, 0u) << what << ": the batch norm's bfloat16 output";
      // The backward kernels' bfloat16 dx (for the convolution before): float32's rounded, with
      // and without ReLU, also where a NaN or an infinity in dy spreads through the sums.
      Kernels& k = kernels_for(y16);
      for (const bool poisoned : {false, true}) {
        std::vector<float> dyv = wave(static_cast<size_t>(y16.numel()), 1.7f);
        if (poisoned) {
          dyv[3] = std::numeric_limits<float>::quiet_NaN();
          dyv[40] = INFINITY;
        }
        const Tensor dy = Tensor::from_vector(dyv, y16.shape());
        for (const bool relu : {false, true}) {
          Tensor mask;
          const BatchNormForward f =
              relu ? k.batch_norm_relu_training(y16, gamma, beta, 1e-3f, &mask)
                   : k.batch_norm_training(y16, gamma, beta, 1e-3f);
          const BatchNormBackward b16 =
              relu ? k.batch_norm_relu_backward(dy, y16, gamma, f.mean, f.var, 1e-3f, mask,
                                                DType::kBFloat16)
                   : k.batch_norm_backward(dy, y16, gamma, f.mean, f.var, 1e-3f, DType::kBFloat16);
          const BatchNormBackward b32 =
              relu ? k.batch_norm_relu_backward(dy, y16, gamma, f.mean, f.var, 1e-3f, mask)
                   : k.batch_norm_backward(dy, y16, gamma, f.mean, f.var, 1e-3f);
          ASSERT_EQ(b16.dx.dtype(), DType::kBFloat16);
          const auto dgot = bits(b16.dx);
          const auto dwant = b32.dx.to_vector<float>();
          differ = 0;
          for (size_t i = 0; i < dwant.size(); ++i) differ += dgot[i] != float_to_bf16(dwant[i]);
          EXPECT_EQ(differ, 0u) << what << ": bfloat16 dx" << (relu ? ", ReLU" : "")
                                << (poisoned ? ", NaN and infinity in dy" : "");
          EXPECT_EQ(std::memcmp(b16.dgamma.raw_data(), b32.dgamma.raw_data(), 32 * 4), 0) << what;
          EXPECT_EQ(std::memcmp(b16.dbeta.raw_data(), b32.dbeta.raw_data(), 32 * 4), 0) << what;
        }
      }
      // The next convolution reads the bfloat16 activation as it is: the float32 one's result.
      const Tensor w2 = Tensor::from_vector(wave(3 * 3 * 32 * 16, 0.23f), Shape{3, 3, 32, 16});
      const auto from16 = ops::conv2d(z16, w2, Tensor(), Conv2dParams{}).to_vector<float>();
      const auto from32 = ops::conv2d(z32, w2, Tensor(), Conv2dParams{}).to_vector<float>();
      EXPECT_EQ(from16, from32) << what;
    }
    {  // A bfloat16 activation read twice: its two bfloat16 gradients are summed in float32,
       // close to the float32 activation's (the gradient is rounded before the sum, not after).
      const auto dx_of = [&](const Conv2dParams& cp, DType* a_dtype) {
        GradientTape t2;
        t2.watch(x);
        const Tensor a = ops::conv2d(x, w, b, cp);
        *a_dtype = a.dtype();
        Tensor m2, v2;
        const Tensor gy =
            Tensor::from_vector(wave(static_cast<size_t>(a.numel()), 0.3f), a.shape());
        const Tensor loss = ops::add(
            ops::sum(ops::mul(ops::batch_norm_training(a, gamma, beta, 1e-3f, &m2, &v2), gy)),
            ops::sum(ops::cast(a, DType::kFloat32)));
        const Tensor dx = t2.gradient(loss, {x})[0];
        EXPECT_EQ(dx.dtype(), DType::kFloat32) << what;
        return dx.to_vector<float>();
      };
      DType a16 = DType::kFloat32, a32 = DType::kBFloat16;
      const auto got = dx_of(p16, &a16), want = dx_of(p, &a32);
      EXPECT_EQ(a16, DType::kBFloat16) << what;
      EXPECT_EQ(a32, DType::kFloat32) << what;
      expect_close(got, want, what + ": a bfloat16 activation read twice");
    }
    {  // A batch norm with ReLU handing bfloat16 to another batch norm (not a convolution): the
       // second's bfloat16 dx is read widened by the first's backward pass.
      const auto dx_of = [&](bool handoff) {
        GradientTape t3;
        t3.watch(x);
        Tensor m3, v3;
        const Tensor a = ops::conv2d(x, w, b, handoff ? p16 : p);
        const Tensor z = ops::batch_norm_relu_training(a, gamma, beta, 1e-3f, &m3, &v3, handoff);
        EXPECT_EQ(z.dtype(), handoff ? DType::kBFloat16 : DType::kFloat32) << what;
        const Tensor u = ops::batch_norm_training(z, gamma, beta, 1e-3f, &m3, &v3);
        const Tensor gy =
            Tensor::from_vector(wave(static_cast<size_t>(u.numel()), 0.3f), u.shape());
        return t3.gradient(ops::sum(ops::mul(u, gy)), {x})[0].to_vector<float>();
      };
      const auto got = dx_of(true), want = dx_of(false);
      expect_close(got, want, what + ": batch norm into batch norm");
    }
    {
      EXPECT_EQ(ops::conv2d(x, w, b, p16).dtype(), DType::kFloat32) << what << ", no tape";
      Tensor m4, v4;
      EXPECT_EQ(
          ops::batch_norm_relu_training(ops::conv2d(x, w, b, p), gamma, beta, 1e-3f, &m4, &v4, true)
              .dtype(),
          DType::kFloat32)
          << what << ", no tape";
      set_precision_policy(Precision::kFloat32);
      GradientTape tape;
      tape.watch(x);
      EXPECT_EQ(ops::conv2d(x, w, b, p16).dtype(), DType::kFloat32) << what << ", float32";
    }
  }
}

// Where the hand-off's rounding can differ from float_to_bf16's: outputs below float32's normal
// range and NaNs. A convolution with a zero filter outputs its bias: denormals of both signs, the
// smallest normal, a NaN. A denormal comes out as float_to_bf16 gives it or as a zero of its
// sign (oneDNN's bfloat16 conversion on AMX flushes them); a NaN as a NaN; the normal exactly.
TEST(CpuBf16, HandedOffConvolutionOutputsBelowTheNormalRange) {
  struct Policy {
    Policy() { set_precision_policy(Precision::kMixedBFloat16); }
    ~Policy() { set_precision_policy(Precision::kFloat32); }
  } policy;
  const std::vector<float> bias_values = {1e-39f,
                                          -1e-39f,
                                          std::numeric_limits<float>::min(),
                                          std::numeric_limits<float>::quiet_NaN(),
                                          3e-40f,
                                          -std::numeric_limits<float>::denorm_min(),
                                          1.f,
                                          0.f};
  std::vector<float> bv(32);
  for (size_t i = 0; i < bv.size(); ++i) bv[i] = bias_values[i % bias_values.size()];
  const Tensor x = Tensor::from_vector(wave(2 * 5 * 5 * 16, 0.37f), Shape{2, 5, 5, 16});
  const Tensor w = Tensor::zeros(Shape{3, 3, 16, 32});
  const Tensor b = Tensor::from_vector(bv, Shape{32});
  Conv2dParams p16;
  p16.bf16_output = true;
  GradientTape tape;
  tape.watch(x);
  const Tensor y = ops::conv2d(x, w, b, p16);
  ASSERT_EQ(y.dtype(), DType::kBFloat16);
  std::vector<uint16_t> got(static_cast<size_t>(y.numel()));
  std::memcpy(got.data(), y.raw_data(), got.size() * 2);
  int flushed = 0, subnormal = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float v = bv[i % 32];
    const uint16_t want = float_to_bf16(v), zero = std::signbit(v) ? 0x8000 : 0;
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(got[i]))) << i;
    } else if (std::fpclassify(v) == FP_SUBNORMAL) {
      EXPECT_TRUE(got[i] == want || got[i] == zero)
          << i << ": " << v << " gave 0x" << std::hex << got[i];
      flushed += got[i] != want;
      ++subnormal;
    } else {
      EXPECT_EQ(got[i], want) << i << ": " << v;
    }
  }
  std::cout << "denormal outputs flushed to zero: " << flushed << " of " << subnormal << "\n";
}

}  // namespace
}  // namespace dtrain
