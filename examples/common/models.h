// The models the Fashion-MNIST examples train, by name (--model). No strategy-specific code:
// make them inside strategy.scope().
#pragma once

#include <memory>
#include <string>

#include "dtrain/dtrain.h"
#include "fashion_mnist/reference_cnn.h"

namespace dtrain::examples {

// A subclassed model (keras.Model subclass style): a stem, one residual block with batch
// normalization, pooling and a dense head, on 28x28x1 images.
class ResidualCnn : public Model {
 public:
  // sync_bn: the batch normalizations use the global batch's statistics (SyncBatchNorm).
  explicit ResidualCnn(bool sync_bn = false) : Model("residual_cnn") {
    using ops::Padding;
    stem_ = register_layer(
        std::make_shared<Conv2D>(16, 3, 3, Activation::kNone, Padding::kSame, 1, false), "stem");
    stem_bn_ =
        register_layer(std::make_shared<BatchNormalization>(0.99f, 1e-3f, sync_bn), "stem_bn");
    conv1_ = register_layer(
        std::make_shared<Conv2D>(16, 3, 3, Activation::kNone, Padding::kSame, 1, false), "conv1");
    bn1_ = register_layer(std::make_shared<BatchNormalization>(0.99f, 1e-3f, sync_bn), "bn1");
    conv2_ = register_layer(
        std::make_shared<Conv2D>(16, 3, 3, Activation::kNone, Padding::kSame, 1, false), "conv2");
    bn2_ = register_layer(std::make_shared<BatchNormalization>(0.99f, 1e-3f, sync_bn), "bn2");
    pool_ = register_layer(std::make_shared<MaxPool2D>(2), "pool");
    head_ = register_layer(std::make_shared<Dense>(10), "logits");
  }

 protected:
  using Model::call;
  Tensor call(const Tensor& x, bool training) override {
    const Tensor h = ops::relu((*stem_bn_)((*stem_)(x), training));
    Tensor r = ops::relu((*bn1_)((*conv1_)(h), training));
    r = (*bn2_)((*conv2_)(r), training);
    const Tensor y = (*pool_)(ops::relu(ops::add(h, r)));
    return (*head_)(ops::mean(y, {1, 2}));
  }

 private:
  std::shared_ptr<Conv2D> stem_, conv1_, conv2_;
  std::shared_ptr<BatchNormalization> stem_bn_, bn1_, bn2_;
  std::shared_ptr<MaxPool2D> pool_;
  std::shared_ptr<Dense> head_;
};

inline std::string model_names() {
  return "reference_cnn (28x28), residual_cnn (a subclassed model, 28x28), resnet8, resnet20, "
         "resnet32, resnet56 (CIFAR ResNets; the images are padded to 32x32)";
}

inline bool wants_32x32(const std::string& name) { return name.rfind("resnet", 0) == 0; }

// sync_bn: every batch normalization synchronized across replicas; shard_blocks: each ResNet
// residual block is a unit of fully sharded parameters (ResNetOptions::shard_parameters; for
// --sharding=parameters). Throws InvalidArgument for an unknown name.
inline std::shared_ptr<Model> make_model(const std::string& name, bool sync_bn = false,
                                         bool shard_blocks = false) {
  if (name == "reference_cnn") return std::make_shared<Sequential>(reference_cnn());
  if (name == "residual_cnn") return std::make_shared<ResidualCnn>(sync_bn);
  if (wants_32x32(name)) {
    applications::ResNetOptions o;
    o.synchronized_batch_norm = sync_bn;
    o.shard_parameters = shard_blocks;
    o.input_shape = Shape{32, 32, 1};
    o.classes = 10;
    const std::string depth = name.substr(6);
    if (!depth.empty() && depth.find_first_not_of("0123456789") == std::string::npos &&
        depth.size() < 4)
      return applications::CifarResNet(std::stoi(depth), o);
  }
  throw InvalidArgument("unknown --model '" + name + "'; known: " + model_names());
}

// The data in the shape the model takes: 28x28 images padded with zeros to 32x32 for the ResNets.
inline FashionMnist fit_to_model(FashionMnist data, const std::string& name) {
  if (wants_32x32(name)) {
    data.train_images = ops::zero_pad2d(data.train_images, 2, 2, 2, 2);
    data.test_images = ops::zero_pad2d(data.test_images, 2, 2, 2, 2);
  }
  return data;
}

}  // namespace dtrain::examples
