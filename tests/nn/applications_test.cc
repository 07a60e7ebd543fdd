// dtrain::applications: the ResNets have Keras' (and torchvision's) parameter counts, path names,
// and run.
#include "dtrain/nn/applications.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <regex>
#include <sstream>

#include "dtrain/core/precision.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/model.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

using applications::ResNetOptions;
using applications::ResNetStyle;

int64_t trainable(const Model& m) {
  int64_t n = 0;
  for (const auto& v : m.trainable_variables()) n += v->shape().numel();
  return n;
}

TEST(Applications, ResNet50HasKerasParameterCountAndPathNames) {
  auto m = applications::ResNet50();
  m->build();
  // keras.applications.ResNet50(weights=None).summary(): 25,636,712 total, 25,583,592 trainable.
  EXPECT_EQ(m->count_params(), 25636712);
  EXPECT_EQ(trainable(*m), 25583592);
  EXPECT_EQ(m->layers().size(), 6u + 16u + 2u);  // stem, 16 blocks, head
  const VariableList vs = m->variables();
  EXPECT_EQ(vs.front()->name(), "conv1_conv/kernel");
  bool found = false;
  for (const auto& v : vs) found = found || v->name() == "conv2_block1/1_conv/kernel";
  EXPECT_TRUE(found);
  EXPECT_EQ(vs.back()->name(), "predictions/bias");
  std::ostringstream s;
  m->summary(s);
  EXPECT_NE(s.str().find("Total params: 25,636,712 (97.80 MB)"), std::string::npos) << s.str();
  EXPECT_NE(s.str().find("conv5_block3 (BottleneckBlock)     (None, 7, 7, 2048)"),
            std::string::npos)
      << s.str();
}

TEST(Applications, CifarAndBasicResNetsHaveTheirReferenceCounts) {
  ResNetOptions cifar;
  cifar.input_shape = Shape{32, 32, 3};
  cifar.classes = 10;
  auto r20 = applications::ResNet20(cifar);
  r20->build();
  // Keras' cifar10_resnet example, resnet_v1(depth=20): 274,442 total, 273,066 trainable.
  EXPECT_EQ(r20->count_params(), 274442);
  EXPECT_EQ(trainable(*r20), 273066);
  const Tensor y = (*r20)(testing::random_tensor({2, 32, 32, 3}, 1), false);
  EXPECT_EQ(y.shape(), (Shape{2, 10}));
  // Each convolution draws its own initial kernel: no two of one shape start equal (a block's
  // convolutions once shared one initializer, that is one random stream).
  std::map<std::string, std::vector<float>> kernels;
  for (const auto& v : r20->variables())
    if (v->name().find("_conv/kernel") != std::string::npos)
      kernels[v->name()] = v->value().to_vector<float>();
  EXPECT_GE(kernels.size(), 19u);
  for (const auto& [a, va] : kernels)
    for (const auto& [b, vb] : kernels)
      if (a < b && va.size() == vb.size()) {
        EXPECT_NE(va, vb) << a << " and " << b;
      }
  // torchvision.models.resnet18(): 11,689,512 parameters (its BN statistics are buffers).
  ResNetOptions small;
  auto r18 = applications::ResNet18(small);
  r18->build();
  EXPECT_EQ(trainable(*r18), 11689512);
  EXPECT_THROW(applications::CifarResNet(21, cifar), InvalidArgument);
  ResNetOptions tiny;
  tiny.input_shape = Shape{16, 16, 3};
  EXPECT_THROW(applications::ResNet50(tiny), InvalidArgument);
  EXPECT_THROW(applications::resnet_by_name("resnet51", cifar), InvalidArgument);
}

TEST(Applications, TorchvisionResNet50HasItsParameterCountAndNoConvolutionBiases) {
  ResNetOptions o;
  o.style = ResNetStyle::kTorchvision;
  auto m = applications::ResNet50(o);
  m->build();
  EXPECT_EQ(trainable(*m),
            25557032);  // sum(p.numel() for p in torchvision resnet50().parameters())
  for (const auto& v : m->variables())
    EXPECT_FALSE(v->name().find("_conv/bias") != std::string::npos) << v->name();
  // v1.5: a stage's first block keeps the resolution in its 1x1 and strides in the 3x3.
  std::shared_ptr<Layer> block;
  for (const auto& l : m->layers())
    if (l->name() == "conv3_block1") block = l;
  ASSERT_TRUE(block);
  const Tensor x = testing::random_tensor({1, 56, 56, 256}, 3);
  const Tensor y1 = (*block->layers().at(2))(x, false);  // 0_conv, 0_bn, then 1_conv
  EXPECT_EQ(y1.shape(), (Shape{1, 56, 56, 128}));
  EXPECT_EQ((*block->layers().at(4))(y1, false).shape(), (Shape{1, 28, 28, 128}));
  auto keras = applications::ResNet50();
  std::shared_ptr<Layer> keras_block;
  for (const auto& l : keras->layers())
    if (l->name() == "conv3_block1") keras_block = l;
  ASSERT_TRUE(keras_block);
  EXPECT_EQ((*keras_block->layers().at(2))(x, false).shape(), (Shape{1, 28, 28, 128}));
}

