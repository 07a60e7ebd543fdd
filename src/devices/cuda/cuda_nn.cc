// CudaKernels: losses, dropout, batch norm and the optimizer updates (argument checking here,
// arithmetic in cuda_loss.cu, cuda_random.cu, cuda_batch_norm.cu and cuda_optim.cu).
#include <cmath>
#include <vector>

#include "devices/cuda/cuda_check.h"
#include "devices/cuda/cuda_guard.h"
#include "devices/cuda/cuda_kernels.h"
#include "devices/cuda/cuda_launch.h"
#include "dtrain/core/error.h"

namespace dtrain::cuda {
namespace {

float* fptr(const Tensor& t) { return static_cast<float*>(t.raw_data()); }
const int32_t* iptr(const Tensor& t) { return static_cast<const int32_t*>(t.raw_data()); }

// Throws unless t has shape [c].
void check_channels(const Tensor& t, int64_t c, const char* op, const char* arg, const Tensor& x) {
  if (t.shape() != Shape{c})
    throw InvalidArgument(detail::str_cat(op, ": ", arg, " has shape ", t.shape().to_string(),
                                          " but x ", x.shape().to_string(), " has ", c,
                                          " channels (last axis); expected [", c, "]"));
}

// Batch norm normalises over all but the last axis, so it needs a batch axis and a channel axis
// (the CPU device's rule too).
void check_bn_rank(const Tensor& x, const char* op) {
  if (x.rank() < 2)
    throw InvalidArgument(detail::str_cat(op, ": x must have rank >= 2 (batch..., channels), got ",
                                          x.shape().to_string()));
}

}  // namespace

// --- losses ---

void CudaKernels::softmax_cross_entropy(const Tensor& logits, const Tensor& labels, Tensor* loss,
                                        Tensor* probs) {
  DeviceGuard guard(ctx_.index());
  check_f32(logits, "softmax_cross_entropy", "logits");
  check_device(labels, "softmax_cross_entropy", "labels");
  if (logits.rank() != 2 || logits.shape()[1] < 1)
    throw InvalidArgument("softmax_cross_entropy: logits must be [N, C] with C >= 1, got " +
                          logits.shape().to_string());
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  if (labels.dtype() != DType::kInt32 || labels.shape() != Shape{n})
    throw InvalidArgument(detail::str_cat("softmax_cross_entropy: labels must be int32 [", n,
                                          "] for logits ", logits.shape().to_string(), ", got ",
                                          labels.to_string()));
  // An out-of-range label would read outside the row, so labels are checked on the host. This
  // waits for the stream, which a training step does at the end of its step anyway.
  std::vector<int32_t> host(static_cast<size_t>(n));
  if (n > 0) {
    DTRAIN_CUDA_CALL(cudaMemcpyAsync(host.data(), labels.raw_data(), labels.nbytes(),
                                     cudaMemcpyDeviceToHost, ctx_.stream()));
    DTRAIN_CUDA_CALL(cudaStreamSynchronize(ctx_.stream()));
  }
  for (int64_t i = 0; i < n; ++i)
    if (host[static_cast<size_t>(i)] < 0 || host[static_cast<size_t>(i)] >= c)
      throw InvalidArgument(detail::str_cat("softmax_cross_entropy: label ",
                                            host[static_cast<size_t>(i)], " of example ", i,
                                            " is outside [0, ", c,
                                            "); labels must be class indices below the number "
                                            "of logits"));
  Tensor l = empty(Shape{n});
  Tensor p = empty(logits.shape());
  launch_softmax_xent(fptr(logits), iptr(labels), fptr(l), fptr(p), n, c, ctx_.stream());
  if (loss) *loss = l;
  if (probs) *probs = p;
}

Tensor CudaKernels::softmax_cross_entropy_backward(const Tensor& probs, const Tensor& labels,
                                                   const Tensor& dloss) {
  DeviceGuard guard(ctx_.index());
  check_f32(probs, "softmax_cross_entropy_backward", "probs");
  check_device(labels, "softmax_cross_entropy_backward", "labels");
  check_f32(dloss, "softmax_cross_entropy_backward", "dloss");
  if (probs.rank() != 2)
    throw InvalidArgument("softmax_cross_entropy_backward: probs must be [N, C], got " +
                          probs.shape().to_string());
  const int64_t n = probs.shape()[0], c = probs.shape()[1];
  if (labels.dtype() != DType::kInt32 || labels.shape() != Shape{n})
    throw InvalidArgument(detail::str_cat("softmax_cross_entropy_backward: labels must be int32 [",
                                          n, "] for probs ", probs.shape().to_string(), ", got ",
                                          labels.to_string()));
  if (dloss.shape() != Shape{n})
    throw InvalidArgument(detail::str_cat("softmax_cross_entropy_backward: dloss must be [", n,
                                          "] for probs ", probs.shape().to_string(), ", got ",
                                          dloss.shape().to_string()));
  // Labels were range-checked by the forward pass; an out-of-range one here only loses its
  // one-hot entry (no out-of-bounds access), so no host round trip is needed.
  Tensor dx = empty(probs.shape());
  launch_softmax_xent_backward(fptr(probs), iptr(labels), fptr(dloss), fptr(dx), n, c,
                               ctx_.stream());
  return dx;
}

// --- dropout ---

Tensor CudaKernels::dropout_mask(const Shape& shape, float rate, uint64_t seed, uint64_t stream) {
  DeviceGuard guard(ctx_.index());
  if (!(rate >= 0.f && rate < 1.f))
    throw InvalidArgument(detail::str_cat("dropout_mask: rate ", rate,
                                          " must be in [0, 1) (the fraction of units dropped)"));
  Tensor mask = empty(shape);
  // The same float expression as the CPU device, so kept values are bit-identical.
  const float scale = 1.0f / (1.0f - rate);
  launch_dropout_mask(fptr(mask), mask.numel(), rate, scale, seed, stream, ctx_.stream());
  return mask;
}

// --- batch norm ---

BatchNormForward CudaKernels::bn_training(const Tensor& x_in, const Tensor& gamma,
                                          const Tensor& beta, float epsilon, bool relu,
                                          DType y_dtype, const char* op) {
  DeviceGuard guard(ctx_.index());
  check_activation(x_in, op, "x");
  if (y_dtype != DType::kFloat32 && y_dtype != DType::kBFloat16)
    throw InvalidArgument(
        detail::str_cat(op, ": y_dtype ", dtype_name(y_dtype), " is not float32 or bfloat16"));
  const bool one_pass = bn_one_pass();
  // (The two-pass kernels, DTRAIN_CUDA_BN=two_pass, read float32.)
  const Tensor x = one_pass ? x_in : as_dtype(x_in, DType::kFloat32);
  check_f32(gamma, op, "gamma");
  check_f32(beta, op, "beta");
  check_bn_rank(x, op);
  const int64_t c = x.shape()[-1];
  check_channels(gamma, c, op, "gamma", x);
  check_channels(beta, c, op, "beta", x);
  const int64_t rows = c == 0 ? 0 : x.numel() / c;
  BatchNormForward out{empty(x.shape(), y_dtype), empty(Shape{c}), empty(Shape{c})};
  if (rows == 0) {  // no samples: zero statistics, as on the CPU (the output is empty)
    launch_fill(out.mean.raw_data(), DType::kFloat32, c, 0.f, ctx_.stream());
    launch_fill(out.var.raw_data(), DType::kFloat32, c, 0.f, ctx_.stream());
    return out;
  }
  launch_bn_stats(x.raw_data(), x.dtype(), rows, c, fptr(out.mean), fptr(out.var), one_pass, ctx_);
  launch_bn_apply(x.raw_data(), x.dtype(), fptr(out.mean), fptr(out.var), fptr(gamma), fptr(beta),
                  epsilon, out.y.raw_data(), y_dtype, rows, c, relu, ctx_.stream());
  return out;
}

BatchNormForward CudaKernels::batch_norm_training(const Tensor& x, const Tensor& gamma,
                                                  const Tensor& beta, float epsilon) {
  return bn_training(x, gamma, beta, epsilon, false, DType::kFloat32, "batch_norm_training");
}

// The ReLU in the normalisation's pass; the mask is the output itself (y > 0 exactly where the
// normalised value was), which batch_norm_relu_backward reads beside dy. A bfloat16 y (y_dtype)
// is the mask too: 0 where a positive output rounds to 0 (below 2^-133, bfloat16's smallest
// subnormal), whose gradient is then 0, as for a Keras layer's bfloat16 output.
BatchNormForward CudaKernels::batch_norm_relu_training(const Tensor& x, const Tensor& gamma,
                                                       const Tensor& beta, float epsilon,
                                                       Tensor* relu_mask, DType y_dtype) {
  BatchNormForward f =
      bn_training(x, gamma, beta, epsilon, true, y_dtype, "batch_norm_relu_training");
  *relu_mask = f.y;
  return f;
}

Tensor CudaKernels::batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                         const Tensor& mean, const Tensor& var, float epsilon) {
  DeviceGuard guard(ctx_.index());
  const char* op = "batch_norm_inference";
  check_f32(x, op, "x");
  check_f32(gamma, op, "gamma");
  check_f32(beta, op, "beta");
  check_f32(mean, op, "mean");
  check_f32(var, op, "var");
  check_bn_rank(x, "batch_norm_inference");
  const int64_t c = x.shape()[-1];
  check_channels(gamma, c, op, "gamma", x);
  check_channels(beta, c, op, "beta", x);
  check_channels(mean, c, op, "mean", x);
  check_channels(var, c, op, "var", x);
  const int64_t rows = c == 0 ? 0 : x.numel() / c;
  Tensor y = empty(x.shape());
  launch_bn_apply(x.raw_data(), DType::kFloat32, fptr(mean), fptr(var), fptr(gamma), fptr(beta),
                  epsilon, y.raw_data(), DType::kFloat32, rows, c, false, ctx_.stream());
  return y;
}

