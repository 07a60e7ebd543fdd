// Kernels: the numeric primitives one device type provides. The model layer's ops call these and
// never see oneDNN, cuDNN or cuBLAS. Layouts follow TensorFlow: activations NHWC, convolution
// filters HWIO ([kh, kw, in, out]), dense weights [in, out].
//
// Conventions: inputs are dense float32 tensors on the kernel's device unless a method says
// otherwise; outputs are newly allocated on the same device. Errors: InvalidArgument for shape or
// dtype mismatches (the message names both shapes). Thread-safety: a Kernels object may be called
// from several threads at once (implementations lock their primitive caches).
#pragma once

#include <cstdint>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

// kGeluErf: x * Phi(x) (Phi the standard normal CDF); kGeluTanh: GPT-2's approximation
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
enum class UnaryOp {
  kRelu,
  kTanh,
  kSigmoid,
  kNeg,
  kExp,
  kLog,
  kSquare,
  kSqrt,
  kAbs,
  kGeluErf,
  kGeluTanh
};
enum class BinaryOp { kAdd, kSub, kMul, kDiv, kMax, kMin };
enum class ReductionKind { kSum, kMean, kMax };

struct DTRAIN_API Conv2dParams {
  int stride_h = 1, stride_w = 1;
  int pad_top = 0, pad_bottom = 0, pad_left = 0, pad_right = 0;
  // conv2d's output in bfloat16 (the float32 sums rounded to nearest even) instead of float32: the
  // values a batch norm after it reads under mixed_bfloat16, without a float32 output to round
  // again (ops::conv2d sets it there, on devices whose hands_off_bfloat16() says so: the CPU, CUDA
  // GPUs from compute capability 8.0).
  bool bf16_output = false;
};

struct DTRAIN_API Pool2dParams {
  int window_h = 2, window_w = 2;
  int stride_h = 2, stride_w = 2;
  int pad_top = 0, pad_bottom = 0, pad_left = 0, pad_right = 0;
  // Max pooling then ReLU, in the pooling's own pass (relu(max) = the max or 0; a NaN stays NaN
  // and, as ReLU's gradient at NaN, passes no gradient). Only where Kernels::fuses_pool_relu();
  // other devices reject it.
  bool relu = false;
};

struct DTRAIN_API BatchNormForward {
  Tensor y;     // normalised output, shape of x
  Tensor mean;  // [C] batch mean
  Tensor var;   // [C] biased batch variance
};

struct DTRAIN_API BatchNormBackward {
  Tensor dx, dgamma, dbeta;
};

struct DTRAIN_API LayerNormForward {
  Tensor y;     // normalised, scaled and shifted, shape of x
  Tensor mean;  // [rows] (every dimension but the last, flattened)
  Tensor var;   // [rows] biased variance
};

struct DTRAIN_API LayerNormBackward {
  Tensor dx, dgamma, dbeta;
};

// What conv2d_max_pool2d keeps for its backward pass. A device that runs the pair in batch chunks
// (the CPU) keeps only the pooling's arg-max workspace, never the convolution's full output.
struct DTRAIN_API ConvPoolSaved {
  Tensor conv_out;    // the convolution's output, when the device keeps it (else undefined)
  Tensor workspace;   // the pooling's workspace (device-specific)
  Shape conv_shape;   // the convolution output's shape [N, OH, OW, Cout]
  int64_t chunk = 0;  // images per chunk (0: not chunked)
};

struct DTRAIN_API ConvPoolGrads {
  Tensor dx, dw, db;  // each defined only when asked for (db only with a bias)
};

class DTRAIN_API Kernels {
 public:
  virtual ~Kernels() = default;

