// The GPU under the precision settings, against the CPU: mixed_bfloat16 (operands rounded to
// bfloat16; cuBLAS's and cuDNN's products on bfloat16 tensor cores, or cuDNN's on TF32 ones where
// it has no bfloat16 plan) and TensorFloat-32 (enable_tensor_float_32_execution), on every product
// kind (matmul, batch_matmul, the three convolution directions); and bfloat16 activations handed
// from layer to layer (Kernels::hands_off_bfloat16), kernel by kernel and through ResNet-18's
// training step. Every test skips when no CUDA device is visible.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "devices/cuda_testing.h"
#include "devices/gpu_test_util.h"
#include "dtrain/core/precision.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"
#include "dtrain/nn/applications.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/model.h"
#include "dtrain/strategies/one_device_strategy.h"
#include "model/op_util.h"

namespace dtrain {
namespace {

using namespace gpu_test;
using applications::ResNetOptions;
using applications::ResNetStyle;

// Sets the precision policy and TF32 for a scope; float32 without TF32 again at its end.
struct PrecisionScope {
  PrecisionScope(Precision p, bool tf32) {
    set_precision_policy(p);
    enable_tensor_float_32_execution(tf32);
  }
  ~PrecisionScope() {
    set_precision_policy(Precision::kFloat32);
    enable_tensor_float_32_execution(false);
  }
  PrecisionScope(const PrecisionScope&) = delete;
  PrecisionScope& operator=(const PrecisionScope&) = delete;
};

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to(kCpu).to_vector<float>(), y = b.to(kCpu).to_vector<float>();
  double d = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i)
    d = std::max(d, std::fabs(static_cast<double>(x[i]) - y[i]));
  return d;
}

// conv_cases() and two ResNet-sized 3x3 convolutions (64 channels), where cuDNN has tensor-core
// engines to choose (the small cases may never use one).
std::vector<ConvCase> precision_cases() {
  std::vector<ConvCase> cases = conv_cases();
  cases.push_back({Shape{2, 14, 14, 64}, Shape{3, 3, 64, 64}, {1, 1, 1, 1, 1, 1}});
  cases.push_back({Shape{2, 14, 14, 64}, Shape{3, 3, 64, 64}, {2, 2, 0, 1, 0, 1}});
  return cases;
}

// The convolutions so far whose float32 output cuDNN wrote in bfloat16 (no plan with a float32
// output for bfloat16 inputs) and the GPU widened after.
int64_t widened_count() { return cuda_testing::conv_outputs_widened_from_bfloat16(); }

// The relative tolerance of a GPU product from bfloat16 operands against the CPU's, given
// widened_count() before it: float32 rounding of the sums (1e-4), or one bfloat16 step twice over
// where its output was written in bfloat16 and widened (as PyTorch's autocast leaves it).
float product_rtol(int64_t widened_before) {
  return widened_count() > widened_before ? 1.f / 128 : 1e-4f;
}

// Every product kind on one set of inputs: the four matmul transposes, a larger matmul, a batched
// product, and each convolution case's three directions. Inputs are host tensors, moved to the
// kernels' device.
struct Products {
  std::vector<std::string> what;
  std::vector<Tensor> out;  // on the kernels' device
  std::vector<float> rtol;  // product_rtol of each
};
Products all_products(Kernels& k, bool gpu_side,
                      const std::vector<ConvCase>& cases = precision_cases()) {
  auto on = [&](const Tensor& t) { return gpu_side ? G(t) : t; };
  Products r;
  const auto add = [&](std::string what, const std::function<Tensor()>& product) {
    const int64_t before = widened_count();
    r.out.push_back(product());
    r.rtol.push_back(product_rtol(before));
    r.what.push_back(std::move(what));
  };
  uint64_t s = 900;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Tensor a = random_tensor(ta ? Shape{33, 17} : Shape{17, 33}, s++);
      const Tensor b = random_tensor(tb ? Shape{9, 33} : Shape{33, 9}, s++);
      add(std::string("matmul ") + (ta ? "a^T" : "a") + (tb ? " b^T" : " b"),
          [&] { return k.matmul(on(a), on(b), ta, tb); });
    }
  const Tensor big_a = random_tensor(Shape{256, 512}, s++),
               big_b = random_tensor(Shape{512, 128}, s++);
  add("matmul 256x512x128", [&] { return k.matmul(on(big_a), on(big_b), false, false); });
  const Tensor ba = random_tensor(Shape{3, 17, 33}, s++), bb = random_tensor(Shape{3, 9, 33}, s++);
  add("batch_matmul [3, 17, 33] @ [3, 9, 33]^T",
      [&] { return k.batch_matmul(on(ba), on(bb), false, true); });
  for (const ConvCase& c : cases) {
    const Tensor x = random_tensor(c.x, s++), w = random_tensor(c.w, s++);
    add("conv2d " + conv_name(c), [&] { return k.conv2d(on(x), on(w), Tensor(), c.p); });
    const Tensor dy = random_tensor(r.out.back().shape(), s++);
    add("conv2d_backward_input " + conv_name(c),
        [&] { return k.conv2d_backward_input(on(dy), on(w), c.x, c.p); });
    add("conv2d_backward_filter " + conv_name(c),
        [&] { return k.conv2d_backward_filter(on(x), on(dy), c.w, c.p, false, nullptr); });
  }
  return r;
}

