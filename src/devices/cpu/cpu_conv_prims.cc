// oneDNN's convolution primitives for the CPU kernels (and max pooling's geometry): shapes, cache
// keys, creation (cpu_conv_prims.h).
#include "devices/cpu/cpu_conv_prims.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "devices/cpu/cpu_winograd.h"
#include "dtrain/core/precision.h"

namespace dtrain::cpu {
namespace {

// Under the mixed_bfloat16 policy the convolution reads bfloat16 (src, weights, diff_dst) and
// writes float32 (dst, diff_src, diff_weights, bias): what its kernels read is rounded, nothing
// else. Without bfloat16 kernels on this CPU, or for a layer conv_reads_bf16 leaves on float32
// kernels, they read float32 rounded to bfloat16 (dnnl_util.h; filter_in rounds).
dt in_type(const ConvShapes& s, bool bf16) { return conv_reads_bf16(s, bf16) ? dt::bf16 : dt::f32; }

std::string conv_key(const char* op, const ConvShapes& s, bool bias, bool bf16, bool winograd) {
  std::string k = op;
  if (winograd) k += "@wino";
  if (bf16) k += conv_reads_bf16(s, bf16) ? "@bf16" : "@bf16-emulated";
  key_dims(k, s.src);
  key_dims(k, s.wei);
  key_dims(k, s.strides);
  key_dims(k, s.pad_l);
  key_dims(k, s.pad_r);
  k += bias ? "b" : "n";
  return k;
}

// The layout of a convolution's activations: NHWC for direct convolutions (dtrain's own), the
// kernels' choice for Winograd ones (nChw16c; the callers reorder, a few ms at ResNet-50's sizes).
tag act_tag(algorithm a) { return a == algorithm::convolution_winograd ? tag::any : tag::nhwc; }

dnnl::convolution_forward::desc conv_fwd_desc(const ConvShapes& s, bool bias, bool bf16,
                                              algorithm a, dt dst_type = dt::f32) {
  const memory::desc src(s.src, in_type(s, bf16), act_tag(a)), dst(s.dst, dst_type, act_tag(a));
  const memory::desc wei(s.wei, in_type(s, bf16), tag::any);
  if (bias)
    return {prop_kind::forward_training,
            a,
            src,
            wei,
            memory::desc(s.bias, dt::f32, tag::a),
            dst,
            s.strides,
            s.pad_l,
            s.pad_r};
  return {prop_kind::forward_training, a, src, wei, dst, s.strides, s.pad_l, s.pad_r};
}

thread_local bool t_direct_only = false;

// Whether a convolution of these shapes should run Winograd's algorithm: the conditions
// precision.h gives (enable_winograd_convolutions). None depends on the batch size, so that a
// layer runs the same algorithm whatever the strategy splits the batch into (Winograd's rounding
// differs from the direct convolution's). Where oneDNN has no Winograd kernels (below
// avx512_core), dtrain's own run (own_winograd); where it has them it checks its own conditions
// (the layout) when the primitive is made, and where those fail the direct convolution runs.
// Under mixed_bfloat16 only where the layer runs float32 kernels (CPUs without oneDNN's bfloat16
// kernels, or where they are slower: dnnl_util.h): the operands are rounded to bfloat16 first, and
// Winograd's float32 arithmetic on them stays within its rounding (about 2e-5 of the terms'
// magnitude) of the products of the rounded operands, far inside bfloat16's 4e-3. Never on the
// bfloat16 kernels, whose transformed operands would be rounded to bfloat16 themselves.
bool winograd_wanted(const ConvShapes& s, bool bf16) {
  if (t_direct_only || conv_reads_bf16(s, bf16) || !winograd_convolutions_enabled()) return false;
  const memory::dims& w = s.wei;  // {Cout, Cin, KH, KW}
  if (w[2] != 3 || w[3] != 3 || s.strides[0] != 1 || s.strides[1] != 1) return false;
  for (const auto pad : {s.pad_l[0], s.pad_l[1], s.pad_r[0], s.pad_r[1]})
    if (pad < 0 || pad > 1) return false;
  if (w[0] % 16 != 0 || w[1] % 16 != 0) return false;
  return ((s.dst[2] + 3) / 4) * ((s.dst[3] + 3) / 4) >= 16;  // 4x4 output tiles per image
}

// Makes a primitive with Winograd's algorithm where wanted and oneDNN has it, else the direct one.
// The caller decides `winograd` once, for the cache key and the primitive alike (the settings may
// change on another thread meanwhile).
template <class Make>
auto with_algorithm(bool winograd, Make make) {
  if (winograd) {
    try {
      return make(algorithm::convolution_winograd);
    } catch (const dnnl::error&) {  // oneDNN's conditions not met: the direct one
    }
  }
  return make(algorithm::convolution_direct);
}

}  // namespace

bool conv_reads_bf16(const ConvShapes& s, bool mixed) {
  return mixed && bf16_kernels_native() && s.wei[1] * s.wei[2] * s.wei[3] >= kBf16MinReduction;
}

ConvShapes conv_shapes(const Shape& x, const Shape& w, const Conv2dParams& p) {
  if (x.rank() != 4 || w.rank() != 4)
    throw InvalidArgument("conv2d expects x [N,H,W,C] and w [KH,KW,Cin,Cout], got " +
                          x.to_string() + " and " + w.to_string());
  if (x[3] != w[2])
    throw InvalidArgument("conv2d: input has " + std::to_string(x[3]) +
                          " channels but the filter expects " + std::to_string(w[2]) + " (x " +
                          x.to_string() + ", w " + w.to_string() + ")");
  const int64_t oh =
      conv_output_size(x[1], static_cast<int>(w[0]), p.stride_h, p.pad_top, p.pad_bottom);
  const int64_t ow =
      conv_output_size(x[2], static_cast<int>(w[1]), p.stride_w, p.pad_left, p.pad_right);
  return {{x[0], x[3], x[1], x[2]},   {w[3], w[2], w[0], w[1]}, {w[3]},
          {x[0], w[3], oh, ow},       {p.stride_h, p.stride_w}, {p.pad_top, p.pad_left},
          {p.pad_bottom, p.pad_right}};
}

// Runs a reorder from the user's tensor (an HWIO filter, an NHWC activation or gradient: a kernel's
// input) into `want` if they differ (a blocked layout, or bfloat16); returns the memory to use.
// Under mixed_bfloat16, where `want` is float32 (no bfloat16 kernels on this CPU, or a layer left
// on float32 kernels), the copy is rounded to bfloat16.
memory filter_in(CpuKernels::State& st, const memory::desc& user, const memory::desc& want,
                 const Tensor& w, Tensor* holder) {
  memory user_mem(user, st.engine, w.raw_data());
  // (A bfloat16 user tensor, the copy an op kept, is exact in bfloat16 already.)
  const bool round = mixed_bf16() && want.data_type() == dt::f32 && user.data_type() == dt::f32;
  if (user == want && !round) return user_mem;
  *holder = scratch(want.get_size(), w.device());
  memory out(want, st.engine, holder->raw_data());
  float* copy = static_cast<float*>(holder->raw_data());
  const size_t floats = want.get_size() / sizeof(float);
  if (user == want) {  // (then round: only the rounding is asked for, in one pass)
    round_to_bf16(static_cast<const float*>(w.raw_data()), copy, floats);
    return out;
  }
  convert(st, user_mem, out, w.device());
  if (round) round_to_bf16(copy, floats);
  return out;
}

PoolGeometry pool_geometry(const Shape& x, const Pool2dParams& p) {
  if (x.rank() != 4) throw InvalidArgument("max_pool2d expects [N,H,W,C], got " + x.to_string());
  const int64_t oh = conv_output_size(x[1], p.window_h, p.stride_h, p.pad_top, p.pad_bottom);
  const int64_t ow = conv_output_size(x[2], p.window_w, p.stride_w, p.pad_left, p.pad_right);
  if (p.pad_top < 0 || p.pad_bottom < 0 || p.pad_top >= p.window_h || p.pad_bottom >= p.window_h ||
      p.pad_left < 0 || p.pad_right < 0 || p.pad_left >= p.window_w || p.pad_right >= p.window_w)
    throw InvalidArgument("max_pool2d: padding (top " + std::to_string(p.pad_top) + ", bottom " +
                          std::to_string(p.pad_bottom) + ", left " + std::to_string(p.pad_left) +
                          ", right " + std::to_string(p.pad_right) +
                          ") must be at least 0 and smaller than the window " +
                          std::to_string(p.window_h) + "x" + std::to_string(p.window_w) +
                          " (a window wholly in the padding has no max); use 'same' padding");
  return {x[0],       x[1],       x[2],       x[3],      oh,         ow,    p.window_h,
          p.window_w, p.stride_h, p.stride_w, p.pad_top, p.pad_left, p.relu};
}

bool onednn_has_winograd() {
  static const bool has = onednn_isa_has(dnnl::cpu_isa::avx512_core);
  return has;
}

bool own_winograd(const ConvShapes& s) {
  if (s.wei[0] == 0 || s.wei[1] == 0 || !winograd_wanted(s, mixed_bf16())) return false;
  // oneDNN 2.6's Winograd input gradient is wrong where a dimension's padding differs between its
  // two sides (1 and 0: cpu_conv_test); those convolutions run dtrain's.
  const bool one_sided = s.pad_l[0] != s.pad_r[0] || s.pad_l[1] != s.pad_r[1];
  return cpu_testing::own_winograd_everywhere() || one_sided || !onednn_has_winograd();
}

DirectConvolutionsOnly::DirectConvolutionsOnly() : previous_(t_direct_only) {
  t_direct_only = true;
}
DirectConvolutionsOnly::~DirectConvolutionsOnly() { t_direct_only = previous_; }

std::shared_ptr<ConvFwd> conv_fwd_prim(CpuKernels::State& st, const ConvShapes& s, bool bias,
                                       bool bf16_dst) {
  const bool bf16 = mixed_bf16(), wino = winograd_wanted(s, bf16);
  return st.get<ConvFwd>(conv_key(bf16_dst ? "cf@bf16dst" : "cf", s, bias, bf16, wino), [&] {
    return with_algorithm(wino, [&](algorithm a) {
      dnnl::convolution_forward::primitive_desc pd(
          conv_fwd_desc(s, bias, bf16, a, bf16_dst ? dt::bf16 : dt::f32), st.engine);
      return std::make_shared<ConvFwd>(
          ConvFwd{pd, dnnl::convolution_forward(pd), memory::desc(s.wei, dt::f32, tag::hwio)});
    });
  });
}

std::shared_ptr<ConvBwdData> conv_bwd_data_prim(CpuKernels::State& st, const ConvShapes& s) {
  const bool bf16 = mixed_bf16(), wino = winograd_wanted(s, bf16);
  return st.get<ConvBwdData>(conv_key("cbd", s, false, bf16, wino), [&] {
    return with_algorithm(wino, [&](algorithm a) {
      dnnl::convolution_forward::primitive_desc hint(conv_fwd_desc(s, false, bf16, a), st.engine);
      dnnl::convolution_backward_data::desc d(a, memory::desc(s.src, dt::f32, act_tag(a)),
                                              memory::desc(s.wei, in_type(s, bf16), tag::any),
                                              memory::desc(s.dst, in_type(s, bf16), act_tag(a)),
                                              s.strides, s.pad_l, s.pad_r);
      dnnl::convolution_backward_data::primitive_desc pd(d, st.engine, hint);
      return std::make_shared<ConvBwdData>(ConvBwdData{pd, dnnl::convolution_backward_data(pd),
                                                       memory::desc(s.wei, dt::f32, tag::hwio)});
    });
  });
}

std::shared_ptr<ConvBwdWeights> conv_bwd_weights_prim(CpuKernels::State& st, const ConvShapes& s,
                                                      bool bias) {
  const bool bf16 = mixed_bf16(), wino = winograd_wanted(s, bf16);
  return st.get<ConvBwdWeights>(conv_key("cbw", s, bias, bf16, wino), [&] {
    return with_algorithm(wino, [&](algorithm a) {
      dnnl::convolution_forward::primitive_desc hint(conv_fwd_desc(s, bias, bf16, a), st.engine);
      const memory::desc src(s.src, in_type(s, bf16), act_tag(a)),
          ddst(s.dst, in_type(s, bf16), act_tag(a));
      const memory::desc dwei(s.wei, dt::f32, tag::any);
      auto d = bias ? dnnl::convolution_backward_weights::desc(
                          a, src, dwei, memory::desc(s.bias, dt::f32, tag::a), ddst, s.strides,
                          s.pad_l, s.pad_r)
                    : dnnl::convolution_backward_weights::desc(a, src, dwei, ddst, s.strides,
                                                               s.pad_l, s.pad_r);
      dnnl::convolution_backward_weights::primitive_desc pd(d, st.engine, hint);
      return std::make_shared<ConvBwdWeights>(ConvBwdWeights{
          pd, dnnl::convolution_backward_weights(pd), memory::desc(s.wei, dt::f32, tag::hwio)});
    });
  });
}

memory out_memory(CpuKernels::State& st, const memory::desc& user, const memory::desc& want,
                  const Tensor& t, Tensor* holder) {
  if (user == want) return memory(user, st.engine, t.raw_data());
  *holder = scratch(want.get_size(), t.device());
  return memory(want, st.engine, holder->raw_data());
}

void finish_out(CpuKernels::State& st, const memory::desc& user, memory written, const Tensor& t) {
  if (written.get_desc() == user) return;
  memory out(user, st.engine, t.raw_data());
  dnnl::stream& stream = st.stream();  // first: the reorder fixes its thread count when made
  dnnl::reorder(written, out).execute(stream, written, out);
}

// Checks conv2d's operands (float32, the bias's shape) and returns the shapes; `op` names the
// caller.
ConvShapes checked_conv_shapes(const char* op, const Tensor& x, const Tensor& w, const Tensor& bias,
                               const Conv2dParams& p, bool x_may_be_kept) {
  if (x_may_be_kept)
    require_f32_or_kept_bf16(x, op, "input");
  else
    require_f32(x, op, "input");
  require_f32(w, op, "filter");
  const ConvShapes s = conv_shapes(x.shape(), w.shape(), p);
  if (bias.defined() && bias.shape() != Shape{s.wei[0]})
    throw InvalidArgument(std::string(op) + ": bias must be [" + std::to_string(s.wei[0]) +
                          "], got " + bias.shape().to_string());
  return s;
}

// A 1x1 convolution without padding on channels-last data is a matrix product over the N H W rows
// it reads: y[NHW, Cout] = x[NHW, Cin] w[Cin, Cout] (the HWIO filter's memory as it is); with a
// stride, over the rows x[:, ::sh, ::sw, :]. Its forward pass already runs oneDNN's brgemm
// convolution, but oneDNN 2.6 runs the two backward passes on older kernels. At stride 1 its
// jit_1x1 ones run at about half the matmul's speed, so these run as matrix products always.
// Strided (ResNet-50's downsampling convolutions), on the bfloat16 kernels of a Xeon with AMX, its
// jit_avx512_core_amx ones ran at 36-90 GFLOP/s where the matmul runs the same products at
// 150-200 (the rows gathered first, dx's rows scattered after): ResNet-50's whole step 11% faster
// under mixed bfloat16. On float32 kernels the strided convolution primitives are as fast or faster
// (the step 4% slower as products), so there they stay. (ResNet-50's 1x1 convolutions: most of
// its backward time.)
// DTRAIN_CPU_CONV_GEMM=0 keeps them all on the convolution primitives, =unstrided the strided
// ones, for comparisons (1, the default, as described; another value is reported and ignored).
bool conv_as_gemm(const Shape& w, const Conv2dParams& p) {
  static const int mode = [] {  // 0: none, 1: stride 1 only, 2: strided too, on bfloat16 kernels
    const char* v = std::getenv("DTRAIN_CPU_CONV_GEMM");
    const std::string s = v ? v : "";
    if (s == "0") return 0;
    if (s == "unstrided") return 1;
    if (!s.empty() && s != "1")
      std::fprintf(stderr,
                   "dtrain: DTRAIN_CPU_CONV_GEMM='%s' is not 0, unstrided or 1; keeping the "
                   "default (1: every 1x1 convolution without padding that can run as a matrix "
                   "product does)\n",
                   s.c_str());
    return 2;
  }();
  if (mode == 0 || w[0] != 1 || w[1] != 1 || p.pad_top != 0 || p.pad_bottom != 0 ||
      p.pad_left != 0 || p.pad_right != 0)
    return false;
  if (p.stride_h == 1 && p.stride_w == 1) return true;
  return mode == 2 && mixed_bf16() && bf16_kernels_native() && w[2] >= kBf16MinReduction;
}

}  // namespace dtrain::cpu
