// CudaKernels: 2-D convolution (forward, input gradient, filter gradient) with cuDNN.
//
// Layout: activations stay NHWC. TensorFlow's HWIO filter [kh, kw, in, out] has no cuDNN format,
// so it is transposed to KRSC [out, kh, kw, in] (cuDNN's NHWC filter format) on the way in, and
// the filter gradient back on the way out; filters are small, so this costs little.
// Padding: cuDNN pads symmetrically only. Symmetric padding is passed to cuDNN; asymmetric padding
// (TF "SAME" with an even window) is applied by an explicit zero-pad kernel, after which cuDNN
// runs unpadded, and the input gradient is cropped back.
// Plans: each direction first runs a cached cuDNN graph-API execution plan (cuda_conv_plan.h: the
// legacy calls, cuda_conv_legacy.h, cost 100-740 us of host time each in cuDNN 9); only a problem
// with no qualifying graph-API engine, or DTRAIN_CUDNN_API=legacy, takes the legacy path.
// Precision: float32 on the float32 units (cuDNN's FMA math, engines without tensor cores) unless
// CudaKernels::tensor_cores() (TF32 switched on); then tensor-core engines may run, and plans and
// algorithm choices are cached apart for the two. Under mixed_bfloat16 (from compute capability
// 8.0: gemm_math() kBFloat16) every direction tries bfloat16 operands on bfloat16 tensor cores:
// the pointwise GEMMs always, cuDNN where it has a qualifying plan for the tensors' types. A
// float32 output from bfloat16 inputs (the input and filter gradients, a convolution with a bias or
// that hands nothing on) may have none: cuDNN's documented bfloat16 configurations have a bfloat16
// output. Then cuDNN writes it in bfloat16 and it is widened after (as PyTorch's autocast keeps
// its convolutions' outputs and gradients in bfloat16), unless a bias is to be added to it: the
// sum is not rounded before its bias. Where cuDNN has neither, the float32 path runs on the
// operands rounded to bfloat16 (product_operand) on TF32 tensor cores, which hold them exactly;
// before 2026-11-29 that was the only cuDNN path under mixed_bfloat16.
// A bfloat16 activation (CudaKernels::hands_off_bfloat16) is read as it is, and a bfloat16 output
// (Conv2dParams::bf16_output) written by the product itself where no bias follows.
// Pointwise convolutions (1x1 window, no padding: two thirds of ResNet-50's) skip cuDNN: on NHWC
// data they are one cuBLAS GEMM over the pixels ([N*H*W, Cin] x [Cin, Cout], the HWIO filter as it
// is), where cuDNN's float32 engines transpose to NCHW and back around every call; a stride > 1
// first subsamples the pixels (and the input gradient is scattered back with zeros).
// DTRAIN_CUDA_CONV_GEMM=0 sends them to cuDNN too (for comparisons).
// The legacy path and its choice of algorithm: cuda_conv_legacy.h.
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "devices/cuda/cuda_conv_legacy.h"
#include "devices/cuda/cuda_gemm.h"
#include "devices/cuda/cuda_guard.h"
#include "devices/cuda/cuda_kernels.h"
#include "devices/cuda/cuda_launch.h"
#include "devices/cuda_testing.h"
#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain::cuda {
namespace {

float* fptr(const Tensor& t) { return static_cast<float*>(t.raw_data()); }

struct ConvGeometry {
  int64_t n, h, w, cin, kh, kw, cout, oh, ow;
  bool explicit_pad;  // asymmetric padding, applied by launch_pad_nhwc
  int64_t hp, wp;     // input height/width as cuDNN sees it
  int pad_h, pad_w;   // padding cuDNN applies
};

ConvGeometry conv_geometry(const char* op, const Shape& x, const Shape& w, const Conv2dParams& p) {
  if (x.rank() != 4 || w.rank() != 4)
    throw InvalidArgument(detail::str_cat(op,
                                          ": x must be [N, H, W, Cin] and w [KH, KW, Cin, Cout]",
                                          ", got x ", x.to_string(), " and w ", w.to_string()));
  if (w[2] != x[3])
    throw InvalidArgument(detail::str_cat(op, ": x ", x.to_string(), " has ", x[3],
                                          " channels but filter ", w.to_string(), " expects ",
                                          w[2]));
  if (p.stride_h < 1 || p.stride_w < 1 || p.pad_top < 0 || p.pad_bottom < 0 || p.pad_left < 0 ||
      p.pad_right < 0)
    throw InvalidArgument(detail::str_cat(
        op, ": strides must be >= 1 and padding >= 0, got stride ", p.stride_h, "x", p.stride_w,
        " padding ", p.pad_top, ",", p.pad_bottom, ",", p.pad_left, ",", p.pad_right));
  ConvGeometry g{};
  g.n = x[0];
  g.h = x[1];
  g.w = x[2];
  g.cin = x[3];
  g.kh = w[0];
  g.kw = w[1];
  g.cout = w[3];
  g.oh = conv_output_size(g.h, static_cast<int>(g.kh), p.stride_h, p.pad_top, p.pad_bottom);
  g.ow = conv_output_size(g.w, static_cast<int>(g.kw), p.stride_w, p.pad_left, p.pad_right);
  g.explicit_pad = p.pad_top != p.pad_bottom || p.pad_left != p.pad_right;
  g.hp = g.explicit_pad ? g.h + p.pad_top + p.pad_bottom : g.h;
  g.wp = g.explicit_pad ? g.w + p.pad_left + p.pad_right : g.w;
  g.pad_h = g.explicit_pad ? 0 : p.pad_top;
  g.pad_w = g.explicit_pad ? 0 : p.pad_left;
  if ((g.hp + 2 * g.pad_h - g.kh) / p.stride_h + 1 != g.oh ||
      (g.wp + 2 * g.pad_w - g.kw) / p.stride_w + 1 != g.ow)
    throw Internal(detail::str_cat(op, ": output size ", g.oh, "x", g.ow,
                                   " disagrees with cuDNN's for x ", x.to_string(), " w ",
                                   w.to_string()));
  return g;
}

// A 1x1 convolution without padding, small enough for cuBLAS's int dimensions.
bool pointwise(const ConvGeometry& g) {
  static const bool on = [] {
    const char* v = std::getenv("DTRAIN_CUDA_CONV_GEMM");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on && g.kh == 1 && g.kw == 1 && !g.explicit_pad && g.pad_h == 0 && g.pad_w == 0 &&
         g.n * g.h * g.w <= INT_MAX && g.cin <= INT_MAX && g.cout <= INT_MAX;
}

ConvPlanProblem plan_problem(const ConvGeometry& g, const Conv2dParams& p) {
  return {g.n,  g.hp, g.wp,    g.cin,   g.kh,       g.kw,      g.cout,
          g.oh, g.ow, g.pad_h, g.pad_w, p.stride_h, p.stride_w};
}

std::string describe(const ConvGeometry& g, const Conv2dParams& p) {
  return detail::str_cat("x [", g.n, ", ", g.h, ", ", g.w, ", ", g.cin, "], w [", g.kh, ", ", g.kw,
                         ", ", g.cin, ", ", g.cout, "], stride ", p.stride_h, "x", p.stride_w,
                         ", padding ", p.pad_top, ",", p.pad_bottom, ",", p.pad_left, ",",
                         p.pad_right);
}

// HWIO [kh, kw, in, out] -> KRSC [out, kh, kw, in].
Tensor hwio_to_krsc(const Tensor& w, const DeviceSpec& dev, cudaStream_t s) {
  const int64_t dims[4] = {w.shape()[0], w.shape()[1], w.shape()[2], w.shape()[3]};
  const int perm[4] = {3, 0, 1, 2};
  Tensor out = Tensor::empty(Shape{dims[3], dims[0], dims[1], dims[2]}, DType::kFloat32, dev);
  launch_permute(fptr(w), fptr(out), 4, dims, perm, s);
  return out;
}

// KRSC [out, kh, kw, in] -> HWIO [kh, kw, in, out].
Tensor krsc_to_hwio(const Tensor& k, const DeviceSpec& dev, cudaStream_t s) {
  const int64_t dims[4] = {k.shape()[0], k.shape()[1], k.shape()[2], k.shape()[3]};
  const int perm[4] = {1, 2, 3, 0};
  Tensor out = Tensor::empty(Shape{dims[1], dims[2], dims[3], dims[0]}, DType::kFloat32, dev);
  launch_permute(fptr(k), fptr(out), 4, dims, perm, s);
  return out;
}

}  // namespace

int CudaKernels::cached_algo(const AlgoKey& key) const {
  std::lock_guard<std::mutex> lock(algo_mu_);
  auto it = algo_cache_.find(key);
  return it == algo_cache_.end() ? -1 : it->second;
}

void CudaKernels::remember_algo(const AlgoKey& key, int algo) {
  std::lock_guard<std::mutex> lock(algo_mu_);
  algo_cache_[key] = algo;
}

void CudaKernels::legacy_conv(ConvDirection d, const ConvPlanProblem& p, bool tc, const void* a,
                              const void* b, void* out, const char* op,
                              const std::string& problem) {
  const AlgoKey key = conv_problem_key(d, p, tc);
  remember_algo(key, legacy_convolve(ctx_, d, p, cached_algo(key), tc, a, b, out, op, problem));
}

Tensor CudaKernels::subsample_nhwc(const Tensor& x, int64_t oh, int64_t ow, int sh, int sw) {
  if (sh == 1 && sw == 1) return x;
  const Shape& s = x.shape();
  Tensor xs = empty(Shape{s[0], oh, ow, s[3]}, x.dtype());
  launch_subsample_nhwc(x.raw_data(), xs.raw_data(), x.dtype(), s[0], s[1], s[2], s[3], oh, ow, sh,
                        sw, ctx_.stream());
  return xs;
}

Tensor CudaKernels::pad_nhwc(const Tensor& x, int top, int bottom, int left, int right,
                             float value) {
  const Shape& s = x.shape();
  const int64_t hp = s[1] + top + bottom, wp = s[2] + left + right;
  Tensor y = empty(Shape{s[0], hp, wp, s[3]}, x.dtype());
  launch_pad_nhwc(x.raw_data(), y.raw_data(), x.dtype(), s[0], s[1], s[2], s[3], top, left, hp, wp,
                  value, ctx_.stream());
  return y;
}

bool CudaKernels::cudnn_bf16() {
  static const bool on =
      env_switch("DTRAIN_CUDNN_BF16", true,
                 "1 (the default) runs cuDNN's convolutions on bfloat16 operands under "
                 "mixed_bfloat16 where it has a plan for them, 0 on the operands rounded to "
                 "bfloat16 and kept as float32, on TF32 tensor cores, as before 2026-11-29");
  return on;
}

ConvTypes CudaKernels::bf16_types(ConvDirection d, DType out) {
  ConvTypes t{DType::kBFloat16, DType::kBFloat16, DType::kBFloat16};
  (d == ConvDirection::kForward ? t.y : d == ConvDirection::kBackwardData ? t.x : t.w) = out;
  return t;
}

namespace {
std::atomic<bool> g_refuse_wide_outputs{false};  // cuda_testing::refuse_float32_outputs_of_...
std::atomic<int64_t> g_widened_outputs{0};       // convolutions whose bfloat16 output was widened
std::atomic<int64_t> g_bf16_plan_runs{0};        // convolutions run on a cuDNN bfloat16 plan
}  // namespace

bool CudaKernels::bf16_conv_may_run(ConvDirection d, const ConvPlanProblem& p, DType out,
                                    bool widen) {
  const bool wide = out == DType::kFloat32;
  if (!(wide && g_refuse_wide_outputs.load()) &&
      conv_plans_.may_run(d, p, true, bf16_types(d, out)))
    return true;
  return wide && widen && conv_plans_.may_run(d, p, true, bf16_types(d, DType::kBFloat16));
}

bool CudaKernels::bf16_conv(ConvDirection d, const ConvPlanProblem& p, const Tensor& a,
                            const Tensor& b, Tensor& out, bool widen) {
  const DType bf16 = DType::kBFloat16;
  DTRAIN_CHECK(a.dtype() == bf16 && b.dtype() == bf16, "bf16_conv takes bfloat16 inputs");
  const auto run = [&](Tensor& o) {
    void *x = nullptr, *w = nullptr, *y = nullptr;
    switch (d) {
      case ConvDirection::kForward:
        x = a.raw_data(), w = b.raw_data(), y = o.raw_data();
        break;
      case ConvDirection::kBackwardData:
        x = o.raw_data(), w = a.raw_data(), y = b.raw_data();
        break;
      case ConvDirection::kBackwardFilter:
        x = a.raw_data(), w = o.raw_data(), y = b.raw_data();
        break;
    }
    return conv_plans_.run(d, p, x, w, y, /*tensor_cores=*/true, bf16_types(d, o.dtype()));
  };
  const bool wide = out.dtype() == DType::kFloat32;
  if (!(wide && g_refuse_wide_outputs.load()) &&
      conv_plans_.may_run(d, p, true, bf16_types(d, out.dtype())) && run(out)) {
    g_bf16_plan_runs.fetch_add(1);
    return true;
  }
  if (!wide || !widen || !conv_plans_.may_run(d, p, true, bf16_types(d, bf16))) return false;
  Tensor narrow = empty(out.shape(), bf16);
  if (!run(narrow)) return false;
  launch_cast(narrow.raw_data(), bf16, out.raw_data(), DType::kFloat32, out.numel(), ctx_.stream());
  g_bf16_plan_runs.fetch_add(1);
  g_widened_outputs.fetch_add(1);
  std::lock_guard<std::mutex> lock(algo_mu_);
  if (widened_.insert(conv_problem_key(d, p, true)).second) {
    DTRAIN_LOG(DEBUG) << "convolution "
                      << (d == ConvDirection::kForward        ? "forward"
                          : d == ConvDirection::kBackwardData ? "backward data"
                                                              : "backward filter")
                      << " x [" << p.n << ", " << p.h << ", " << p.w << ", " << p.cin << "] w ["
                      << p.kh << ", " << p.kw << ", " << p.cin << ", " << p.cout
                      << "]: no cuDNN plan with a float32 output from bfloat16 inputs; written in "
                         "bfloat16 and widened";
  }
  return true;
}

// Under mixed_bfloat16 from compute capability 8.0 (gemm_math() kBFloat16) each direction reads
// bfloat16 operands: a bfloat16 activation as it is (hands_off_bfloat16), anything else as a
// rounded copy, on cuDNN plans for bfloat16 data (float32 sums; a float32 output possibly written
// in bfloat16 and widened, bf16_conv) or the pointwise GEMMs. Where cuDNN has no such plan, the
// float32 path runs on the same rounded values (TF32 tensor cores). A bfloat16 output
// (Conv2dParams::bf16_output) is written by the product itself where it can be (no bias), else
// rounded after.
Tensor CudaKernels::conv2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                           const Conv2dParams& p) {
  DeviceGuard guard(ctx_.index());
  check_activation(x, "conv2d", "x");
  check_f32(w, "conv2d", "w");
  const ConvGeometry g = conv_geometry("conv2d", x.shape(), w.shape(), p);
  if (bias.defined()) {
    check_f32(bias, "conv2d", "bias");
    if (bias.shape() != Shape{g.cout})
      throw InvalidArgument(detail::str_cat("conv2d: bias ", bias.shape().to_string(),
                                            " does not match the filter's ", g.cout,
                                            " output channels"));
  }
  const GemmMath math = gemm_math();
  const bool bf16 = math == GemmMath::kBFloat16;
  const DType want = p.bf16_output ? DType::kBFloat16 : DType::kFloat32;
  const Shape y_shape{g.n, g.oh, g.ow, g.cout};
  if (y_shape.numel() == 0) return empty(y_shape, want);
  Tensor y = empty(y_shape, bf16 && !bias.defined() ? want : DType::kFloat32);
  const ConvPlanProblem pp = plan_problem(g, p);
  if (g.cin == 0 || g.kh == 0 || g.kw == 0) {  // an empty sum: the output is the bias alone
    launch_fill(y.raw_data(), y.dtype(), y.numel(), 0.f, ctx_.stream());
  } else if (pointwise(g)) {
    const Tensor xs = gemm_operand(subsample_nhwc(x, g.oh, g.ow, p.stride_h, p.stride_w), math);
    const Tensor wr = gemm_operand(w, math);
    gemm_row_major(ctx_, math, false, false, g.n * g.oh * g.ow, g.cout, g.cin, xs.raw_data(), g.cin,
                   wr.raw_data(), g.cout, y.raw_data(), g.cout, y.dtype());
  } else {
    const auto padded = [&](const Tensor& t) {
      return g.explicit_pad ? pad_nhwc(t, p.pad_top, p.pad_bottom, p.pad_left, p.pad_right, 0.f)
                            : t;
    };
    const Tensor wk = hwio_to_krsc(w, ctx_.spec(), ctx_.stream());
    const bool widen = !bias.defined();  // (a bias is added to the sum before any rounding)
    const bool done = bf16 && cudnn_bf16() &&
                      bf16_conv_may_run(ConvDirection::kForward, pp, y.dtype(), widen) &&
                      bf16_conv(ConvDirection::kForward, pp, padded(as_dtype(x, DType::kBFloat16)),
                                as_dtype(wk, DType::kBFloat16), y, widen);
    if (!done) {
      if (y.dtype() != DType::kFloat32) y = empty(y_shape);
      const bool tc = tensor_cores();
      const Tensor xin = padded(rounded_f32(x));
      const Tensor wr = product_operand(wk);
      if (!conv_plans_.run(ConvDirection::kForward, pp, xin.raw_data(), wr.raw_data(), y.raw_data(),
                           tc))
        legacy_conv(ConvDirection::kForward, pp, tc, xin.raw_data(), wr.raw_data(), y.raw_data(),
                    "conv2d", describe(g, p));
    }
  }
  if (bias.defined())
    launch_add_bias(fptr(y), fptr(bias), g.n * g.oh * g.ow, g.cout, ctx_.stream());
  return as_dtype(y, want);
}