// Under mixed_bfloat16 the GPU's products read their operands rounded to bfloat16 and accumulate
// in float32 (from compute capability 8.0 on tensor cores: cuBLAS's products on bfloat16 copies,
// cuDNN's on bfloat16 plans, or as TF32, which holds bfloat16 values exactly, where cuDNN has no
// plan for the types), as the CPU device's do: the two agree to float32 rounding of the sums (to a
// bfloat16 step where cuDNN wrote a float32 output in bfloat16: product_rtol), and both differ
// from float32's results (so the rounding did happen).
TEST(GpuKernels, MixedBFloat16ProductsMatchTheCpus) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Products f32 = all_products(cpu(), false);
  PrecisionScope scope(Precision::kMixedBFloat16, false);
  const Products c = all_products(cpu(), false);
  const Products g = all_products(gpu(), true);
  ASSERT_EQ(c.out.size(), g.out.size());
  for (size_t i = 0; i < c.out.size(); ++i) {
    expect_close(c.out[i], g.out[i], g.rtol[i], 1e-4f, c.what[i]);
    EXPECT_GT(max_abs_diff(f32.out[i], g.out[i]), 0.0)
        << c.what[i] << ": bfloat16 gave float32's exact values (were the operands rounded?)";
  }
}

// TF32 (enable_tensor_float_32_execution): within TF32's rounding of float32 (about 1e-3 relative
// per product), and off again, float32's results as before: TF32's cuDNN plans and algorithm
// choices are cached apart from float32's. Shapes no other test uses run under TF32 first, so a
// TF32 plan reused for float32 would show as float32 off by TF32's error.
TEST(GpuKernels, TensorFloat32StaysNearFloat32AndSwitchesOffCleanly) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (const char* o = std::getenv("NVIDIA_TF32_OVERRIDE"); o && std::string(o) == "0")
    GTEST_SKIP() << "NVIDIA_TF32_OVERRIDE=0 turns TF32 off";
  const std::vector<ConvCase> fresh = {
      {Shape{2, 10, 10, 48}, Shape{3, 3, 48, 40}, {1, 1, 1, 1, 1, 1}},
      {Shape{2, 10, 10, 48}, Shape{1, 1, 48, 40}, {1, 1, 0, 0, 0, 0}}};
  {
    PrecisionScope scope(Precision::kFloat32, true);
    (void)all_products(gpu(), true, fresh);
  }
  const Products fresh_cpu = all_products(cpu(), false, fresh);
  const Products fresh_f32 = all_products(gpu(), true, fresh);
  for (size_t i = 0; i < fresh_cpu.out.size(); ++i)
    expect_close(fresh_cpu.out[i], fresh_f32.out[i], 1e-4f, 1e-4f,
                 "float32 after TF32 on a new shape: " + fresh_cpu.what[i]);

  const Products c = all_products(cpu(), false);
  const Products before = all_products(gpu(), true);
  Products tf32;
  {
    PrecisionScope scope(Precision::kFloat32, true);
    tf32 = all_products(gpu(), true);
  }
  const Products after = all_products(gpu(), true);
  ASSERT_EQ(c.out.size(), tf32.out.size());
  double largest = 0, largest_conv = 0;
  for (size_t i = 0; i < c.out.size(); ++i) {
    expect_close(c.out[i], tf32.out[i], 1e-2f, 1e-2f, "TF32 " + c.what[i]);
    expect_bitwise_equal(before.out[i], after.out[i],
                         "float32 before and after TF32: " + c.what[i]);
    const double d = max_abs_diff(before.out[i], tf32.out[i]);
    largest = std::max(largest, d);
    if (c.what[i].find("x [2, 14, 14, 64]") != std::string::npos) {
      largest_conv = std::max(largest_conv, d);
      std::cout << "TF32 - float32, largest difference: " << d << " in " << c.what[i] << "\n";
    }
  }
  // Tensor cores exist from compute capability 8.0 ("sm_80" in the description); there TF32 must
  // have changed the 256x512x128 product and at least one direction of the 64-channel
  // convolutions.
  const std::string d = get_device(kGpu).description();
  const size_t at = d.find("sm_");
  const int major = at == std::string::npos ? 0 : std::atoi(d.c_str() + at + 3) / 10;
  if (major >= 8) {
    EXPECT_GT(largest, 0.0) << d << ": TF32 gave float32's exact results (did it run?)";
    EXPECT_GT(largest_conv, 0.0) << d << ": no 64-channel convolution ran on TF32 tensor cores";
  }
}