  // --- convolution (x: [N,H,W,Cin], w: [KH,KW,Cin,Cout], bias: [Cout] or undefined) ---
  // Under mixed_bfloat16, on a device whose kept copies are bfloat16 (the CPU:
  // dtrain/core/precision.h), x and dy may be those bfloat16 copies: what the kernels read anyway,
  // made once for the forward and the backward pass (x) or for both gradients (dy; not with a
  // bias).
  virtual Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                        const Conv2dParams& p) = 0;
  // Whether these kernels take and give bfloat16 activations under mixed_bfloat16 (ops asks before
  // it hands any on, or keeps any): Conv2dParams::bf16_output, batch_norm_relu_training's y_dtype
  // and the batch norms' dx_dtype, and a bfloat16 x or dy where those outputs arrive (conv2d's x,
  // both of its backward kernels' x and dy, the batch norms' x and relu_mask); and the bfloat16
  // copies ops keeps for the backward pass (op_util.h's keep_for_backward): the operands of matmul
  // and batch_matmul, activation_backward's x_or_y, add_relu's `rounded`. The CPU's do; the CUDA
  // device's from compute capability 8.0 unless DTRAIN_CUDA_BF16_HANDOFFS=0.
  virtual bool hands_off_bfloat16() const { return false; }
  virtual Tensor conv2d_backward_input(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                                       const Conv2dParams& p) = 0;
  // Returns dw (shape of w); writes db ([Cout]) when want_bias.
  virtual Tensor conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Shape& w_shape,
                                        const Conv2dParams& p, bool want_bias, Tensor* db) = 0;

  // --- max pooling, NHWC. `workspace` is device-specific state the backward needs. ---
  // Whether max_pool2d and conv2d_max_pool2d take Pool2dParams::relu (the CPU's do).
  virtual bool fuses_pool_relu() const { return false; }
  virtual Tensor max_pool2d(const Tensor& x, const Pool2dParams& p, Tensor* workspace) = 0;
  virtual Tensor max_pool2d_backward(const Tensor& dy, const Tensor& x, const Tensor& workspace,
                                     const Pool2dParams& p) = 0;

  // --- convolution then max pooling, as one op ---
  // max_pool2d(conv2d(x, w, bias)). The default runs the two kernels; the CPU runs them a few
  // images at a time, so that the convolution's output (the largest tensor of a small CNN) stays in
  // the core's cache instead of making a round trip through memory, and is never kept whole.
  virtual Tensor conv2d_max_pool2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                                   const Conv2dParams& cp, const Pool2dParams& pp,
                                   ConvPoolSaved* saved);
  // The gradients of conv2d_max_pool2d for the pooled output's gradient dy: dx when want_dx, dw
  // (and db when has_bias) when want_dw.
  virtual ConvPoolGrads conv2d_max_pool2d_backward(const Tensor& dy, const Tensor& x,
                                                   const Tensor& w, bool has_bias,
                                                   const ConvPoolSaved& saved,
                                                   const Conv2dParams& cp, const Pool2dParams& pp,
                                                   bool want_dx, bool want_dw);

  // --- dense algebra ---
  // op(a) @ op(b) for 2-D a, b.
  virtual Tensor matmul(const Tensor& a, const Tensor& b, bool transpose_a, bool transpose_b) = 0;

  // Batched: a [B, M, K] ([B, K, M] when transpose_a), b [B, K, N] ([B, N, K] when transpose_b)
  // -> [B, M, N], each batch entry op(a[i]) @ op(b[i]) (the caller flattens leading dimensions).
  // Under mixed_bfloat16 the operands are rounded to bfloat16 as matmul's are.
  virtual Tensor batch_matmul(const Tensor& a, const Tensor& b, bool transpose_a,
                              bool transpose_b) = 0;

  // --- layout ---
  // x's dimensions reordered (numpy transpose): y.shape[i] = x.shape[perm[i]]; float32 or int32.
  virtual Tensor permute(const Tensor& x, const std::vector<int>& perm) = 0;
  // Rows of table [V, D] picked by int32 indices of any shape -> [indices..., D]. Throws
  // InvalidArgument naming the first index outside [0, V).
  virtual Tensor gather_rows(const Tensor& table, const Tensor& indices) = 0;
  // The gradient of gather_rows: [rows, D], row r the sum of dy's rows whose index is r, added in
  // the order the indices come (bitwise repeatable, independent of threads).
  virtual Tensor scatter_add_rows(const Tensor& dy, const Tensor& indices, int64_t rows) = 0;

  // --- elementwise ---
  virtual Tensor unary(UnaryOp op, const Tensor& x) = 0;
  // dL/dx for kRelu, kGeluErf and kGeluTanh (given x), kTanh and kSigmoid (given y = f(x)).
  virtual Tensor activation_backward(UnaryOp op, const Tensor& x_or_y, const Tensor& dy) = 0;
  // Numpy broadcasting between a and b.
  virtual Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) = 0;
  // relu(a + b) for a and b of one shape (a residual block's sum and ReLU). This default runs
  // binary() and unary(); the CPU does it in one pass over the data. With `rounded`, a device that
  // can also writes the output rounded to bfloat16 there in the same pass (the CPU, where it
  // streams the pass: the copy ops keep under mixed_bfloat16); otherwise *rounded is left as it is.
  virtual Tensor add_relu(const Tensor& a, const Tensor& b, Tensor* rounded = nullptr) {
    (void)rounded;
    return unary(UnaryOp::kRelu, binary(BinaryOp::kAdd, a, b));
  }
  // ReLU's gradient at y (as activation_backward(kRelu, y, dy)) of dy = a + b, for a, b of y's
  // shape: the gradient of a residual block's input, which arrives in two parts (the tape's
  // SumBackwardFn). This default runs binary() and activation_backward(); CUDA does it in one
  // pass, the sum never stored, with the same bits, and the CPU where its passes stream (4 MB and
  // more).
  virtual Tensor relu_grad_of_sum(const Tensor& y, const Tensor& a, const Tensor& b) {
    return activation_backward(UnaryOp::kRelu, y, binary(BinaryOp::kAdd, a, b));
  }
  // alpha * x + beta.
  virtual Tensor affine(const Tensor& x, float alpha, float beta) = 0;
  // Reduces over `axes` (unique, ascending); keeps size-1 dims when keepdims.
  virtual Tensor reduce(ReductionKind kind, const Tensor& x, const std::vector<int>& axes,
                        bool keepdims) = 0;
  // Copies x converted to dtype (float32 <-> float16/bfloat16/float64).
  virtual Tensor cast(const Tensor& x, DType dtype) = 0;
  virtual void fill(Tensor& x, float value) = 0;
  // Copies src's indices [src_begin, src_begin + count) along `axis` into dst's
  // [dst_begin, dst_begin + count) (every other dimension and the dtype equal; the caller checks).
  // The default makes one copy per index of the dimensions before `axis`, through the devices'
  // allocators (on the CPU, memcpy), so it is correct on any device.
  virtual void copy_slab(const Tensor& src, int axis, int64_t src_begin, Tensor& dst,
                         int64_t dst_begin, int64_t count);

  // --- losses ---
  // logits [N, C] float32, labels [N] int32 in [0, C). Writes per-example loss [N] and
  // softmax probabilities [N, C]. Throws InvalidArgument for a label out of range.
  virtual void softmax_cross_entropy(const Tensor& logits, const Tensor& labels, Tensor* loss,
                                     Tensor* probs) = 0;
  // (probs - onehot(labels)) * dloss[:, None].
  virtual Tensor softmax_cross_entropy_backward(const Tensor& probs, const Tensor& labels,
                                                const Tensor& dloss) = 0;

  // Softmax (log_softmax when `log`) over the last axis, numerically stable (max subtracted).
  virtual Tensor softmax(const Tensor& x, bool log) = 0;
  // dL/dx given y = softmax(x) (or log_softmax(x)) and dy.
  virtual Tensor softmax_backward(const Tensor& y, const Tensor& dy, bool log) = 0;
  // softmax over the last axis of x [..., T, S] plus a decoder's causal mask: mask_value added
  // where key j lies after query i (j > i, aligned at position 0 as Keras' mask), in float32 as
  // binary(kAdd) adds it, so the values are those of binary(kAdd, x, mask) then softmax, bit for
  // bit. Its gradient is softmax_backward's. This default makes the [T, S] mask on the host, copies
  // it to x's device at each call and runs those two kernels (a reference: ops never calls it); a
  // device that runs it as one kernel says so in fuses_causal_softmax (ops::causal_softmax
  // otherwise adds a mask it keeps per shape and device).
  virtual bool fuses_causal_softmax() const { return false; }
  virtual Tensor causal_softmax(const Tensor& x, float mask_value);

  // --- regularisation / normalisation ---
  // Layer normalisation over the last axis (x [..., C], gamma and beta [C]):
  // y = (x - mean) / sqrt(var + epsilon) * gamma + beta.
  virtual LayerNormForward layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      float epsilon) = 0;
  virtual LayerNormBackward layer_norm_backward(const Tensor& dy, const Tensor& x,
                                                const Tensor& gamma, const Tensor& mean,
                                                const Tensor& var, float epsilon) = 0;
  // Elementwise keep-mask scaled by 1/(1-rate): element i is kept iff
  // Philox(seed, stream).uniform(i) >= rate, so every device draws the same mask.
  virtual Tensor dropout_mask(const Shape& shape, float rate, uint64_t seed, uint64_t stream) = 0;
  // Channels-last batch norm over all but the last axis. Under mixed_bfloat16 the training passes'
  // x may be bfloat16: a copy ops keeps (the CPU), or a convolution's bfloat16 output
  // (hands_off_bfloat16: the CPU, CUDA).
  virtual BatchNormForward batch_norm_training(const Tensor& x, const Tensor& gamma,
                                               const Tensor& beta, float epsilon) = 0;
  virtual Tensor batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      const Tensor& mean, const Tensor& var, float epsilon) = 0;
  // `dx_dtype` kBFloat16: dx rounded to bfloat16 (nearest even; a NaN to 0x7fc0), for the
  // convolution before a batch norm whose input was its bfloat16 output, whose backward kernels
  // read the gradient so (the CPU writes it so in its last pass, CUDA in its dx kernel).
  virtual BatchNormBackward batch_norm_backward(const Tensor& dy, const Tensor& x,
                                                const Tensor& gamma, const Tensor& mean,
                                                const Tensor& var, float epsilon,
                                                DType dx_dtype = DType::kFloat32) = 0;
  // relu(batch_norm_training(x, ...)) as one op (TF's grappler makes the same fusion:
  // _FusedBatchNormEx with activation_mode "Relu"). `relu_mask` receives what the backward pass
  // needs to know where the output was positive, in the device's own form: the default runs the two
  // kernels and keeps the output itself; the CPU runs oneDNN's fused kernel (fuse_norm_relu), which
  // writes a bitmask (1/32 of y's bytes) and saves one pass over y in each direction, or on a
  // bfloat16 x its own loops, which keep the per-channel scale and shift ([2, C]) and compute y
  // again in the backward pass. `y_dtype` kBFloat16: y rounded to bfloat16 (nearest even), for a
  // convolution after it that reads it so under mixed_bfloat16 (the CPU writes it so in the
  // normalizing pass, CUDA in its normalising kernel, whose bfloat16 output is then its mask).
  virtual BatchNormForward batch_norm_relu_training(const Tensor& x, const Tensor& gamma,
                                                    const Tensor& beta, float epsilon,
                                                    Tensor* relu_mask,
                                                    DType y_dtype = DType::kFloat32);
  // The gradients of batch_norm_relu_training for its output's gradient dy (dx_dtype: as
  // batch_norm_backward's).
  virtual BatchNormBackward batch_norm_relu_backward(const Tensor& dy, const Tensor& x,
                                                     const Tensor& gamma, const Tensor& mean,
                                                     const Tensor& var, float epsilon,
                                                     const Tensor& relu_mask,
                                                     DType dx_dtype = DType::kFloat32);

  // --- optimizer updates, in place ---
  // SGD: with momentum m: buf = mu*buf + g; var -= lr * (nesterov ? g + mu*buf : buf).
  // Without momentum (momentum == nullptr): var -= lr * g.
  virtual void sgd_update(Tensor& var, const Tensor& grad, Tensor* momentum, float lr, float mu,
                          bool nesterov) = 0;
  // Adam (Kingma & Ba, with TF/Keras epsilon placement), with the gradient scaled by grad_scale
  // (clipping by norm) and the variable by decay (AdamW's 1 - lr * weight_decay) in the same pass:
  // g = grad_scale * grad; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  // var = decay * var - lr_t * m / (sqrt(v) + eps), lr_t = lr sqrt(1-b2^t)/(1-b1^t).
  // The same IEEE operations as scaling grad and var first, but one pass over memory instead of
  // three (GPT-2 small: 124 M weights, 7% of a step on one core).
  virtual void adam_update(Tensor& var, Tensor& m, Tensor& v, const Tensor& grad, float lr,
                           float beta1, float beta2, float epsilon, int64_t step, float grad_scale,
                           float decay) = 0;
};

// Output shape of a convolution / pooling window; throws InvalidArgument when it would be empty.
DTRAIN_API int64_t conv_output_size(int64_t in, int window, int stride, int pad_before,
                                    int pad_after);
// Numpy broadcast of two shapes; throws InvalidArgument naming both when incompatible.
DTRAIN_API Shape broadcast_shapes(const Shape& a, const Shape& b);

}  // namespace dtrain