// The value tests/nn/torchvision_logits.py gives element i (torch's layout) of torch parameter
// `name`.
// `gamma`: the parameter is a batch normalization's scale.
float torch_formula(const std::string& name, bool gamma, int64_t i, int64_t fan_in) {
  const double s = std::sin(0.7 * static_cast<double>(i) + 0.1 * static_cast<double>(name.size()));
  if (gamma) return static_cast<float>(1.0 + 0.1 * s);
  if (fan_in == 0) return static_cast<float>(0.1 * s);
  return static_cast<float>(0.5 * s / std::sqrt(static_cast<double>(fan_in)));
}

// dtrain's variable path -> torchvision's parameter name; empty for the batch statistics.
std::string torch_name(const std::string& path) {
  std::smatch m;
  if (path == "predictions/kernel") return "fc.weight";
  if (path == "predictions/bias") return "fc.bias";
  if (path == "conv1_conv/kernel") return "conv1.weight";
  if (path == "conv1_bn/gamma") return "bn1.weight";
  if (path == "conv1_bn/beta") return "bn1.bias";
  static const std::regex block("conv(\\d)_block(\\d+)/(\\d)_(conv|bn)/(kernel|gamma|beta)");
  if (!std::regex_match(path, m, block)) return "";
  const std::string prefix = "layer" + std::to_string(std::stoi(m[1]) - 1) + "." +
                             std::to_string(std::stoi(m[2]) - 1) + ".";
  const std::string k = m[3], kind = m[4], what = m[5];
  const std::string suffix = what == "beta" ? "bias" : "weight";
  if (k == "0") return prefix + (kind == "conv" ? "downsample.0." : "downsample.1.") + suffix;
  return prefix + kind + k + "." + suffix;
}

