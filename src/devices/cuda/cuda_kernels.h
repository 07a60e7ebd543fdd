// CudaKernels: the Kernels interface on one GPU — cuDNN for convolution and pooling, cuBLAS for
// matmul, and dtrain's own CUDA kernels (src/devices/cuda/*.cu) for everything else.
//
// Semantics are those documented in include/dtrain/devices/kernels.h and match the CPU device
// (dropout masks, casts and fills bit for bit, everything else to float32 rounding). Each method
// makes this GPU the calling thread's current device, checks its arguments on the host, and
// enqueues its work on the device stream without waiting, except where a result must be
// host-visible (label validation in softmax_cross_entropy). Thread-safety: callable from any
// thread; see CudaContext for the locks.
//
// The methods are defined in several files by concept: cuda_kernels.cc (elementwise, reduce,
// cast, fill), cuda_nn.cc (losses, dropout, batch norm, optimizers), cuda_conv.cc (convolution),
// cuda_pool.cc (max pooling), cuda_matmul.cc (cuBLAS).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "devices/cuda/cuda_context.h"
#include "devices/cuda/cuda_conv_plan.h"
#include "devices/cuda/cuda_gemm.h"
#include "dtrain/devices/kernels.h"

namespace dtrain::cuda {

class CudaKernels final : public Kernels {
 public:
  explicit CudaKernels(CudaContext& ctx) : ctx_(ctx), conv_plans_(ctx) {}

  Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                const Conv2dParams& p) override;
  Tensor conv2d_backward_input(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                               const Conv2dParams& p) override;
  Tensor conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Shape& w_shape,
                                const Conv2dParams& p, bool want_bias, Tensor* db) override;

  Tensor max_pool2d(const Tensor& x, const Pool2dParams& p, Tensor* workspace) override;
  Tensor max_pool2d_backward(const Tensor& dy, const Tensor& x, const Tensor& workspace,
                             const Pool2dParams& p) override;

  Tensor matmul(const Tensor& a, const Tensor& b, bool transpose_a, bool transpose_b) override;

  Tensor batch_matmul(const Tensor& a, const Tensor& b, bool transpose_a,
                      bool transpose_b) override;
  Tensor permute(const Tensor& x, const std::vector<int>& perm) override;
  Tensor gather_rows(const Tensor& table, const Tensor& indices) override;
  Tensor scatter_add_rows(const Tensor& dy, const Tensor& indices, int64_t rows) override;
  Tensor softmax(const Tensor& x, bool log) override;
  Tensor softmax_backward(const Tensor& y, const Tensor& dy, bool log) override;
  // One kernel: the mask is worked out from each row's index, never read.
  bool fuses_causal_softmax() const override { return true; }
  // From compute capability 8.0 (bfloat16 tensor cores), unless DTRAIN_CUDA_BF16_HANDOFFS=0 (read
  // once; for comparisons): the convolutions write bfloat16 for the batch norms after them and
  // read bfloat16 from those with ReLU, and the batch norms' dx is bfloat16 where their x was.
  bool hands_off_bfloat16() const override;
  Tensor causal_softmax(const Tensor& x, float mask_value) override;
  LayerNormForward layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                              float epsilon) override;
  LayerNormBackward layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                        const Tensor& mean, const Tensor& var,
                                        float epsilon) override;
  Tensor unary(UnaryOp op, const Tensor& x) override;
  Tensor activation_backward(UnaryOp op, const Tensor& x_or_y, const Tensor& dy) override;
  Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) override;
  // One pass (the sum is never stored); with `rounded`, its bfloat16 copy in the same pass.
  Tensor add_relu(const Tensor& a, const Tensor& b, Tensor* rounded = nullptr) override;
  Tensor relu_grad_of_sum(const Tensor& y, const Tensor& a, const Tensor& b) override;
  Tensor affine(const Tensor& x, float alpha, float beta) override;
  Tensor reduce(ReductionKind kind, const Tensor& x, const std::vector<int>& axes,
                bool keepdims) override;
  Tensor cast(const Tensor& x, DType dtype) override;
  void fill(Tensor& x, float value) override;
  void copy_slab(const Tensor& src, int axis, int64_t src_begin, Tensor& dst, int64_t dst_begin,
                 int64_t count) override;

  void softmax_cross_entropy(const Tensor& logits, const Tensor& labels, Tensor* loss,
                             Tensor* probs) override;
  Tensor softmax_cross_entropy_backward(const Tensor& probs, const Tensor& labels,
                                        const Tensor& dloss) override;

  Tensor dropout_mask(const Shape& shape, float rate, uint64_t seed, uint64_t stream) override;
  BatchNormForward batch_norm_training(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                       float epsilon) override;
  // The ReLU fused into the normalisation's pass (the mask is the output, which the backward pass
  // reads beside dy).
  BatchNormForward batch_norm_relu_training(const Tensor& x, const Tensor& gamma,
                                            const Tensor& beta, float epsilon, Tensor* relu_mask,
                                            DType y_dtype = DType::kFloat32) override;
  Tensor batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                              const Tensor& mean, const Tensor& var, float epsilon) override;
  BatchNormBackward batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                        const Tensor& mean, const Tensor& var, float epsilon,
                                        DType dx_dtype = DType::kFloat32) override;
  BatchNormBackward batch_norm_relu_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                             const Tensor& mean, const Tensor& var, float epsilon,
                                             const Tensor& relu_mask,
                                             DType dx_dtype = DType::kFloat32) override;

  void sgd_update(Tensor& var, const Tensor& grad, Tensor* momentum, float lr, float mu,
                  bool nesterov) override;
  void adam_update(Tensor& var, Tensor& m, Tensor& v, const Tensor& grad, float lr, float beta1,
                   float beta2, float epsilon, int64_t step, float grad_scale,
                   float decay) override;

 private:
  // batch_norm_training, with relu(y) written in the same pass when relu; y in y_dtype (float32
  // or bfloat16), x float32 or bfloat16.
  BatchNormForward bn_training(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                               float epsilon, bool relu, DType y_dtype, const char* op);
  // batch_norm_backward; with relu_mask, of relu(y) for batch_norm_relu_training's output y
  // (float32 or bfloat16). dx in dx_dtype.
  BatchNormBackward bn_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                const Tensor& mean, const Tensor& var, float epsilon,
                                const Tensor* relu_mask, DType dx_dtype, const char* op);
  // Throws InvalidArgument unless t is defined and lives on this GPU.
  void check_device(const Tensor& t, const char* op, const char* arg) const;
  // check_device plus dtype float32.
  void check_f32(const Tensor& t, const char* op, const char* arg) const;
  // check_device plus dtype float32 or bfloat16: where a bfloat16 activation may arrive
  // (hands_off_bfloat16).
  void check_activation(const Tensor& t, const char* op, const char* arg) const;
  // product_operand of t in float32: a bfloat16 t widened (its values are bfloat16's already).
  Tensor rounded_f32(const Tensor& t) const;
  // t in float32 (a widened copy of a bfloat16 t), or in bfloat16 (a copy rounded to nearest
  // even, as gemm_operand's): t itself where it already is.
  Tensor as_dtype(const Tensor& t, DType dtype) const;
  // The operand a cuDNN convolution reads (and a cuBLAS product on GPUs before compute capability
  // 8.0): under the mixed_bfloat16 policy (core/precision.h) a copy of t rounded to bfloat16 and
  // kept as float32, else t itself.
  Tensor product_operand(const Tensor& t) const;
  // How this call's cuBLAS products multiply (cuda_gemm.h): bfloat16 operands under mixed_bfloat16,
  // TF32 with enable_tensor_float_32_execution, else float32; float32 on GPUs older than
  // compute capability 8.0 (under mixed_bfloat16 with product_operand's rounded operands there).
  // Read once per op, so that the operands' dtype and the math agree (the policy is meant to be set
  // before training; one set during an op may leave its operands rounded differently).
  GemmMath gemm_math() const;
  // The operand a cuBLAS product under `math` reads: for GemmMath::kBFloat16, t in bfloat16 (a
  // bfloat16 t as it is, else a copy rounded to nearest, ties to even, as product_operand rounds);
  // else product_operand of t in float32.
  Tensor gemm_operand(const Tensor& t, GemmMath math) const;
  // Whether convolutions run on tensor cores as TensorFloat-32: under mixed_bfloat16
  // (TF32 holds its rounded operands exactly, so the products are bfloat16's, accumulated in
  // float32) or with enable_tensor_float_32_execution, on GPUs of compute capability 8.0 and later.
  // Elsewhere they run float32, with the same rounded operands under mixed_bfloat16. (cuDNN's
  // convolutions; cuBLAS's products follow gemm_math.)
  bool tensor_cores() const;
  // Throws InvalidArgument naming both shapes unless they are equal.
  static void check_same_shape(const Tensor& a, const Tensor& b, const char* op);
  Tensor empty(const Shape& shape, DType dtype = DType::kFloat32) const;
  // Zero-pads (conv, value 0) or -inf-pads (pooling) an NHWC tensor spatially.
  Tensor pad_nhwc(const Tensor& x, int top, int bottom, int left, int right, float value);
  // x[:, ::sh, ::sw, :] cut to [N, oh, ow, C] (x itself when both strides are 1).
  Tensor subsample_nhwc(const Tensor& x, int64_t oh, int64_t ow, int sh, int sw);

  // A legacy-API cuDNN algorithm choice (used when no graph-API plan qualifies), cached by problem
  // (kind, shapes, params): the heuristics query is much slower than the convolution itself for
  // small layers.
  using AlgoKey = std::vector<int64_t>;
  int cached_algo(const AlgoKey& key) const;  // -1 when unknown
  void remember_algo(const AlgoKey& key, int algo);
  // Direction d of problem p on bfloat16 operands (mixed_bfloat16's products on bfloat16 tensor
  // cores), from a cuDNN plan for exactly these types: a and b are the direction's inputs in
  // bfloat16 (forward x and the KRSC filter, backward data the filter and dy, backward filter x and
  // dy), `out` its output, float32 or bfloat16 as its dtype. A float32 output for which cuDNN has
  // no plan (its documented bfloat16 configurations have a bfloat16 output) is written in bfloat16
  // and widened, as PyTorch's autocast leaves its convolutions' outputs and gradients in bfloat16;
  // faster than the float32 path on TF32 tensor cores, which reads and writes twice the bytes.
  // Not with widen = false (a forward convolution whose bias is added after: the sum would be
  // rounded before the bias, and a bfloat16 result rounded twice). False, doing nothing, when cuDNN
  // has no qualifying engine for either (the caller then runs the float32 path on the rounded
  // values).
  bool bf16_conv(ConvDirection d, const ConvPlanProblem& p, const Tensor& a, const Tensor& b,
                 Tensor& out, bool widen = true);
  // False when bf16_conv already knows it has no plan for direction d of p with an `out` output
  // (nor, for a float32 one it may widen, a bfloat16 output): callers skip converting operands.
  bool bf16_conv_may_run(ConvDirection d, const ConvPlanProblem& p, DType out, bool widen = true);
  // bf16_conv's types: bfloat16 inputs, `out` for the output.
  static ConvTypes bf16_types(ConvDirection d, DType out);
  // False under DTRAIN_CUDNN_BF16=0 (read once): bf16_conv is never tried, and cuDNN's
  // convolutions run on rounded float32 operands under mixed_bfloat16 (TF32), as before
  // 2026-11-29; for comparisons.
  static bool cudnn_bf16();
  // Direction d of problem p on cuDNN's legacy calls (cuda_conv_legacy.h), with the choice cached.
  void legacy_conv(ConvDirection d, const ConvPlanProblem& p, bool tc, const void* a, const void* b,
                   void* out, const char* op, const std::string& problem);

  CudaContext& ctx_;
  ConvPlanCache conv_plans_;  // cuDNN graph-API plans, tried before the legacy algorithms
  mutable std::mutex algo_mu_;
  std::map<AlgoKey, int> algo_cache_;
  std::set<AlgoKey> widened_;  // problems bf16_conv widened, each logged once (under algo_mu_)
};

}  // namespace dtrain::cuda
