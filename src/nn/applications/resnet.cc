#include <functional>
#include <memory>

#include "dtrain/model/initializers.h"
#include "dtrain/nn/applications.h"
#include "dtrain/nn/layers.h"

namespace dtrain::applications {
namespace {

using ops::Padding;

bool torchvision(const ResNetOptions& o) { return o.style == ResNetStyle::kTorchvision; }

// Makes one convolution's kernel initializer. One per convolution: an initializer is one random
// stream, so two kernels sharing one would start from the same numbers. Empty: glorot_uniform.
using InitFactory = std::function<Initializer()>;
Initializer make(const InitFactory& f) { return f ? f() : Initializer(); }

// torchvision's convolutions: kaiming_normal_(mode="fan_out", nonlinearity="relu").
Initializer kaiming_fan_out() {
  return initializers::variance_scaling(2.0, "fan_out", "untruncated_normal");
}

std::shared_ptr<BatchNormalization> bn(const ResNetOptions& o, float epsilon,
                                       std::string name = "batch_normalization") {
  return std::make_shared<BatchNormalization>(0.99f, epsilon, o.synchronized_batch_norm,
                                              std::move(name));
}

std::shared_ptr<Conv2D> conv(int64_t filters, int k, int stride, bool bias, Padding p,
                             Initializer init = {}, std::string name = "conv2d") {
  auto c =
      std::make_shared<Conv2D>(filters, k, k, Activation::kNone, p, stride, bias, std::move(name));
  c->kernel_initializer = std::move(init);
  return c;
}

// Under mixed_bfloat16 on the CPU or a CUDA GPU, bfloat16 activations from each convolution to the
// batch norm after it and from a batch norm with ReLU to the convolution after it
// (Conv2D::bfloat16_output): those consumers read them rounded so anyway. Not into a synchronized
// batch norm, which reads float32.
std::shared_ptr<Conv2D> to_bn(std::shared_ptr<Conv2D> c, const ResNetOptions& o) {
  c->bfloat16_output = !o.synchronized_batch_norm;
  return c;
}
std::shared_ptr<BatchNormalization> relu_to_conv(std::shared_ptr<BatchNormalization> b) {
  b->activation = Activation::kRelu;
  b->bfloat16_output = true;
  return b;
}

// Keras' residual_block_v1: 1x1 (stride) -> 3x3 -> 1x1 (4 x filters), BN after each, and a 1x1
// projection of the input (with BN) when `project`. In torchvision's form (v1.5) the 3x3 strides,
// padded by one on each side, and no convolution has a bias.
class BottleneckBlock : public Layer {
 public:
  BottleneckBlock(int64_t filters, int stride, bool project, const ResNetOptions& o,
                  std::string name)
      : Layer(std::move(name)) {
    const bool tv = torchvision(o);
    const float eps = tv ? 1e-5f : 1.001e-5f;
    const bool bias = !tv;
    const InitFactory init = tv ? InitFactory(kaiming_fan_out) : InitFactory();
    if (project) {
      c0_ = register_layer(
          to_bn(conv(4 * filters, 1, stride, bias, Padding::kValid, make(init)), o), "0_conv");
      b0_ = register_layer(bn(o, eps), "0_bn");
    }
    c1_ = register_layer(
        to_bn(conv(filters, 1, tv ? 1 : stride, bias, Padding::kValid, make(init)), o), "1_conv");
    // Keras' 1_relu, 2_relu: fused into the batch norms.
    b1_ = register_layer(relu_to_conv(bn(o, eps)), "1_bn");
    c2_ = register_layer(
        to_bn(conv(filters, 3, tv ? stride : 1, bias, Padding::kSame, make(init)), o), "2_conv");
    if (tv && stride > 1) c2_->set_explicit_padding(1, 1);  // kSame would pad the end only
    b2_ = register_layer(relu_to_conv(bn(o, eps)), "2_bn");
    c3_ = register_layer(to_bn(conv(4 * filters, 1, 1, bias, Padding::kValid, make(init)), o),
                         "3_conv");
    b3_ = register_layer(bn(o, eps), "3_bn");
  }
  std::string class_name() const override { return "BottleneckBlock"; }

 protected:
  using Layer::call;
  Tensor call(const Tensor& x, bool training) override {
    const Tensor shortcut = c0_ ? (*b0_)((*c0_)(x), training) : x;
    Tensor y = (*b1_)((*c1_)(x), training);
    y = (*b2_)((*c2_)(y), training);
    y = (*b3_)((*c3_)(y), training);
    return ops::add_relu(shortcut, y);
  }

