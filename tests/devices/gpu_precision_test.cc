// The GPU under the precision settings, against the CPU: mixed_bfloat16 (operands rounded to
// bfloat16; cuBLAS's and cuDNN's products on bfloat16 tensor cores, or cuDNN's on TF32 ones where
// it has no bfloat16 plan) and TensorFloat-32 (enable_tensor_float_32_execution), on every product
// kind (matmul, batch_matmul, the three convolution directions); and bfloat16 activations handed
// from layer to layer (Kernels::hands_off_bfloat16), kernel by kernel (the training steps:
// gpu_bf16_steps_test.cc). Every test skips when no CUDA device is visible.
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

namespace dtrain {
namespace {

using namespace gpu_test;

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

// "NAME=value" of the switch that turns cuDNN's bfloat16 plans off (DTRAIN_CUDNN_API=legacy: no
// graph-API plans; DTRAIN_CUDNN_BF16=0), or "" where they are on.
std::string cudnn_bf16_plans_off() {
  for (const char* name : {"DTRAIN_CUDNN_API", "DTRAIN_CUDNN_BF16"}) {
    const char* v = std::getenv(name);
    if (v && (std::string(v) == "legacy" || std::string(v) == "0"))
      return std::string(name) + "=" + v;
  }
  return "";
}

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
  if (cudnn_bf16_plans_off().empty()) {
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
  if (const std::string off = cudnn_bf16_plans_off(); !off.empty())
    GTEST_SKIP() << off << " turns cuDNN's bfloat16 plans off";
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

}  // namespace
}  // namespace dtrain
