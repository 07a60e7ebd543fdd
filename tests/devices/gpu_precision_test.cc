// The GPU under the precision settings, against the CPU: mixed_bfloat16 (operands rounded to
// bfloat16; cuBLAS's products on bfloat16 tensor cores, cuDNN's on TF32 ones) and TensorFloat-32
// (enable_tensor_float_32_execution), on every product kind (matmul, batch_matmul, the three
// convolution directions). Every test skips when no CUDA device is visible.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "devices/gpu_test_util.h"
#include "dtrain/core/precision.h"

namespace dtrain {
namespace {

using namespace gpu_test;

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

// Every product kind on one set of inputs: the four matmul transposes, a larger matmul, a batched
// product, and each convolution case's three directions. Inputs are host tensors, moved to the
// kernels' device.
struct Products {
  std::vector<std::string> what;
  std::vector<Tensor> out;  // on the kernels' device
};
Products all_products(Kernels& k, bool gpu_side,
                      const std::vector<ConvCase>& cases = precision_cases()) {
  auto on = [&](const Tensor& t) { return gpu_side ? G(t) : t; };
  Products r;
  uint64_t s = 900;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Tensor a = random_tensor(ta ? Shape{33, 17} : Shape{17, 33}, s++);
      const Tensor b = random_tensor(tb ? Shape{9, 33} : Shape{33, 9}, s++);
      r.what.push_back(std::string("matmul ") + (ta ? "a^T" : "a") + (tb ? " b^T" : " b"));
      r.out.push_back(k.matmul(on(a), on(b), ta, tb));
    }
  const Tensor big_a = random_tensor(Shape{256, 512}, s++),
               big_b = random_tensor(Shape{512, 128}, s++);
  r.what.push_back("matmul 256x512x128");
  r.out.push_back(k.matmul(on(big_a), on(big_b), false, false));
  const Tensor ba = random_tensor(Shape{3, 17, 33}, s++), bb = random_tensor(Shape{3, 9, 33}, s++);
  r.what.push_back("batch_matmul [3, 17, 33] @ [3, 9, 33]^T");
  r.out.push_back(k.batch_matmul(on(ba), on(bb), false, true));
  for (const ConvCase& c : cases) {
    const Tensor x = random_tensor(c.x, s++), w = random_tensor(c.w, s++);
    const Tensor y = k.conv2d(on(x), on(w), Tensor(), c.p);
    r.what.push_back("conv2d " + conv_name(c));
    r.out.push_back(y);
    const Tensor dy = random_tensor(y.shape(), s++);
    r.what.push_back("conv2d_backward_input " + conv_name(c));
    r.out.push_back(k.conv2d_backward_input(on(dy), on(w), c.x, c.p));
    r.what.push_back("conv2d_backward_filter " + conv_name(c));
    r.out.push_back(k.conv2d_backward_filter(on(x), on(dy), c.w, c.p, false, nullptr));
  }
  return r;
}

// Under mixed_bfloat16 the GPU's products read their operands rounded to bfloat16 and accumulate
// in float32 (from compute capability 8.0 on tensor cores: cuBLAS's products on bfloat16 copies,
// cuDNN's as TF32, which holds bfloat16 values exactly), as the CPU device's do: the two agree to
// float32 rounding of the sums, and both differ from float32's results (so the rounding did
// happen).
TEST(GpuKernels, MixedBFloat16ProductsMatchTheCpus) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Products f32 = all_products(cpu(), false);
  PrecisionScope scope(Precision::kMixedBFloat16, false);
  const Products c = all_products(cpu(), false);
  const Products g = all_products(gpu(), true);
  ASSERT_EQ(c.out.size(), g.out.size());
  for (size_t i = 0; i < c.out.size(); ++i) {
    expect_close(c.out[i], g.out[i], 1e-4f, 1e-4f, c.what[i]);
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

}  // namespace
}  // namespace dtrain