 private:
  std::shared_ptr<Conv2D> c0_, c1_, c2_, c3_;
  std::shared_ptr<BatchNormalization> b0_, b1_, b2_, b3_;
};

// Two 3x3 convolutions with BN; the shortcut is the input, or a 1x1 projection (with BN when
// `projection_bn`) when the stride or the width changes. `torch_padding`: a strided first
// convolution pads one on each side (torchvision), not Keras' "same" (the extra row at the end).
class BasicBlock : public Layer {
 public:
  BasicBlock(int64_t filters, int stride, bool project, bool use_bias, bool projection_bn,
             float epsilon, const InitFactory& init, bool torch_padding, const ResNetOptions& o,
             std::string name)
      : Layer(std::move(name)) {
    c1_ = register_layer(to_bn(conv(filters, 3, stride, use_bias, Padding::kSame, make(init)), o),
                         "1_conv");
    if (torch_padding && stride > 1) c1_->set_explicit_padding(1, 1);
    b1_ = register_layer(relu_to_conv(bn(o, epsilon)), "1_bn");  // 1_relu, fused
    c2_ = register_layer(to_bn(conv(filters, 3, 1, use_bias, Padding::kSame, make(init)), o),
                         "2_conv");
    b2_ = register_layer(bn(o, epsilon), "2_bn");
    if (project) {
      c0_ =
          register_layer(conv(filters, 1, stride, use_bias, Padding::kValid, make(init)), "0_conv");
      if (projection_bn) {
        to_bn(c0_, o);
        b0_ = register_layer(bn(o, epsilon), "0_bn");
      }
    }
  }
  std::string class_name() const override { return "BasicBlock"; }

 protected:
  using Layer::call;
  Tensor call(const Tensor& x, bool training) override {
    Tensor y = (*b1_)((*c1_)(x), training);
    y = (*b2_)((*c2_)(y), training);
    Tensor shortcut = x;
    if (c0_) shortcut = (*c0_)(x);
    if (b0_) shortcut = (*b0_)(shortcut, training);
    return ops::add_relu(shortcut, y);
  }

