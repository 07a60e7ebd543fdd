#include "dtrain/nn/layers.h"

#include <algorithm>

#include "dtrain/core/random.h"
#include "dtrain/devices/device.h"
#include "dtrain/model/initializers.h"
#include "dtrain/model/recompute.h"
#include "dtrain/nn/sync_batch_norm.h"
#include "dtrain/strategies/strategy.h"

namespace dtrain {

// --- Dense ---
Dense::Dense(int64_t units, Activation activation, bool use_bias, std::string name)
    : Layer(std::move(name)), units_(units), activation_(activation), use_bias_(use_bias) {
  if (units < 1) throw InvalidArgument("Dense needs units >= 1, got " + std::to_string(units));
}

void Dense::build_weights(const Shape& s) {
  if (s.rank() < 2)
    throw InvalidArgument("Dense '" + name() + "' expects [batch, ..., features] input, got " +
                          s.to_string());
  kernel = add_weight("kernel", Shape{s[-1], units_},
                      kernel_initializer ? kernel_initializer : initializers::glorot_uniform());
  if (use_bias_) bias = add_weight("bias", Shape{units_}, initializers::zeros());
}

Tensor Dense::call(const Tensor& x, bool) {
  Tensor y = ops::matmul(x, kernel->value());
  if (use_bias_) y = ops::bias_add(y, bias->value());
  return apply_activation(activation_, y);
}

// --- Conv2D ---
Conv2D::Conv2D(int64_t filters, int kh, int kw, Activation activation, ops::Padding padding,
               int stride, bool use_bias, std::string name)
    : Layer(std::move(name)),
      filters_(filters),
      kh_(kh),
      kw_(kw),
      activation_(activation),
      padding_(padding),
      stride_(stride),
      use_bias_(use_bias) {
  if (filters < 1 || kh < 1 || kw < 1 || stride < 1)
    throw InvalidArgument("Conv2D needs filters, kernel size and stride >= 1");
}

void Conv2D::build_weights(const Shape& s) {
  if (s.rank() != 4)
    throw InvalidArgument("Conv2D '" + name() + "' expects NHWC input [N, H, W, C], got " +
                          s.to_string() + "; reshape images to [N, 28, 28, 1]");
  kernel = add_weight("kernel", Shape{kh_, kw_, s[3], filters_},
                      kernel_initializer ? kernel_initializer : initializers::glorot_uniform());
  if (use_bias_) bias = add_weight("bias", Shape{filters_}, initializers::zeros());
}

void Conv2D::set_explicit_padding(int pad_h, int pad_w) {
  if (pad_h < 0 || pad_w < 0)
    throw InvalidArgument("Conv2D '" + name() + "': explicit padding must be >= 0, got (" +
                          std::to_string(pad_h) + ", " + std::to_string(pad_w) + ")");
  if (built())
    throw FailedPrecondition("Conv2D '" + name() +
                             "': set_explicit_padding() after the layer was built; set it first");
  pad_h_ = pad_h;
  pad_w_ = pad_w;
}

Tensor Conv2D::linear(const Tensor& x) {
  const Tensor b = use_bias_ ? bias->value() : Tensor();
  Conv2dParams p =
      pad_h_ < 0 ? ops::conv_params(x.shape(), kernel->value().shape(), stride_, stride_, padding_)
                 : Conv2dParams{stride_, stride_, pad_h_, pad_h_, pad_w_, pad_w_};
  // (ops::conv2d gives it only under mixed_bfloat16 on a device that takes it, one tape recording.)
  p.bf16_output = bfloat16_output && activation_ == Activation::kNone;
  return ops::conv2d(x, kernel->value(), b, p);
}

Tensor Conv2D::call(const Tensor& x, bool) { return apply_activation(activation_, linear(x)); }

Layer::FusedCall Conv2D::fuse_with_next(const Layer& next) {
  // Conv2D(activation=relu) then max pooling: pooled first, then ReLU. The values are the same
  // (ReLU is non-decreasing, so it commutes with max; pooling never reads padding), and so are the
  // gradients; the ReLU and its backward pass touch a quarter of the elements (a 2x2 pool), which
  // is most of the memory traffic of the reference CNN's first layer. The convolution, the pooling
  // and the ReLU run as one op (ops::conv2d_max_pool2d), which a CPU runs a few images at a time
  // with the ReLU in the pooling's pass (no pass of its own either way).
  const std::optional<Pool2DSpec> pool = next.max_pool_spec();
  if (activation_ != Activation::kRelu || !pool || !built() || !next.built() || pad_h_ >= 0 ||
      pool->window_h != pool->window_w || pool->stride_h != pool->stride_w)
    return {};
  const Pool2DSpec p = *pool;
  return [this, p](const std::vector<Tensor>& xs, bool) {
    // (A bfloat16 activation, BatchNormalization::bfloat16_output's, is read widened: the fused
    // kernel takes float32.)
    const Tensor& x = xs.at(0);
    return ops::conv2d_max_pool2d(x.dtype() == DType::kBFloat16 ? ops::cast(x, DType::kFloat32) : x,
                                  kernel->value(), use_bias_ ? bias->value() : Tensor(), stride_,
                                  padding_, p.window_h, p.stride_h, p.padding,
                                  /*relu=*/true);
  };
}

// --- MaxPool2D ---
MaxPool2D::MaxPool2D(int pool, int stride, ops::Padding padding, std::string name)
    : Layer(std::move(name)), pool_(pool), stride_(stride > 0 ? stride : pool), padding_(padding) {}

std::optional<Pool2DSpec> MaxPool2D::max_pool_spec() const {
  return Pool2DSpec{pool_, pool_, stride_, stride_, padding_};
}

Tensor MaxPool2D::call(const Tensor& x, bool) {
  return ops::max_pool2d(x, pool_, pool_, stride_, stride_, padding_);
}

// --- AveragePooling2D ---
AveragePooling2D::AveragePooling2D(int pool, int stride, ops::Padding padding, std::string name)
    : Layer(std::move(name)), pool_(pool), stride_(stride > 0 ? stride : pool), padding_(padding) {
  if (pool < 1) throw InvalidArgument("AveragePooling2D needs pool >= 1");
}

Tensor AveragePooling2D::call(const Tensor& x, bool) {
  return ops::avg_pool2d(x, pool_, pool_, stride_, stride_, padding_);
}

// --- ZeroPadding2D, GlobalAveragePooling2D ---
ZeroPadding2D::ZeroPadding2D(int top, int bottom, int left, int right, std::string name)
    : Layer(std::move(name)), top_(top), bottom_(bottom), left_(left), right_(right) {
  if (top < 0 || bottom < 0 || left < 0 || right < 0)
    throw InvalidArgument("ZeroPadding2D needs padding >= 0");
}

Tensor ZeroPadding2D::call(const Tensor& x, bool) {
  if (x.shape().rank() != 4)
    throw InvalidArgument("ZeroPadding2D '" + path() + "' expects NHWC input [N, H, W, C], got " +
                          x.shape().to_string());
  return ops::zero_pad2d(x, top_, bottom_, left_, right_);
}

Tensor GlobalAveragePooling2D::call(const Tensor& x, bool) {
  if (x.shape().rank() != 4)
    throw InvalidArgument("GlobalAveragePooling2D '" + path() +
                          "' expects NHWC input [N, H, W, C], got " + x.shape().to_string());
  return ops::mean(x, {1, 2});
}

// --- Dropout ---
Dropout::Dropout(float rate, std::string name) : Layer(std::move(name)), rate_(rate) {
  if (rate < 0.f || rate >= 1.f)
    throw InvalidArgument("Dropout rate must be in [0, 1), got " + std::to_string(rate));
  const Philox p = global_next_stream();
  seed_ = (static_cast<uint64_t>(p.block(0)[0]) << 32) | p.block(0)[1];
  layer_stream_ = p.block(0)[2];
}

int64_t Dropout::rng_calls() const {
  // Every replica has made the same number of calls at a step's end, when checkpoints save this.
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t most = 0;
  for (const auto& [replica, n] : calls_) most = std::max(most, n);
  return static_cast<int64_t>(base_calls_ + most);
}
void Dropout::set_rng_calls(int64_t calls) {
  if (calls < 0) throw InvalidArgument("Dropout '" + name() + "': call count must be >= 0");
  std::lock_guard<std::mutex> lock(mu_);
  base_calls_ = static_cast<uint64_t>(calls);
  calls_.clear();
}

Tensor Dropout::call(const Tensor& x, bool training) {
  if (!training || rate_ == 0.f) return x;
  ReplicaContext* ctx = get_replica_context();
  const uint64_t replica = ctx ? static_cast<uint64_t>(ctx->replica_id_in_sync_group()) : 0;
  // The replica's own call count; under recompute_grad the replay reads back the call the first
  // pass drew, so it applies the same mask.
  const uint64_t call = recompute::replayed_draw([this, replica] {
    std::lock_guard<std::mutex> lock(mu_);
    return base_calls_ + calls_[replica]++;
  });
  const uint64_t stream = (layer_stream_ << 40) ^ (replica << 32) ^ call;
  return ops::dropout(x, rate_, true, seed_, stream);
}

// --- BatchNormalization ---
BatchNormalization::BatchNormalization(float momentum, float epsilon, bool synchronized,
                                       std::string name)
    : Layer(std::move(name)), momentum_(momentum), epsilon_(epsilon), synchronized_(synchronized) {}

void BatchNormalization::build_weights(const Shape& s) {
  const Shape c{s[-1]};
  gamma = add_weight("gamma", c, initializers::ones());
  beta = add_weight("beta", c, initializers::zeros());
  moving_mean = add_weight("moving_mean", c, initializers::zeros(), false,
                           VariableSynchronization::kOnRead, VariableAggregation::kMean);
  moving_variance = add_weight("moving_variance", c, initializers::ones(), false,
                               VariableSynchronization::kOnRead, VariableAggregation::kMean);
}

Tensor BatchNormalization::call(const Tensor& x_in, bool training_call) {
  // Frozen (set_trainable(false)): inference mode, moving statistics kept, as in Keras 2+.
  const bool training = training_call && trainable();
  ReplicaContext* ctx = get_replica_context();
  const bool sync = training && synchronized_ && ctx && ctx->num_replicas_in_sync() > 1;
  // A Conv2D's bfloat16 output (Conv2D::bfloat16_output) goes to the training kernels as it is;
  // inference and SyncBatchNorm read it widened (the same values).
  const Tensor x = x_in.dtype() == DType::kBFloat16 && (!training || sync)
                       ? ops::cast(x_in, DType::kFloat32)
                       : x_in;
  if (!training)
    return apply_activation(activation, ops::batch_norm_inference(
                                            x, gamma->value(), beta->value(), moving_mean->value(),
                                            moving_variance->value(), epsilon_));
  Tensor mean, var, y;
  if (sync)
    y = apply_activation(
        activation, ops::sync_batch_norm_training(*ctx, x, gamma->value(), beta->value(), epsilon_,
                                                  &mean, &var));
  else if (activation == Activation::kRelu)
    y = ops::batch_norm_relu_training(x, gamma->value(), beta->value(), epsilon_, &mean, &var,
                                      bfloat16_output);
  else
    y = apply_activation(activation, ops::batch_norm_training(x, gamma->value(), beta->value(),
                                                              epsilon_, &mean, &var));
  // A recompute_grad replay computes the step's statistics again: the first pass updated them.
  if ((sync || x.numel() > 0) && !recompute::replaying()) {
    Kernels& k = kernels_for(x);
    // moving = momentum * moving + (1 - momentum) * batch, on this replica's copy.
    moving_mean->update([&](Tensor& m, size_t) {
      m.copy_from(k.binary(BinaryOp::kAdd, k.affine(m, momentum_, 0.f),
                           k.affine(mean.to(m.device()), 1.f - momentum_, 0.f)));
    });
    moving_variance->update([&](Tensor& v, size_t) {
      v.copy_from(k.binary(BinaryOp::kAdd, k.affine(v, momentum_, 0.f),
                           k.affine(var.to(v.device()), 1.f - momentum_, 0.f)));
    });
  }
  return y;
}

}  // namespace dtrain
