// Convolution and max pooling on oneDNN. Activations are NHWC in memory (what TF users pass and
// what oneDNN's brgemm kernels read without a reorder); filters are stored HWIO and reordered
// into the primitive's preferred blocked layout per call (a few KB, so cheaper than keeping a
// second copy in sync with the optimizer).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/precision.h"

namespace dtrain::cpu {
namespace {

struct ConvShapes {
  memory::dims src, wei, bias, dst, strides, pad_l, pad_r;
};

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

// Under the mixed_bfloat16 policy the convolution reads bfloat16 (src, weights, diff_dst) and
// writes float32 (dst, diff_src, diff_weights, bias): what its kernels read is rounded, nothing
// else. Without bfloat16 kernels on this CPU they read float32 rounded to bfloat16 (dnnl_util.h).
dt in_type(bool bf16) { return bf16 ? kernel_input_type() : dt::f32; }

std::string conv_key(const char* op, const ConvShapes& s, bool bias) {
  std::string k = op;
  if (mixed_bf16()) k += bf16_kernels_native() ? "@bf16" : "@bf16-emulated";
  key_dims(k, s.src);
  key_dims(k, s.wei);
  key_dims(k, s.strides);
  key_dims(k, s.pad_l);
  key_dims(k, s.pad_r);
  k += bias ? "b" : "n";
  return k;
}

dnnl::convolution_forward::desc conv_fwd_desc(const ConvShapes& s, bool bias, bool bf16) {
  const memory::desc src(s.src, in_type(bf16), tag::nhwc), dst(s.dst, dt::f32, tag::nhwc);
  const memory::desc wei(s.wei, in_type(bf16), tag::any);
  if (bias)
    return {prop_kind::forward_training,
            algorithm::convolution_direct,
            src,
            wei,
            memory::desc(s.bias, dt::f32, tag::a),
            dst,
            s.strides,
            s.pad_l,
            s.pad_r};
  return {prop_kind::forward_training,
          algorithm::convolution_direct,
          src,
          wei,
          dst,
          s.strides,
          s.pad_l,
          s.pad_r};
}

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
                 const Tensor& w, Tensor* holder) {
  memory user_mem(user, st.engine, w.raw_data());
  const bool round = mixed_bf16() && !bf16_kernels_native();
  if (user == want && !round) return user_mem;
  *holder = scratch(want.get_size(), w.device());
  memory out(want, st.engine, holder->raw_data());
  if (user == want)
    std::memcpy(holder->raw_data(), w.raw_data(), want.get_size());
  else
    dnnl::reorder(user_mem, out).execute(st.stream(), user_mem, out);
  if (round)
    round_to_bf16(static_cast<float*>(holder->raw_data()), want.get_size() / sizeof(float));
  return out;
}

struct PoolShapes {
  memory::dims src, dst, strides, kernel, pad_l, pad_r;
};

PoolShapes pool_shapes(const Shape& x, const Pool2dParams& p) {
  if (x.rank() != 4) throw InvalidArgument("max_pool2d expects [N,H,W,C], got " + x.to_string());
  const int64_t oh = conv_output_size(x[1], p.window_h, p.stride_h, p.pad_top, p.pad_bottom);
  const int64_t ow = conv_output_size(x[2], p.window_w, p.stride_w, p.pad_left, p.pad_right);
  return {{x[0], x[3], x[1], x[2]}, {x[0], x[3], oh, ow},    {p.stride_h, p.stride_w},
          {p.window_h, p.window_w}, {p.pad_top, p.pad_left}, {p.pad_bottom, p.pad_right}};
}

dnnl::pooling_forward::desc pool_fwd_desc(const PoolShapes& s) {
  return {prop_kind::forward_training,
          algorithm::pooling_max,
          memory::desc(s.src, dt::f32, tag::nhwc),
          memory::desc(s.dst, dt::f32, tag::nhwc),
          s.strides,
          s.kernel,
          s.pad_l,
          s.pad_r};
}

std::string pool_key(const char* op, const PoolShapes& s) {
  std::string k = op;
  key_dims(k, s.src);
  key_dims(k, s.kernel);
  key_dims(k, s.strides);
  key_dims(k, s.pad_l);
  key_dims(k, s.pad_r);
  return k;
}

struct PoolFwd {
  dnnl::pooling_forward::primitive_desc pd;
  dnnl::pooling_forward prim;
};
struct PoolBwd {
  dnnl::pooling_backward::primitive_desc pd;
  dnnl::pooling_backward prim;
};

std::shared_ptr<ConvFwd> conv_fwd_prim(CpuKernels::State& st, const ConvShapes& s, bool bias) {
  return st.get<ConvFwd>(conv_key("cf", s, bias), [&] {
    dnnl::convolution_forward::primitive_desc pd(conv_fwd_desc(s, bias, mixed_bf16()), st.engine);
    return std::make_shared<ConvFwd>(
        ConvFwd{pd, dnnl::convolution_forward(pd), memory::desc(s.wei, dt::f32, tag::hwio)});
  });
}

std::shared_ptr<ConvBwdData> conv_bwd_data_prim(CpuKernels::State& st, const ConvShapes& s) {
  return st.get<ConvBwdData>(conv_key("cbd", s, false), [&] {
    const bool bf16 = mixed_bf16();
    dnnl::convolution_forward::primitive_desc hint(conv_fwd_desc(s, false, bf16), st.engine);
    dnnl::convolution_backward_data::desc d(
        algorithm::convolution_direct, memory::desc(s.src, dt::f32, tag::nhwc),
        memory::desc(s.wei, in_type(bf16), tag::any), memory::desc(s.dst, in_type(bf16), tag::nhwc),
        s.strides, s.pad_l, s.pad_r);
    dnnl::convolution_backward_data::primitive_desc pd(d, st.engine, hint);
    return std::make_shared<ConvBwdData>(ConvBwdData{pd, dnnl::convolution_backward_data(pd),
                                                     memory::desc(s.wei, dt::f32, tag::hwio)});
  });
}

std::shared_ptr<ConvBwdWeights> conv_bwd_weights_prim(CpuKernels::State& st, const ConvShapes& s,
                                                      bool bias) {
  return st.get<ConvBwdWeights>(conv_key("cbw", s, bias), [&] {
    const bool bf16 = mixed_bf16();
    dnnl::convolution_forward::primitive_desc hint(conv_fwd_desc(s, bias, bf16), st.engine);
    const memory::desc src(s.src, in_type(bf16), tag::nhwc), ddst(s.dst, in_type(bf16), tag::nhwc);
    const memory::desc dwei(s.wei, dt::f32, tag::any);
    auto d =
        bias ? dnnl::convolution_backward_weights::desc(algorithm::convolution_direct, src, dwei,
                                                        memory::desc(s.bias, dt::f32, tag::a), ddst,
                                                        s.strides, s.pad_l, s.pad_r)
             : dnnl::convolution_backward_weights::desc(algorithm::convolution_direct, src, dwei,
                                                        ddst, s.strides, s.pad_l, s.pad_r);
    dnnl::convolution_backward_weights::primitive_desc pd(d, st.engine, hint);
    return std::make_shared<ConvBwdWeights>(ConvBwdWeights{
        pd, dnnl::convolution_backward_weights(pd), memory::desc(s.wei, dt::f32, tag::hwio)});
  });
}

std::shared_ptr<PoolFwd> pool_fwd_prim(CpuKernels::State& st, const PoolShapes& s) {
  return st.get<PoolFwd>(pool_key("pf", s), [&] {
    dnnl::pooling_forward::primitive_desc pd(pool_fwd_desc(s), st.engine);
    return std::make_shared<PoolFwd>(PoolFwd{pd, dnnl::pooling_forward(pd)});
  });
}

std::shared_ptr<PoolBwd> pool_bwd_prim(CpuKernels::State& st, const PoolShapes& s) {
  return st.get<PoolBwd>(pool_key("pb", s), [&] {
    dnnl::pooling_forward::primitive_desc hint(pool_fwd_desc(s), st.engine);
    dnnl::pooling_backward::desc d(algorithm::pooling_max, memory::desc(s.src, dt::f32, tag::nhwc),
                                   memory::desc(s.dst, dt::f32, tag::nhwc), s.strides, s.kernel,
                                   s.pad_l, s.pad_r);
    dnnl::pooling_backward::primitive_desc pd(d, st.engine, hint);
    return std::make_shared<PoolBwd>(PoolBwd{pd, dnnl::pooling_backward(pd)});
  });
}

Shape with_rows(const Shape& s, int64_t n) {
  std::vector<int64_t> d = s.dims();
  d[0] = n;
  return Shape(d);
}

// Images per chunk of conv2d_max_pool2d: as many as keep the chunk's convolution output within half
// of a core's L2 cache per thread (1-2 MB on current x86 servers), at least one per thread.
int64_t conv_pool_chunk(const Shape& conv_shape, int threads) {
  constexpr int64_t kBytesPerThread = 512 * 1024;
  const int64_t per_image = std::max<int64_t>(1, conv_shape[1] * conv_shape[2] * conv_shape[3] * 4);
  return std::max<int64_t>(threads, kBytesPerThread * threads / per_image);
}

// The primitives for chunks of `m` images.
struct ChunkPrims {
  ConvShapes cs;
  PoolShapes ps;
  std::shared_ptr<ConvFwd> fwd;
  std::shared_ptr<PoolFwd> pool_fwd;
  std::shared_ptr<PoolBwd> pool_bwd;
  std::shared_ptr<ConvBwdData> bwd_data;
  std::shared_ptr<ConvBwdWeights> bwd_weights;
};

ChunkPrims chunk_prims(CpuKernels::State& st, const Shape& x, const Shape& w,
                       const Conv2dParams& cp, const Pool2dParams& pp, bool bias, bool forward,
                       bool want_dx, bool want_dw) {
  ChunkPrims c;
  c.cs = conv_shapes(x, w, cp);
  c.ps = pool_shapes(Shape{c.cs.dst[0], c.cs.dst[2], c.cs.dst[3], c.cs.dst[1]}, pp);
  if (forward) {
    c.fwd = conv_fwd_prim(st, c.cs, bias);
    c.pool_fwd = pool_fwd_prim(st, c.ps);
  } else {
    c.pool_bwd = pool_bwd_prim(st, c.ps);
    if (want_dx) c.bwd_data = conv_bwd_data_prim(st, c.cs);
    if (want_dw) c.bwd_weights = conv_bwd_weights_prim(st, c.cs, bias);
  }
  return c;
}

// Checks conv2d's operands (float32, the bias's shape) and returns the shapes; `op` names the
// caller.
ConvShapes checked_conv_shapes(const char* op, const Tensor& x, const Tensor& w, const Tensor& bias,
                               const Conv2dParams& p) {
  require_f32(x, op, "input");
  require_f32(w, op, "filter");
  const ConvShapes s = conv_shapes(x.shape(), w.shape(), p);
  if (bias.defined() && bias.shape() != Shape{s.wei[0]})
    throw InvalidArgument(std::string(op) + ": bias must be [" + std::to_string(s.wei[0]) +
                          "], got " + bias.shape().to_string());
  return s;
}

// A 1x1 convolution with stride 1 and no padding on channels-last data is a matrix product over
// the N H W rows: y[NHW, Cout] = x[NHW, Cin] w[Cin, Cout] (the HWIO filter's memory as it is). Its
// forward pass already runs oneDNN's brgemm convolution, but oneDNN 2.6 runs the two backward
// passes on its older jit_1x1 kernels at about half their speed; as matrix products they run on the
// matmul primitive. (ResNet-50's 1x1 convolutions: most of its backward time.)
// DTRAIN_CPU_CONV_GEMM=0 keeps them on the convolution primitives, for comparisons.
bool conv_as_gemm(const Shape& w, const Conv2dParams& p) {
  static const bool on = [] {
    const char* v = std::getenv("DTRAIN_CPU_CONV_GEMM");
    return !(v && std::string(v) == "0");
  }();
  return on && w[0] == 1 && w[1] == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_top == 0 &&
         p.pad_bottom == 0 && p.pad_left == 0 && p.pad_right == 0;
}

}  // namespace

