// GPU kernels of training against the CPU reference: losses, dropout masks, batch norm, the ReLU
// gradient of a gradient in two parts and the optimizer updates (see gpu_kernels_test.cc). Every
// test skips when no CUDA device is visible.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "devices/gpu_test_util.h"
#include "dtrain/core/precision.h"

namespace dtrain {
namespace {

using namespace gpu_test;

// --- the ReLU gradient of a residual block's input ---

// The ReLU gradient of a gradient in two parts (a residual block's input): one kernel, the bits
// of the sum's kernel then the ReLU gradient's, with y float32 and a kept bfloat16 copy.
TEST(GpuKernels, ReluGradOfSumIsAddThenReluGrad) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint64_t s = 970;
  for (const Shape& shape : {Shape{2, 6, 5, 16}, Shape{3, 7, 5}, Shape{1}}) {
    const Tensor y = random_tensor(shape, s++, -2.f, 2.f), a = random_tensor(shape, s++),
                 b = random_tensor(shape, s++);
    const Tensor dx = gpu().relu_grad_of_sum(G(y), G(a), G(b));
    expect_bitwise_equal(
        gpu().activation_backward(UnaryOp::kRelu, G(y), gpu().binary(BinaryOp::kAdd, G(a), G(b))),
        dx, "relu_grad_of_sum " + shape.to_string());
    expect_close(cpu().relu_grad_of_sum(y, a, b), dx, 1e-6f, 1e-7f,
                 "relu_grad_of_sum " + shape.to_string());
    set_precision_policy(Precision::kMixedBFloat16);
    const Tensor y16 = gpu().cast(G(y), DType::kBFloat16);
    const Tensor dx16 = gpu().relu_grad_of_sum(y16, G(a), G(b));
    const Tensor want16 =
        gpu().activation_backward(UnaryOp::kRelu, y16, gpu().binary(BinaryOp::kAdd, G(a), G(b)));
    set_precision_policy(Precision::kFloat32);
    expect_bitwise_equal(want16, dx16, "relu_grad_of_sum, bfloat16 y " + shape.to_string());
  }
  // The CPU's rule at the special values, bit for bit (oneDNN's ReLU gradient: y <= 0 ? 0 * dy :
  // dy): a NaN y passes dy on, a NaN or infinite dy where y <= 0 gives NaN, a negative one -0.
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  const std::vector<float> ys = {1.f, 0.f, -0.f, -1.f, nan, 2.f, -inf, inf, 1e-39f, -1e-39f};
  const std::vector<float> ds = {nan, inf, -inf, -1.f, 1.f, 0.f, -0.f, 3.f, 1e-39f, -1e-39f};
  std::vector<float> yv, av, bv;
  for (float yy : ys)
    for (float d : ds) {
      yv.push_back(yy);
      av.push_back(d);
      bv.push_back(0.f);  // d + 0 = d, -0 + 0 = +0 (as on both devices)
    }
  const Shape sp{static_cast<int64_t>(yv.size())};
  const Tensor ty = Tensor::from_vector(yv, sp), ta = Tensor::from_vector(av, sp),
               tb = Tensor::from_vector(bv, sp);
  // Bits equal, or both NaN (a NaN's payload is the CPU's operand's or x86's default, and CUDA's
  // canonical 0x7fffffff).
  const auto same = [&](const Tensor& c, const Tensor& g, const char* what) {
    const std::vector<float> vc = c.to_vector<float>(), vg = g.to(kCpu).to_vector<float>();
    ASSERT_EQ(vc.size(), vg.size());
    for (size_t i = 0; i < vc.size(); ++i) {
      uint32_t bc, bg;
      std::memcpy(&bc, &vc[i], 4);
      std::memcpy(&bg, &vg[i], 4);
      EXPECT_TRUE(bc == bg || (std::isnan(vc[i]) && std::isnan(vg[i])))
          << what << " at y " << yv[i] << ", dy " << av[i] << ": cpu " << vc[i] << " gpu " << vg[i]
          << " (bits " << std::hex << bc << " and " << bg << ")";
    }
  };
  same(cpu().activation_backward(UnaryOp::kRelu, ty, ta),
       gpu().activation_backward(UnaryOp::kRelu, G(ty), G(ta)), "ReLU gradient");
  same(cpu().relu_grad_of_sum(ty, ta, tb), gpu().relu_grad_of_sum(G(ty), G(ta), G(tb)),
       "relu_grad_of_sum");
  try {
    gpu().relu_grad_of_sum(G(random_tensor(Shape{4, 4}, 980)), G(random_tensor(Shape{4, 4}, 981)),
                           G(random_tensor(Shape{4, 2}, 982)));
    FAIL() << "relu_grad_of_sum took [4, 4] and [4, 2]";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("relu_grad_of_sum"), std::string::npos) << e.what();
  }
}

