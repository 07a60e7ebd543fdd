// Layers, initializers and optimizers against hand-computed values.
#include "dtrain/nn/layers.h"

#include <sched.h>

#include <cmath>
#include <iostream>

#include "dtrain/core/precision.h"
#include "dtrain/model/initializers.h"
#include "dtrain/nn/losses.h"
#include "dtrain/nn/metrics.h"
#include "dtrain/nn/optimizers.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

class Layers : public ::testing::Test {
 protected:
  void SetUp() override { testing::use_two_cpus(); }
};

std::shared_ptr<Variable> scalar_var(float v) {
  return create_variable({"w", Shape{1}, DType::kFloat32, initializers::constant(v)});
}

TEST_F(Layers, DenseComputesXWPlusB) {
  Dense d(3, Activation::kNone);
  d.build(Shape{1, 2});
  d.kernel->assign(Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, Shape{2, 3}));
  d.bias->assign(Tensor::from_vector<float>({0.5f, -0.5f, 1}, Shape{3}));
  Tensor y = d(Tensor::from_vector<float>({1, 2}, Shape{1, 2}));
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{9.5f, 11.5f, 16.f}));
  EXPECT_EQ(d.trainable_variables().size(), 2u);
}

// Keras' Dense: the last axis of any rank >= 2 (a sequence [batch, time, features] is one product);
// a vector without a batch axis is refused.
TEST_F(Layers, DenseTakesTheLastAxisAndRefusesAVector) {
  Dense d(3);
  EXPECT_EQ(d(Tensor::zeros(Shape{1, 2, 2})).shape(), (Shape{1, 2, 3}));
  Dense v(3);
  EXPECT_THROW(v(Tensor::zeros(Shape{4})), InvalidArgument);
}

TEST_F(Layers, Conv2DAndMaxPoolByHand) {
  Conv2D c(1, 2, 2, Activation::kNone);
  std::vector<float> x(9);
  for (int i = 0; i < 9; ++i) x[static_cast<size_t>(i)] = static_cast<float>(i + 1);
  c.build(Shape{1, 3, 3, 1});
  c.kernel->assign(Tensor::full(Shape{2, 2, 1, 1}, 1.f));
  c.bias->assign(Tensor::full(Shape{1}, 1.f));
  EXPECT_EQ(c(Tensor::from_vector(x, Shape{1, 3, 3, 1})).to_vector<float>(),
            (std::vector<float>{13, 17, 25, 29}));

  std::vector<float> p(16);
  for (int i = 0; i < 16; ++i) p[static_cast<size_t>(i)] = static_cast<float>(i + 1);
  MaxPool2D pool(2);
  EXPECT_EQ(pool(Tensor::from_vector(p, Shape{1, 4, 4, 1})).to_vector<float>(),
            (std::vector<float>{6, 8, 14, 16}));
}

TEST_F(Layers, ConvReluThenMaxPoolEqualsTheLayersOneByOneBitwise) {
  // Sequential runs Conv2D(relu) + MaxPool2D as conv, pool, ReLU: the outputs and every gradient
  // must be exactly those of the layers applied one after another, for both paddings, including
  // windows that are all negative (ReLU gives 0 either way).
  for (ops::Padding pad : {ops::Padding::kValid, ops::Padding::kSame}) {
    set_global_seed(17);
    Sequential m;
    m.add(std::make_shared<Conv2D>(4, 3, 3, Activation::kRelu, pad));
    m.add(std::make_shared<MaxPool2D>(2, 2, pad));
    m.add(std::make_shared<Flatten>());
    m.add(std::make_shared<Dense>(3));
    m.build(Shape{2, 7, 7, 2});
    std::vector<float> xs(2 * 7 * 7 * 2);
    for (size_t i = 0; i < xs.size(); ++i) xs[i] = std::sin(0.7f * static_cast<float>(i)) - 0.3f;
    const Tensor x = Tensor::from_vector(xs, Shape{2, 7, 7, 2});
    GradientTape fused_tape;
    const Tensor fused = m(x, true);
    const auto fused_grads =
        fused_tape.gradient(ops::sum(ops::square(fused)), m.trainable_variables());
    GradientTape plain_tape;
    Tensor y = x;
    for (const auto& l : m.layers())
      y = (*l)(y, true);  // each layer on its own: conv+relu, then pool
    const auto plain_grads = plain_tape.gradient(ops::sum(ops::square(y)), m.trainable_variables());
    EXPECT_EQ(fused.to_vector<float>(), y.to_vector<float>());
    ASSERT_EQ(fused_grads.size(), plain_grads.size());
    for (size_t i = 0; i < fused_grads.size(); ++i)
      EXPECT_EQ(fused_grads[i].to_vector<float>(), plain_grads[i].to_vector<float>())
          << "gradient " << i;
  }
}