Tensor CpuKernels::conv2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                          const Conv2dParams& p) {
  const ConvShapes s = checked_conv_shapes("conv2d", x, w, bias, p);
  const bool has_bias = bias.defined();
  Tensor y = Tensor::empty(Shape{s.dst[0], s.dst[2], s.dst[3], s.dst[1]}, DType::kFloat32, spec_);
  if (y.numel() == 0) return y;
  try {
    auto e = conv_fwd_prim(*state_, s, has_bias);
    Tensor holder, x_holder;
    memory wm = filter_in(*state_, e->user_w, e->pd.weights_desc(), w, &holder);
    memory xm =
        filter_in(*state_, memory::desc(s.src, dt::f32, tag::nhwc), e->pd.src_desc(), x, &x_holder);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, xm},
                                         {DNNL_ARG_WEIGHTS, wm},
                                         {DNNL_ARG_DST, mem(e->pd.dst_desc(), state_->engine, y)}};
    if (has_bias) args.emplace(DNNL_ARG_BIAS, mem(e->pd.bias_desc(), state_->engine, bias));
    e->prim.execute(state_->stream(), args);
  } catch (const dnnl::error& err) {
    rethrow_dnnl("conv2d", err);
  }
  return y;
}

Tensor CpuKernels::conv2d_backward_input(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                                         const Conv2dParams& p) {
  require_f32(dy, "conv2d_backward_input", "dy");
  const ConvShapes s = conv_shapes(x_shape, w.shape(), p);
  if (conv_as_gemm(w.shape(), p) && x_shape.numel() > 0) {  // dx = dy w^T
    const int64_t cin = w.shape()[2], cout = w.shape()[3];
    return matmul(dy.view(Shape{dy.numel() / cout, cout}), w.view(Shape{cin, cout}), false, true)
        .view(x_shape);
  }
  Tensor dx = Tensor::empty(x_shape, DType::kFloat32, spec_);
  if (dx.numel() == 0) return dx;
  try {
    auto e = conv_bwd_data_prim(*state_, s);
    Tensor holder, dy_holder;
    memory wm = filter_in(*state_, e->user_w, e->pd.weights_desc(), w, &holder);
    memory dym = filter_in(*state_, memory::desc(s.dst, dt::f32, tag::nhwc), e->pd.diff_dst_desc(),
                           dy, &dy_holder);
    e->prim.execute(state_->stream(),
                    {{DNNL_ARG_DIFF_DST, dym},
                     {DNNL_ARG_WEIGHTS, wm},
                     {DNNL_ARG_DIFF_SRC, mem(e->pd.diff_src_desc(), state_->engine, dx)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("conv2d_backward_input", err);
  }
  return dx;
}

Tensor CpuKernels::conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Shape& w_shape,
                                          const Conv2dParams& p, bool want_bias, Tensor* db) {
  require_f32(x, "conv2d_backward_filter", "x");
  require_f32(dy, "conv2d_backward_filter", "dy");
  const ConvShapes s = conv_shapes(x.shape(), w_shape, p);
  if (conv_as_gemm(w_shape, p) && x.numel() > 0 && dy.numel() > 0) {  // dw = x^T dy, db = sum dy
    const int64_t cin = w_shape[2], cout = w_shape[3];
    const Tensor rows = dy.view(Shape{dy.numel() / cout, cout});
    if (want_bias) *db = reduce(ReductionKind::kSum, rows, {0}, false);
    return matmul(x.view(Shape{x.numel() / cin, cin}), rows, true, false).view(w_shape);
  }
  Tensor dw = Tensor::empty(w_shape, DType::kFloat32, spec_);
  if (want_bias) *db = Tensor::empty(Shape{s.wei[0]}, DType::kFloat32, spec_);
  if (x.numel() == 0 || dy.numel() == 0) {
    fill(dw, 0.f);
    if (want_bias) fill(*db, 0.f);
    return dw;
  }
  try {
    auto e = conv_bwd_weights_prim(*state_, s, want_bias);
    const bool direct = e->pd.diff_weights_desc() == e->user_w;
    Tensor holder = direct ? dw : scratch(e->pd.diff_weights_desc().get_size(), spec_);
    memory dwm(e->pd.diff_weights_desc(), state_->engine, holder.raw_data());
    Tensor x_holder, dy_holder;
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, filter_in(*state_, memory::desc(s.src, dt::f32, tag::nhwc), e->pd.src_desc(),
                                 x, &x_holder)},
        {DNNL_ARG_DIFF_DST, filter_in(*state_, memory::desc(s.dst, dt::f32, tag::nhwc),
                                      e->pd.diff_dst_desc(), dy, &dy_holder)},
        {DNNL_ARG_DIFF_WEIGHTS, dwm}};
    if (want_bias)
      args.emplace(DNNL_ARG_DIFF_BIAS, mem(e->pd.diff_bias_desc(), state_->engine, *db));
    e->prim.execute(state_->stream(), args);
    if (!direct) {
      memory out(e->user_w, state_->engine, dw.raw_data());
      dnnl::reorder(dwm, out).execute(state_->stream(), dwm, out);
    }
  } catch (const dnnl::error& err) {
    rethrow_dnnl("conv2d_backward_filter", err);
  }
  return dw;
}

