// mixed_bfloat16 on the CPU device where oneDNN has no bfloat16 kernels (devices/cpu/dnnl_util.h).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/precision.h"
#include "dtrain/devices/device.h"
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
  EXPECT_NE(emulated.find("mixed_bfloat16 emulated: oneDNN has no bfloat16 kernels for this CPU"),
            std::string::npos)
      << emulated;
  EXPECT_NE(native.find(cpu::bf16_kernels_native() ? "on oneDNN's bfloat16 kernels"
                                                   : "mixed_bfloat16 emulated"),
            std::string::npos)
      << native;
}

}  // namespace
}  // namespace dtrain