// Largest absolute difference between two tensors, relative to the largest magnitude in `want`.
double relative_error(const Tensor& got, const Tensor& want) {
  const auto g = got.to_vector<float>(), w = want.to_vector<float>();
  EXPECT_EQ(g.size(), w.size());
  double scale = 1e-30, err = 0;
  for (size_t i = 0; i < std::min(g.size(), w.size()); ++i) {
    scale = std::max(scale, std::abs(static_cast<double>(w[i])));
    err = std::max(err, std::abs(static_cast<double>(g[i]) - w[i]));
  }
  return err / scale;
}

TEST_F(Layers, ConvMaxPoolInChunksEqualsTheOpsApart) {
  // ops::conv2d_max_pool2d runs on a CPU a few images at a time (a chunk's convolution output fits
  // in 512 KB, half of an L2) and never keeps the convolution's output. 30x30 images through 32
  // filters make 100 KB (valid: 28x28) or 115 KB (same: 30x30) of output each: chunks of 5 or 4.
  // So 13 images run as 5+5+3, 10 as 4+4+2, 13 at stride 2 (29x29) as 4+4+4+1, and 4 images in one
  // piece (the kernels apart). Every output and gradient must match conv2d then max_pool2d: the
  // forward pass and the input's gradient to the bit (each image is computed alone either way), the
  // filter's and bias's gradients to float32 rounding (they sum the chunks).
  struct Case {
    int64_t n;
    int stride;
    ops::Padding conv_pad, pool_pad;
    bool bias;
    int window;
    int64_t chunk;
  };
  for (const Case& c : {Case{13, 1, ops::Padding::kValid, ops::Padding::kValid, true, 2, 5},
                        Case{10, 1, ops::Padding::kSame, ops::Padding::kSame, false, 3, 4},
                        Case{13, 2, ops::Padding::kSame, ops::Padding::kValid, true, 2, 4},
                        Case{4, 1, ops::Padding::kValid, ops::Padding::kValid, true, 2, 0}}) {
    SCOPED_TRACE("n=" + std::to_string(c.n) + " stride=" + std::to_string(c.stride));
    const int64_t hw = c.stride == 1 ? 30 : 58;
    Tensor x = testing::random_tensor({c.n, hw, hw, 2}, 70);
    Tensor w = testing::random_tensor({3, 3, 2, 32}, 71, -0.3f, 0.3f);
    Tensor b = c.bias ? testing::random_tensor({32}, 72) : Tensor();
    const Conv2dParams cp = ops::conv_params(x.shape(), w.shape(), c.stride, c.stride, c.conv_pad);
    const Shape conv_shape = ops::conv2d(x, w, b, c.stride, c.stride, c.conv_pad).shape();
    ConvPoolSaved saved;
    Pool2dParams pp;
    pp.window_h = pp.window_w = c.window;
    const Conv2dParams pool_pad =
        ops::conv_params(conv_shape, Shape{c.window, c.window}, 2, 2, c.pool_pad);
    pp.pad_top = pool_pad.pad_top;
    pp.pad_bottom = pool_pad.pad_bottom;
    pp.pad_left = pool_pad.pad_left;
    pp.pad_right = pool_pad.pad_right;
    get_device(DeviceSpec::cpu(0)).kernels().conv2d_max_pool2d(x, w, b, cp, pp, &saved);
    EXPECT_EQ(saved.chunk, c.chunk);
    EXPECT_EQ(saved.conv_out.defined(), c.chunk == 0)
        << "only the unchunked pass keeps the convolution output";

    const Tensor dy_weights =
        testing::random_tensor(ops::max_pool2d(ops::conv2d(x, w, b, c.stride, c.stride, c.conv_pad),
                                               c.window, c.window, 2, 2, c.pool_pad)
                                   .shape(),
                               73);
    auto run = [&](bool fused, bool relu) {
      GradientTape tape;
      Tensor xv = x, wv = w, bv = b;
      tape.watch(xv);
      tape.watch(wv);
      if (c.bias) tape.watch(bv);
      Tensor y = fused ? ops::conv2d_max_pool2d(xv, wv, bv, c.stride, c.conv_pad, c.window, 2,
                                                c.pool_pad, relu && fused)
                       : ops::max_pool2d(ops::conv2d(xv, wv, bv, c.stride, c.stride, c.conv_pad),
                                         c.window, c.window, 2, 2, c.pool_pad);
      if (relu && !fused) y = ops::relu(y);  // the ReLU apart
      std::vector<Tensor> sources{xv, wv};
      if (c.bias) sources.push_back(bv);
      std::vector<Tensor> out{y};
      for (Tensor& g : tape.gradient(ops::sum(ops::mul(y, dy_weights)), sources)) out.push_back(g);
      return out;
    };
    // And with the ReLU in the pooling's pass (relu = true) against ops::relu after it.
    for (const bool relu : {false, true}) {
      SCOPED_TRACE(relu ? "then ReLU" : "no ReLU");
      const auto fused = run(true, relu), apart = run(false, relu);
      ASSERT_EQ(fused.size(), apart.size());
      EXPECT_EQ(fused[0].to_vector<float>(), apart[0].to_vector<float>()) << "forward";
      const char* what[] = {"forward", "dx", "dw", "db"};
      for (size_t i = 1; i < fused.size(); ++i) {
        ASSERT_TRUE(fused[i].defined()) << what[i];
        EXPECT_LT(relative_error(fused[i], apart[i]), 1e-5) << what[i];
      }
      // The input's gradient does not depend on the chunks' order: it is exact as well.
      EXPECT_EQ(fused[1].to_vector<float>(), apart[1].to_vector<float>()) << "dx";
    }
  }
}