Tensor CpuKernels::max_pool2d(const Tensor& x, const Pool2dParams& p, Tensor* workspace) {
  require_f32(x, "max_pool2d", "input");
  const PoolShapes s = pool_shapes(x.shape(), p);
  Tensor y = Tensor::empty(Shape{s.dst[0], s.dst[2], s.dst[3], s.dst[1]}, DType::kFloat32, spec_);
  if (y.numel() == 0) {
    *workspace = Tensor::empty(Shape{0}, DType::kFloat32, spec_);
    return y;
  }
  try {
    auto e = pool_fwd_prim(*state_, s);
    *workspace = scratch(e->pd.workspace_desc().get_size(), spec_);
    e->prim.execute(state_->stream(), {{DNNL_ARG_SRC, mem(e->pd.src_desc(), state_->engine, x)},
                                       {DNNL_ARG_DST, mem(e->pd.dst_desc(), state_->engine, y)},
                                       {DNNL_ARG_WORKSPACE,
                                        mem(e->pd.workspace_desc(), state_->engine, *workspace)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("max_pool2d", err);
  }
  return y;
}

Tensor CpuKernels::max_pool2d_backward(const Tensor& dy, const Tensor& x, const Tensor& workspace,
                                       const Pool2dParams& p) {
  require_f32(dy, "max_pool2d_backward", "dy");
  const PoolShapes s = pool_shapes(x.shape(), p);
  Tensor dx = Tensor::empty(x.shape(), DType::kFloat32, spec_);
  if (dy.numel() == 0) {
    fill(dx, 0.f);
    return dx;
  }
  try {
    auto e = pool_bwd_prim(*state_, s);
    e->prim.execute(state_->stream(),
                    {{DNNL_ARG_DIFF_DST, mem(e->pd.diff_dst_desc(), state_->engine, dy)},
                     {DNNL_ARG_DIFF_SRC, mem(e->pd.diff_src_desc(), state_->engine, dx)},
                     {DNNL_ARG_WORKSPACE, mem(e->pd.workspace_desc(), state_->engine, workspace)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("max_pool2d_backward", err);
  }
  return dx;
}

// The pair a chunk of images at a time: each chunk's convolution output goes to one buffer, reused
// by every chunk (so it stays in cache), and is pooled from there into its rows of the output. The
// pooling's workspace is kept whole (chunk k's at k times a full chunk's size); the convolution's
// output is not kept at all: the backward pass needs only the pooling's arg-max.
Tensor CpuKernels::conv2d_max_pool2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                                     const Conv2dParams& cp, const Pool2dParams& pp,
                                     ConvPoolSaved* saved) {
  const ConvShapes full = checked_conv_shapes("conv2d_max_pool2d", x, w, bias, cp);
  const bool has_bias = bias.defined();
  const Shape conv_shape{full.dst[0], full.dst[2], full.dst[3], full.dst[1]};
  const int64_t n = x.shape()[0];
  const int64_t chunk = conv_pool_chunk(conv_shape, state_->threads);
  if (chunk >= n) return Kernels::conv2d_max_pool2d(x, w, bias, cp, pp, saved);
  const PoolShapes pfull = pool_shapes(conv_shape, pp);
  Tensor y =
      Tensor::empty(Shape{n, pfull.dst[2], pfull.dst[3], pfull.dst[1]}, DType::kFloat32, spec_);
  if (y.numel() == 0) return Kernels::conv2d_max_pool2d(x, w, bias, cp, pp, saved);
  try {
    const int64_t tail = n % chunk;
    const ChunkPrims body = chunk_prims(*state_, with_rows(x.shape(), chunk), w.shape(), cp, pp,
                                        has_bias, true, false, false);
    ChunkPrims last;
    if (tail)
      last = chunk_prims(*state_, with_rows(x.shape(), tail), w.shape(), cp, pp, has_bias, true,
                         false, false);
    const size_t ws_chunk = body.pool_fwd->pd.workspace_desc().get_size();
    Tensor workspace = scratch(ws_chunk * static_cast<size_t>(n / chunk) +
                                   (tail ? last.pool_fwd->pd.workspace_desc().get_size() : 0),
                               spec_);
    Tensor conv_buf = Tensor::empty(with_rows(conv_shape, chunk), DType::kFloat32, spec_);
    Tensor w_body, w_last;  // the filter in each primitive's layout, reordered once
    const memory wm_body =
        filter_in(*state_, body.fwd->user_w, body.fwd->pd.weights_desc(), w, &w_body);
    memory wm_last = wm_body;
    if (tail && last.fwd->pd.weights_desc() != body.fwd->pd.weights_desc())
      wm_last = filter_in(*state_, last.fwd->user_w, last.fwd->pd.weights_desc(), w, &w_last);
    dnnl::stream& stream = state_->stream();
    for (int64_t off = 0, k = 0; off < n; off += chunk, ++k) {
      const int64_t m = std::min(chunk, n - off);
      const ChunkPrims& c = m == chunk ? body : last;
      Tensor x_holder;
      const memory xm = filter_in(*state_, memory::desc(c.cs.src, dt::f32, tag::nhwc),
                                  c.fwd->pd.src_desc(), x.slice_rows(off, off + m), &x_holder);
      const memory cm(c.fwd->pd.dst_desc(), state_->engine, conv_buf.raw_data());
      std::unordered_map<int, memory> args{{DNNL_ARG_SRC, xm},
                                           {DNNL_ARG_WEIGHTS, m == chunk ? wm_body : wm_last},
                                           {DNNL_ARG_DST, cm}};
      if (has_bias) args.emplace(DNNL_ARG_BIAS, mem(c.fwd->pd.bias_desc(), state_->engine, bias));
      c.fwd->prim.execute(stream, args);
      c.pool_fwd->prim.execute(
          stream, {{DNNL_ARG_SRC, cm},
                   {DNNL_ARG_DST,
                    mem(c.pool_fwd->pd.dst_desc(), state_->engine, y.slice_rows(off, off + m))},
                   {DNNL_ARG_WORKSPACE, memory(c.pool_fwd->pd.workspace_desc(), state_->engine,
                                               static_cast<char*>(workspace.raw_data()) +
                                                   ws_chunk * static_cast<size_t>(k))}});
    }
    saved->conv_out = Tensor();
    saved->workspace = workspace;
    saved->conv_shape = conv_shape;
    saved->chunk = chunk;
  } catch (const dnnl::error& err) {
    rethrow_dnnl("conv2d_max_pool2d", err);
  }
  return y;
}

// The backward pass chunk by chunk as well: the pooling's backward pass writes a chunk's gradient
// of the convolution output into one reused buffer, which the convolution's backward passes read
// while it is in cache. The filter's gradient is summed over the chunks in the primitive's layout
// (the same sums as one pass over the batch, in another order).
ConvPoolGrads CpuKernels::conv2d_max_pool2d_backward(const Tensor& dy, const Tensor& x,
                                                     const Tensor& w, bool has_bias,
                                                     const ConvPoolSaved& saved,
                                                     const Conv2dParams& cp, const Pool2dParams& pp,
                                                     bool want_dx, bool want_dw) {
  if (saved.chunk == 0)
    return Kernels::conv2d_max_pool2d_backward(dy, x, w, has_bias, saved, cp, pp, want_dx, want_dw);
  require_f32(dy, "conv2d_max_pool2d_backward", "dy");
  ConvPoolGrads g;
  const int64_t n = x.shape()[0], chunk = saved.chunk, tail = n % chunk;
  try {
    const ChunkPrims body = chunk_prims(*state_, with_rows(x.shape(), chunk), w.shape(), cp, pp,
                                        has_bias, false, want_dx, want_dw);
    ChunkPrims last;
    if (tail)
      last = chunk_prims(*state_, with_rows(x.shape(), tail), w.shape(), cp, pp, has_bias, false,
                         want_dx, want_dw);
    const size_t ws_chunk = body.pool_bwd->pd.workspace_desc().get_size();
    Tensor dconv = Tensor::empty(with_rows(saved.conv_shape, chunk), DType::kFloat32, spec_);
    if (want_dx) g.dx = Tensor::empty(x.shape(), DType::kFloat32, spec_);
    // Filter for the input's gradient, reordered once per primitive.
    Tensor w_body, w_last;
    memory wm_body, wm_last;
    if (want_dx) {
      wm_body =
          filter_in(*state_, body.bwd_data->user_w, body.bwd_data->pd.weights_desc(), w, &w_body);
      wm_last = wm_body;
      if (tail && last.bwd_data->pd.weights_desc() != body.bwd_data->pd.weights_desc())
        wm_last =
            filter_in(*state_, last.bwd_data->user_w, last.bwd_data->pd.weights_desc(), w, &w_last);
    }
    // Filter-gradient sums in the body primitive's layout; each chunk's part goes to `part` first.
    memory::desc acc_desc;
    Tensor acc, part, last_part, db_part;
    if (want_dw) {
      acc_desc = body.bwd_weights->pd.diff_weights_desc();
      g.dw = Tensor::empty(w.shape(), DType::kFloat32, spec_);
      // Sum straight into dw when the primitive keeps the filter's own layout (HWIO).
      acc = acc_desc == body.bwd_weights->user_w ? g.dw : scratch(acc_desc.get_size(), spec_);
      part = scratch(acc_desc.get_size(), spec_);
      if (has_bias) {
        g.db = Tensor::empty(Shape{saved.conv_shape[3]}, DType::kFloat32, spec_);
        db_part = Tensor::empty(Shape{saved.conv_shape[3]}, DType::kFloat32, spec_);
      }
      if (tail && last.bwd_weights->pd.diff_weights_desc() != acc_desc)
        last_part = scratch(last.bwd_weights->pd.diff_weights_desc().get_size(), spec_);
    }
    const size_t acc_floats = want_dw ? acc_desc.get_size() / sizeof(float) : 0;
    dnnl::stream& stream = state_->stream();
    for (int64_t off = 0, k = 0; off < n; off += chunk, ++k) {
      const int64_t m = std::min(chunk, n - off);
      const ChunkPrims& c = m == chunk ? body : last;
      const Tensor dconv_m = m == chunk ? dconv : dconv.slice_rows(0, m);
      c.pool_bwd->prim.execute(
          stream,
          {{DNNL_ARG_DIFF_DST,
            mem(c.pool_bwd->pd.diff_dst_desc(), state_->engine, dy.slice_rows(off, off + m))},
           {DNNL_ARG_DIFF_SRC, mem(c.pool_bwd->pd.diff_src_desc(), state_->engine, dconv_m)},
           {DNNL_ARG_WORKSPACE, memory(c.pool_bwd->pd.workspace_desc(), state_->engine,
                                       static_cast<char*>(saved.workspace.raw_data()) +
                                           ws_chunk * static_cast<size_t>(k))}});
      memory dconv_w;  // the chunk's gradient as the filter's backward pass reads it (bfloat16
                       // under bf16)
      Tensor dconv_holder;
      if (want_dw) {
        const bool first = off == 0;
        const bool direct = c.bwd_weights->pd.diff_weights_desc() == acc_desc;
        Tensor& out = first && direct ? acc : direct ? part : last_part;
        memory dwm(c.bwd_weights->pd.diff_weights_desc(), state_->engine, out.raw_data());
        Tensor x_holder;
        dconv_w = filter_in(*state_, memory::desc(c.cs.dst, dt::f32, tag::nhwc),
                            c.bwd_weights->pd.diff_dst_desc(), dconv_m, &dconv_holder);
        std::unordered_map<int, memory> args{
            {DNNL_ARG_SRC,
             filter_in(*state_, memory::desc(c.cs.src, dt::f32, tag::nhwc),
                       c.bwd_weights->pd.src_desc(), x.slice_rows(off, off + m), &x_holder)},
            {DNNL_ARG_DIFF_DST, dconv_w},
            {DNNL_ARG_DIFF_WEIGHTS, dwm}};
        if (has_bias)
          args.emplace(DNNL_ARG_DIFF_BIAS, mem(c.bwd_weights->pd.diff_bias_desc(), state_->engine,
                                               first ? g.db : db_part));
        c.bwd_weights->prim.execute(stream, args);
        if (!direct) {  // the tail primitive chose another layout: bring its part into the sums'
                        // layout
          memory to(acc_desc, state_->engine, part.raw_data());
          dnnl::reorder(dwm, to).execute(stream, dwm, to);
        }
        if (!first) {  // (the first chunk is a full one and wrote the sums directly)
          float* a = static_cast<float*>(acc.raw_data());
          const float* p = static_cast<const float*>(part.raw_data());
          for (size_t i = 0; i < acc_floats; ++i) a[i] += p[i];
          if (has_bias) {
            float* b = static_cast<float*>(g.db.raw_data());
            const float* q = static_cast<const float*>(db_part.raw_data());
            for (int64_t i = 0; i < g.db.numel(); ++i) b[i] += q[i];
          }
        }
      }
      if (want_dx) {
        Tensor dy_holder;
        const memory dconv_x =
            want_dw && c.bwd_data->pd.diff_dst_desc() == c.bwd_weights->pd.diff_dst_desc()
                ? dconv_w
                : filter_in(*state_, memory::desc(c.cs.dst, dt::f32, tag::nhwc),
                            c.bwd_data->pd.diff_dst_desc(), dconv_m, &dy_holder);
        c.bwd_data->prim.execute(
            stream, {{DNNL_ARG_DIFF_DST, dconv_x},
                     {DNNL_ARG_WEIGHTS, m == chunk ? wm_body : wm_last},
                     {DNNL_ARG_DIFF_SRC, mem(c.bwd_data->pd.diff_src_desc(), state_->engine,
                                             g.dx.slice_rows(off, off + m))}});
      }
    }
    if (want_dw && acc.raw_data() != g.dw.raw_data()) {
      memory from(acc_desc, state_->engine, acc.raw_data());
      memory to(body.bwd_weights->user_w, state_->engine, g.dw.raw_data());
      dnnl::reorder(from, to).execute(stream, from, to);
    }
  } catch (const dnnl::error& err) {
    rethrow_dnnl("conv2d_max_pool2d_backward", err);
  }
  return g;
}

}  // namespace dtrain::cpu