Tensor CudaKernels::conv2d_backward_input(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                                          const Conv2dParams& p) {
  DeviceGuard guard(ctx_.index());
  check_activation(dy, "conv2d_backward_input", "dy");
  check_f32(w, "conv2d_backward_input", "w");
  const ConvGeometry g = conv_geometry("conv2d_backward_input", x_shape, w.shape(), p);
  if (dy.shape() != Shape{g.n, g.oh, g.ow, g.cout})
    throw InvalidArgument(detail::str_cat("conv2d_backward_input: dy ", dy.shape().to_string(),
                                          " does not match the forward output [", g.n, ", ", g.oh,
                                          ", ", g.ow, ", ", g.cout, "] of ", describe(g, p)));
  Tensor dx = empty(x_shape);
  if (dx.numel() == 0) return dx;
  if (dy.numel() == 0 || g.kh == 0 || g.kw == 0) {
    launch_fill(dx.raw_data(), DType::kFloat32, dx.numel(), 0.f, ctx_.stream());
    return dx;
  }
  const GemmMath math = gemm_math();
  if (pointwise(g)) {
    const Tensor dyg = gemm_operand(dy, math), wg = gemm_operand(w, math);
    const bool strided = p.stride_h != 1 || p.stride_w != 1;
    const Tensor dxs = strided ? empty(Shape{g.n, g.oh, g.ow, g.cin}) : dx;
    gemm_row_major(ctx_, math, false, true, g.n * g.oh * g.ow, g.cin, g.cout, dyg.raw_data(),
                   g.cout, wg.raw_data(), g.cout, fptr(dxs), g.cin);
    if (strided)
      launch_upsample_zero_nhwc(fptr(dxs), fptr(dx), g.n, g.h, g.w, g.cin, g.oh, g.ow, p.stride_h,
                                p.stride_w, ctx_.stream());
    return dx;
  }
  const ConvPlanProblem pp = plan_problem(g, p);
  const Tensor wk = hwio_to_krsc(w, ctx_.spec(), ctx_.stream());
  Tensor dxp = g.explicit_pad ? empty(Shape{g.n, g.hp, g.wp, g.cin}) : dx;
  const bool done = math == GemmMath::kBFloat16 && cudnn_bf16() &&
                    bf16_conv_may_run(ConvDirection::kBackwardData, pp, DType::kFloat32) &&
                    bf16_conv(ConvDirection::kBackwardData, pp, as_dtype(wk, DType::kBFloat16),
                              as_dtype(dy, DType::kBFloat16), dxp);
  if (!done) {
    const bool tc = tensor_cores();
    const Tensor dyr = rounded_f32(dy);
    const Tensor wr = product_operand(wk);
    if (!conv_plans_.run(ConvDirection::kBackwardData, pp, dxp.raw_data(), wr.raw_data(),
                         dyr.raw_data(), tc))
      legacy_conv(ConvDirection::kBackwardData, pp, tc, wr.raw_data(), dyr.raw_data(),
                  dxp.raw_data(), "conv2d_backward_input", describe(g, p));
  }
  if (g.explicit_pad)
    launch_crop_nhwc(fptr(dxp), fptr(dx), g.n, g.h, g.w, g.cin, p.pad_top, p.pad_left, g.hp, g.wp,
                     ctx_.stream());
  return dx;
}