// --- bfloat16 activations handed from layer to layer (hands_off_bfloat16) ---

Tensor widened(Kernels& k, const Tensor& t) {
  return t.dtype() == DType::kFloat32 ? t : k.cast(t, DType::kFloat32);
}
// A host tensor's values rounded to bfloat16 and kept so.
Tensor bf16(const Tensor& t) { return cpu().cast(t, DType::kBFloat16); }

// Each kernel that takes or gives a bfloat16 activation, against the CPU's with the same
// arguments: a convolution's bfloat16 output (within one bfloat16 step: the float32 sums differ in
// order before they are rounded), its two gradients read from bfloat16 x and dy, and the batch
// norms reading bfloat16 x and writing bfloat16 y (with ReLU) and dx.
TEST(GpuKernels, Bfloat16HandOffsMatchTheCpus) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!gpu().hands_off_bfloat16())
    GTEST_SKIP() << "this GPU keeps float32 activations (before compute capability 8.0, or "
                    "DTRAIN_CUDA_BF16_HANDOFFS=0)";
  PrecisionScope scope(Precision::kMixedBFloat16, false);
  const float step = 1.f / 128;  // bfloat16's relative spacing, twice over
  uint64_t s = 2000;
  const int64_t plan_runs_before = cuda_testing::conv_bfloat16_plan_runs();
  for (const ConvCase& c : precision_cases()) {
    const std::string at = std::string(" ").append(conv_name(c));
    const Tensor x = bf16(random_tensor(c.x, s++)), w = random_tensor(c.w, s++);
    Conv2dParams p = c.p;
    p.bf16_output = true;
    const Tensor yc = cpu().conv2d(x, w, Tensor(), p), yg = gpu().conv2d(G(x), G(w), Tensor(), p);
    EXPECT_EQ(yg.dtype(), DType::kBFloat16) << at;
    expect_close(widened(cpu(), yc), widened(gpu(), yg), step, 1e-3f, "conv2d y" + at);
    // With a bias (the Keras form's convolutions): the sum, plus the bias, then rounded.
    const Tensor bias = random_tensor(Shape{c.w[3]}, s++);
    expect_close(widened(cpu(), cpu().conv2d(x, w, bias, p)),
                 widened(gpu(), gpu().conv2d(G(x), G(w), G(bias), p)), step, 1e-3f,
                 "conv2d y with a bias" + at);
    const Tensor dy = bf16(random_tensor(yc.shape(), s++));
    int64_t before = widened_count();
    const Tensor dxg = gpu().conv2d_backward_input(G(dy), G(w), c.x, c.p);
    expect_close(cpu().conv2d_backward_input(dy, w, c.x, c.p), dxg, product_rtol(before), 1e-4f,
                 "conv2d_backward_input of a bfloat16 dy" + at);
    before = widened_count();
    const Tensor dwg = gpu().conv2d_backward_filter(G(x), G(dy), c.w, c.p, false, nullptr);
    expect_close(cpu().conv2d_backward_filter(x, dy, c.w, c.p, false, nullptr), dwg,
                 product_rtol(before), 1e-4f, "conv2d_backward_filter of bfloat16 x and dy" + at);
  }
  // cuDNN's bfloat16 plans ran (not only the TF32 fallback, which the comparisons above pass too),
  // unless they are turned off (as bench/gpu/run.sh's fallback row does).
  bool plans_off = false;
  for (const char* off : {"DTRAIN_CUDNN_API", "DTRAIN_CUDNN_BF16"}) {
    const char* v = std::getenv(off);
    plans_off = plans_off || (v && (std::string(v) == "legacy" || std::string(v) == "0"));
  }
  if (!plans_off) {
    EXPECT_GT(cuda_testing::conv_bfloat16_plan_runs(), plan_runs_before)
        << "no convolution ran on a cuDNN bfloat16 plan";
  }
  {
    // A 1x1 convolution (cuBLAS) with a long inner dimension and few outputs, like ResNet-50's last
    // stage at a small batch: cuBLAS may split the sum (split-K); its partial sums must be added in
    // float32 and rounded to bfloat16 once (CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION), else
    // the outputs near zero are off by bfloat16 steps of the partial sums.
    const Tensor x = bf16(random_tensor(Shape{8, 7, 7, 2048}, s++)),
                 w = random_tensor(Shape{1, 1, 2048, 256}, s++);
    Conv2dParams p;  // stride 1, no padding
    p.bf16_output = true;
    const Tensor yg = gpu().conv2d(G(x), G(w), Tensor(), p);
    EXPECT_EQ(yg.dtype(), DType::kBFloat16);
    expect_close(widened(cpu(), cpu().conv2d(x, w, Tensor(), p)), widened(gpu(), yg), step, 1e-3f,
                 "conv2d y, 1x1 over 2048 channels");
  }
  for (const Shape& shape : {Shape{8, 5, 5, 6}, Shape{4, 14, 14, 64}, Shape{3, 7}}) {
    const std::string at = std::string(" ").append(shape.to_string());
    const int64_t ch = shape[-1];
    const Tensor x = bf16(random_tensor(shape, s++, -1.f, 3.f));
    const Tensor dy = random_tensor(shape, s++);
    const Tensor gamma = random_tensor(Shape{ch}, s++, 0.5f, 1.5f),
                 beta = random_tensor(Shape{ch}, s++);
    Tensor mc, mg;
    const BatchNormForward fc =
        cpu().batch_norm_relu_training(x, gamma, beta, 1e-3f, &mc, DType::kBFloat16);
    const BatchNormForward fg =
        gpu().batch_norm_relu_training(G(x), G(gamma), G(beta), 1e-3f, &mg, DType::kBFloat16);
    EXPECT_EQ(fg.y.dtype(), DType::kBFloat16) << at;
    expect_close(fc.mean, fg.mean, 1e-5f, 1e-6f, "mean of a bfloat16 x" + at);
    expect_close(fc.var, fg.var, 1e-4f, 1e-6f, "var of a bfloat16 x" + at);
    expect_close(widened(cpu(), fc.y), widened(gpu(), fg.y), step, 1e-3f, "bfloat16 y" + at);
    const float atol = 1e-4f * std::sqrt(static_cast<float>(shape.numel() / ch));
    for (const bool relu : {true, false}) {
      const std::string what = relu ? at + " (relu)" : at;
      const BatchNormBackward bc =
          relu ? cpu().batch_norm_relu_backward(dy, x, gamma, fc.mean, fc.var, 1e-3f, mc,
                                                DType::kBFloat16)
               : cpu().batch_norm_backward(dy, x, gamma, fc.mean, fc.var, 1e-3f, DType::kBFloat16);
      const BatchNormBackward bg =
          relu ? gpu().batch_norm_relu_backward(G(dy), G(x), G(gamma), G(fc.mean), G(fc.var), 1e-3f,
                                                mg, DType::kBFloat16)
               : gpu().batch_norm_backward(G(dy), G(x), G(gamma), G(fc.mean), G(fc.var), 1e-3f,
                                           DType::kBFloat16);
      EXPECT_EQ(bg.dx.dtype(), DType::kBFloat16) << what;
      expect_close(bc.dbeta, bg.dbeta, 1e-4f, atol, "dbeta" + what);
      expect_close(bc.dgamma, bg.dgamma, 1e-4f, atol, "dgamma" + what);
      expect_close(widened(cpu(), bc.dx), widened(gpu(), bg.dx), step, 1e-3f, "bfloat16 dx" + what);
    }
  }
}