// --- losses ---

TEST(GpuKernels, SoftmaxCrossEntropy) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<std::pair<int64_t, int32_t>> cases = {{16, 10}, {5, 1}, {7, 1000}, {300, 33}};
  for (const auto& [n, classes] : cases) {
    const Tensor logits = random_tensor(Shape{n, classes}, 1100 + n, -4.f, 4.f);
    const Tensor labels = random_labels(n, classes, 1200 + n);
    Tensor loss_c, probs_c, loss_g, probs_g;
    cpu().softmax_cross_entropy(logits, labels, &loss_c, &probs_c);
    gpu().softmax_cross_entropy(G(logits), G(labels), &loss_g, &probs_g);
    const std::string what = "N " + std::to_string(n) + " C " + std::to_string(classes);
    expect_close(loss_c, loss_g, 1e-5f, 1e-6f, "loss " + what);
    expect_close(probs_c, probs_g, 1e-5f, 1e-7f, "probs " + what);
  }
  const Tensor logits = random_tensor(Shape{3, 4}, 1300);
  Tensor loss, probs;
  for (int32_t bad : {4, -1}) {
    const Tensor labels = Tensor::from_vector<int32_t>({0, bad, 1}, Shape{3});
    EXPECT_THROW(cpu().softmax_cross_entropy(logits, labels, &loss, &probs), InvalidArgument);
    EXPECT_THROW(gpu().softmax_cross_entropy(G(logits), G(labels), &loss, &probs), InvalidArgument);
  }
}

TEST(GpuKernels, SoftmaxCrossEntropyBackward) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 37;
  const int32_t classes = 11;
  const Tensor logits = random_tensor(Shape{n, classes}, 1400, -3.f, 3.f);
  const Tensor labels = random_labels(n, classes, 1401);
  const Tensor dloss = random_tensor(Shape{n}, 1402);
  Tensor loss, probs;
  cpu().softmax_cross_entropy(logits, labels, &loss, &probs);
  expect_close(cpu().softmax_cross_entropy_backward(probs, labels, dloss),
               gpu().softmax_cross_entropy_backward(G(probs), G(labels), G(dloss)), 1e-6f, 1e-7f);
}

// --- regularisation / normalisation ---

TEST(GpuKernels, DropoutMaskIsBitIdenticalToCpuAndPhilox) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<Shape> shapes = {Shape{1001}, Shape{3, 5, 7}, Shape{64, 257}, Shape{0}};
  const std::vector<std::pair<uint64_t, uint64_t>> seeds = {
      {0, 0}, {42, 7}, {0x123456789abcdefull, 1ull << 40}};
  for (const Shape& shape : shapes)
    for (float rate : {0.f, 0.1f, 0.5f, 0.9f})
      for (const auto& [seed, stream] : seeds) {
        const std::string what = shape.to_string() + " rate " + std::to_string(rate) + " seed " +
                                 std::to_string(seed) + " stream " + std::to_string(stream);
        const Tensor c = cpu().dropout_mask(shape, rate, seed, stream);
        const Tensor g = gpu().dropout_mask(shape, rate, seed, stream);
        expect_bitwise_equal(c, g, what);
        const Philox rng(seed, stream);
        const std::vector<float> gv = g.to_vector<float>();
        const float keep = 1.f / (1.f - rate);
        for (size_t i = 0; i < gv.size(); ++i)
          ASSERT_EQ(gv[i], rng.uniform(i) >= rate ? keep : 0.f) << what << " element " << i;
      }
  EXPECT_THROW(gpu().dropout_mask(Shape{4}, 1.f, 0, 0), InvalidArgument);
  EXPECT_THROW(gpu().dropout_mask(Shape{4}, -0.1f, 0, 0), InvalidArgument);
}

