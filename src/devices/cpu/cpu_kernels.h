// CpuKernels: the Kernels of one logical CPU device. Convolution, matmul, eltwise, binary,
// reduction, batch norm and reorders are oneDNN primitives, created once per shape and cached; the
// things oneDNN has no primitive for (the fused softmax cross-entropy, Philox dropout masks,
// optimizer updates) or runs slowly (max pooling on channels-last data: cpu_pool.h) are loops of
// our own, vectorised by hand (AVX-512) or by the compiler.
//
// Thread-safety: the primitive cache is guarded by a mutex; primitives execute on the calling
// thread with the device's thread count (set as the calling thread's OpenMP thread count).
#pragma once

// Function multiversioning: an ifunc picks a clone for this CPU when the library is loaded. The
// ifunc cannot see DTRAIN_MAX_CPU_ISA, so clones are AVX2 and baseline only: loops built for
// AVX-512 pick their build at first use under the cap (cpu_supports), so that a cap of AVX2 (the
// AVX2-only CPUs' stand-in) runs no AVX-512. A cap below AVX2 (tests only) still runs the AVX2
// clones, whose results are the baseline's: no FMA contraction in them.
// ThreadSanitizer instruments that resolver, which the dynamic loader runs before TSan's runtime
// exists (a crash at load), so TSan builds (DTRAIN_SANITIZE=thread) get the portable clone only.
#if defined(__SANITIZE_THREAD__)
#define DTRAIN_TARGET_CLONES(...)
#else
#define DTRAIN_TARGET_CLONES(...) __attribute__((target_clones(__VA_ARGS__)))
#endif

#include <memory>
#include <utility>

#include "dtrain/devices/kernels.h"

namespace dtrain::cpu {

class CpuKernels final : public Kernels {
 public:
  // threads: the device's intra-op threads; every primitive runs with that many, on any thread.
  CpuKernels(DeviceSpec spec, int threads);
  ~CpuKernels() override;

  Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                const Conv2dParams& p) override;
  Tensor conv2d_backward_input(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                               const Conv2dParams& p) override;
  Tensor conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Shape& w_shape,
                                const Conv2dParams& p, bool want_bias, Tensor* db) override;
  bool fuses_pool_relu() const override { return true; }
  bool hands_off_bfloat16() const override { return true; }
  Tensor max_pool2d(const Tensor& x, const Pool2dParams& p, Tensor* workspace) override;
  Tensor max_pool2d_backward(const Tensor& dy, const Tensor& x, const Tensor& workspace,
                             const Pool2dParams& p) override;
  Tensor conv2d_max_pool2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                           const Conv2dParams& cp, const Pool2dParams& pp,
                           ConvPoolSaved* saved) override;
  ConvPoolGrads conv2d_max_pool2d_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                           bool has_bias, const ConvPoolSaved& saved,
                                           const Conv2dParams& cp, const Pool2dParams& pp,
                                           bool want_dx, bool want_dw) override;
  Tensor matmul(const Tensor& a, const Tensor& b, bool transpose_a, bool transpose_b) override;
  Tensor batch_matmul(const Tensor& a, const Tensor& b, bool transpose_a,
                      bool transpose_b) override;
  Tensor permute(const Tensor& x, const std::vector<int>& perm) override;
  Tensor gather_rows(const Tensor& table, const Tensor& indices) override;
  Tensor scatter_add_rows(const Tensor& dy, const Tensor& indices, int64_t rows) override;
  Tensor softmax(const Tensor& x, bool log) override;
  Tensor softmax_backward(const Tensor& y, const Tensor& dy, bool log) override;
  LayerNormForward layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                              float epsilon) override;
  LayerNormBackward layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                        const Tensor& mean, const Tensor& var,
                                        float epsilon) override;
  Tensor unary(UnaryOp op, const Tensor& x) override;
  Tensor activation_backward(UnaryOp op, const Tensor& x_or_y, const Tensor& dy) override;
  Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) override;
  Tensor add_relu(const Tensor& a, const Tensor& b, Tensor* rounded = nullptr) override;
  Tensor relu_grad_of_sum(const Tensor& y, const Tensor& a, const Tensor& b) override;
  Tensor affine(const Tensor& x, float alpha, float beta) override;
  Tensor reduce(ReductionKind kind, const Tensor& x, const std::vector<int>& axes,
                bool keepdims) override;
  Tensor cast(const Tensor& x, DType dtype) override;
  void fill(Tensor& x, float value) override;
  void softmax_cross_entropy(const Tensor& logits, const Tensor& labels, Tensor* loss,
                             Tensor* probs) override;
  Tensor softmax_cross_entropy_backward(const Tensor& probs, const Tensor& labels,
                                        const Tensor& dloss) override;
  Tensor dropout_mask(const Shape& shape, float rate, uint64_t seed, uint64_t stream) override;
  BatchNormForward batch_norm_training(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                       float epsilon) override;
  Tensor batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                              const Tensor& mean, const Tensor& var, float epsilon) override;
  BatchNormBackward batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                        const Tensor& mean, const Tensor& var, float epsilon,
                                        DType dx_dtype = DType::kFloat32) override;
  BatchNormForward batch_norm_relu_training(const Tensor& x, const Tensor& gamma,
                                            const Tensor& beta, float epsilon, Tensor* relu_mask,
                                            DType y_dtype = DType::kFloat32) override;
  BatchNormBackward batch_norm_relu_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                             const Tensor& mean, const Tensor& var, float epsilon,
                                             const Tensor& relu_mask,
                                             DType dx_dtype = DType::kFloat32) override;
  void sgd_update(Tensor& var, const Tensor& grad, Tensor* momentum, float lr, float mu,
                  bool nesterov) override;
  void adam_update(Tensor& var, Tensor& m, Tensor& v, const Tensor& grad, float lr, float beta1,
                   float beta2, float epsilon, int64_t step, float grad_scale,
                   float decay) override;

  struct State;  // oneDNN engine, per-thread streams and the primitive cache (cpu_kernels.cc)

 private:
  BatchNormForward batch_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      float eps, Tensor* relu_mask,
                                      DType y_dtype = DType::kFloat32);
  BatchNormBackward batch_norm_backward_impl(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                             const Tensor& mean, const Tensor& var, float eps,
                                             const Tensor* relu_mask, DType dx_dtype);
  // The same on a bfloat16 x (cpu_batch_norm_bf16.cc): loops of our own; relu_mask is then [2, C].
  BatchNormForward batch_norm_forward_bf16(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                           float eps, Tensor* relu_mask, DType y_dtype);
  BatchNormBackward batch_norm_backward_bf16(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                             const Tensor& mean, const Tensor& var, float eps,
                                             const Tensor* relu_mask, DType dx_dtype);
  DeviceSpec spec_;
  std::unique_ptr<State> state_;
};

