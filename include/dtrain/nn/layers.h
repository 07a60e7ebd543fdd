// Keras-style layers. A layer creates its weights lazily on first call (or Sequential::build),
// always through create_variable(), so the active strategy decides where they live. Build models
// inside strategy.scope() and call build() there before training: building inside run() with more
// than one replica throws FailedPrecondition.
//
// Thread-safety: after build, call() may run concurrently on several replica threads.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/model/ops.h"
#include "dtrain/model/variable.h"

namespace dtrain {

enum class Activation { kNone, kRelu, kTanh, kSigmoid };
DTRAIN_API Tensor apply_activation(Activation a, const Tensor& x);

using VariableList = std::vector<std::shared_ptr<Variable>>;

class DTRAIN_API Layer {
 public:
  explicit Layer(std::string name) : name_(std::move(name)) {}
  virtual ~Layer() = default;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  // Builds on first use, then runs the layer.
  Tensor operator()(const Tensor& x, bool training = false);
  const std::string& name() const { return name_; }
  bool built() const { return built_; }
  VariableList variables() const { return weights_; }
  VariableList trainable_variables() const;
  // Creates the weights for inputs of `input_shape` (batch dimension included).
  void build(const Shape& input_shape);
  // Random state a checkpoint keeps (Dropout: calls per local replica so far); -1 when none.
  virtual int64_t rng_calls() const { return -1; }
  virtual void set_rng_calls(int64_t /*calls*/) {}

 protected:
  virtual void build_weights(const Shape& /*input_shape*/) {}
  virtual Tensor call(const Tensor& x, bool training) = 0;
  std::shared_ptr<Variable> add_weight(
      const std::string& name, const Shape& shape, Initializer init, bool trainable = true,
      VariableSynchronization sync = VariableSynchronization::kAuto,
      VariableAggregation agg = VariableAggregation::kNone);

 private:
  friend class Sequential;  // makes names unique within a model before build
  std::string name_;
  bool built_ = false;
  VariableList weights_;
};

class DTRAIN_API Dense : public Layer {
 public:
  Dense(int64_t units, Activation activation = Activation::kNone, bool use_bias = true,
        std::string name = "dense");
  std::shared_ptr<Variable> kernel, bias;

 protected:
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
  std::shared_ptr<Variable> kernel, bias;

 protected:
  void build_weights(const Shape& input_shape) override;
  Tensor call(const Tensor& x, bool training) override;

 private:
  friend class Sequential;         // runs conv + ReLU + max-pool as conv, pool, ReLU (same values)
  Tensor linear(const Tensor& x);  // the convolution and bias, without the activation
  int64_t filters_;
  int kh_, kw_;
  Activation activation_;
  ops::Padding padding_;
  int stride_;
  bool use_bias_;
};

class DTRAIN_API MaxPool2D : public Layer {
 public:
  explicit MaxPool2D(int pool = 2, int stride = 0, ops::Padding padding = ops::Padding::kValid,
                     std::string name = "max_pool2d");

 protected:
  Tensor call(const Tensor& x, bool training) override;

 private:
  friend class Sequential;  // runs Conv2D(relu) + MaxPool2D as one op, then ReLU
  int pool_, stride_;
  ops::Padding padding_;
};

class DTRAIN_API Flatten : public Layer {
 public:
  explicit Flatten(std::string name = "flatten") : Layer(std::move(name)) {}

 protected:
  Tensor call(const Tensor& x, bool /*training*/) override { return ops::flatten(x); }
};

class DTRAIN_API ActivationLayer : public Layer {
 public:
  explicit ActivationLayer(Activation a, std::string name = "activation")
      : Layer(std::move(name)), a_(a) {}

 protected:
  Tensor call(const Tensor& x, bool /*training*/) override { return apply_activation(a_, x); }

 private:
  Activation a_;
};

// Inverted dropout. Each call draws a new Philox stream from (seed, layer, replica, call), so
// masks are reproducible from --seed and differ across replicas and steps.
class DTRAIN_API Dropout : public Layer {
 public:
  explicit Dropout(float rate, std::string name = "dropout");
  int64_t rng_calls() const override;
  void set_rng_calls(int64_t calls) override;

 protected:
  Tensor call(const Tensor& x, bool training) override;

 private:
  float rate_;
  uint64_t seed_, layer_stream_;
  std::atomic<uint64_t> calls_{0};
};

// Keras BatchNormalization over the last axis. Moving statistics are non-trainable ON_READ
// variables with MEAN aggregation. By default each replica normalises with its own batch's
// statistics; synchronized = true (SyncBatchNorm) uses the global batch's, all-reduced across
// replicas in training (identical to one device at the same global batch).
class DTRAIN_API BatchNormalization : public Layer {
 public:
  explicit BatchNormalization(float momentum = 0.99f, float epsilon = 1e-3f,
                              bool synchronized = false, std::string name = "batch_normalization");
  std::shared_ptr<Variable> gamma, beta, moving_mean, moving_variance;

 protected:
  void build_weights(const Shape& input_shape) override;
  Tensor call(const Tensor& x, bool training) override;

 private:
  float momentum_, epsilon_;
  bool synchronized_;
};

// A linear stack of layers (keras.Sequential). Layer names are made unique within the model as
// Keras does: a second "dense" becomes "dense_1", a third "dense_2", so variable names
// ("dense_1/kernel") identify a weight in checkpoints.
class DTRAIN_API Sequential {
 public:
  Sequential() = default;
  explicit Sequential(std::vector<std::shared_ptr<Layer>> layers);
  // Throws FailedPrecondition after build() or for a layer that is already built.
  Sequential& add(std::shared_ptr<Layer> layer);
  // Creates all weights by running a zero batch of `input_shape` (batch dim included) through the
  // model on the current strategy's first device. Call inside strategy.scope().
  void build(const Shape& input_shape);
  Tensor operator()(const Tensor& x, bool training = false);
  VariableList trainable_variables() const;
  VariableList variables() const;
  const std::vector<std::shared_ptr<Layer>>& layers() const { return layers_; }
  bool built() const { return built_; }
  // Total number of parameters in trainable variables.
  int64_t count_params() const;

 private:
  std::vector<std::shared_ptr<Layer>> layers_;
  bool built_ = false;
};

}  // namespace dtrain