TEST(GpuKernels, BatchNormTrainingAndInference) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint64_t s = 1500;
  // Shape{6, 4, 4, 8}: channels a multiple of 4, the float4 kernels; the others the scalar ones.
  // Shape{16, 28, 28, 64}: 12,544 rows, in many chunks (bn_moments_finish); its values lie in
  // [1000, 1001], where float32 E[x^2] - mean^2 has no digit left.
  for (const Shape& shape : {Shape{8, 5, 5, 6}, Shape{32, 10}, Shape{3, 1}, Shape{4096, 3},
                             Shape{6, 4, 4, 8}, Shape{16, 28, 28, 64}}) {
    const int64_t c = shape[-1];
    // An offset mean makes a one-pass variance lose digits; both devices must not.
    const bool far = shape.numel() > 100000;
    const Tensor x = random_tensor(shape, s++, far ? 1000.f : 2.f, far ? 1001.f : 4.f);
    const Tensor gamma = random_tensor(Shape{c}, s++, 0.5f, 1.5f);
    const Tensor beta = random_tensor(Shape{c}, s++);
    const BatchNormForward fc = cpu().batch_norm_training(x, gamma, beta, 1e-3f);
    const BatchNormForward fg = gpu().batch_norm_training(G(x), G(gamma), G(beta), 1e-3f);
    if (!far) {
      expect_close(fc.mean, fg.mean, 1e-5f, 1e-5f, "mean " + shape.to_string());
      expect_close(fc.var, fg.var, 1e-4f, 1e-5f, "var " + shape.to_string());
      expect_close(fc.y, fg.y, 1e-4f, 1e-4f, "y " + shape.to_string());
    } else {
      // Near 1000 one ulp of the mean (6.1e-5) moves y by 6.1e-5 x 3.5 (1 / std) x gamma (< 1.5),
      // and the CPU's (oneDNN's float32 sums of 12,544 values near 1000, split as its threads
      // split them) may be off by many: the GPU's statistics are checked against float64 ones
      // instead (its Welford sums of x - x[0] lose nothing here), and its y against the CPU's
      // formula on the GPU's own statistics.
      const std::vector<float> xv = x.to_vector<float>();
      std::vector<double> sum(c, 0.0), sq(c, 0.0);
      for (size_t i = 0; i < xv.size(); ++i) sum[i % c] += xv[i];
      const double rows = static_cast<double>(shape.numel() / c);
      for (size_t i = 0; i < xv.size(); ++i) {
        const double d = xv[i] - sum[i % c] / rows;
        sq[i % c] += d * d;
      }
      std::vector<float> mean64(c), var64(c);
      for (int64_t j = 0; j < c; ++j) {
        mean64[j] = static_cast<float>(sum[j] / rows);
        var64[j] = static_cast<float>(sq[j] / rows);  // biased, as batch norm's
      }
      // the mean within 2 ulps (1.2e-4 near 1000), the variance (about 1/12) to 1e-4
      expect_close(Tensor::from_vector(mean64, Shape{c}, kCpu), fg.mean, 0.f, 1.3e-4f,
                   "mean against float64 " + shape.to_string());
      expect_close(Tensor::from_vector(var64, Shape{c}, kCpu), fg.var, 1e-4f, 1e-6f,
                   "var against float64 " + shape.to_string());
      const Tensor gm = fg.mean.to(kCpu), gv = fg.var.to(kCpu);
      expect_close(cpu().batch_norm_inference(x, gamma, beta, gm, gv, 1e-3f), fg.y, 1e-4f, 1e-4f,
                   "y on the GPU's statistics " + shape.to_string());
    }
    const Tensor mean = random_tensor(Shape{c}, s++), var = random_tensor(Shape{c}, s++, 0.1f, 2.f);
    expect_close(cpu().batch_norm_inference(x, gamma, beta, mean, var, 1e-3f),
                 gpu().batch_norm_inference(G(x), G(gamma), G(beta), G(mean), G(var), 1e-3f), 1e-5f,
                 1e-5f, "inference " + shape.to_string());
  }
}