// Batch norm's view of a channels-last tensor: [rows, channels] (rows = the product of the leading
// axes, also where channels is 0). Throws InvalidArgument below rank 2.
std::pair<int64_t, int64_t> batch_norm_rows(const Shape& s);
// Throws InvalidArgument unless t is float32 (names the op and the operand).
void require_f32(const Tensor& t, const char* op, const char* what);
// The same, but under mixed_bfloat16 also a bfloat16 tensor: what an op kept for its backward pass
// (a matmul or convolution rounds what it reads to bfloat16 then anyway).
void require_f32_or_kept_bf16(const Tensor& t, const char* op, const char* what);
// c = a op b with numpy broadcasting, for the cases oneDNN's src1-only broadcast cannot do.
void binary_broadcast_loop(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& c);
// Element conversion for the types oneDNN's reorder has no data type for (float64, int64).
void cast_loop(const Tensor& x, Tensor& y);
// Softmax's backward pass, dx = y * (dy - sum(dy * y)) over each row of c, on up to `threads`
// threads (AVX2 with FMA, or scalar): where oneDNN has only its reference kernel for it (oneDNN
// 2.6's vector one is AVX-512 only; its reference one was 1.7% of oneDNN's time in GPT-2 small's
// steps under the AVX2 cap).
void softmax_backward_rows(const float* y, const float* dy, float* dx, int64_t rows, int64_t c,
                           int threads);
// GELU in its tanh form, forward (y) and backward (dx = dy gelu'(x)), over n floats on AVX2 with
// FMA (cpu_loops.cc): where the device runs without AVX-512 (own_gelu_tanh), since oneDNN 2.6's
// AVX2 gelu_tanh takes 5.2x its AVX-512 time (6.41 against 1.24 ms for 3.1 M floats, one Zen 5
// core; 2.6% of oneDNN's time in GPT-2 small's steps under the AVX2 cap).
bool own_gelu_tanh();
void gelu_tanh_forward(const float* x, float* y, int64_t n);
void gelu_tanh_backward(const float* x, const float* dy, float* dx, int64_t n);

}  // namespace dtrain::cpu

namespace dtrain::cpu_testing {
// How many times softmax_backward_rows has run in this process (all devices), and which row it
// runs ("avx2" or "scalar"), for tests of the dispatch.
uint64_t own_softmax_backward_runs();
const char* own_softmax_backward_row();
// How many times gelu_tanh_forward/backward have run (all devices), and forcing them on a CPU with
// AVX-512 (where oneDNN's kernel runs otherwise), for tests.
uint64_t own_gelu_runs();
void force_own_gelu(bool on);
// Batch norm's loops on a bfloat16 x (cpu_batch_norm_bf16.cc): whether they take their AVX-512
// chunks (this CPU under DTRAIN_MAX_CPU_ISA, and not forced off), and forcing the portable loops
// alone, so that a test sets the two beside each other in one process.
bool batch_norm_loops_avx512();
void force_portable_batch_norm_loops(bool on);
// Which build of Adam's elementwise pass runs: "avx512", "avx2" or "portable".
const char* adam_loop_isa();
}  // namespace dtrain::cpu_testing