BatchNormBackward CudaKernels::batch_norm_backward(const Tensor& dy, const Tensor& x,
                                                   const Tensor& gamma, const Tensor& mean,
                                                   const Tensor& var, float epsilon,
                                                   DType dx_dtype) {
  return bn_backward(dy, x, gamma, mean, var, epsilon, nullptr, dx_dtype, "batch_norm_backward");
}

// The ReLU's gradient taken where the mask (the output) is > 0 as the kernels read dy, rather than
// written first by a kernel of its own (Kernels' default, kept under DTRAIN_CUDA_BN=two_pass).
BatchNormBackward CudaKernels::batch_norm_relu_backward(const Tensor& dy, const Tensor& x,
                                                        const Tensor& gamma, const Tensor& mean,
                                                        const Tensor& var, float epsilon,
                                                        const Tensor& relu_mask, DType dx_dtype) {
  const char* op = "batch_norm_relu_backward";
  DeviceGuard guard(ctx_.index());  // the two-pass branch launches casts before bn_backward's guard
  check_activation(dy, op, "dy");   // before the two-pass branch casts it
  check_activation(x, op, "x");
  check_activation(relu_mask, op, "relu_mask");
  check_same_shape(relu_mask, x, op);
  if (!bn_one_pass())  // the ReLU gradient's own kernel reads a float32 mask and dy
    return Kernels::batch_norm_relu_backward(as_dtype(dy, DType::kFloat32), x, gamma, mean, var,
                                             epsilon, as_dtype(relu_mask, DType::kFloat32),
                                             dx_dtype);
  return bn_backward(dy, x, gamma, mean, var, epsilon, &relu_mask, dx_dtype, op);
}

