// Convolution and max pooling on oneDNN. Activations are NHWC in memory (what TF users pass and
// what oneDNN's brgemm kernels read without a reorder); filters are stored HWIO and reordered
// into the primitive's preferred blocked layout per call (a few KB, so cheaper than keeping a
// second copy in sync with the optimizer).
#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/precision.h"

namespace dtrain::cpu {
namespace {

using dnnl::algorithm;
using dnnl::prop_kind;
using tag = memory::format_tag;
using dt = memory::data_type;

struct ConvShapes {
  memory::dims src, wei, bias, dst, strides, pad_l, pad_r;
};

ConvShapes conv_shapes(const Shape& x, const Shape& w, const Conv2dParams& p) {
  if (x.rank() != 4 || w.rank() != 4)
    throw InvalidArgument("conv2d expects x [N,H,W,C] and w [KH,KW,Cin,Cout], got " +
                          x.to_string() + " and " + w.to_string());
  if (x[3] != w[2])
    throw InvalidArgument("conv2d: input has " + std::to_string(x[3]) +
                          " channels but the filter expects " + std::to_string(w[2]) +
                          " (x " + x.to_string() + ", w " + w.to_string() + ")");
  const int64_t oh = conv_output_size(x[1], static_cast<int>(w[0]), p.stride_h, p.pad_top, p.pad_bottom);
  const int64_t ow = conv_output_size(x[2], static_cast<int>(w[1]), p.stride_w, p.pad_left, p.pad_right);
  return {{x[0], x[3], x[1], x[2]}, {w[3], w[2], w[0], w[1]}, {w[3]}, {x[0], w[3], oh, ow},
          {p.stride_h, p.stride_w}, {p.pad_top, p.pad_left}, {p.pad_bottom, p.pad_right}};
}

// Under the mixed_bfloat16 policy the convolution reads bfloat16 (src, weights, diff_dst) and
// writes float32 (dst, diff_src, diff_weights, bias): what its kernels read is rounded, nothing else.
bool mixed_bf16() { return precision_policy() == Precision::kMixedBFloat16; }
dt in_type(bool bf16) { return bf16 ? dt::bf16 : dt::f32; }

std::string conv_key(const char* op, const ConvShapes& s, bool bias) {
  std::string k = op;
  if (mixed_bf16()) k += "@bf16";
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
    return {prop_kind::forward_training, algorithm::convolution_direct, src, wei,
            memory::desc(s.bias, dt::f32, tag::a), dst, s.strides, s.pad_l, s.pad_r};
  return {prop_kind::forward_training, algorithm::convolution_direct, src, wei, dst, s.strides,
          s.pad_l, s.pad_r};
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

// Runs a reorder from the user's tensor (an HWIO filter, an NHWC activation or gradient) into `want`
// if they differ (a blocked layout, or bfloat16); returns the memory to use.
memory filter_in(CpuKernels::State& st, const memory::desc& user, const memory::desc& want,
                 const Tensor& w, Tensor* holder) {
  memory user_mem(user, st.engine, w.raw_data());
  if (user == want) return user_mem;
  *holder = scratch(want.get_size(), w.device());
  memory out(want, st.engine, holder->raw_data());
  dnnl::reorder(user_mem, out).execute(st.stream(), user_mem, out);
  return out;
}

struct PoolShapes {
  memory::dims src, dst, strides, kernel, pad_l, pad_r;
};

PoolShapes pool_shapes(const Shape& x, const Pool2dParams& p) {
  if (x.rank() != 4) throw InvalidArgument("max_pool2d expects [N,H,W,C], got " + x.to_string());
  const int64_t oh = conv_output_size(x[1], p.window_h, p.stride_h, p.pad_top, p.pad_bottom);
  const int64_t ow = conv_output_size(x[2], p.window_w, p.stride_w, p.pad_left, p.pad_right);
  return {{x[0], x[3], x[1], x[2]}, {x[0], x[3], oh, ow}, {p.stride_h, p.stride_w},
          {p.window_h, p.window_w}, {p.pad_top, p.pad_left}, {p.pad_bottom, p.pad_right}};
}

dnnl::pooling_forward::desc pool_fwd_desc(const PoolShapes& s) {
  return {prop_kind::forward_training, algorithm::pooling_max,
          memory::desc(s.src, dt::f32, tag::nhwc), memory::desc(s.dst, dt::f32, tag::nhwc),
          s.strides, s.kernel, s.pad_l, s.pad_r};
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

}  // namespace

Tensor CpuKernels::conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p) {
  require_f32(x, "conv2d", "input");
  require_f32(w, "conv2d", "filter");
  const ConvShapes s = conv_shapes(x.shape(), w.shape(), p);
  const bool has_bias = bias.defined();
  if (has_bias && bias.shape() != Shape{s.wei[0]})
    throw InvalidArgument("conv2d: bias must be [" + std::to_string(s.wei[0]) + "], got " +
                          bias.shape().to_string());
  Tensor y = Tensor::empty(Shape{s.dst[0], s.dst[2], s.dst[3], s.dst[1]}, DType::kFloat32, spec_);
  if (y.numel() == 0) return y;
  try {
    const bool bf16 = mixed_bf16();
    auto e = state_->get<ConvFwd>(conv_key("cf", s, has_bias), [&] {
      dnnl::convolution_forward::primitive_desc pd(conv_fwd_desc(s, has_bias, bf16), state_->engine);
      return std::make_shared<ConvFwd>(ConvFwd{pd, dnnl::convolution_forward(pd),
                                               memory::desc(s.wei, dt::f32, tag::hwio)});
    });
    Tensor holder, x_holder;
    memory wm = filter_in(*state_, e->user_w, e->pd.weights_desc(), w, &holder);
    memory xm = filter_in(*state_, memory::desc(s.src, dt::f32, tag::nhwc), e->pd.src_desc(), x, &x_holder);
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
  Tensor dx = Tensor::empty(x_shape, DType::kFloat32, spec_);
  if (dx.numel() == 0) return dx;
  try {
    const bool bf16 = mixed_bf16();
    auto e = state_->get<ConvBwdData>(conv_key("cbd", s, false), [&] {
      dnnl::convolution_forward::primitive_desc hint(conv_fwd_desc(s, false, bf16), state_->engine);
      dnnl::convolution_backward_data::desc d(
          algorithm::convolution_direct, memory::desc(s.src, dt::f32, tag::nhwc),
          memory::desc(s.wei, in_type(bf16), tag::any), memory::desc(s.dst, in_type(bf16), tag::nhwc),
          s.strides, s.pad_l, s.pad_r);
      dnnl::convolution_backward_data::primitive_desc pd(d, state_->engine, hint);
      return std::make_shared<ConvBwdData>(ConvBwdData{pd, dnnl::convolution_backward_data(pd),
                                                       memory::desc(s.wei, dt::f32, tag::hwio)});
    });
    Tensor holder, dy_holder;
    memory wm = filter_in(*state_, e->user_w, e->pd.weights_desc(), w, &holder);
    memory dym = filter_in(*state_, memory::desc(s.dst, dt::f32, tag::nhwc), e->pd.diff_dst_desc(), dy, &dy_holder);
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
  Tensor dw = Tensor::empty(w_shape, DType::kFloat32, spec_);
  if (want_bias) *db = Tensor::empty(Shape{s.wei[0]}, DType::kFloat32, spec_);
  if (x.numel() == 0 || dy.numel() == 0) {
    fill(dw, 0.f);
    if (want_bias) fill(*db, 0.f);
    return dw;
  }
  try {
    const bool bf16 = mixed_bf16();
    auto e = state_->get<ConvBwdWeights>(conv_key("cbw", s, want_bias), [&] {
      dnnl::convolution_forward::primitive_desc hint(conv_fwd_desc(s, want_bias, bf16), state_->engine);
      const memory::desc src(s.src, in_type(bf16), tag::nhwc), ddst(s.dst, in_type(bf16), tag::nhwc);
      const memory::desc dwei(s.wei, dt::f32, tag::any);
      auto d = want_bias ? dnnl::convolution_backward_weights::desc(
                               algorithm::convolution_direct, src, dwei,
                               memory::desc(s.bias, dt::f32, tag::a), ddst, s.strides, s.pad_l, s.pad_r)
                         : dnnl::convolution_backward_weights::desc(
                               algorithm::convolution_direct, src, dwei, ddst, s.strides, s.pad_l, s.pad_r);
      dnnl::convolution_backward_weights::primitive_desc pd(d, state_->engine, hint);
      return std::make_shared<ConvBwdWeights>(ConvBwdWeights{
          pd, dnnl::convolution_backward_weights(pd), memory::desc(s.wei, dt::f32, tag::hwio)});
    });
    const bool direct = e->pd.diff_weights_desc() == e->user_w;
    Tensor holder = direct ? dw : scratch(e->pd.diff_weights_desc().get_size(), spec_);
    memory dwm(e->pd.diff_weights_desc(), state_->engine, holder.raw_data());
    Tensor x_holder, dy_holder;
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, filter_in(*state_, memory::desc(s.src, dt::f32, tag::nhwc), e->pd.src_desc(), x, &x_holder)},
        {DNNL_ARG_DIFF_DST,
         filter_in(*state_, memory::desc(s.dst, dt::f32, tag::nhwc), e->pd.diff_dst_desc(), dy, &dy_holder)},
        {DNNL_ARG_DIFF_WEIGHTS, dwm}};
    if (want_bias) args.emplace(DNNL_ARG_DIFF_BIAS, mem(e->pd.diff_bias_desc(), state_->engine, *db));
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
    auto e = state_->get<PoolFwd>(pool_key("pf", s), [&] {
      dnnl::pooling_forward::primitive_desc pd(pool_fwd_desc(s), state_->engine);
      return std::make_shared<PoolFwd>(PoolFwd{pd, dnnl::pooling_forward(pd)});
    });
    *workspace = scratch(e->pd.workspace_desc().get_size(), spec_);
    e->prim.execute(state_->stream(),
                    {{DNNL_ARG_SRC, mem(e->pd.src_desc(), state_->engine, x)},
                     {DNNL_ARG_DST, mem(e->pd.dst_desc(), state_->engine, y)},
                     {DNNL_ARG_WORKSPACE, mem(e->pd.workspace_desc(), state_->engine, *workspace)}});
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
    auto e = state_->get<PoolBwd>(pool_key("pb", s), [&] {
      dnnl::pooling_forward::primitive_desc hint(pool_fwd_desc(s), state_->engine);
      dnnl::pooling_backward::desc d(algorithm::pooling_max, memory::desc(s.src, dt::f32, tag::nhwc),
                                     memory::desc(s.dst, dt::f32, tag::nhwc), s.strides, s.kernel,
                                     s.pad_l, s.pad_r);
      dnnl::pooling_backward::primitive_desc pd(d, state_->engine, hint);
      return std::make_shared<PoolBwd>(PoolBwd{pd, dnnl::pooling_backward(pd)});
    });
    e->prim.execute(state_->stream(),
                    {{DNNL_ARG_DIFF_DST, mem(e->pd.diff_dst_desc(), state_->engine, dy)},
                     {DNNL_ARG_DIFF_SRC, mem(e->pd.diff_src_desc(), state_->engine, dx)},
                     {DNNL_ARG_WORKSPACE, mem(e->pd.workspace_desc(), state_->engine, workspace)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("max_pool2d_backward", err);
  }
  return dx;
}

}  // namespace dtrain::cpu
