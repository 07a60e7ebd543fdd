// Keras' layers (nn/layer.h says what a layer is; nn/model.h, Model and Sequential).
//
// Thread-safety: after build, call() may run concurrently on several replica threads.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/model/ops.h"
#include "dtrain/nn/layer.h"
#include "dtrain/nn/merging.h"
#include "dtrain/nn/model.h"

namespace dtrain {

// keras.layers.Dense: x [batch, ..., features] @ kernel [features, units] (+ bias) on the last
// axis, for inputs of any rank >= 2 (a [batch, time, features] sequence is one product).
class DTRAIN_API Dense : public Layer {
 public:
  Dense(int64_t units, Activation activation = Activation::kNone, bool use_bias = true,
        std::string name = "dense");
  std::string class_name() const override { return "Dense"; }
  std::shared_ptr<Variable> kernel, bias;
  // Keras' kernel_initializer; set before the layer is built.
  Initializer kernel_initializer;  // empty: glorot_uniform

 protected:
  using Layer::build_weights;
  using Layer::call;
  void build_weights(const Shape& input_shape) override;
  Tensor call(const Tensor& x, bool training) override;

 private:
  int64_t units_;
  Activation activation_;
  bool use_bias_;
};

class DTRAIN_API Conv2D : public Layer {
 public:
  Conv2D(int64_t filters, int kernel_h, int kernel_w, Activation activation = Activation::kNone,
         ops::Padding padding = ops::Padding::kValid, int stride = 1, bool use_bias = true,
         std::string name = "conv2d");
  std::string class_name() const override { return "Conv2D"; }
  std::shared_ptr<Variable> kernel, bias;
  // Keras' kernel_initializer; set before the layer is built.
  Initializer kernel_initializer;  // empty: glorot_uniform
  // torch.nn.Conv2d's padding=(pad_h, pad_w): that many zeros on each side, in place of the
  // constructor's `padding` (Keras has only "valid" and "same"). Set before the layer is built.
  void set_explicit_padding(int pad_h, int pad_w);
  // With ReLU, followed by max pooling: the convolution and the pooling as one op, then the ReLU.
  FusedCall fuse_with_next(const Layer& next) override;
  // Under mixed_bfloat16 on a CPU or CUDA device (Kernels::hands_off_bfloat16), in a training
  // step (one GradientTape recording), the
  // output is bfloat16, as a Keras layer's under a bfloat16 compute dtype, instead of float32: for
  // a BatchNormalization after it, which reads its input rounded to bfloat16 anyway. The values
  // are the same (but for outputs below float32's normal range, which oneDNN's bfloat16
  // conversion on AMX flushes to zero); the step writes 2 bytes an element instead of 4 and
  // rounds none again. Only for a layer whose output goes to a BatchNormalization (or a Conv2D);
  // other ops take float32. Not with an activation. The ResNets of applications.h set it.
  // Elsewhere the output is float32.
  bool bfloat16_output = false;

 protected:
  using Layer::build_weights;
  using Layer::call;
  void build_weights(const Shape& input_shape) override;
  Tensor call(const Tensor& x, bool training) override;

 private:
  Tensor linear(const Tensor& x);  // the convolution and bias, without the activation
  int64_t filters_;
  int kh_, kw_;
  Activation activation_;
  ops::Padding padding_;
  int stride_;
  bool use_bias_;
  int pad_h_ = -1, pad_w_ = -1;  // set_explicit_padding's; -1: padding_
};

class DTRAIN_API MaxPool2D : public Layer {
 public:
  explicit MaxPool2D(int pool = 2, int stride = 0, ops::Padding padding = ops::Padding::kValid,
                     std::string name = "max_pool2d");
  std::string class_name() const override { return "MaxPooling2D"; }
  std::optional<Pool2DSpec> max_pool_spec() const override;

 protected:
  using Layer::call;
  Tensor call(const Tensor& x, bool training) override;

 private:
  int pool_, stride_;
  ops::Padding padding_;
};

// keras.layers.AveragePooling2D (TF's padding semantics: "same" windows divide by the elements they
// cover).
class DTRAIN_API AveragePooling2D : public Layer {
 public:
  explicit AveragePooling2D(int pool = 2, int stride = 0,
                            ops::Padding padding = ops::Padding::kValid,
                            std::string name = "average_pooling2d");
  std::string class_name() const override { return "AveragePooling2D"; }

 protected:
  using Layer::call;
  Tensor call(const Tensor& x, bool training) override;