TEST(GpuKernels, BatchNormBackward) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint64_t s = 1600;
  for (const Shape& shape : {Shape{8, 5, 5, 6}, Shape{32, 10}, Shape{4096, 3}, Shape{6, 4, 4, 8}}) {
    const int64_t c = shape[-1];
    const Tensor x = random_tensor(shape, s++);
    const Tensor dy = random_tensor(shape, s++);
    const Tensor gamma = random_tensor(Shape{c}, s++, 0.5f, 1.5f);
    const Tensor beta = random_tensor(Shape{c}, s++);
    const BatchNormForward f = cpu().batch_norm_training(x, gamma, beta, 1e-3f);
    const BatchNormBackward bc = cpu().batch_norm_backward(dy, x, gamma, f.mean, f.var, 1e-3f);
    const BatchNormBackward bg =
        gpu().batch_norm_backward(G(dy), G(x), G(gamma), G(f.mean), G(f.var), 1e-3f);
    const float atol = 1e-4f * std::sqrt(static_cast<float>(shape.numel() / c));
    expect_close(bc.dbeta, bg.dbeta, 1e-4f, atol, "dbeta " + shape.to_string());
    expect_close(bc.dgamma, bg.dgamma, 1e-4f, atol, "dgamma " + shape.to_string());
    expect_close(bc.dx, bg.dx, 1e-3f, 1e-4f, "dx " + shape.to_string());
  }
}

// batch norm + ReLU as one op: the CPU's fused kernel (a bitmask) against the GPU's (the ReLU in
// the normalisation's pass, the output as the mask).
TEST(GpuKernels, BatchNormReluMatchesTheCpu) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint64_t s = 1650;
  for (const Shape& shape : {Shape{8, 5, 5, 6}, Shape{6, 4, 4, 8}}) {
    const int64_t c = shape[-1];
    const Tensor x = random_tensor(shape, s++);
    const Tensor dy = random_tensor(shape, s++);
    const Tensor gamma = random_tensor(Shape{c}, s++, 0.5f, 1.5f);
    const Tensor beta = random_tensor(Shape{c}, s++);
    Tensor mc, mg;
    const BatchNormForward fc = cpu().batch_norm_relu_training(x, gamma, beta, 1e-3f, &mc);
    const BatchNormForward fg = gpu().batch_norm_relu_training(G(x), G(gamma), G(beta), 1e-3f, &mg);
    expect_close(fc.y, fg.y, 1e-4f, 1e-4f, "y " + shape.to_string());
    // The GPU fuses the ReLU into the normalisation's pass: the same bits as the two kernels.
    expect_bitwise_equal(
        gpu().unary(UnaryOp::kRelu, gpu().batch_norm_training(G(x), G(gamma), G(beta), 1e-3f).y),
        fg.y, "fused against batch_norm_training then relu " + shape.to_string());
    const BatchNormBackward bc =
        cpu().batch_norm_relu_backward(dy, x, gamma, fc.mean, fc.var, 1e-3f, mc);
    const BatchNormBackward bg =
        gpu().batch_norm_relu_backward(G(dy), G(x), G(gamma), fg.mean, fg.var, 1e-3f, mg);
    const float atol = 1e-4f * std::sqrt(static_cast<float>(shape.numel() / c));
    expect_close(bc.dbeta, bg.dbeta, 1e-4f, atol, "dbeta " + shape.to_string());
    expect_close(bc.dgamma, bg.dgamma, 1e-4f, atol, "dgamma " + shape.to_string());
    expect_close(bc.dx, bg.dx, 1e-3f, 1e-4f, "dx " + shape.to_string());
  }
}