// A cuDNN plan that cuDNN finalized but will not run (its first run reports NOT_SUPPORTED, brought
// about by cuda_testing's hook) is no plan: each direction of the convolution takes its fallback
// (the legacy algorithms in float32; the TF32 path on rounded operands under mixed bfloat16, with
// the bfloat16 output still bfloat16) instead of throwing, and keeps it, so the result stays as
// near the CPU's after the hook is off. Shapes no other test runs, so that no plan has run before.
TEST(GpuKernels, AConvolutionPlanFailingAtItsFirstRunFallsBack) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (const char* v = std::getenv("DTRAIN_CUDNN_API"); v && std::string(v) == "legacy")
    GTEST_SKIP() << "DTRAIN_CUDNN_API=legacy builds no graph-API plans for the hook to fail";
  struct Hook {
    Hook() { cuda_testing::fail_first_conv_plan_runs(true); }
    ~Hook() { cuda_testing::fail_first_conv_plan_runs(false); }
  };
  uint64_t s = 3000;
  for (const Precision precision : {Precision::kFloat32, Precision::kMixedBFloat16}) {
    const bool mixed = precision == Precision::kMixedBFloat16;
    const std::string at = mixed ? " (mixed bfloat16)" : " (float32)";
    PrecisionScope scope(precision, false);
    const ConvCase c{
        Shape{3, 10, 11, mixed ? 24 : 16}, Shape{3, 3, mixed ? 24 : 16, 40}, {1, 1, 1, 1, 1, 1}};
    const Tensor x = mixed ? bf16(random_tensor(c.x, s++)) : random_tensor(c.x, s++);
    const Tensor w = random_tensor(c.w, s++);
    Conv2dParams p = c.p;
    p.bf16_output = mixed;
    const Tensor y = cpu().conv2d(x, w, Tensor(), p);
    const Tensor dy = mixed ? bf16(random_tensor(y.shape(), s++)) : random_tensor(y.shape(), s++);
    const Tensor dx = cpu().conv2d_backward_input(dy, w, c.x, c.p);
    const Tensor dw = cpu().conv2d_backward_filter(x, dy, c.w, c.p, false, nullptr);
    const float y_rtol = mixed ? 1.f / 128 : 1e-4f;
    // filter gradients sum over N*OH*OW products (as Conv2dBackwardFilter's tolerance)
    const float dw_atol = 1e-4f * std::sqrt(static_cast<float>(y.numel() / c.w[3]));
    const int64_t failed_before = cuda_testing::conv_plans_failed_at_first_run();
    for (const bool hooked : {true, false}) {
      const std::string what = at + (hooked ? ", its plans failing" : ", after");
      std::optional<Hook> hook;
      if (hooked) hook.emplace();
      Tensor yg, dxg, dwg;
      ASSERT_NO_THROW(yg = gpu().conv2d(G(x), G(w), Tensor(), p)) << what;
      const int64_t before_dx = widened_count();
      ASSERT_NO_THROW(dxg = gpu().conv2d_backward_input(G(dy), G(w), c.x, c.p)) << what;
      const float dx_rtol = product_rtol(before_dx);
      const int64_t before_dw = widened_count();
      ASSERT_NO_THROW(dwg = gpu().conv2d_backward_filter(G(x), G(dy), c.w, c.p, false, nullptr))
          << what;
      const float dw_rtol = product_rtol(before_dw);
      EXPECT_EQ(yg.dtype(), y.dtype()) << what;
      expect_close(widened(cpu(), y), widened(gpu(), yg), y_rtol, 1e-3f, "conv2d y" + what);
      expect_close(dx, dxg, dx_rtol, 1e-4f, "conv2d_backward_input" + what);
      expect_close(dw, dwg, dw_rtol, dw_atol, "conv2d_backward_filter" + what);
      // the hook fired: plans were found for these problems and failed (else nothing was tested)
      if (hooked) {
        EXPECT_GT(cuda_testing::conv_plans_failed_at_first_run(), failed_before) << what;
      }
    }
  }
}

