// CudaKernels: 2-D convolution (forward, input gradient, filter gradient) with cuDNN.
//
// Layout: activations stay NHWC. TensorFlow's HWIO filter [kh, kw, in, out] has no cuDNN format,
// so it is transposed to KRSC [out, kh, kw, in] (cuDNN's NHWC filter format) on the way in, and
// the filter gradient back on the way out; filters are small, so this costs little.
// Padding: cuDNN pads symmetrically only. Symmetric padding is passed to cuDNN; asymmetric padding
// (TF "SAME" with an even window) is applied by an explicit zero-pad kernel, after which cuDNN
// runs unpadded, and the input gradient is cropped back.
// Algorithms: cuDNN's heuristics rank candidates; the first that runs is cached per problem.
#include <string>
#include <vector>

#include "devices/cuda/cuda_check.h"
#include "devices/cuda/cuda_cudnn.h"
#include "devices/cuda/cuda_guard.h"
#include "devices/cuda/cuda_kernels.h"
#include "devices/cuda/cuda_launch.h"
#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain::cuda {
namespace {

// Workspaces above this are skipped in favour of the next candidate algorithm.
constexpr size_t kMaxWorkspaceBytes = size_t{1} << 30;

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

bool not_supported(cudnnStatus_t st) {
  return CUDNN_STATUS_CATEGORY(st) == CUDNN_STATUS_NOT_SUPPORTED;
}

// A cached choice: the algorithm, plus this flag when it needed cuDNN's default math.
constexpr int kDefaultMathFlag = 0x100;

// Runs `run(algo, workspace, bytes)` with the cached choice, else with each candidate in order,
// until one is accepted (cuDNN reports some layout/algorithm combinations as NOT_SUPPORTED only
// at execution). Candidates are first sought with FP32 FMA math; only if none accepts the problem
// does it fall back, with a warning, to cuDNN's default math, which may use TF32 tensor cores.
// Returns the choice to cache.
template <typename Algo, typename CandidatesFn, typename SizeFn, typename RunFn>
int run_first_supported(CudaContext& ctx, ConvDesc& cd, int cached, CandidatesFn candidates,
                        SizeFn size_of, RunFn run, const char* call, const std::string& problem) {
  cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
  auto attempt = [&](Algo algo) -> bool {
    size_t bytes = 0;
    cudnnStatus_t st = size_of(algo, &bytes);
    if (st != CUDNN_STATUS_SUCCESS || bytes > kMaxWorkspaceBytes) {
      if (st != CUDNN_STATUS_SUCCESS) last = st;
      return false;
    }
    std::shared_ptr<Storage> ws;
    if (bytes > 0) {
      try {
        ws = ctx.scratch(bytes);
      } catch (const Unavailable&) {
        DTRAIN_LOG(DEBUG) << call << ": no memory for a " << bytes
                          << "-byte workspace; trying the next algorithm";
        return false;
      }
    }
    st = run(algo, ws ? ws->data() : nullptr, bytes);
    if (st == CUDNN_STATUS_SUCCESS) return true;
    if (!not_supported(st)) throw_cudnn_error(st, call, __FILE__, __LINE__);
    last = st;
    return false;
  };
  if (cached >= 0) {
    cd.set_math((cached & kDefaultMathFlag) ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH);
    if (attempt(static_cast<Algo>(cached & ~kDefaultMathFlag))) return cached;
  }
  cd.set_math(CUDNN_FMA_MATH);
  for (Algo algo : candidates())
    if (attempt(algo)) return static_cast<int>(algo);
  cd.set_math(CUDNN_DEFAULT_MATH);
  for (Algo algo : candidates()) {
    if (attempt(algo)) {
      DTRAIN_LOG(WARNING) << call << ": no FP32 (FMA) cuDNN algorithm accepts " << problem
                          << "; using cuDNN's default math, which may use TF32 (about 1e-3 "
                             "relative error)";
      return static_cast<int>(algo) | kDefaultMathFlag;
    }
  }
  throw Unimplemented(detail::str_cat(call, ": no cuDNN algorithm accepts ", problem,
                                      " (last status: ", cudnnGetErrorString(last), ")"));
}

// cuDNN's ranked candidates that report success, then the implicit-GEMM algorithms, which support
// NHWC float32 in every cuDNN release, as a last resort.
template <typename Perf, typename Algo, typename QueryFn>
std::vector<Algo> ranked(QueryFn query, int max_count, std::initializer_list<Algo> fallbacks) {
  std::vector<Perf> perf(static_cast<size_t>(max_count));
  int got = 0;
  // A failed query leaves only the fallbacks, which the caller tries anyway.
  if (query(max_count, &got, perf.data()) != CUDNN_STATUS_SUCCESS) got = 0;
  std::vector<Algo> out;
  for (int i = 0; i < got; ++i)
    if (perf[static_cast<size_t>(i)].status == CUDNN_STATUS_SUCCESS)
      out.push_back(perf[static_cast<size_t>(i)].algo);
  for (Algo a : fallbacks) {
    bool present = false;
    for (Algo b : out) present = present || a == b;
    if (!present) out.push_back(a);
  }
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

Tensor CudaKernels::pad_nhwc(const Tensor& x, int top, int bottom, int left, int right,
                             float value) {
  const Shape& s = x.shape();
  const int64_t hp = s[1] + top + bottom, wp = s[2] + left + right;
  Tensor y = empty(Shape{s[0], hp, wp, s[3]});
  launch_pad_nhwc(fptr(x), fptr(y), s[0], s[1], s[2], s[3], top, left, hp, wp, value,
                  ctx_.stream());
  return y;
}

Tensor CudaKernels::conv2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                           const Conv2dParams& p) {
  DeviceGuard guard(ctx_.index());
  check_f32(x, "conv2d", "x");
  check_f32(w, "conv2d", "w");
  const ConvGeometry g = conv_geometry("conv2d", x.shape(), w.shape(), p);
  if (bias.defined()) {
    check_f32(bias, "conv2d", "bias");
    if (bias.shape() != Shape{g.cout})
      throw InvalidArgument(detail::str_cat("conv2d: bias ", bias.shape().to_string(),
                                            " does not match the filter's ", g.cout,
                                            " output channels"));
  }
  Tensor y = empty(Shape{g.n, g.oh, g.ow, g.cout});
  if (y.numel() == 0) return y;
  if (g.cin == 0 || g.kh == 0 || g.kw == 0) {  // an empty sum: the output is the bias alone
    launch_fill(y.raw_data(), DType::kFloat32, y.numel(), 0.f, ctx_.stream());
  } else {
    const Tensor xin =
        g.explicit_pad ? pad_nhwc(x, p.pad_top, p.pad_bottom, p.pad_left, p.pad_right, 0.f) : x;
    const Tensor wk = hwio_to_krsc(w, ctx_.spec(), ctx_.stream());
    TensorDesc xd, yd;
    FilterDesc wd;
    ConvDesc cd;
    xd.set_nhwc(g.n, g.hp, g.wp, g.cin, "conv2d");
    yd.set_nhwc(g.n, g.oh, g.ow, g.cout, "conv2d");
    wd.set_krsc(g.cout, g.kh, g.kw, g.cin, "conv2d");
    cd.set(g.pad_h, g.pad_w, p.stride_h, p.stride_w);
    const AlgoKey key{0,    g.n,    g.hp,    g.wp,    g.cin,      g.kh,
                      g.kw, g.cout, g.pad_h, g.pad_w, p.stride_h, p.stride_w};
    const float alpha = 1.f, beta = 0.f;
    auto lock = ctx_.lock_cudnn();
    cudnnHandle_t h = ctx_.cudnn();
    const int algo = run_first_supported<cudnnConvolutionFwdAlgo_t>(
        ctx_, cd, cached_algo(key),
        [&] {
          return ranked<cudnnConvolutionFwdAlgoPerf_t, cudnnConvolutionFwdAlgo_t>(
              [&](int count, int* got, cudnnConvolutionFwdAlgoPerf_t* perf) {
                return cudnnGetConvolutionForwardAlgorithm_v7(h, xd.get(), wd.get(), cd.get(),
                                                              yd.get(), count, got, perf);
              },
              CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
              {CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
               CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM});
        },
        [&](cudnnConvolutionFwdAlgo_t a, size_t* bytes) {
          return cudnnGetConvolutionForwardWorkspaceSize(h, xd.get(), wd.get(), cd.get(), yd.get(),
                                                         a, bytes);
        },
        [&](cudnnConvolutionFwdAlgo_t a, void* ws, size_t bytes) {
          return cudnnConvolutionForward(h, &alpha, xd.get(), xin.raw_data(), wd.get(),
                                         wk.raw_data(), cd.get(), a, ws, bytes, &beta, yd.get(),
                                         y.raw_data());
        },
        "cudnnConvolutionForward", describe(g, p));
    remember_algo(key, algo);
  }
  if (bias.defined())
    launch_add_bias(fptr(y), fptr(bias), g.n * g.oh * g.ow, g.cout, ctx_.stream());
  return y;
}

Tensor CudaKernels::conv2d_backward_input(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                                          const Conv2dParams& p) {
  DeviceGuard guard(ctx_.index());
  check_f32(dy, "conv2d_backward_input", "dy");
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
  const Tensor wk = hwio_to_krsc(w, ctx_.spec(), ctx_.stream());
  const Tensor dxp = g.explicit_pad ? empty(Shape{g.n, g.hp, g.wp, g.cin}) : dx;
  TensorDesc dxd, dyd;
  FilterDesc wd;
  ConvDesc cd;
  dxd.set_nhwc(g.n, g.hp, g.wp, g.cin, "conv2d_backward_input");
  dyd.set_nhwc(g.n, g.oh, g.ow, g.cout, "conv2d_backward_input");
  wd.set_krsc(g.cout, g.kh, g.kw, g.cin, "conv2d_backward_input");
  cd.set(g.pad_h, g.pad_w, p.stride_h, p.stride_w);
  const AlgoKey key{1,    g.n,    g.hp,    g.wp,    g.cin,      g.kh,
                    g.kw, g.cout, g.pad_h, g.pad_w, p.stride_h, p.stride_w};
  const float alpha = 1.f, beta = 0.f;
  {
    auto lock = ctx_.lock_cudnn();
    cudnnHandle_t h = ctx_.cudnn();
    const int algo = run_first_supported<cudnnConvolutionBwdDataAlgo_t>(
        ctx_, cd, cached_algo(key),
        [&] {
          return ranked<cudnnConvolutionBwdDataAlgoPerf_t, cudnnConvolutionBwdDataAlgo_t>(
              [&](int count, int* got, cudnnConvolutionBwdDataAlgoPerf_t* perf) {
                return cudnnGetConvolutionBackwardDataAlgorithm_v7(h, wd.get(), dyd.get(), cd.get(),
                                                                   dxd.get(), count, got, perf);
              },
              CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
              {CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, CUDNN_CONVOLUTION_BWD_DATA_ALGO_0});
        },
        [&](cudnnConvolutionBwdDataAlgo_t a, size_t* bytes) {
          return cudnnGetConvolutionBackwardDataWorkspaceSize(h, wd.get(), dyd.get(), cd.get(),
                                                              dxd.get(), a, bytes);
        },
        [&](cudnnConvolutionBwdDataAlgo_t a, void* ws, size_t bytes) {
          return cudnnConvolutionBackwardData(h, &alpha, wd.get(), wk.raw_data(), dyd.get(),
                                              dy.raw_data(), cd.get(), a, ws, bytes, &beta,
                                              dxd.get(), dxp.raw_data());
        },
        "cudnnConvolutionBackwardData", describe(g, p));
    remember_algo(key, algo);
  }
  if (g.explicit_pad)
    launch_crop_nhwc(fptr(dxp), fptr(dx), g.n, g.h, g.w, g.cin, p.pad_top, p.pad_left, g.hp, g.wp,
                     ctx_.stream());
  return dx;
}

Tensor CudaKernels::conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Shape& w_shape,
                                           const Conv2dParams& p, bool want_bias, Tensor* db) {
  DeviceGuard guard(ctx_.index());
  check_f32(x, "conv2d_backward_filter", "x");
  check_f32(dy, "conv2d_backward_filter", "dy");
  if (want_bias && !db)
    throw InvalidArgument("conv2d_backward_filter: want_bias needs a db output pointer");
  const ConvGeometry g = conv_geometry("conv2d_backward_filter", x.shape(), w_shape, p);
  if (dy.shape() != Shape{g.n, g.oh, g.ow, g.cout})
    throw InvalidArgument(detail::str_cat("conv2d_backward_filter: dy ", dy.shape().to_string(),
                                          " does not match the forward output [", g.n, ", ", g.oh,
                                          ", ", g.ow, ", ", g.cout, "] of ", describe(g, p)));
  if (want_bias) {
    Tensor b = empty(Shape{g.cout});
    launch_column_sum(fptr(dy), fptr(b), g.n * g.oh * g.ow, g.cout, ctx_);
    *db = b;
  }
  if (w_shape.numel() == 0) return empty(w_shape);
  if (dy.numel() == 0 || x.numel() == 0) {  // an empty sum
    Tensor dw = empty(w_shape);
    launch_fill(dw.raw_data(), DType::kFloat32, dw.numel(), 0.f, ctx_.stream());
    return dw;
  }
  const Tensor xin =
      g.explicit_pad ? pad_nhwc(x, p.pad_top, p.pad_bottom, p.pad_left, p.pad_right, 0.f) : x;
  Tensor dwk = empty(Shape{g.cout, g.kh, g.kw, g.cin});
  TensorDesc xd, dyd;
  FilterDesc dwd;
  ConvDesc cd;
  xd.set_nhwc(g.n, g.hp, g.wp, g.cin, "conv2d_backward_filter");
  dyd.set_nhwc(g.n, g.oh, g.ow, g.cout, "conv2d_backward_filter");
  dwd.set_krsc(g.cout, g.kh, g.kw, g.cin, "conv2d_backward_filter");
  cd.set(g.pad_h, g.pad_w, p.stride_h, p.stride_w);
  const AlgoKey key{2,    g.n,    g.hp,    g.wp,    g.cin,      g.kh,
                    g.kw, g.cout, g.pad_h, g.pad_w, p.stride_h, p.stride_w};
  const float alpha = 1.f, beta = 0.f;
  {
    auto lock = ctx_.lock_cudnn();
    cudnnHandle_t h = ctx_.cudnn();
    const int algo = run_first_supported<cudnnConvolutionBwdFilterAlgo_t>(
        ctx_, cd, cached_algo(key),
        [&] {
          return ranked<cudnnConvolutionBwdFilterAlgoPerf_t, cudnnConvolutionBwdFilterAlgo_t>(
              [&](int count, int* got, cudnnConvolutionBwdFilterAlgoPerf_t* perf) {
                return cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                    h, xd.get(), dyd.get(), cd.get(), dwd.get(), count, got, perf);
              },
              CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
              {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0});
        },
        [&](cudnnConvolutionBwdFilterAlgo_t a, size_t* bytes) {
          return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, xd.get(), dyd.get(), cd.get(),
                                                                dwd.get(), a, bytes);
        },
        [&](cudnnConvolutionBwdFilterAlgo_t a, void* ws, size_t bytes) {
          return cudnnConvolutionBackwardFilter(h, &alpha, xd.get(), xin.raw_data(), dyd.get(),
                                                dy.raw_data(), cd.get(), a, ws, bytes, &beta,
                                                dwd.get(), dwk.raw_data());
        },
        "cudnnConvolutionBackwardFilter", describe(g, p));
    remember_algo(key, algo);
  }
  return krsc_to_hwio(dwk, ctx_.spec(), ctx_.stream());
}

}  // namespace dtrain::cuda
