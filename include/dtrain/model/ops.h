// Differentiable tensor ops. Each runs on the device its inputs live on (via that device's
// Kernels) and records itself on active GradientTapes. Shapes follow TF: activations NHWC,
// conv filters HWIO, dense kernels [in, out]. Errors: InvalidArgument naming the op and shapes.
#pragma once

#include <cstdint>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"
#include "dtrain/devices/kernels.h"

namespace dtrain::ops {

// --- elementwise, numpy broadcasting ---
DTRAIN_API Tensor add(const Tensor& a, const Tensor& b);
DTRAIN_API Tensor sub(const Tensor& a, const Tensor& b);
DTRAIN_API Tensor mul(const Tensor& a, const Tensor& b);
DTRAIN_API Tensor div(const Tensor& a, const Tensor& b);
DTRAIN_API Tensor scale(const Tensor& x, float alpha);      // alpha * x
DTRAIN_API Tensor add_scalar(const Tensor& x, float beta);  // x + beta
DTRAIN_API Tensor neg(const Tensor& x);
DTRAIN_API Tensor exp(const Tensor& x);
DTRAIN_API Tensor log(const Tensor& x);
DTRAIN_API Tensor square(const Tensor& x);
DTRAIN_API Tensor sqrt(const Tensor& x);

// --- activations ---
DTRAIN_API Tensor relu(const Tensor& x);
// relu(a + b), the end of a residual block, as one op: one pass over the data instead of two, and
// the sum is never stored. a and b of one shape (other shapes: relu(add(a, b))); the same values
// and gradients as the two ops.
DTRAIN_API Tensor add_relu(const Tensor& a, const Tensor& b);
DTRAIN_API Tensor tanh(const Tensor& x);
DTRAIN_API Tensor sigmoid(const Tensor& x);

// --- linear algebra ---
// op(a) @ op(b). 2-D operands; or both of rank >= 3 with equal leading (batch) dimensions, each
// batch entry multiplied (tf.linalg.matmul, torch.bmm); or a of rank >= 3 ([..., K]) times a 2-D
// b (torch.matmul's broadcast of a weight matrix).
DTRAIN_API Tensor matmul(const Tensor& a, const Tensor& b, bool transpose_a = false,
                         bool transpose_b = false);
// The batched case of matmul (rank >= 3, equal batch dimensions).
DTRAIN_API Tensor batch_matmul(const Tensor& a, const Tensor& b, bool transpose_a = false,
                               bool transpose_b = false);
// x [..., C] + b [C].
DTRAIN_API Tensor bias_add(const Tensor& x, const Tensor& b);

// --- reductions (axes may be negative; empty axes = all) ---
DTRAIN_API Tensor sum(const Tensor& x, std::vector<int> axes = {}, bool keepdims = false);
DTRAIN_API Tensor mean(const Tensor& x, std::vector<int> axes = {}, bool keepdims = false);
// Sums g down to `shape` (undoes broadcasting).
DTRAIN_API Tensor sum_to_shape(const Tensor& g, const Shape& shape);

// --- shape ---
DTRAIN_API Tensor reshape(const Tensor& x, const Shape& shape);  // one dim may be -1
DTRAIN_API Tensor flatten(const Tensor& x);                      // [N, ...] -> [N, prod(...)]
DTRAIN_API Tensor stop_gradient(const Tensor& x);
DTRAIN_API Tensor cast(const Tensor& x, DType dtype);
DTRAIN_API Tensor ones_like(const Tensor& x);
DTRAIN_API Tensor zeros_like(const Tensor& x);

// The axes reordered (tf.transpose, numpy): y.shape[i] = x.shape[perm[i]]; empty perm reverses
// them; negative entries count from the end. float32 or int32.
DTRAIN_API Tensor transpose(const Tensor& x, std::vector<int> perm = {});

// --- joining and slicing (any rank; a negative axis counts from the end) ---
// Joins tensors whose shapes are equal but along `axis` (keras.layers.Concatenate, tf.concat).
// Throws InvalidArgument naming the first tensor that does not fit.
DTRAIN_API Tensor concat(const std::vector<Tensor>& xs, int axis);
// x's indices [begin, begin + size) along `axis` (a copy).
DTRAIN_API Tensor slice(const Tensor& x, int axis, int64_t begin, int64_t size);
// Cuts x along `axis` into pieces of `sizes`, which must add up to the dimension (tf.split).
DTRAIN_API std::vector<Tensor> split(const Tensor& x, int axis, const std::vector<int64_t>& sizes);
// NHWC zero padding of height and width (keras.layers.ZeroPadding2D).
DTRAIN_API Tensor zero_pad2d(const Tensor& x, int top, int bottom, int left, int right);

// --- neural network ---
enum class Padding { kValid, kSame };
DTRAIN_API Conv2dParams conv_params(const Shape& x, const Shape& w, int stride_h, int stride_w,
                                    Padding padding);
DTRAIN_API Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, int stride_h = 1,
                         int stride_w = 1, Padding padding = Padding::kValid);