Tensor CudaKernels::conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Shape& w_shape,
                                           const Conv2dParams& p, bool want_bias, Tensor* db) {
  DeviceGuard guard(ctx_.index());
  check_activation(x, "conv2d_backward_filter", "x");
  check_activation(dy, "conv2d_backward_filter", "dy");
  if (want_bias && !db)
    throw InvalidArgument("conv2d_backward_filter: want_bias needs a db output pointer");
  const ConvGeometry g = conv_geometry("conv2d_backward_filter", x.shape(), w_shape, p);
  if (dy.shape() != Shape{g.n, g.oh, g.ow, g.cout})
    throw InvalidArgument(detail::str_cat("conv2d_backward_filter: dy ", dy.shape().to_string(),
                                          " does not match the forward output [", g.n, ", ", g.oh,
                                          ", ", g.ow, ", ", g.cout, "] of ", describe(g, p)));
  if (want_bias) {
    Tensor b = empty(Shape{g.cout});
    const Tensor dy32 = as_dtype(dy, DType::kFloat32);
    launch_column_sum(fptr(dy32), fptr(b), g.n * g.oh * g.ow, g.cout, ctx_);
    *db = b;
  }
  if (w_shape.numel() == 0) return empty(w_shape);
  if (dy.numel() == 0 || x.numel() == 0) {  // an empty sum
    Tensor dw = empty(w_shape);
    launch_fill(dw.raw_data(), DType::kFloat32, dw.numel(), 0.f, ctx_.stream());
    return dw;
  }
  // The bias gradient above sums dy as it is; the filter gradient reads the rounded operands.
  const GemmMath math = gemm_math();
  if (pointwise(g)) {
    const Tensor xs = gemm_operand(subsample_nhwc(x, g.oh, g.ow, p.stride_h, p.stride_w), math);
    const Tensor dyg = gemm_operand(dy, math);
    Tensor dw = empty(w_shape);  // HWIO [1, 1, Cin, Cout] is the matrix [Cin, Cout]
    gemm_row_major(ctx_, math, true, false, g.cin, g.cout, g.n * g.oh * g.ow, xs.raw_data(), g.cin,
                   dyg.raw_data(), g.cout, fptr(dw), g.cout);
    return dw;
  }
  const ConvPlanProblem pp = plan_problem(g, p);
  const auto padded = [&](const Tensor& t) {
    return g.explicit_pad ? pad_nhwc(t, p.pad_top, p.pad_bottom, p.pad_left, p.pad_right, 0.f) : t;
  };
  Tensor dwk = empty(Shape{g.cout, g.kh, g.kw, g.cin});
  const bool done =
      math == GemmMath::kBFloat16 && cudnn_bf16() &&
      bf16_conv_may_run(ConvDirection::kBackwardFilter, pp, DType::kFloat32) &&
      bf16_conv(ConvDirection::kBackwardFilter, pp, padded(as_dtype(x, DType::kBFloat16)),
                as_dtype(dy, DType::kBFloat16), dwk);
  if (!done) {
    const bool tc = tensor_cores();
    const Tensor dyr = rounded_f32(dy);
    const Tensor xin = padded(rounded_f32(x));
    if (!conv_plans_.run(ConvDirection::kBackwardFilter, pp, xin.raw_data(), dwk.raw_data(),
                         dyr.raw_data(), tc))
      legacy_conv(ConvDirection::kBackwardFilter, pp, tc, xin.raw_data(), dyr.raw_data(),
                  dwk.raw_data(), "conv2d_backward_filter", describe(g, p));
  }
  return krsc_to_hwio(dwk, ctx_.spec(), ctx_.stream());
}

}  // namespace dtrain::cuda

namespace dtrain::cuda_testing {
void refuse_float32_outputs_of_bfloat16_convs(bool on) { cuda::g_refuse_wide_outputs = on; }
int64_t conv_outputs_widened_from_bfloat16() { return cuda::g_widened_outputs.load(); }
int64_t conv_bfloat16_plan_runs() { return cuda::g_bf16_plan_runs.load(); }
}  // namespace dtrain::cuda_testing