TEST_F(Layers, MixedBfloat16ConvAndMatmulRoundTheirInputsOnly) {
  // Under mixed_bfloat16, conv2d and matmul (forward and both backward passes) read bfloat16 and
  // return float32: within bfloat16's rounding (2^-8 relative per input) of float32, not equal to
  // it, and exactly float32 again once the policy is back.
  std::vector<float> xs(2 * 6 * 6 * 3), ws(3 * 3 * 3 * 4), as(5 * 7), bs(7 * 3);
  for (size_t i = 0; i < xs.size(); ++i) xs[i] = std::sin(0.37f * static_cast<float>(i));
  for (size_t i = 0; i < ws.size(); ++i) ws[i] = std::cos(0.91f * static_cast<float>(i)) * 0.5f;
  for (size_t i = 0; i < as.size(); ++i) as[i] = std::sin(1.3f * static_cast<float>(i));
  for (size_t i = 0; i < bs.size(); ++i) bs[i] = std::cos(0.7f * static_cast<float>(i));
  const Tensor x = Tensor::from_vector(xs, Shape{2, 6, 6, 3}),
               a = Tensor::from_vector(as, Shape{5, 7});
  auto run = [&] {
    Tensor w = Tensor::from_vector(ws, Shape{3, 3, 3, 4}), b = Tensor::from_vector(bs, Shape{7, 3});
    GradientTape tape;
    tape.watch(w);
    tape.watch(b);
    Tensor xw = x;
    tape.watch(xw);
    const Tensor y = ops::conv2d(xw, w, Tensor(), 1, 1, ops::Padding::kValid);
    const Tensor z = ops::matmul(a, b);
    const auto g =
        tape.gradient(ops::add(ops::sum(ops::square(y)), ops::sum(ops::square(z))), {xw, w, b});
    return std::vector<std::vector<float>>{y.to_vector<float>(), z.to_vector<float>(),
                                           g[0].to_vector<float>(), g[1].to_vector<float>(),
                                           g[2].to_vector<float>()};
  };
  const auto f32 = run();
  set_precision_policy(Precision::kMixedBFloat16);
  std::vector<std::vector<float>> b16;
  try {
    b16 = run();
  } catch (...) {
    set_precision_policy(Precision::kFloat32);
    throw;
  }
  set_precision_policy(Precision::kFloat32);
  const char* what[] = {"conv2d", "matmul", "conv2d dx", "conv2d dw", "matmul db"};
  for (size_t k = 0; k < f32.size(); ++k) {
    double scale = 0, err = 0;
    for (size_t i = 0; i < f32[k].size(); ++i) {
      scale = std::max(scale, std::abs(static_cast<double>(f32[k][i])));
      err = std::max(err, std::abs(static_cast<double>(f32[k][i]) - b16[k][i]));
    }
    EXPECT_GT(err, 0.0) << what[k] << ": bfloat16 gave exactly float32's values (did it run?)";
    EXPECT_LT(err, 3e-2 * scale) << what[k];
  }
  EXPECT_EQ(run(), f32);  // float32 again, bit for bit
  // TensorFloat-32 is a GPU setting: CPU results stay float32's, bit for bit.
  EXPECT_FALSE(tensor_float_32_execution_enabled());  // off unless asked for
  enable_tensor_float_32_execution(true);
  EXPECT_TRUE(tensor_float_32_execution_enabled());
  std::vector<std::vector<float>> tf32;
  try {
    tf32 = run();
  } catch (...) {
    enable_tensor_float_32_execution(false);
    throw;
  }
  enable_tensor_float_32_execution(false);
  EXPECT_EQ(tf32, f32);
  EXPECT_EQ(parse_precision("mixed_bfloat16"), Precision::kMixedBFloat16);
  EXPECT_THROW(parse_precision("fp16"), InvalidArgument);
}