// The same with explicit zero padding: torch.nn.Conv2d(padding=(h, w)) is pad_top = pad_bottom = h,
// pad_left = pad_right = w. (For a stride of 2 on an even input, TF's kSame pads one row at the
// end only, torch's padding=1 one on each side: the same output size, windows one row apart.)
// Throws InvalidArgument for a stride < 1, a negative pad or a filter larger than the padded input.
// params.bf16_output asks for a bfloat16 output (Conv2D::bfloat16_output): given under
// mixed_bfloat16 on a device that takes them (Kernels::hands_off_bfloat16: the CPU, a CUDA GPU)
// while one tape records the op, else the output is float32.
DTRAIN_API Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                         const Conv2dParams& params);
// NHWC max pooling as TF's max_pool2d. The gradient goes to each window's first maximum
// (row-major); a NaN in a window is its maximum on CPU and GPU (torch.nn.MaxPool2d's rule), so a
// NaN is never hidden by pooling.
DTRAIN_API Tensor max_pool2d(const Tensor& x, int window_h = 2, int window_w = 2, int stride_h = 2,
                             int stride_w = 2, Padding padding = Padding::kValid);
// NHWC average pooling as TF's avg_pool2d: with kSame padding each output divides by the number
// of input elements its window covers (padding not counted). Composed from conv2d (a fixed
// per-channel filter), so it runs and differentiates on every device.
DTRAIN_API Tensor avg_pool2d(const Tensor& x, int window_h = 2, int window_w = 2, int stride_h = 2,
                             int stride_w = 2, Padding padding = Padding::kValid);
// max_pool2d(conv2d(x, w, bias, stride, stride, conv_padding), window, window, pool_stride,
// pool_stride, pool_padding) as one op, with the same values and gradients up to the order in which
// the filter's gradient is summed over the batch. A CPU device runs it a few images at a time, so
// the convolution's output stays in cache and is never kept whole for the backward pass.
// relu: then ReLU, relu(max_pool2d(conv2d(...))) with the same values and gradients (ReLU commutes
// with max), in the pooling's own pass where the device fuses it (the CPU), else as ops::relu.
DTRAIN_API Tensor conv2d_max_pool2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                                    int stride, Padding conv_padding, int window, int pool_stride,
                                    Padding pool_padding, bool relu = false);
// --- attention and sequence models ---
// Softmax / log-softmax along `axis`, numerically stable (the maximum subtracted).
DTRAIN_API Tensor softmax(const Tensor& x, int axis = -1);
DTRAIN_API Tensor log_softmax(const Tensor& x, int axis = -1);
// Layer normalisation over the last axis (Ba et al. 2016; keras LayerNormalization(axis=-1)):
// (x - mean) / sqrt(var + epsilon) * gamma + beta, gamma and beta [C].
DTRAIN_API Tensor layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                             float epsilon = 1e-5f);
// GELU: exact x Phi(x), or with approximate the tanh form GPT-2 uses (keras.activations.gelu).
DTRAIN_API Tensor gelu(const Tensor& x, bool approximate = false);
// Rows of table [V, D] for int32 ids of any shape -> [ids..., D] (tf.nn.embedding_lookup). The
// gradient for the table is a scatter-add summed in id order: bitwise repeatable. An id outside
// [0, V) throws InvalidArgument naming it and its position.
DTRAIN_API Tensor embedding_lookup(const Tensor& table, const Tensor& ids);
// Additive value of a masked-out attention score (Keras' -1e9): exp underflows to exactly 0.
inline constexpr float kMaskValue = -1e9f;
// scores [..., T, S] with kMaskValue added where key j lies after query i (j > i): the causal
// mask of a decoder, as keras MultiHeadAttention(use_causal_mask=True) and PyTorch's
// scaled_dot_product_attention(is_causal=True) make it, for T != S too (aligned at position 0).
DTRAIN_API Tensor causal_mask(const Tensor& scores);
// softmax(causal_mask(scores), -1) as one op: the same values bit for bit, and one pass over the
// scores instead of two on a device that fuses it (the CUDA device; the CPU adds the mask first).
// Like PyTorch's scaled_dot_product_attention(is_causal=True) without the products.
DTRAIN_API Tensor causal_softmax(const Tensor& scores);
// Sparse softmax cross-entropy of every position: logits [..., V], int32 labels [...] -> [...]
// (the per-token losses of a language model, [batch, time]).
DTRAIN_API Tensor sequence_cross_entropy(const Tensor& logits, const Tensor& labels);

// Per-example sparse softmax cross-entropy: logits [N, C], labels int32 [N] -> [N].
DTRAIN_API Tensor sparse_softmax_cross_entropy(const Tensor& logits, const Tensor& labels);
// Per-example mean squared error over the last axis: [N, ...] -> [N].
DTRAIN_API Tensor mean_squared_error(const Tensor& pred, const Tensor& target);
// Inverted dropout with a Philox mask drawn from (seed, stream); identity when !training or rate 0.
DTRAIN_API Tensor dropout(const Tensor& x, float rate, bool training, uint64_t seed,
                          uint64_t stream);
// Training-mode batch norm over all but the last axis; returns y and writes batch mean/var.
DTRAIN_API Tensor batch_norm_training(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      float epsilon, Tensor* batch_mean, Tensor* batch_var);
DTRAIN_API Tensor batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                       const Tensor& mean, const Tensor& var, float epsilon);
// relu(batch_norm_training(...)) as one op, the same values (TF's grappler fuses FusedBatchNorm and
// Relu into _FusedBatchNormEx the same way): on the CPU one pass over the data each way instead of
// two, and the ReLU's backward pass reads a bitmask instead of the output.
// `bf16_output` asks for y in bfloat16, as conv2d's params.bf16_output (and given under the same
// conditions): BatchNormalization::bfloat16_output.
DTRAIN_API Tensor batch_norm_relu_training(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                           float epsilon, Tensor* batch_mean, Tensor* batch_var,
                                           bool bf16_output = false);

}  // namespace dtrain::ops