// Where cuDNN has no plan with a float32 output for bfloat16 inputs (its documented bfloat16
// configurations have a bfloat16 output; brought about here by cuda_testing's hook), a mixed
// bfloat16 convolution's float32 output (the input and filter gradients, a forward convolution
// that hands nothing on) is written in bfloat16 by cuDNN and widened, not computed on TF32 tensor
// cores from float32 copies: each direction counts once, its values are bfloat16 values, and all
// three are within a bfloat16 step of the CPU's, which keeps float32 outputs. A forward
// convolution with a bias is not (the bias is added to the sum before any rounding): it stays
// within float32 rounding. Symmetric padding, and asymmetric padding (padded explicitly; the
// input gradient cropped after widening).
TEST(GpuKernels, Float32OutputsWithoutACudnnPlanAreWrittenInBfloat16AndWidened) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!gpu().hands_off_bfloat16())
    GTEST_SKIP() << "this GPU has no bfloat16 tensor cores (or DTRAIN_CUDA_BF16_HANDOFFS=0)";
  for (const char* off : {"DTRAIN_CUDNN_API", "DTRAIN_CUDNN_BF16"}) {
    const char* v = std::getenv(off);
    if (v && (std::string(v) == "legacy" || std::string(v) == "0"))
      GTEST_SKIP() << off << "=" << v << " turns cuDNN's bfloat16 plans off";
  }
  struct Hook {
    Hook() { cuda_testing::refuse_float32_outputs_of_bfloat16_convs(true); }
    ~Hook() { cuda_testing::refuse_float32_outputs_of_bfloat16_convs(false); }
  } hook;
  PrecisionScope scope(Precision::kMixedBFloat16, false);
  const float step = 1.f / 128;  // bfloat16's relative spacing, twice over
  const auto expect_bfloat16_values = [](const Tensor& t, const std::string& what) {
    expect_bitwise_equal(gpu().cast(gpu().cast(t, DType::kBFloat16), DType::kFloat32), t, what);
  };
  uint64_t s = 3100;
  for (const Conv2dParams& p : {Conv2dParams{1, 1, 1, 1, 1, 1}, Conv2dParams{2, 2, 0, 1, 0, 1}}) {
    const ConvCase c{Shape{2, 9, 13, 32}, Shape{3, 3, 32, 48}, p};
    const std::string at = " " + conv_name(c);
    const Tensor x = bf16(random_tensor(c.x, s++)), w = random_tensor(c.w, s++);
    const Tensor bias = random_tensor(Shape{c.w[3]}, s++);
    const Tensor y = cpu().conv2d(x, w, Tensor(), c.p);
    const Tensor y_biased = cpu().conv2d(x, w, bias, c.p);
    ASSERT_EQ(y.dtype(), DType::kFloat32) << at;
    const Tensor dy = bf16(random_tensor(y.shape(), s++));
    const Tensor dx = cpu().conv2d_backward_input(dy, w, c.x, c.p);
    const Tensor dw = cpu().conv2d_backward_filter(x, dy, c.w, c.p, false, nullptr);
    const float dw_atol = 1e-4f * std::sqrt(static_cast<float>(y.numel() / c.w[3]));
    const int64_t before = widened_count();
    const Tensor yg = gpu().conv2d(G(x), G(w), Tensor(), c.p);
    EXPECT_EQ(widened_count(), before + 1) << "conv2d" << at;
    const Tensor dxg = gpu().conv2d_backward_input(G(dy), G(w), c.x, c.p);
    EXPECT_EQ(widened_count(), before + 2) << "conv2d_backward_input" << at;
    const Tensor dwg = gpu().conv2d_backward_filter(G(x), G(dy), c.w, c.p, false, nullptr);
    EXPECT_EQ(widened_count(), before + 3) << "conv2d_backward_filter" << at;
    const Tensor yg_biased = gpu().conv2d(G(x), G(w), G(bias), c.p);
    EXPECT_EQ(widened_count(), before + 3) << "conv2d with a bias" << at;
    expect_close(y, yg, step, 1e-4f, "conv2d y" + at);
    expect_close(dx, dxg, step, 1e-4f, "conv2d_backward_input" + at);
    expect_close(dw, dwg, step, dw_atol, "conv2d_backward_filter" + at);
    expect_close(y_biased, yg_biased, 1e-4f, 1e-4f, "conv2d y with a bias" + at);
    expect_bfloat16_values(yg, "conv2d y's values" + at);
    expect_bfloat16_values(dxg, "conv2d_backward_input's values" + at);
    expect_bfloat16_values(dwg, "conv2d_backward_filter's values" + at);
  }
}