TEST_F(Layers, ConvSamePaddingKeepsSize) {
  Conv2D c(4, 3, 3, Activation::kRelu, ops::Padding::kSame);
  EXPECT_EQ(c(Tensor::zeros(Shape{2, 5, 5, 3})).shape(), (Shape{2, 5, 5, 4}));
}

TEST_F(Layers, DropoutScalesKeptUnitsAndIsIdentityInInference) {
  Dropout d(0.5f);
  Tensor x = Tensor::full(Shape{1000}, 1.f);
  EXPECT_EQ(d(x, false).to_vector<float>(), x.to_vector<float>());
  const auto y = d(x, true).to_vector<float>();
  int kept = 0;
  for (float v : y) {
    EXPECT_TRUE(v == 0.f || v == 2.f);
    kept += v == 2.f;
  }
  EXPECT_GT(kept, 400);
  EXPECT_LT(kept, 600);
}

TEST_F(Layers, BatchNormNormalisesAndUpdatesMovingStats) {
  BatchNormalization bn(0.5f, 0.f);
  Tensor x = Tensor::from_vector<float>({1, 10, 3, 30}, Shape{2, 2});  // two channels
  const auto y = bn(x, true).to_vector<float>();
  EXPECT_NEAR(y[0], -1.f, 1e-4);
  EXPECT_NEAR(y[2], 1.f, 1e-4);
  EXPECT_NEAR(y[1], -1.f, 1e-4);
  // moving = 0.5 * init + 0.5 * batch
  EXPECT_EQ(bn.moving_mean->value().to_vector<float>(), (std::vector<float>{1.f, 10.f}));
  EXPECT_EQ(bn.moving_variance->value().to_vector<float>(), (std::vector<float>{1.f, 50.5f}));
}