 private:
  int pool_, stride_;
  ops::Padding padding_;
};

class DTRAIN_API Flatten : public Layer {
 public:
  explicit Flatten(std::string name = "flatten") : Layer(std::move(name)) {}
  std::string class_name() const override { return "Flatten"; }

 protected:
  using Layer::call;
  Tensor call(const Tensor& x, bool /*training*/) override { return ops::flatten(x); }
};

// keras.layers.ZeroPadding2D: rows of zeros above and below, columns left and right (NHWC).
class DTRAIN_API ZeroPadding2D : public Layer {
 public:
  explicit ZeroPadding2D(int padding = 1, std::string name = "zero_padding2d")
      : ZeroPadding2D(padding, padding, padding, padding, std::move(name)) {}
  ZeroPadding2D(int top, int bottom, int left, int right, std::string name = "zero_padding2d");
  std::string class_name() const override { return "ZeroPadding2D"; }

 protected:
  using Layer::call;
  Tensor call(const Tensor& x, bool training) override;

 private:
  int top_, bottom_, left_, right_;
};

// keras.layers.GlobalAveragePooling2D: [N, H, W, C] -> [N, C], the mean over height and width.
class DTRAIN_API GlobalAveragePooling2D : public Layer {
 public:
  explicit GlobalAveragePooling2D(std::string name = "global_average_pooling2d")
      : Layer(std::move(name)) {}
  std::string class_name() const override { return "GlobalAveragePooling2D"; }

 protected:
  using Layer::call;
  Tensor call(const Tensor& x, bool training) override;
};

class DTRAIN_API ActivationLayer : public Layer {
 public:
  explicit ActivationLayer(Activation a, std::string name = "activation")
      : Layer(std::move(name)), a_(a) {}
  std::string class_name() const override { return "Activation"; }
  std::optional<Activation> activation_spec() const override { return a_; }

 protected:
  using Layer::call;
  Tensor call(const Tensor& x, bool /*training*/) override { return apply_activation(a_, x); }

 private:
  Activation a_;
};

// Inverted dropout. Each call draws a new Philox stream from (seed, layer, replica, call), so
// masks are reproducible from --seed and differ across replicas and steps. Calls are counted per
// replica, so a layer called several times a step (a block's one Dropout after attention and
// after the MLP) gives the same masks whatever the replica threads' timing.
class DTRAIN_API Dropout : public Layer {
 public:
  explicit Dropout(float rate, std::string name = "dropout");
  int64_t rng_calls() const override;
  void set_rng_calls(int64_t calls) override;
  std::string class_name() const override { return "Dropout"; }

 protected:
  using Layer::call;
  Tensor call(const Tensor& x, bool training) override;

 private:
  float rate_;
  uint64_t seed_, layer_stream_;
  mutable std::mutex mu_;
  uint64_t base_calls_ = 0;                       // set_rng_calls()
  std::unordered_map<uint64_t, uint64_t> calls_;  // replica -> calls since then
};

// Keras BatchNormalization over the last axis. Moving statistics are non-trainable ON_READ
// variables with MEAN aggregation. By default each replica normalises with its own batch's
// statistics; synchronized = true (SyncBatchNorm) uses the global batch's, all-reduced across
// replicas in training (identical to one device at the same global batch).
class DTRAIN_API BatchNormalization : public Layer {
 public:
  explicit BatchNormalization(float momentum = 0.99f, float epsilon = 1e-3f,
                              bool synchronized = false, std::string name = "batch_normalization");
  std::string class_name() const override { return "BatchNormalization"; }
  std::shared_ptr<Variable> gamma, beta, moving_mean, moving_variance;
  // dtrain's addition to Keras' layer: an activation applied to the output, the same values as an
  // Activation layer after it. kRelu in training runs as one op (ops::batch_norm_relu_training: on
  // the CPU a pass less over the data each way, and the backward pass reads a bitmask instead of
  // the output), as TF's grappler fuses FusedBatchNorm+Relu; the ResNets of applications.h use it.
  Activation activation = Activation::kNone;
  // With activation kRelu, in training without synchronization, under mixed_bfloat16 on a CPU or
  // CUDA device: the output in bfloat16, as Conv2D::bfloat16_output, for a Conv2D after it (which
  // reads it rounded so anyway). A bfloat16 input (a Conv2D's) is read as it is either way.
  bool bfloat16_output = false;

 protected:
  using Layer::build_weights;
  using Layer::call;
  void build_weights(const Shape& input_shape) override;
  Tensor call(const Tensor& x, bool training) override;

 private:
  float momentum_, epsilon_;
  bool synchronized_;
};

}  // namespace dtrain