// One training step's logits and gradients (as host vectors): the model on `in`, the loss
// sum(y * dl), under the tape.
std::vector<std::vector<float>> step_values(Model& m, const Tensor& in, const Tensor& dl) {
  GradientTape tape;
  const Tensor y = m(in, /*training=*/true);
  std::vector<std::vector<float>> out{y.to(kCpu).to_vector<float>()};
  for (const Tensor& t : tape.gradient(ops::sum(ops::mul(y, dl)), m.trainable_variables())) {
    EXPECT_EQ(t.dtype(), DType::kFloat32);
    out.push_back(t.to(kCpu).to_vector<float>());
  }
  return out;
}

// The GPU's mixed bfloat16 step (gpu) against the CPU's (cpu), each tensor within 3 times the
// CPU's own distance between its mixed bfloat16 and float32 (f32) results, plus 0.1% of the
// tensor's largest value; plus, for the gradients, a bfloat16 step twice over of it
// (product_rtol's) where the GPU's step wrote float32 outputs in bfloat16 and widened them
// (`widened`: no cuDNN plan with a float32 output; a rounding the CPU does not do).
void expect_near_the_cpus(const std::vector<std::vector<float>>& cpu_values,
                          const std::vector<std::vector<float>>& gpu_values,
                          const std::vector<std::vector<float>>& f32, const std::string& form,
                          bool widened = false) {
  ASSERT_EQ(cpu_values.size(), gpu_values.size()) << form;
  ASSERT_EQ(cpu_values.size(), f32.size()) << form;
  for (size_t k = 0; k < cpu_values.size(); ++k) {
    const std::string what = form + (k == 0 ? ": logits" : ": gradient " + std::to_string(k));
    const std::vector<float>&a = cpu_values[k], &b = gpu_values[k], &r = f32[k];
    ASSERT_EQ(a.size(), b.size()) << what;
    ASSERT_EQ(a.size(), r.size()) << what;
    float largest = 0.f, to_f32 = 0.f, to_gpu = 0.f;
    for (size_t i = 0; i < a.size(); ++i) {
      largest = std::max(largest, std::fabs(a[i]));
      to_f32 = std::max(to_f32, std::fabs(a[i] - r[i]));
      to_gpu = std::max(to_gpu, std::fabs(a[i] - b[i]));
    }
    // (the logits: forward convolutions never widen; a bias is added to the unrounded sum)
    const bool wide = widened && k > 0;
    EXPECT_LE(to_gpu, 3.f * to_f32 + (wide ? 1e-3f + 1.f / 128 : 1e-3f) * largest)
        << what << ": the GPU is " << to_gpu << " from the CPU, whose mixed bfloat16 is " << to_f32
        << " from its float32 (largest value " << largest << ")"
        << (wide ? "; outputs widened from bfloat16 in the GPU's step" : "");
  }
}