// dtrain's torchvision-form ResNets compute torchvision's function: every parameter set as
// torchvision_logits.py sets torch's, two 64x64 images in training mode (batch statistics), the
// logits it printed (torchvision 0.29.2, PyTorch 2.15, one thread). The strided 3x3 convolutions
// are what the form changes most: with Keras' "same" padding these differ by up to 0.2.
TEST(Applications, TorchvisionFormResNetsComputeTorchvisionsLogits) {
  const std::vector<float> want50 = {1.84581f,  3.31942f, 1.60053f, -1.63803f, -3.2596f,
                                     -1.71496f, 1.4607f,  3.1598f,  1.74043f,  -1.37813f,
                                     1.49706f,  2.74611f, 1.36267f, -1.3081f,  -2.68416f,
                                     -1.4561f,  1.15013f, 2.58316f, 1.46098f,  -1.08743f};
  const std::vector<float> want18 = {0.617128f, 0.881615f, 1.04774f,  1.10942f,  1.08388f,
                                     1.00051f,  0.885898f, 0.752124f, 0.593891f, 0.395534f,
                                     0.710531f, 1.04959f,  1.27913f,  1.38885f,  1.39279f,
                                     1.3184f,   1.19164f,  1.02541f,  0.816572f, 0.55282f};
  std::vector<float> x(2 * 64 * 64 * 3);
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t h = 0; h < 64; ++h)
      for (int64_t w = 0; w < 64; ++w)
        for (int64_t c = 0; c < 3; ++c)
          x[static_cast<size_t>(((n * 64 + h) * 64 + w) * 3 + c)] = static_cast<float>(
              std::sin(0.013 * static_cast<double>(((n * 3 + c) * 64 + h) * 64 + w)));
  const Tensor input = Tensor::from_vector(x, Shape{2, 64, 64, 3});
  for (const bool fifty : {true, false}) {
    ResNetOptions o;
    o.style = ResNetStyle::kTorchvision;
    o.input_shape = Shape{64, 64, 3};
    o.classes = 10;
    auto m = fifty ? applications::ResNet50(o) : applications::ResNet18(o);
    m->build();
    int set = 0;
    for (const auto& v : m->trainable_variables()) {
      const std::string name = torch_name(v->name());
      ASSERT_FALSE(name.empty()) << v->name();
      static const std::regex is_gamma("(^|\\.)bn[123]\\.weight$|downsample\\.1\\.weight$");
      const bool gamma = std::regex_search(name, is_gamma);
      const Shape& s = v->shape();
      std::vector<float> val(static_cast<size_t>(s.numel()));
      if (s.rank() == 4) {  // [kh, kw, in, out] <- torch's [out, in, kh, kw]
        const int64_t kh = s[0], kw = s[1], ci = s[2], co = s[3];
        for (int64_t h = 0; h < kh; ++h)
          for (int64_t w = 0; w < kw; ++w)
            for (int64_t i = 0; i < ci; ++i)
              for (int64_t o2 = 0; o2 < co; ++o2)
                val[static_cast<size_t>(((h * kw + w) * ci + i) * co + o2)] =
                    torch_formula(name, gamma, ((o2 * ci + i) * kh + h) * kw + w, ci * kh * kw);
      } else if (s.rank() == 2) {  // [in, out] <- torch's [out, in]
        for (int64_t i = 0; i < s[0]; ++i)
          for (int64_t o2 = 0; o2 < s[1]; ++o2)
            val[static_cast<size_t>(i * s[1] + o2)] =
                torch_formula(name, gamma, o2 * s[0] + i, s[0]);
      } else {
        for (int64_t i = 0; i < s.numel(); ++i)
          val[static_cast<size_t>(i)] = torch_formula(name, gamma, i, 0);
      }
      v->assign(Tensor::from_vector(val, s));
      ++set;
    }
    EXPECT_EQ(set, fifty ? 161 : 62);
    const std::vector<float> got = (*m)(input, true).to_vector<float>();
    const std::vector<float>& want = fifty ? want50 : want18;
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 2e-3) << (fifty ? "resnet50" : "resnet18") << " logit " << i;
  }
}

// Under mixed_bfloat16 on the CPU the ResNets hand bfloat16 activations from each convolution to
// its batch norm and from each batch norm with ReLU to the convolution after it
// (Conv2D::bfloat16_output, BatchNormalization::bfloat16_output). Those consumers read them rounded
// so anyway: a training step's logits and every gradient are the same bits with the hand-offs
// turned off, in both forms, with bottleneck and basic blocks.
TEST(Applications, ResNetsPassBfloat16ActivationsWithTheSameResults) {
  set_precision_policy(Precision::kMixedBFloat16);
  struct Reset {
    ~Reset() { set_precision_policy(Precision::kFloat32); }
  } reset;
  std::vector<float> xv(2 * 32 * 32 * 3), gv(2 * 10);
  for (size_t i = 0; i < xv.size(); ++i) xv[i] = static_cast<float>(std::sin(0.37 * i));
  for (size_t i = 0; i < gv.size(); ++i) gv[i] = static_cast<float>(std::cos(1.3 * i));
  const Tensor x = Tensor::from_vector(xv, Shape{2, 32, 32, 3});
  const Tensor g = Tensor::from_vector(gv, Shape{2, 10});
  for (const ResNetStyle style : {ResNetStyle::kKeras, ResNetStyle::kTorchvision})
    for (const bool fifty : {true, false}) {
      ResNetOptions o;
      o.style = style;
      o.input_shape = Shape{32, 32, 3};
      o.classes = 10;
      auto m = fifty ? applications::ResNet50(o) : applications::ResNet18(o);
      m->build();
      const auto step = [&] {
        GradientTape tape;
        const Tensor y = (*m)(x, /*training=*/true);
        std::vector<std::vector<float>> out{y.to_vector<float>()};
        for (const Tensor& t : tape.gradient(ops::sum(ops::mul(y, g)), m->trainable_variables()))
          out.push_back(t.to_vector<float>());
        return out;
      };
      // Every Conv2D and BatchNormalization below the model, and how many hand off bfloat16.
      int convs = 0, norms = 0;
      const auto set = [&](bool on) {
        convs = norms = 0;
        std::function<void(const Layer&)> walk = [&](const Layer& l) {
          for (const auto& c : l.layers()) {
            if (auto* conv = dynamic_cast<Conv2D*>(c.get())) {
              convs += conv->bfloat16_output;
              conv->bfloat16_output = on && conv->bfloat16_output;
            }
            if (auto* bn = dynamic_cast<BatchNormalization*>(c.get())) {
              norms += bn->bfloat16_output;
              bn->bfloat16_output = on && bn->bfloat16_output;
            }
            walk(*c);
          }
        };
        walk(*m);
      };
      const std::string what =
          std::string(fifty ? "ResNet50" : "ResNet18") +
          (style == ResNetStyle::kKeras ? ", Keras form" : ", torchvision form");
      const auto with = step();
      set(false);
      // ResNet-50: 53 convolutions (the stem, 3 in each of 16 blocks, 4 projections), 32 batch
      // norms with ReLU into a convolution; ResNet-18: 1 + 2 x 8 + 3, and 8.
      EXPECT_EQ(convs, fifty ? 53 : 20) << what;
      EXPECT_EQ(norms, fifty ? 32 : 8) << what;
      const auto without = step();
      ASSERT_EQ(with.size(), without.size());
      for (size_t k = 0; k < with.size(); ++k) {
        ASSERT_EQ(with[k].size(), without[k].size());
        size_t differ = 0;
        for (size_t i = 0; i < with[k].size(); ++i)
          differ += std::memcmp(&with[k][i], &without[k][i], sizeof(float)) != 0;
        EXPECT_EQ(differ, 0u) << what << (k == 0 ? ": logits" : ": gradient ") << k;
      }
    }
}

