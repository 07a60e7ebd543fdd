// dtrain::applications: the ResNet family as functional models (keras.applications, without
// pretrained weights: nothing is downloaded). Each residual block is a layer with its sublayers,
// so variable names are paths: "conv2_block1/1_conv/kernel".
//
//   ResNet50/101/152   Keras' topology (He et al. 2015, v1: bottleneck blocks, stride on the first
//                      1x1 convolution, biases on every convolution, BatchNormalization epsilon
//                      1.001e-5); ResNet50(...) has 25,636,712 parameters at 224x224x3 and 1,000
//                      classes, as keras.applications.ResNet50(weights=None).
//   ResNet18/34        basic blocks as torchvision's (no convolution biases, projection shortcuts
//                      with BatchNormalization, strided 3x3 convolutions padded by one on each
//                      side); ResNet18 has torchvision's 11,689,512 trainable parameters.
//   ResNetOptions::style = ResNetStyle::kTorchvision: ResNet50/101/152 as torchvision's (below).
//   ResNet20/32/56     He et al. 2015, section 4.2 (CIFAR), written as Keras' cifar10_resnet
//   example
//                      (resnet_v1: 16/32/64 filters, 1x1 projection shortcuts when the shape
//                      changes, he_normal initialisation); ResNet20 has its 274,442 parameters at
//                      32x32x3 and 10 classes.
//
// Build and train them inside strategy.scope(), as any model. The head's Dense returns logits (no
// softmax: dtrain's losses take logits).
#pragma once

#include <memory>
#include <string>

#include "dtrain/core/export.h"
#include "dtrain/nn/model.h"

namespace dtrain::applications {

// The form of ResNet50/101/152. ResNet18/34 have torchvision's topology either way; kTorchvision
// gives them torchvision's initializers too.
//   kKeras        keras.applications.ResNet50 (ResNet v1): a strided block strides in its first 1x1
//                 convolution, a bias on every convolution, BatchNormalization epsilon 1.001e-5,
//                 glorot_uniform kernels; 25,636,712 parameters (Keras' count, with the batch
//                 statistics).
//   kTorchvision  torchvision.models.resnet50() (v1.5): the stride on the 3x3 convolution,
//                 padded by one on each side (torch's padding=1); no convolution biases (a bias
//                 before batch normalization is subtracted again by it); epsilon 1e-5; kernels
//                 kaiming_normal_(mode="fan_out"), the head's torch.nn.Linear's U(+-1/sqrt(fan_in))
//                 (its bias starts at zero here); 25,557,032 trainable parameters (torchvision's
//                 count). tests/nn/applications_test.cc checks its logits against torchvision's.
// The two do different work: v1.5 runs 4.09 G multiply-adds a 224x224 image forward, v1 3.86 G
// (6% fewer: in the three strided blocks v1's first 1x1 convolution sees a quarter of the
// positions), and on a GPU v1's biases cost a pass over each convolution's output and gradient.
// Compare with TensorFlow in the Keras form and with PyTorch in the torchvision form.
enum class ResNetStyle { kKeras, kTorchvision };

struct DTRAIN_API ResNetOptions {
  ResNetStyle style = ResNetStyle::kKeras;
  Shape input_shape{224, 224, 3};  // one example's shape (HWC)
  int64_t classes = 1000;
  // false: no pooling and no Dense head; the model returns the last block's feature map.
  bool include_top = true;
  // Every BatchNormalization synchronized across replicas (SyncBatchNorm).
  bool synchronized_batch_norm = false;
  // Activation recomputation per residual block (Layer::set_recompute_grad): training keeps each
  // block's input instead of its activations, for one more forward pass of the blocks.
  bool recompute = false;
  // Fully sharded parameters per residual block (Layer::set_shard_parameters): under
  // Sharding::kParameters each block's weights are kept as one part per replica and gathered when
  // the block runs (ZeRO-3, one unit per block). A no-op under other strategies.
  bool shard_parameters = false;
};

// Throw InvalidArgument for an input too small for the network's strides, or classes < 1.
DTRAIN_API std::shared_ptr<Model> ResNet50(const ResNetOptions& options = {});
DTRAIN_API std::shared_ptr<Model> ResNet101(const ResNetOptions& options = {});
DTRAIN_API std::shared_ptr<Model> ResNet152(const ResNetOptions& options = {});
DTRAIN_API std::shared_ptr<Model> ResNet18(const ResNetOptions& options = {});
DTRAIN_API std::shared_ptr<Model> ResNet34(const ResNetOptions& options = {});
// CIFAR ResNets of depth 6n + 2 (20, 32, 44, 56, 110, ...); options.input_shape defaults to 224 x
// 224: set it (32 x 32 x 3 for CIFAR-10).
DTRAIN_API std::shared_ptr<Model> CifarResNet(int depth, const ResNetOptions& options);
DTRAIN_API std::shared_ptr<Model> ResNet20(const ResNetOptions& options);
DTRAIN_API std::shared_ptr<Model> ResNet32(const ResNetOptions& options);
DTRAIN_API std::shared_ptr<Model> ResNet56(const ResNetOptions& options);
// By name ("resnet50", "resnet20", ...); throws InvalidArgument listing the names.
DTRAIN_API std::shared_ptr<Model> resnet_by_name(const std::string& name,
                                                 const ResNetOptions& options);

}  // namespace dtrain::applications
