// Differentiable tensor ops. Each runs on the device its inputs live on (via that device's
// Kernels) and records itself on active GradientTapes. Shapes follow TF: activations NHWC,
// conv filters HWIO, dense kernels [in, out]. Errors: InvalidArgument naming the op and shapes.
#pragma once

#include <cstdint>
#include <vector>

#include "dtrain/core/tensor.h"
#include "dtrain/devices/kernels.h"

namespace dtrain::ops {

// --- elementwise, numpy broadcasting ---
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor scale(const Tensor& x, float alpha);             // alpha * x
Tensor add_scalar(const Tensor& x, float beta);         // x + beta
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor square(const Tensor& x);
Tensor sqrt(const Tensor& x);

// --- activations ---
Tensor relu(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);

// --- linear algebra ---
Tensor matmul(const Tensor& a, const Tensor& b, bool transpose_a = false, bool transpose_b = false);
// x [..., C] + b [C].
Tensor bias_add(const Tensor& x, const Tensor& b);

// --- reductions (axes may be negative; empty axes = all) ---
Tensor sum(const Tensor& x, std::vector<int> axes = {}, bool keepdims = false);
Tensor mean(const Tensor& x, std::vector<int> axes = {}, bool keepdims = false);
// Sums g down to `shape` (undoes broadcasting).
Tensor sum_to_shape(const Tensor& g, const Shape& shape);

// --- shape ---
Tensor reshape(const Tensor& x, const Shape& shape);  // one dim may be -1
Tensor flatten(const Tensor& x);                       // [N, ...] -> [N, prod(...)]
Tensor stop_gradient(const Tensor& x);
Tensor cast(const Tensor& x, DType dtype);
Tensor ones_like(const Tensor& x);
Tensor zeros_like(const Tensor& x);

// --- neural network ---
enum class Padding { kValid, kSame };
Conv2dParams conv_params(const Shape& x, const Shape& w, int stride_h, int stride_w, Padding padding);
Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, int stride_h = 1,
              int stride_w = 1, Padding padding = Padding::kValid);
Tensor max_pool2d(const Tensor& x, int window_h = 2, int window_w = 2, int stride_h = 2,
                  int stride_w = 2, Padding padding = Padding::kValid);
// Per-example sparse softmax cross-entropy: logits [N, C], labels int32 [N] -> [N].
Tensor sparse_softmax_cross_entropy(const Tensor& logits, const Tensor& labels);
// Per-example mean squared error over the last axis: [N, ...] -> [N].
Tensor mean_squared_error(const Tensor& pred, const Tensor& target);
// Inverted dropout with a Philox mask drawn from (seed, stream); identity when !training or rate 0.
Tensor dropout(const Tensor& x, float rate, bool training, uint64_t seed, uint64_t stream);
// Training-mode batch norm over all but the last axis; returns y and writes batch mean/var.
Tensor batch_norm_training(const Tensor& x, const Tensor& gamma, const Tensor& beta, float epsilon,
                           Tensor* batch_mean, Tensor* batch_var);
Tensor batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                            const Tensor& mean, const Tensor& var, float epsilon);

}  // namespace dtrain::ops