BatchNormBackward CudaKernels::bn_backward(const Tensor& dy_in, const Tensor& x_in,
                                           const Tensor& gamma, const Tensor& mean,
                                           const Tensor& var, float epsilon,
                                           const Tensor* relu_mask, DType dx_dtype,
                                           const char* op) {
  DeviceGuard guard(ctx_.index());
  check_activation(dy_in, op, "dy");
  check_activation(x_in, op, "x");
  if (dx_dtype != DType::kFloat32 && dx_dtype != DType::kBFloat16)
    throw InvalidArgument(
        detail::str_cat(op, ": dx_dtype ", dtype_name(dx_dtype), " is not float32 or bfloat16"));
  // With a mask the caller chose the one-pass kernels; without one, read the switch here.
  const bool one_pass = relu_mask != nullptr || bn_one_pass();
  const Tensor dy = as_dtype(dy_in, DType::kFloat32);
  const Tensor x = one_pass ? x_in : as_dtype(x_in, DType::kFloat32);
  check_f32(gamma, op, "gamma");
  check_f32(mean, op, "mean");
  check_f32(var, op, "var");
  check_same_shape(dy, x, op);
  check_bn_rank(x, op);
  const int64_t c = x.shape()[-1];
  check_channels(gamma, c, op, "gamma", x);
  check_channels(mean, c, op, "mean", x);
  check_channels(var, c, op, "var", x);
  const int64_t rows = c == 0 ? 0 : x.numel() / c;
  BatchNormBackward out{empty(x.shape(), dx_dtype), empty(Shape{c}), empty(Shape{c})};
  launch_bn_backward(fptr(dy), relu_mask ? relu_mask->raw_data() : nullptr,
                     relu_mask ? relu_mask->dtype() : DType::kFloat32, x.raw_data(), x.dtype(),
                     fptr(gamma), fptr(mean), fptr(var), epsilon, out.dx.raw_data(), dx_dtype,
                     fptr(out.dgamma), fptr(out.dbeta), rows, c, one_pass, ctx_);
  return out;
}