// BatchNormalization(activation = relu) runs ops::batch_norm_relu_training (on the CPU oneDNN's
// fused kernel with its bitmask): the same output, statistics and gradients as the layer followed
// by a ReLU, in training and in inference; and the devices' default (the two kernels, the output
// kept as the mask, what CUDA runs) agrees with the CPU's fused kernel.
TEST_F(Layers, BatchNormReluEqualsBatchNormThenRelu) {
  const Shape shape{4, 5, 5, 6};
  const Tensor x = testing::random_tensor(shape, 31, -1.f, 2.f);
  const Tensor weights = testing::random_tensor(shape, 32);  // loss = sum(y * weights)
  BatchNormalization fused(0.9f, 1e-3f), plain(0.9f, 1e-3f);
  fused.activation = Activation::kRelu;
  for (BatchNormalization* l : {&fused, &plain}) {
    l->build(shape);
    l->gamma->assign(testing::random_tensor(Shape{6}, 33, 0.5f, 1.5f));
    l->beta->assign(testing::random_tensor(Shape{6}, 34, -0.5f, 0.5f));
  }
  GradientTape ft, pt;
  ft.watch(x);
  pt.watch(x);
  const Tensor yf = fused(x, true);
  const Tensor yp = ops::relu(plain(x, true));
  EXPECT_LT(relative_error(yf, yp), 1e-6);
  const std::vector<Tensor> gf =
      ft.gradient(ops::sum(ops::mul(yf, weights)), {x, fused.gamma->value(), fused.beta->value()});
  const std::vector<Tensor> gp =
      pt.gradient(ops::sum(ops::mul(yp, weights)), {x, plain.gamma->value(), plain.beta->value()});
  ASSERT_EQ(gf.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_LT(relative_error(gf[i], gp[i]), 1e-5) << "gradient " << i;
  EXPECT_LT(relative_error(fused.moving_mean->value(), plain.moving_mean->value()), 1e-6);
  EXPECT_LT(relative_error(fused.moving_variance->value(), plain.moving_variance->value()), 1e-6);
  EXPECT_LT(relative_error(fused(x, false), ops::relu(plain(x, false))), 1e-6);

  Kernels& k = kernels_for(x);
  const Tensor gamma = fused.gamma->value(), beta = fused.beta->value();
  Tensor mask_cpu, mask_default;
  const BatchNormForward fc = k.batch_norm_relu_training(x, gamma, beta, 1e-3f, &mask_cpu);
  const BatchNormForward fd =
      k.Kernels::batch_norm_relu_training(x, gamma, beta, 1e-3f, &mask_default);
  EXPECT_LT(relative_error(fc.y, fd.y), 1e-6);
  EXPECT_LE(mask_cpu.nbytes() * 4, fc.y.nbytes());  // a bit or a byte an element, not y
  const BatchNormBackward bc =
      k.batch_norm_relu_backward(weights, x, gamma, fc.mean, fc.var, 1e-3f, mask_cpu);
  const BatchNormBackward bd =
      k.Kernels::batch_norm_relu_backward(weights, x, gamma, fd.mean, fd.var, 1e-3f, mask_default);
  EXPECT_LT(relative_error(bc.dx, bd.dx), 1e-5);
  EXPECT_LT(relative_error(bc.dgamma, bd.dgamma), 1e-5);
  EXPECT_LT(relative_error(bc.dbeta, bd.dbeta), 1e-5);
  // A mask from another tensor (too small for this x) is refused, naming what to pass.
  Tensor small_mask;
  k.batch_norm_relu_training(testing::random_tensor(Shape{1, 6}, 35), gamma, beta, 1e-3f,
                             &small_mask);
  try {
    k.batch_norm_relu_backward(weights, x, gamma, fc.mean, fc.var, 1e-3f, small_mask);
    ADD_FAILURE() << "a mask of the wrong size was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("batch_norm_relu_training wrote for this x"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(Layers, InitializersAreSeededAndBounded) {
  set_global_seed(11);
  auto a = initializers::glorot_uniform()(Shape{20, 30}, DType::kFloat32, DeviceSpec::cpu());
  set_global_seed(11);
  auto b = initializers::glorot_uniform()(Shape{20, 30}, DType::kFloat32, DeviceSpec::cpu());
  EXPECT_EQ(a.to_vector<float>(), b.to_vector<float>());
  const float limit = std::sqrt(6.f / 50.f);
  for (float v : a.to_vector<float>()) EXPECT_LE(std::fabs(v), limit);
  auto h = initializers::he_normal()(Shape{3, 3, 16, 8}, DType::kFloat32, DeviceSpec::cpu());
  const float sd = std::sqrt(2.f / 144.f) / 0.87962566f;
  double sq = 0;
  for (float v : h.to_vector<float>()) {
    EXPECT_LE(std::fabs(v), 2 * sd + 1e-6);
    sq += v * v;
  }
  EXPECT_NEAR(std::sqrt(sq / h.numel()), std::sqrt(2.f / 144.f), 0.02);
}

// Each random initializer's element i is its formula applied to element i of its stream, as
// defined element by element (the values every run, checkpoint and test since the first release
// were made with; the initializers fill in blocks now).
TEST_F(Layers, InitializersGiveTheirElementwiseValues) {
  const Shape shape{3, 3, 7, 5};  // 315 elements: blocks cut at the end
  const int64_t n = shape.numel();
  set_global_seed(11);
  const std::vector<float> g =
      initializers::glorot_uniform()(shape, DType::kFloat32, DeviceSpec::cpu()).to_vector<float>();
  set_global_seed(11);
  const std::vector<float> h =
      initializers::he_normal()(shape, DType::kFloat32, DeviceSpec::cpu()).to_vector<float>();
  set_global_seed(11);
  const std::vector<float> u =
      initializers::random_uniform(-0.5f, 2.f)(shape, DType::kFloat32, DeviceSpec::cpu())
          .to_vector<float>();
  set_global_seed(11);
  const std::vector<float> z =
      initializers::random_normal(1.f, 0.25f)(shape, DType::kFloat32, DeviceSpec::cpu())
          .to_vector<float>();
  const Philox rng(11, 0);  // the first stream after set_global_seed(11)
  const float limit = static_cast<float>(std::sqrt(6.0 / (63.0 + 45.0)));  // fans 63, 45
  const float sd = static_cast<float>(std::sqrt(2.0 / 63.0) / 0.87962566103423978);
  int redrawn = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<uint64_t>(i);
    ASSERT_EQ(g[k], (2.f * rng.uniform(k) - 1.f) * limit) << "glorot_uniform " << i;
    float zz = rng.normal(k);
    for (uint64_t r = 1; std::fabs(zz) > 2.f; ++r)
      zz = rng.normal(k + r * static_cast<uint64_t>(n));
    redrawn += std::fabs(rng.normal(k)) > 2.f;
    ASSERT_EQ(h[k], zz * sd) << "he_normal " << i;
    ASSERT_EQ(u[k], -0.5f + 2.5f * rng.uniform(k)) << "random_uniform " << i;
    ASSERT_EQ(z[k], 1.f + 0.25f * rng.normal(k)) << "random_normal " << i;
  }
  EXPECT_GT(redrawn, 0);  // the redraw path ran
}

// keras.initializers.VarianceScaling: each mode's fan, each distribution's formula on the stream.
TEST_F(Layers, VarianceScalingGivesKerasValuesForEachModeAndDistribution) {
  const Shape shape{3, 3, 7, 5};  // fan_in 63, fan_out 45
  const int64_t n = shape.numel();
  const Philox rng(11, 0);
  auto draw = [&](double scale, const char* mode, const char* dist) {
    set_global_seed(11);
    return initializers::variance_scaling(scale, mode, dist)(shape, DType::kFloat32,
                                                             DeviceSpec::cpu())
        .to_vector<float>();
  };
  // torchvision's ResNet convolutions: kaiming_normal_(mode="fan_out", nonlinearity="relu").
  const std::vector<float> kaiming = draw(2.0, "fan_out", "untruncated_normal");
  const std::vector<float> uni = draw(1.0, "fan_avg", "uniform");  // = glorot_uniform
  const std::vector<float> trunc = draw(0.5, "fan_in", "truncated_normal");
  const float sd_out = static_cast<float>(std::sqrt(2.0 / 45.0));
  const float limit = static_cast<float>(std::sqrt(3.0 / 54.0));
  const float sd_in = static_cast<float>(std::sqrt(0.5 / 63.0) / 0.87962566103423978);
  double sq = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<uint64_t>(i);
    ASSERT_EQ(kaiming[k], rng.normal(k) * sd_out) << i;
    ASSERT_EQ(uni[k], (2.f * rng.uniform(k) - 1.f) * limit) << i;
    float z = rng.normal(k);
    for (uint64_t r = 1; !(std::fabs(z) <= 2.f); ++r)
      z = rng.normal(k + r * static_cast<uint64_t>(n));
    ASSERT_EQ(trunc[k], z * sd_in) << i;
    sq += static_cast<double>(kaiming[k]) * kaiming[k];
  }
  EXPECT_NEAR(std::sqrt(sq / static_cast<double>(n)), sd_out, 0.15 * sd_out);
  EXPECT_EQ(draw(1.0, "fan_avg", "uniform"),
            (set_global_seed(11),
             initializers::glorot_uniform()(shape, DType::kFloat32, DeviceSpec::cpu())
                 .to_vector<float>()));
  EXPECT_THROW(initializers::variance_scaling(2, "fan_mid", "uniform"), InvalidArgument);
  EXPECT_THROW(initializers::variance_scaling(2, "fan_in", "normal"), InvalidArgument);
  EXPECT_THROW(initializers::variance_scaling(0, "fan_in", "uniform"), InvalidArgument);
}