// A chain the ResNets never build: a batch norm handing bfloat16 to a Conv2D(relu) that runs fused
// with the max pooling after it (ops::conv2d_max_pool2d takes float32, so the fused call reads the
// activation widened). The step runs, and its logits and gradients are those with the hand-offs
// off, but for the batch norm's gradient read in bfloat16 (within 2% of each tensor's largest).
TEST(Applications, ABfloat16HandOffIntoAConvolutionFusedWithPooling) {
  set_precision_policy(Precision::kMixedBFloat16);
  struct Reset {
    ~Reset() { set_precision_policy(Precision::kFloat32); }
  } reset;
  // (No bias before the batch norm, as in the ResNets: its gradient is zero but for rounding.)
  auto conv1 = std::make_shared<Conv2D>(8, 3, 3, Activation::kNone, ops::Padding::kSame,
                                        /*stride=*/1, /*use_bias=*/false);
  auto norm = std::make_shared<BatchNormalization>();
  norm->activation = Activation::kRelu;
  auto conv2 = std::make_shared<Conv2D>(6, 3, 3, Activation::kRelu, ops::Padding::kSame);
  auto pool = std::make_shared<MaxPool2D>();
  Sequential m({conv1, norm, conv2, pool, std::make_shared<Flatten>(), std::make_shared<Dense>(4)});
  m.build(Shape{2, 8, 8, 3});
  ASSERT_TRUE(conv2->fuse_with_next(*pool));
  std::vector<float> xv(2 * 8 * 8 * 3), gv(2 * 4);
  for (size_t i = 0; i < xv.size(); ++i) xv[i] = static_cast<float>(std::sin(0.41 * i));
  for (size_t i = 0; i < gv.size(); ++i) gv[i] = static_cast<float>(std::cos(0.9 * i));
  const Tensor x = Tensor::from_vector(xv, Shape{2, 8, 8, 3});
  const Tensor g = Tensor::from_vector(gv, Shape{2, 4});
  const auto step = [&](bool handoff) {
    conv1->bfloat16_output = norm->bfloat16_output = handoff;
    GradientTape tape;
    const Tensor y = m(x, /*training=*/true);
    std::vector<std::vector<float>> out{y.to_vector<float>()};
    for (const Tensor& t : tape.gradient(ops::sum(ops::mul(y, g)), m.trainable_variables()))
      out.push_back(t.to_vector<float>());
    return out;
  };
  const auto with = step(true), without = step(false);
  ASSERT_EQ(with.size(), without.size());
  EXPECT_EQ(with[0], without[0]) << "logits";
  for (size_t k = 1; k < with.size(); ++k) {
    ASSERT_EQ(with[k].size(), without[k].size());
    float scale = 0, diff = 0;
    for (size_t i = 0; i < with[k].size(); ++i) {
      scale = std::max(scale, std::abs(without[k][i]));
      diff = std::max(diff, std::abs(with[k][i] - without[k][i]));
    }
    EXPECT_GT(scale, 0) << "gradient " << k;
    EXPECT_LE(diff, 2e-2f * scale) << "gradient " << k;
  }
}

}  // namespace
}  // namespace dtrain
