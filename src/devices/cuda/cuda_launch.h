// Host-callable launchers for dtrain's own CUDA kernels (the *.cu files in this folder). They take
// raw device pointers and enqueue work on the given stream without waiting; argument checking is
// done by CudaKernels before it calls them. Element counts of zero launch nothing. Each launcher
// throws Internal if the launch itself fails.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dtrain/core/dtype.h"
#include "dtrain/devices/kernels.h"

namespace dtrain::cuda {

class CudaContext;

constexpr int kMaxDims = 8;

// --- cuda_elementwise.cu ---
void launch_unary(UnaryOp op, const float* x, float* y, int64_t n, cudaStream_t s);
// x_or_y float32 or bfloat16 (xy_type: a copy kept under mixed_bfloat16).
void launch_activation_backward(UnaryOp op, const void* x_or_y, DType xy_type, const float* dy,
                                float* dx, int64_t n, cudaStream_t s);
// Output shape out_dims (rank <= kMaxDims); a_strides/b_strides are element strides of a and b
// laid over the output's dimensions, 0 where that input is broadcast.
struct BroadcastGeometry {
  int rank = 0;
  int64_t out_dims[kMaxDims] = {};
  int64_t a_strides[kMaxDims] = {};
  int64_t b_strides[kMaxDims] = {};
};
// out = a op b elementwise; geometry == nullptr means a, b and out all have n elements.
void launch_binary(BinaryOp op, const float* a, const float* b, float* out, int64_t n,
                   const BroadcastGeometry* geometry, cudaStream_t s);
// out = relu(a + b) over n elements in one pass: binary(kAdd) then unary(kRelu), bit for bit;
// with `rounded` (bfloat16 bits, or null), also out rounded to bfloat16 in the same pass.
void launch_add_relu(const float* a, const float* b, float* out, uint16_t* rounded, int64_t n,
                     cudaStream_t s);
// dx = ReLU's gradient at y (float32, or a kept bfloat16 copy) of a + b, in one pass: the bits of
// launch_binary(kAdd) then launch_activation_backward(kRelu).
void launch_relu_grad_of_sum(const void* y, DType y_type, const float* a, const float* b, float* dx,
                             int64_t n, cudaStream_t s);
void launch_affine(const float* x, float* y, int64_t n, float alpha, float beta, cudaStream_t s);
// Sets n elements of type dtype to value (converted as a C++ static_cast / the host's rounding).
void launch_fill(void* x, DType dtype, int64_t n, float value, cudaStream_t s);
// Converts n elements; float16/bfloat16 narrowing rounds exactly like float_to_f16/float_to_bf16.
void launch_cast(const void* x, DType from, void* y, DType to, int64_t n, cudaStream_t s);
// y = x rounded to bfloat16 (as float_to_bf16: to nearest, ties to even), kept as float32: the
// operands of a product under the mixed_bfloat16 policy. y may be x.
void launch_round_to_bf16(const float* x, float* y, int64_t n, cudaStream_t s);
// y[r, c] += bias[c] for a row-major [rows, cols] matrix.
void launch_add_bias(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t s);

// --- cuda_layout.cu ---
// y[n, h, w, c] = x[n, h - top, w - left, c] inside x, else value; y is [N, Hp, Wp, C]. x and y
// are float32, or bfloat16 (value 0 only).
void launch_pad_nhwc(const void* x, void* y, DType dtype, int64_t N, int64_t H, int64_t W,
                     int64_t C, int64_t top, int64_t left, int64_t Hp, int64_t Wp, float value,
                     cudaStream_t s);
// x[n, h, w, c] = xp[n, h + top, w + left, c]; the inverse window of launch_pad_nhwc.
void launch_crop_nhwc(const float* xp, float* x, int64_t N, int64_t H, int64_t W, int64_t C,
                      int64_t top, int64_t left, int64_t Hp, int64_t Wp, cudaStream_t s);
// xs[n, i, j, c] = x[n, i * sh, j * sw, c] for xs [N, OH, OW, C] (a strided 1x1 convolution's
// input; float32 or bfloat16); launch_upsample_zero_nhwc is its adjoint (float32): x gets xs at
// those positions and 0 elsewhere.
void launch_subsample_nhwc(const void* x, void* xs, DType dtype, int64_t N, int64_t H, int64_t W,
                           int64_t C, int64_t OH, int64_t OW, int64_t sh, int64_t sw,
                           cudaStream_t s);
void launch_upsample_zero_nhwc(const float* xs, float* x, int64_t N, int64_t H, int64_t W,
                               int64_t C, int64_t OH, int64_t OW, int64_t sh, int64_t sw,
                               cudaStream_t s);
// y = x transposed: y's dimension i is x's dimension perm[i] (rank <= kMaxDims).
void launch_permute(const float* x, float* y, int rank, const int64_t* x_dims, const int* perm,
                    cudaStream_t s);

// --- cuda_transformer.cu: rows x c matrices, the last axis contiguous ---
void launch_softmax(const float* x, float* y, int64_t rows, int64_t c, bool log, cudaStream_t s);
// softmax over rows of c of x [rows / t, t, c] with mask_value added where key j > row % t, as
// binary(kAdd) with the causal mask then softmax, bit for bit.
void launch_causal_softmax(const float* x, float* y, int64_t rows, int64_t t, int64_t c,
                           float mask_value, cudaStream_t s);
void launch_softmax_backward(const float* y, const float* dy, float* dx, int64_t rows, int64_t c,
                             bool log, cudaStream_t s);
void launch_layer_norm(const float* x, const float* gamma, const float* beta, float* y, float* mean,
                       float* var, int64_t rows, int64_t c, float eps, cudaStream_t s);
void launch_layer_norm_backward(const float* dy, const float* x, const float* gamma,
                                const float* mean, const float* var, float* dx, float* dgamma,
                                float* dbeta, int64_t rows, int64_t c, float eps, CudaContext& ctx);
void launch_gather_rows(const float* table, const int32_t* idx, float* out, int64_t n, int64_t d,
                        cudaStream_t s);
// order/starts: dy's rows grouped by target row, in index order (built on the host).
void launch_scatter_add_rows(const float* dy, const int32_t* order, const int64_t* starts,
                             float* out, int64_t rows, int64_t d, cudaStream_t s);

// --- cuda_reduce.cu ---
// A reduction after adjacent dimensions of the same kind were merged and size-1 ones dropped:
// output element c and reduced element r address x at
//   sum_i coord_i(c) * kept_strides[i] + sum_j coord_j(r) * red_strides[j].
struct ReduceGeometry {
  int kept_rank = 0;
  int64_t kept_dims[kMaxDims] = {};
  int64_t kept_strides[kMaxDims] = {};
  int red_rank = 0;
  int64_t red_dims[kMaxDims] = {};
  int64_t red_strides[kMaxDims] = {};
  int64_t num_out = 1;  // product of kept_dims
  int64_t num_red = 1;  // product of red_dims
};
// out[c] = sum/mean/max over r; out has num_out elements.
void launch_reduce(ReductionKind kind, const float* x, float* out, const ReduceGeometry& g,
                   CudaContext& ctx);
// out[c] = sum_r x[r, c] for a row-major [rows, cols] matrix.
void launch_column_sum(const float* x, float* out, int64_t rows, int64_t cols, CudaContext& ctx);

// --- cuda_loss.cu ---
// logits/probs [n, c]; loss [n] (either output may be null). Labels must already be in [0, c).
void launch_softmax_xent(const float* logits, const int32_t* labels, float* loss, float* probs,
                         int64_t n, int64_t c, cudaStream_t s);
// dx = (probs - onehot(labels)) * dloss[:, None]. Labels outside [0, c) give no one-hot entry.
void launch_softmax_xent_backward(const float* probs, const int32_t* labels, const float* dloss,
                                  float* dx, int64_t n, int64_t c, cudaStream_t s);

// --- cuda_random.cu ---
// out[i] = Philox(seed, stream).uniform(i) >= rate ? scale : 0 (the CPU's exact stream).
void launch_dropout_mask(float* out, int64_t n, float rate, float scale, uint64_t seed,
                         uint64_t stream, cudaStream_t s);

// --- cuda_batch_norm.cu (x viewed as [rows, C], channels last) ---
// false under DTRAIN_CUDA_BN=two_pass: the two-pass kernels (as before 2026-11-29, but with dy *
// xhat rounded before it is summed), for comparisons. Read at each call; the callers pass what
// they read to the launches below (one_pass).
bool bn_one_pass();
// Batch mean and biased variance per channel: one read of x (Welford's update on x less the
// channel's first value, partial results merged in a fixed order), or with !one_pass two (the
// mean, then the squared deviations from it; float32 x only). rows > 0. x is float32 or bfloat16
// (x_type).
void launch_bn_stats(const void* x, DType x_type, int64_t rows, int64_t C, float* mean, float* var,
                     bool one_pass, CudaContext& ctx);
// y = (x - mean) / sqrt(var + eps) * gamma + beta; with relu, relu(y) in the same pass. x and y
// are float32 or bfloat16 (y rounded to nearest even).
void launch_bn_apply(const void* x, DType x_type, const float* mean, const float* var,
                     const float* gamma, const float* beta, float eps, void* y, DType y_type,
                     int64_t rows, int64_t C, bool relu, cudaStream_t s);
// dx, dgamma and dbeta for the output gradient dy: dbeta and dgamma in one pass over dy and x, or
// with !one_pass in two reductions (the same sums, bit for bit; float32 x only). relu_y non-null
// (one_pass only): dy is the gradient of relu(y) for batch_norm_relu_training's output relu_y,
// taken where relu_y > 0 as it is read. x, relu_y and dx are float32 or bfloat16 (their types).
void launch_bn_backward(const float* dy, const void* relu_y, DType relu_y_type, const void* x,
                        DType x_type, const float* gamma, const float* mean, const float* var,
                        float eps, void* dx, DType dx_type, float* dgamma, float* dbeta,
                        int64_t rows, int64_t C, bool one_pass, CudaContext& ctx);

// --- cuda_optim.cu (in place) ---
// momentum == nullptr: var -= lr * g. Else buf = mu*buf + g; var -= lr*(nesterov ? g + mu*buf :
// buf).
void launch_sgd_update(float* var, const float* grad, float* momentum, int64_t n, float lr,
                       float mu, bool nesterov, cudaStream_t s);
// g = grad_scale grad; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// var = decay var - lr_t m / (sqrt(v) + eps).
void launch_adam_update(float* var, float* m, float* v, const float* grad, int64_t n, float lr_t,
                        float beta1, float beta2, float epsilon, float grad_scale, float decay,
                        cudaStream_t s);

}  // namespace dtrain::cuda