// Tensors of a million elements and more are filled by several threads (one per usable core, as
// on this suite's 2-core machines): every element is still its formula on its stream element.
TEST_F(Layers, LargeInitializersFilledInParallelGiveTheElementwiseValues) {
  const Shape shape{1100, 1001};  // 1,101,100 elements: ranges of 550,552 and 550,548
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) < 2)
    std::cout << "one usable core: the tensor is filled on one thread here\n";
  const int64_t n = shape.numel();
  set_global_seed(5);
  const std::vector<float> h =
      initializers::he_normal()(shape, DType::kFloat32, DeviceSpec::cpu()).to_vector<float>();
  set_global_seed(5);
  const std::vector<float> g =
      initializers::glorot_uniform()(shape, DType::kFloat32, DeviceSpec::cpu()).to_vector<float>();
  const Philox rng(5, 0);
  const float sd = static_cast<float>(std::sqrt(2.0 / 1100.0) / 0.87962566103423978);
  const float limit = static_cast<float>(std::sqrt(6.0 / (1100.0 + 1001.0)));
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<uint64_t>(i);
    float z = rng.normal(k);
    for (uint64_t r = 1; !(std::fabs(z) <= 2.f); ++r)
      z = rng.normal(k + r * static_cast<uint64_t>(n));
    ASSERT_EQ(h[k], z * sd) << "he_normal " << i;
    ASSERT_EQ(g[k], (2.f * rng.uniform(k) - 1.f) * limit) << "glorot_uniform " << i;
  }
}