// --- optimizers ---

void CudaKernels::sgd_update(Tensor& var, const Tensor& grad, Tensor* momentum, float lr, float mu,
                             bool nesterov) {
  DeviceGuard guard(ctx_.index());
  check_f32(var, "sgd_update", "var");
  check_f32(grad, "sgd_update", "grad");
  check_same_shape(var, grad, "sgd_update");
  float* buf = nullptr;
  if (momentum) {
    check_f32(*momentum, "sgd_update", "momentum");
    check_same_shape(var, *momentum, "sgd_update");
    buf = fptr(*momentum);
  }
  launch_sgd_update(fptr(var), fptr(grad), buf, var.numel(), lr, mu, nesterov, ctx_.stream());
}

void CudaKernels::adam_update(Tensor& var, Tensor& m, Tensor& v, const Tensor& grad, float lr,
                              float beta1, float beta2, float epsilon, int64_t step,
                              float grad_scale, float decay) {
  DeviceGuard guard(ctx_.index());
  check_f32(var, "adam_update", "var");
  check_f32(m, "adam_update", "m");
  check_f32(v, "adam_update", "v");
  check_f32(grad, "adam_update", "grad");
  check_same_shape(var, grad, "adam_update");
  check_same_shape(var, m, "adam_update");
  check_same_shape(var, v, "adam_update");
  if (step < 1)
    throw InvalidArgument(detail::str_cat("adam_update: step ", step,
                                          " must be >= 1 (count steps from 1, as Keras does)"));
  const double t = static_cast<double>(step);
  const float lr_t = static_cast<float>(lr * std::sqrt(1.0 - std::pow(double{beta2}, t)) /
                                        (1.0 - std::pow(double{beta1}, t)));
  launch_adam_update(fptr(var), fptr(m), fptr(v), fptr(grad), var.numel(), lr_t, beta1, beta2,
                     epsilon, grad_scale, decay, ctx_.stream());
}

}  // namespace dtrain::cuda