 private:
  std::shared_ptr<Conv2D> c0_, c1_, c2_;
  std::shared_ptr<BatchNormalization> b0_, b1_, b2_;
};

void check(const ResNetOptions& o, int64_t min_side, const char* model) {
  if (o.input_shape.rank() != 3)
    throw InvalidArgument(std::string(model) + ": input_shape is one image, [height, width, " +
                          "channels]; got " + o.input_shape.to_string());
  if (o.input_shape[0] < min_side || o.input_shape[1] < min_side || o.input_shape[2] < 1)
    throw InvalidArgument(std::string(model) + ": input_shape " + o.input_shape.to_string() +
                          " is too small; height and width must be at least " +
                          std::to_string(min_side));
  if (o.include_top && o.classes < 1)
    throw InvalidArgument(std::string(model) + ": classes must be >= 1");
}

KerasTensor head(KerasTensor x, const ResNetOptions& o) {
  if (!o.include_top) return x;
  x = (*std::make_shared<GlobalAveragePooling2D>("avg_pool"))(x);
  auto dense = std::make_shared<Dense>(o.classes, Activation::kNone, true, "predictions");
  // torch.nn.Linear's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  if (torchvision(o))
    dense->kernel_initializer = initializers::variance_scaling(1.0 / 3, "fan_in", "uniform");
  return (*dense)(x);
}

// The ImageNet stem: 7x7/2 convolution, BN, ReLU, 3x3/2 max pooling (Keras' names). Without the
// bias, torchvision's: BN epsilon 1e-5. (Zeros pad the pooling where torch pads with -inf: the
// same maxima after the ReLU.)
KerasTensor stem(KerasTensor x, bool bias, const ResNetOptions& o) {
  x = (*std::make_shared<ZeroPadding2D>(3, 3, 3, 3, "conv1_pad"))(x);
  x = (*to_bn(conv(64, 7, 2, bias, Padding::kValid,
                   torchvision(o) ? kaiming_fan_out() : Initializer(), "conv1_conv"),
              o))(x);
  x = (*bn(o, bias ? 1.001e-5f : 1e-5f, "conv1_bn"))(x);
  x = (*std::make_shared<ActivationLayer>(Activation::kRelu, "conv1_relu"))(x);
  x = (*std::make_shared<ZeroPadding2D>(1, 1, 1, 1, "pool1_pad"))(x);
  return (*std::make_shared<MaxPool2D>(3, 2, Padding::kValid, "pool1_pool"))(x);
}

// The ImageNet ResNets: the stem, stages of blocks at 64, 128, 256 and 512 filters (the first
// block of each stage after the first strides by 2), the head. `block(filters, stride, first,
// name)` makes one block.
using BlockFn = std::function<std::shared_ptr<Layer>(int64_t, int, bool, const std::string&)>;
std::shared_ptr<Model> imagenet_resnet(const std::vector<int>& blocks, const std::string& name,
                                       bool stem_bias, const ResNetOptions& o,
                                       const BlockFn& block) {
  check(o, 32, name.c_str());
  KerasTensor in = Input(o.input_shape, "input_layer");
  KerasTensor x = stem(in, stem_bias, o);
  const int64_t filters[] = {64, 128, 256, 512};
  for (size_t s = 0; s < blocks.size(); ++s)
    for (int b = 1; b <= blocks[s]; ++b) {
      const std::string n = "conv" + std::to_string(s + 2) + "_block" + std::to_string(b);
      std::shared_ptr<Layer> layer = block(filters[s], b == 1 && s > 0 ? 2 : 1, b == 1, n);
      layer->set_recompute_grad(o.recompute);
      layer->set_shard_parameters(o.shard_parameters);
      x = (*layer)(x);
    }
  return std::make_shared<Model>(in, head(x, o), name);
}

std::shared_ptr<Model> bottleneck_resnet(const std::vector<int>& blocks, const std::string& name,
                                         const ResNetOptions& o) {
  return imagenet_resnet(blocks, name, !torchvision(o), o,
                         [&o](int64_t f, int stride, bool first, const std::string& n) {
                           return std::make_shared<BottleneckBlock>(f, stride, first, o, n);
                         });
}

std::shared_ptr<Model> basic_resnet(const std::vector<int>& blocks, const std::string& name,
                                    const ResNetOptions& o) {
  return imagenet_resnet(
      blocks, name, false, o, [&o](int64_t f, int stride, bool, const std::string& n) {
        return std::make_shared<BasicBlock>(
            f, stride, stride != 1, false, true, 1e-5f,
            torchvision(o) ? InitFactory(kaiming_fan_out) : InitFactory(), true, o, n);
      });
}

}  // namespace

std::shared_ptr<Model> ResNet50(const ResNetOptions& o) {
  return bottleneck_resnet({3, 4, 6, 3}, "resnet50", o);
}
std::shared_ptr<Model> ResNet101(const ResNetOptions& o) {
  return bottleneck_resnet({3, 4, 23, 3}, "resnet101", o);
}
std::shared_ptr<Model> ResNet152(const ResNetOptions& o) {
  return bottleneck_resnet({3, 8, 36, 3}, "resnet152", o);
}
std::shared_ptr<Model> ResNet18(const ResNetOptions& o) {
  return basic_resnet({2, 2, 2, 2}, "resnet18", o);
}
std::shared_ptr<Model> ResNet34(const ResNetOptions& o) {
  return basic_resnet({3, 4, 6, 3}, "resnet34", o);
}

std::shared_ptr<Model> CifarResNet(int depth, const ResNetOptions& o) {
  if (depth < 8 || (depth - 2) % 6 != 0)
    throw InvalidArgument("CIFAR ResNet depth must be 6n + 2 (20, 32, 44, 56, 110), got " +
                          std::to_string(depth));
  const std::string name = "resnet" + std::to_string(depth);
  check(o, 8, name.c_str());
  const int n = (depth - 2) / 6;
  KerasTensor in = Input(o.input_shape, "input_layer");
  KerasTensor x = (*to_bn(
      conv(16, 3, 1, true, Padding::kSame, initializers::he_normal(), "conv1_conv"), o))(in);
  x = (*bn(o, 1e-3f, "conv1_bn"))(x);
  x = (*std::make_shared<ActivationLayer>(Activation::kRelu, "conv1_relu"))(x);
  int64_t filters = 16;
  for (int s = 0; s < 3; ++s, filters *= 2)
    for (int b = 1; b <= n; ++b) {
      const int stride = s > 0 && b == 1 ? 2 : 1;
      const std::string bn_name = "stack" + std::to_string(s + 1) + "_block" + std::to_string(b);
      auto block =
          std::make_shared<BasicBlock>(filters, stride, stride != 1, true, false, 1e-3f,
                                       InitFactory(initializers::he_normal), false, o, bn_name);
      block->set_recompute_grad(o.recompute);
      block->set_shard_parameters(o.shard_parameters);
      x = (*block)(x);
    }
  if (o.include_top) {
    x = (*std::make_shared<GlobalAveragePooling2D>("avg_pool"))(x);
    auto d = std::make_shared<Dense>(o.classes, Activation::kNone, true, "predictions");
    d->kernel_initializer = initializers::he_normal();
    x = (*d)(x);
  }
  return std::make_shared<Model>(in, x, name);
}

std::shared_ptr<Model> ResNet20(const ResNetOptions& o) { return CifarResNet(20, o); }
std::shared_ptr<Model> ResNet32(const ResNetOptions& o) { return CifarResNet(32, o); }
std::shared_ptr<Model> ResNet56(const ResNetOptions& o) { return CifarResNet(56, o); }

std::shared_ptr<Model> resnet_by_name(const std::string& name, const ResNetOptions& o) {
  if (name == "resnet50") return ResNet50(o);
  if (name == "resnet101") return ResNet101(o);
  if (name == "resnet152") return ResNet152(o);
  if (name == "resnet18") return ResNet18(o);
  if (name == "resnet34") return ResNet34(o);
  if (name.rfind("resnet", 0) == 0 && name.size() > 6 &&
      name.find_first_not_of("0123456789", 6) == std::string::npos && name.size() < 10) {
    const int depth = std::stoi(name.substr(6));
    if (depth >= 8 && (depth - 2) % 6 == 0) return CifarResNet(depth, o);
  }
  throw InvalidArgument("unknown model '" + name +
                        "' (resnet18, resnet34, resnet50, resnet101, resnet152, and the CIFAR "
                        "resnet20, resnet32, resnet44, resnet56, resnet110)");
}

}  // namespace dtrain::applications