// The same weights in a model built under the GPU strategy's scope.
void copy_weights(const Model& from, Model& to) {
  const VariableList vc = from.variables(), vg = to.variables();
  ASSERT_EQ(vc.size(), vg.size());
  for (size_t i = 0; i < vc.size(); ++i) vg[i]->assign(vc[i]->value().to(kGpu));
}

// ResNet-18's training step under mixed_bfloat16 on the GPU, both forms, with the same weights as
// on the CPU, against the CPU's. The hand-offs run (the model's stem convolution, called as the
// model calls it, gives bfloat16 on the GPU under a tape), and the logits and every gradient are as
// close to the CPU's as rounding allows: each within 3 times the CPU's own distance between its
// mixed bfloat16 and float32 results, plus 0.1% of the tensor's largest value. (64 x 64 images,
// 8 of them, so that the last stage's batch norms still see 32 rows.) The bound, tried on the CPU
// with its bfloat16 kernels against its float32 kernels on rounded operands (the same roundings,
// the sums in other orders; DTRAIN_BF16_KERNELS native and emulated, 2026-11-29): those two
// stayed within 0.84 of twice the distance, so 3 times leaves room for the GPU's other orders.
TEST(GpuKernels, ResNetStepHandsOffBfloat16AsTheCpu) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!gpu().hands_off_bfloat16()) GTEST_SKIP() << "this GPU keeps float32 activations";
  std::vector<float> xv(8 * 64 * 64 * 3), gv(8 * 10);
  for (size_t i = 0; i < xv.size(); ++i) xv[i] = static_cast<float>(std::sin(0.37 * i));
  for (size_t i = 0; i < gv.size(); ++i) gv[i] = static_cast<float>(std::cos(1.3 * i));
  const Tensor x = Tensor::from_vector(xv, Shape{8, 64, 64, 3});
  const Tensor g = Tensor::from_vector(gv, Shape{8, 10});
  OneDeviceStrategy on_gpu(kGpu);
  for (const ResNetStyle style : {ResNetStyle::kKeras, ResNetStyle::kTorchvision}) {
    const std::string form = style == ResNetStyle::kKeras ? "Keras form" : "torchvision form";
    ResNetOptions o;
    o.style = style;
    o.input_shape = Shape{64, 64, 3};
    o.classes = 10;
    auto mc = applications::ResNet18(o);
    mc->build();
    std::shared_ptr<Model> mg;
    {
      auto in_scope = on_gpu.scope();
      mg = applications::ResNet18(o);
      mg->build();
    }
    copy_weights(*mc, *mg);
    const std::vector<std::vector<float>> f32 = step_values(*mc, x, g);
    PrecisionScope scope(Precision::kMixedBFloat16, false);
    {  // the model's first convolution, as the model calls it
      std::function<Conv2D*(const Layer&)> first = [&](const Layer& l) -> Conv2D* {
        for (const auto& c : l.layers()) {
          if (auto* conv = dynamic_cast<Conv2D*>(c.get())) return conv;
          if (Conv2D* inner = first(*c)) return inner;
        }
        return nullptr;
      };
      Conv2D* stem = first(*mg);
      ASSERT_NE(stem, nullptr) << form;
      ASSERT_TRUE(stem->bfloat16_output) << form;
      GradientTape tape;  // (unpadded: the model pads the image first, but 7x7 "valid" fits)
      EXPECT_EQ((*stem)(G(x), /*training=*/true).dtype(), DType::kBFloat16)
          << form << ": the stem convolution's output on the GPU under a tape";
    }
    const std::vector<std::vector<float>> on_cpu = step_values(*mc, x, g);
    const int64_t widened_before = widened_count();
    const std::vector<std::vector<float>> on_gpu = step_values(*mg, G(x), G(g));
    expect_near_the_cpus(on_cpu, on_gpu, f32, form, widened_count() > widened_before);
  }
}