// DTRAIN_CUDA_BN set for one scope (the CUDA device reads it at each call), then as it was.
class ScopedBatchNormKernels {
 public:
  explicit ScopedBatchNormKernels(const char* value) {
    if (const char* v = std::getenv("DTRAIN_CUDA_BN")) before_ = v, had_ = true;
    ::setenv("DTRAIN_CUDA_BN", value, 1);
  }
  ~ScopedBatchNormKernels() {
    if (had_)
      ::setenv("DTRAIN_CUDA_BN", before_.c_str(), 1);
    else
      ::unsetenv("DTRAIN_CUDA_BN");
  }

 private:
  std::string before_;
  bool had_ = false;
};

// The one-pass kernels (the default) against those before them (DTRAIN_CUDA_BN=two_pass): the
// statistics close (Welford's arithmetic differs), the backward pass bit for bit: dbeta and dgamma
// are the same sums in the same order, and batch_norm_relu_backward's ReLU taken as dy is read
// gives what the ReLU gradient kernel gave, but for the sign of a zero (below).
TEST(GpuKernels, BatchNormOnePassMatchesTwoPass) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint64_t s = 1700;
  for (const Shape& shape :
       {Shape{8, 5, 5, 6}, Shape{6, 4, 4, 8}, Shape{4096, 3}, Shape{32, 28, 28, 64}, Shape{1, 2}}) {
    const int64_t c = shape[-1];
    const std::string at = " " + shape.to_string();
    const Tensor x = G(random_tensor(shape, s++, -1.f, 3.f));
    const Tensor dy = G(random_tensor(shape, s++));
    const Tensor gamma = G(random_tensor(Shape{c}, s++, 0.5f, 1.5f));
    const Tensor beta = G(random_tensor(Shape{c}, s++));
    Tensor mask1, mask2;
    BatchNormForward f1, f2;
    BatchNormBackward b1, b2, r1, r2;
    f1 = gpu().batch_norm_relu_training(x, gamma, beta, 1e-3f, &mask1);
    b1 = gpu().batch_norm_backward(dy, x, gamma, f1.mean, f1.var, 1e-3f);
    r1 = gpu().batch_norm_relu_backward(dy, x, gamma, f1.mean, f1.var, 1e-3f, mask1);
    {
      ScopedBatchNormKernels before("two_pass");
      f2 = gpu().batch_norm_relu_training(x, gamma, beta, 1e-3f, &mask2);
      // The same statistics for both backward passes, so that only their kernels differ.
      b2 = gpu().batch_norm_backward(dy, x, gamma, f1.mean, f1.var, 1e-3f);
      r2 = gpu().batch_norm_relu_backward(dy, x, gamma, f1.mean, f1.var, 1e-3f, mask1);
    }
    expect_close(f2.mean.to(kCpu), f1.mean, 1e-5f, 1e-6f, "mean" + at);
    expect_close(f2.var.to(kCpu), f1.var, 1e-5f, 1e-7f, "var" + at);
    expect_close(f2.y.to(kCpu), f1.y, 1e-4f, 1e-5f, "y" + at);
    expect_bitwise_equal(b2.dbeta, b1.dbeta, "dbeta" + at);
    expect_bitwise_equal(b2.dgamma, b1.dgamma, "dgamma" + at);
    expect_bitwise_equal(b2.dx, b1.dx, "dx" + at);
    // The two-pass ReLU gradient is the CPU's 0 * dy where the mask is off (-0 for a negative dy),
    // the one-pass kernel's +0 (the sums start at +0, so dbeta and dgamma agree): with one row
    // (Shape{1, 2}) dx = gamma / std * (dz - dbeta - 0) is -0 in one and +0 in the other.
    expect_bitwise_equal(r2.dbeta, r1.dbeta, "relu dbeta" + at);
    expect_bitwise_equal(r2.dgamma, r1.dgamma, "relu dgamma" + at);
    expect_bitwise_equal(r2.dx, r1.dx, "relu dx" + at, true);
  }
}