TEST_F(Layers, SgdPlainMomentumNesterovByHand) {
  const Tensor g = Tensor::full(Shape{1}, 0.5f);
  struct Case {
    float mu;
    bool nesterov;
    float after1, after2;
  };
  for (const Case& c : {Case{0.f, false, 0.95f, 0.9f}, Case{0.9f, false, 0.95f, 0.855f},
                        Case{0.9f, true, 0.905f, 0.7695f}}) {
    auto w = scalar_var(1.f);
    SGD opt(0.1f, c.mu, c.nesterov);
    opt.apply_gradients({g}, {w});
    EXPECT_NEAR(w->value().item(), c.after1, 1e-6);
    opt.apply_gradients({g}, {w});
    EXPECT_NEAR(w->value().item(), c.after2, 1e-6);
    EXPECT_EQ(opt.iterations(), 2);
  }
}

TEST_F(Layers, AdamByHand) {
  auto w = scalar_var(1.f);
  Adam opt(0.1f);
  double m = 0, v = 0, x = 1;
  const double grads[] = {0.5, -0.25, 1.0};
  for (int t = 1; t <= 3; ++t) {
    const double g = grads[t - 1];
    opt.apply_gradients({Tensor::full(Shape{1}, static_cast<float>(g))}, {w});
    m = 0.9 * m + 0.1 * g;
    v = 0.999 * v + 0.001 * g * g;
    const double lr_t = 0.1 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
    x -= lr_t * m / (std::sqrt(v) + 1e-7);
    EXPECT_NEAR(w->value().item(), x, 1e-6) << "step " << t;
  }
}

TEST_F(Layers, OptimizerSkipsMissingGradientsAndChecksShapes) {
  auto a = scalar_var(1.f), b = scalar_var(2.f);
  SGD opt(1.f);
  opt.apply_gradients({Tensor(), Tensor::full(Shape{1}, 1.f)}, {a, b});
  EXPECT_EQ(a->value().item(), 1.f);
  EXPECT_EQ(b->value().item(), 1.f);
  EXPECT_THROW(opt.apply_gradients({Tensor::full(Shape{2}, 1.f)}, {a}), InvalidArgument);
}

TEST_F(Layers, ComputeAverageLossDividesByGlobalBatch) {
  Tensor per = Tensor::from_vector<float>({1, 2, 3}, Shape{3});
  EXPECT_FLOAT_EQ(compute_average_loss(per, 6).item(), 1.f);
  EXPECT_FLOAT_EQ(compute_average_loss(per).item(), 2.f);
}

TEST_F(Layers, AccuracyMetric) {
  SparseCategoricalAccuracy acc;
  acc.update(Tensor::from_vector<float>({0.1f, 0.9f, 0.8f, 0.2f, 0.3f, 0.7f}, Shape{3, 2}),
             Tensor::from_vector<int32_t>({1, 0, 0}, Shape{3}));
  EXPECT_NEAR(acc.result(), 2.0 / 3.0, 1e-12);
}

}  // namespace
}  // namespace dtrain