// The copies kept for the backward pass in bfloat16 on the GPU (keep_for_backward), kernel by
// kernel against the CPU's, which reads the same copies: the products' operands, the activations'
// gradients from a kept output, and add_relu's bfloat16 copy written in its own pass.
TEST(GpuKernels, KeptBfloat16CopiesMatchTheCpus) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!gpu().hands_off_bfloat16()) GTEST_SKIP() << "this GPU keeps float32 copies";
  PrecisionScope scope(Precision::kMixedBFloat16, false);
  uint64_t s = 2200;
  {  // the copies are made on the GPU, as on the CPU: bfloat16, shared by the ops that keep x
    const Tensor x = G(random_tensor(Shape{16, 8}, s++));
    GradientTape tape;
    tape.watch(x);
    const Tensor kept = ops::keep_for_backward(x);
    EXPECT_EQ(kept.dtype(), DType::kBFloat16);
    EXPECT_EQ(kept.device(), kGpu);
    EXPECT_EQ(ops::keep_for_backward(x).id(), kept.id()) << "a second op made a copy of its own";
    expect_bitwise_equal(gpu().cast(x, DType::kBFloat16), kept, "the kept copy");
  }
  const Tensor a = bf16(random_tensor(Shape{67, 129}, s++)),
               b = bf16(random_tensor(Shape{129, 33}, s++));
  expect_close(cpu().matmul(a, b, false, false), gpu().matmul(G(a), G(b), false, false), 1e-4f,
               1e-4f, "matmul of bfloat16 operands");
  const Tensor b32 = random_tensor(Shape{129, 33}, s++);
  expect_close(cpu().matmul(a, b32, false, false), gpu().matmul(G(a), G(b32), false, false), 1e-4f,
               1e-4f, "matmul of a bfloat16 and a float32 operand");
  const Tensor ba = bf16(random_tensor(Shape{3, 17, 40}, s++)),
               bb = bf16(random_tensor(Shape{3, 9, 40}, s++));
  expect_close(cpu().batch_matmul(ba, bb, false, true),
               gpu().batch_matmul(G(ba), G(bb), false, true), 1e-4f, 1e-4f,
               "batch_matmul of bfloat16 operands");
  for (const int64_t n : {int64_t{1000}, int64_t{1003}}) {  // the float4 path and the scalar one
    const Tensor y = bf16(random_tensor(Shape{n}, s++, -2.f, 2.f)),
                 dy = random_tensor(Shape{n}, s++);
    for (const UnaryOp op :
         {UnaryOp::kRelu, UnaryOp::kGeluTanh, UnaryOp::kGeluErf, UnaryOp::kTanh, UnaryOp::kSigmoid})
      expect_close(cpu().activation_backward(op, cpu().cast(y, DType::kFloat32), dy),
                   gpu().activation_backward(op, G(y), G(dy)), 1e-5f, 1e-6f,
                   "activation_backward of a bfloat16 kept value, op " +
                       std::to_string(static_cast<int>(op)) + ", n " + std::to_string(n));
    const Tensor u = random_tensor(Shape{n}, s++), v = random_tensor(Shape{n}, s++);
    Tensor rounded;
    const Tensor out = gpu().add_relu(G(u), G(v), &rounded);
    ASSERT_TRUE(rounded.defined());
    EXPECT_EQ(rounded.dtype(), DType::kBFloat16);
    expect_bitwise_equal(gpu().cast(out, DType::kBFloat16), rounded, "add_relu's bfloat16 copy");
    expect_bitwise_equal(gpu().unary(UnaryOp::kRelu, gpu().binary(BinaryOp::kAdd, G(u), G(v))), out,
                         "add_relu with its copy");
  }
}

// GPT (the gpt-nano preset, 3 layers) trains a step under mixed_bfloat16 on the GPU, keeping
// bfloat16 copies of its products' operands, as close to the CPU's step as rounding allows (as
// ResNetStepHandsOffBfloat16AsTheCpu).
TEST(GpuKernels, GptStepKeepsBfloat16CopiesAsTheCpu) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!gpu().hands_off_bfloat16()) GTEST_SKIP() << "this GPU keeps float32 copies";
  applications::GPTConfig c = applications::GPTConfig::preset("gpt-nano");
  std::vector<int32_t> ids(4 * 64);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 37 + 11) % 256);
  const Tensor x = Tensor::from_vector(ids, Shape{4, 64});
  const Tensor g = random_tensor(Shape{4, 64, c.vocab_size}, 2300);
  auto mc = std::make_shared<applications::GPT>(c);
  mc->build(Shape{4, 64});
  OneDeviceStrategy on_gpu(kGpu);
  std::shared_ptr<applications::GPT> mg;
  {
    auto in_scope = on_gpu.scope();
    mg = std::make_shared<applications::GPT>(c);
    mg->build(Shape{4, 64});
  }
  copy_weights(*mc, *mg);
  const std::vector<std::vector<float>> f32 = step_values(*mc, x, g);
  PrecisionScope scope(Precision::kMixedBFloat16, false);
  expect_near_the_cpus(step_values(*mc, x, g), step_values(*mg, G(x), G(g)), f32, "gpt-nano");
}

}  // namespace
}  // namespace dtrain