// A mask of another shape is refused by name.
TEST(GpuKernels, BatchNormReluBackwardChecksItsMask) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Tensor x = G(random_tensor(Shape{4, 8}, 1750));
  const Tensor gamma = G(random_tensor(Shape{8}, 1751));
  const Tensor mean = G(random_tensor(Shape{8}, 1752)),
               var = G(random_tensor(Shape{8}, 1753, 1, 2));
  const Tensor wrong = G(random_tensor(Shape{4, 4}, 1754));
  try {
    gpu().batch_norm_relu_backward(x, x, gamma, mean, var, 1e-3f, wrong);
    FAIL() << "a [4, 4] mask for a [4, 8] input was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("batch_norm_relu_backward"), std::string::npos)
        << e.what();
  }
}

// --- optimizers ---

TEST(GpuKernels, SgdUpdate) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (int mode = 0; mode < 3; ++mode) {  // plain, momentum, nesterov
    Tensor var_c = random_tensor(Shape{513}, 1700), var_g = G(var_c);
    Tensor mom_c = Tensor::zeros(Shape{513}, DType::kFloat32, kCpu);
    Tensor mom_g = Tensor::zeros(Shape{513}, DType::kFloat32, kGpu);
    for (int step = 0; step < 3; ++step) {
      const Tensor grad = random_tensor(Shape{513}, 1710 + static_cast<uint64_t>(step));
      cpu().sgd_update(var_c, grad, mode ? &mom_c : nullptr, 0.1f, 0.9f, mode == 2);
      gpu().sgd_update(var_g, G(grad), mode ? &mom_g : nullptr, 0.1f, 0.9f, mode == 2);
    }
    expect_close(var_c, var_g, 1e-5f, 1e-6f, "var mode " + std::to_string(mode));
    expect_close(mom_c, mom_g, 1e-5f, 1e-6f, "momentum mode " + std::to_string(mode));
  }
}

TEST(GpuKernels, AdamUpdate) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Tensor var_c = random_tensor(Shape{1000}, 1800), var_g = G(var_c);
  Tensor m_c = Tensor::zeros(Shape{1000}, DType::kFloat32, kCpu);
  Tensor v_c = Tensor::zeros(Shape{1000}, DType::kFloat32, kCpu);
  Tensor m_g = Tensor::zeros(Shape{1000}, DType::kFloat32, kGpu);
  Tensor v_g = Tensor::zeros(Shape{1000}, DType::kFloat32, kGpu);
  for (int64_t step = 1; step <= 4; ++step) {
    const Tensor grad = random_tensor(Shape{1000}, 1810 + static_cast<uint64_t>(step));
    cpu().adam_update(var_c, m_c, v_c, grad, 1e-2f, 0.9f, 0.999f, 1e-7f, step, 0.5f, 0.999f);
    gpu().adam_update(var_g, m_g, v_g, G(grad), 1e-2f, 0.9f, 0.999f, 1e-7f, step, 0.5f, 0.999f);
  }
  expect_close(var_c, var_g, 1e-5f, 1e-6f, "var");
  expect_close(m_c, m_g, 1e-5f, 1e-7f, "m");
  expect_close(v_c, v_g, 1e-5f, 1e-8f, "v");
}

TEST(GpuKernels, RejectsCpuTensorsAndOtherDtypes) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Tensor x = random_tensor(Shape{4}, 1);
  EXPECT_THROW(gpu().unary(UnaryOp::kRelu, x), InvalidArgument);  // on the CPU
  EXPECT_THROW(gpu().unary(UnaryOp::kRelu, G(cpu().cast(x, DType::kFloat64))), InvalidArgument);
}

}  // namespace
}  // namespace dtrain
