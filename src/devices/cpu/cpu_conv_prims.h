// Private to the CPU convolution and pooling kernels (cpu_conv_pool.cc, cpu_conv_pool_fused.cc):
// the shapes oneDNN is given, and its primitives, created once per shape and cached in the
// device's State. Not a public header.
#pragma once

#include <memory>
#include <string>

#include "devices/cpu/cpu_pool.h"
#include "devices/cpu/dnnl_util.h"

namespace dtrain::cpu {

struct ConvShapes {
  memory::dims src, wei, bias, dst, strides, pad_l, pad_r;
};

ConvShapes conv_shapes(const Shape& x, const Shape& w, const Conv2dParams& p);

struct ConvFwd {
  dnnl::convolution_forward::primitive_desc pd;
  dnnl::convolution_forward prim;
  memory::desc user_w;
};
struct ConvBwdData {
  dnnl::convolution_backward_data::primitive_desc pd;
  dnnl::convolution_backward_data prim;
  memory::desc user_w;
};
struct ConvBwdWeights {
  dnnl::convolution_backward_weights::primitive_desc pd;
  dnnl::convolution_backward_weights prim;
  memory::desc user_w;
};

// Runs a reorder from the user's tensor (an HWIO filter, an NHWC activation or gradient: a kernel's
// input) into `want` if they differ (a blocked layout, or bfloat16); returns the memory to use.
// Under mixed_bfloat16 without bfloat16 kernels, `want` is float32 and the copy is rounded to
// bfloat16.
memory filter_in(CpuKernels::State& st, const memory::desc& user, const memory::desc& want,
                 const Tensor& w, Tensor* holder);

// Max pooling's geometry for x [N,H,W,C] (cpu_pool.h); throws InvalidArgument when the window
// does not fit or a padding is not smaller than the window.
PoolGeometry pool_geometry(const Shape& x, const Pool2dParams& p);

// The convolution primitives, cached per shape. Where Winograd's algorithm is wanted (precision.h:
// enable_winograd_convolutions) and oneDNN has it, the primitive is a Winograd one whose
// activations are in a blocked layout (not NHWC): read them through filter_in, write them through
// out_memory and finish_out. `bf16_dst`: the forward primitive writes bfloat16 (on bfloat16 kernels
// only: conv_reads_bf16).
std::shared_ptr<ConvFwd> conv_fwd_prim(CpuKernels::State& st, const ConvShapes& s, bool bias,
                                       bool bf16_dst = false);
std::shared_ptr<ConvBwdData> conv_bwd_data_prim(CpuKernels::State& st, const ConvShapes& s);
std::shared_ptr<ConvBwdWeights> conv_bwd_weights_prim(CpuKernels::State& st, const ConvShapes& s,
                                                      bool bias);

// Whether this convolution runs dtrain's own Winograd kernels (cpu_winograd.h): where Winograd's
// algorithm is wanted (the conditions precision.h gives, none depending on the batch) and this
// CPU's oneDNN has no Winograd kernels (below avx512_core, or capped there: DTRAIN_MAX_CPU_ISA,
// ONEDNN_MAX_CPU_ISA) or its Winograd input gradient is wrong (padding that differs between the
// two sides of a dimension), and the convolution has channels to compute. Where oneDNN has them,
// conv_fwd_prim and its kin make oneDNN's. cpu_testing::OwnWinogradEverywhere (cpu_winograd.h)
// takes dtrain's wherever Winograd is wanted.
bool own_winograd(const ConvShapes& s);
// Whether oneDNN's effective instruction set holds avx512_core, where oneDNN 2.6 has its Winograd
// kernels (found once, after the CPU device capped it).
bool onednn_has_winograd();

// While one lives, the convolutions this thread runs are direct ones: the fused conv+pool kernel's
// (its chunked path pools the NHWC output in place, and its unchunked path, taken for small
// batches, must compute what the chunked one does, so that strategies agree).
class DirectConvolutionsOnly {
 public:
  DirectConvolutionsOnly();
  ~DirectConvolutionsOnly();
  DirectConvolutionsOnly(const DirectConvolutionsOnly&) = delete;
  DirectConvolutionsOnly& operator=(const DirectConvolutionsOnly&) = delete;

 private:
  bool previous_;
};

// The memory a primitive writes the NHWC tensor `t` through: `t` itself where the primitive's
// layout `want` is the user's, else a scratch buffer in `want` (kept in *holder) that finish_out
// then reorders into `t`.
memory out_memory(CpuKernels::State& st, const memory::desc& user, const memory::desc& want,
                  const Tensor& t, Tensor* holder);
void finish_out(CpuKernels::State& st, const memory::desc& user, memory written, const Tensor& t);

// Under mixed_bfloat16 (`mixed`), whether a convolution of these shapes runs oneDNN's bfloat16
// kernels: where this CPU runs them (bf16_kernels_native) and each output sums at least
// kBf16MinReduction products (KH x KW x Cin; an AMX tile row holds 32 bfloat16 values). With
// fewer, oneDNN 2.6's bfloat16 kernels pad the channels to their pairs and tiles and ran slower
// than float32 ones on a Xeon with AMX: the reference CNN's first layer (3x3x1 = 9) 1.8x slower
// forward and backward, where ResNet-50's stem (7x7x3 = 147) runs 2.2x faster forward and 1.4x
// faster backward on them. Those layers run float32 kernels on operands rounded to bfloat16, the
// same numerics.
constexpr int64_t kBf16MinReduction = 32;
bool conv_reads_bf16(const ConvShapes& s, bool mixed);

// Checks conv2d's operands (float32, the bias's shape) and returns the shapes; `op` names the
// caller. With `x_may_be_kept`, x may also be a bfloat16 copy keep_for_backward made (under
// mixed_bfloat16: exact in bfloat16, what the kernel reads anyway).
ConvShapes checked_conv_shapes(const char* op, const Tensor& x, const Tensor& w, const Tensor& bias,
                               const Conv2dParams& p, bool x_may_be_kept = false);

// Whether a convolution with filter w [KH,KW,Cin,Cout] runs its two backward passes as matrix
// products (cpu_conv_prims.cc says why): 1x1 filters without padding, at stride 1, and strided
// where the convolution runs oneDNN's bfloat16 kernels (mixed_bfloat16, native kernels, Cin at
// least kBf16MinReduction). DTRAIN_CPU_CONV_GEMM=0 keeps them all on the convolution primitives,
// =unstrided the strided ones, for comparisons.
bool conv_as_gemm(const Shape& w, const Conv2dParams& p);

}  // namespace dtrain::cpu
