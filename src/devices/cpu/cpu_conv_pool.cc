// Convolution on oneDNN, max pooling on cpu_pool.h's loops. Activations are NHWC in memory (what TF
// users pass and what oneDNN's brgemm kernels read without a reorder); filters are stored HWIO and
// reordered into the primitive's preferred blocked layout per call (a few KB, so cheaper than
// keeping a second copy in sync with the optimizer).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "devices/cpu/cpu_conv_prims.h"
#include "devices/cpu/cpu_stream.h"
#include "devices/cpu/cpu_winograd.h"
#include "dtrain/core/precision.h"

namespace dtrain::cpu {
namespace {

// Copies between an NHWC tensor's positions x[:, ::sh, ::sw, :] and dense rows [N*Ho*Wo, C] (the
// matmul's operand), one C-element row a position, in either direction (`gather`: x -> rows).
// (oneDNN's reorder would take a strided view only where Ho*sh <= H and Wo*sw <= W.)
void sampled_rows_copy(const Shape& x, int64_t oh, int64_t ow, int sh, int sw, size_t elem,
                       char* xp, char* rows, bool gather, int threads) {
  const int64_t n = x[0], h = x[1], w = x[2];
  const size_t row = static_cast<size_t>(x[3]) * elem;
  // Row r of the result lies at image r / oh, output row r % oh: at x row (r % oh) * sh.
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < n * oh; ++r) {
    char* from = xp + static_cast<size_t>((r / oh) * h + (r % oh) * sh) * w * row;
    char* to = rows + static_cast<size_t>(r * ow) * row;
    for (int64_t j = 0; j < ow; ++j, from += sw * row, to += row) {
      if (gather)
        std::memcpy(to, from, row);
      else
        std::memcpy(from, to, row);
    }
  }
}

// The bias's gradient under mixed_bfloat16: the column sums of dy's rows [M, C] rounded to bfloat16
// (what the products read, and what oneDNN's convolutions sum from their bfloat16 diff_dst), in
// float32, row by row: a bfloat16 copy of dy and the float32 dy give the same bits.
Tensor rounded_column_sums(const Tensor& rows, DeviceSpec spec) {
  const int64_t m = rows.shape()[0], c = rows.shape()[1];
  Tensor out = Tensor::empty(Shape{c}, DType::kFloat32, spec);
  float* acc = static_cast<float*>(out.raw_data());
  std::fill(acc, acc + c, 0.f);
  if (rows.dtype() == DType::kBFloat16) {
    const uint16_t* p = static_cast<const uint16_t*>(rows.raw_data());
    for (int64_t r = 0; r < m; ++r, p += c)
      for (int64_t j = 0; j < c; ++j) acc[j] += widened_bf16(p[j]);
    return out;
  }
  Tensor row = Tensor::empty(Shape{c}, DType::kFloat32, spec);  // one row rounded at a time
  float* q = static_cast<float*>(row.raw_data());
  const float* p = static_cast<const float*>(rows.raw_data());
  for (int64_t r = 0; r < m; ++r, p += c) {
    round_to_bf16(p, q, static_cast<size_t>(c));
    for (int64_t j = 0; j < c; ++j) acc[j] += q[j];
  }
  return out;
}

void require_dy_shape(const char* op, const Tensor& dy, const ConvShapes& s, const Shape& x) {
  const Shape want{s.dst[0], s.dst[2], s.dst[3], s.dst[1]};
  if (dy.shape() != want)
    throw InvalidArgument(std::string(op) + ": dy is " + dy.shape().to_string() +
                          ", but the convolution of " + x.to_string() + " gives " +
                          want.to_string());
}

// An operand of dtrain's own Winograd kernels, which read float32: a bfloat16 copy an op kept
// widened (exact), and under mixed_bfloat16 (float32 kernels there: winograd_wanted) a float32
// operand rounded to bfloat16, as filter_in rounds the primitives' operands.
Tensor winograd_operand(Kernels& k, const Tensor& t) {
  if (t.dtype() == DType::kBFloat16) return k.cast(t, DType::kFloat32);
  if (!mixed_bf16()) return t;
  Tensor r = Tensor::empty(t.shape(), DType::kFloat32, t.device());
  round_to_bf16(static_cast<const float*>(t.raw_data()), static_cast<float*>(r.raw_data()),
                static_cast<size_t>(t.numel()));
  return r;
}

WinogradConv winograd_conv(const Conv2dParams& p, const ConvShapes& s) {
  return {p.pad_top, p.pad_left, s.dst[2], s.dst[3]};
}

}  // namespace

Tensor CpuKernels::conv2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                          const Conv2dParams& p) {
  const ConvShapes s = checked_conv_shapes("conv2d", x, w, bias, p, /*x_may_be_kept=*/true);
  const bool has_bias = bias.defined();
  // bf16_output: written so by the bfloat16 kernels; on float32 ones (mixed_bfloat16 off, or short
  // sums: conv_reads_bf16) the float32 output rounded after, the same values.
  const bool bf16_dst = p.bf16_output && conv_reads_bf16(s, mixed_bf16());
  if (p.bf16_output && !bf16_dst) {
    Conv2dParams f32 = p;
    f32.bf16_output = false;
    return cast(conv2d(x, w, bias, f32), DType::kBFloat16);
  }
  if (own_winograd(s) && x.numel() > 0)
    return winograd_conv2d(*state_, winograd_operand(*this, x), winograd_operand(*this, w), bias,
                           winograd_conv(p, s));
  Tensor y = Tensor::empty(Shape{s.dst[0], s.dst[2], s.dst[3], s.dst[1]},
                           bf16_dst ? DType::kBFloat16 : DType::kFloat32, spec_);
  if (y.numel() == 0) return y;
  try {
    auto e = conv_fwd_prim(*state_, s, has_bias, bf16_dst);
    Tensor holder, x_holder, y_holder;
    memory wm = filter_in(*state_, e->user_w, e->pd.weights_desc(), w, &holder);
    memory xm = filter_in(*state_, memory::desc(s.src, dnnl_type(x.dtype()), tag::nhwc),
                          e->pd.src_desc(), x, &x_holder);
    const memory::desc y_user(s.dst, bf16_dst ? dt::bf16 : dt::f32, tag::nhwc);
    const memory ym = out_memory(*state_, y_user, e->pd.dst_desc(), y, &y_holder);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}};
    if (has_bias) args.emplace(DNNL_ARG_BIAS, mem(e->pd.bias_desc(), state_->engine, bias));
    e->prim.execute(state_->stream(), args);
    finish_out(*state_, y_user, ym, y);
  } catch (const dnnl::error& err) {
    rethrow_dnnl("conv2d", err);
  }
  return y;
}

Tensor CpuKernels::conv2d_backward_input(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                                         const Conv2dParams& p) {
  require_f32_or_kept_bf16(dy, "conv2d_backward_input", "dy");
  require_f32(w, "conv2d_backward_input", "filter");
  const ConvShapes s = conv_shapes(x_shape, w.shape(), p);
  require_dy_shape("conv2d_backward_input", dy, s, x_shape);
  if (dy.numel() == 0) {  // no outputs (or no output channels): nothing flows back
    Tensor dx = Tensor::empty(x_shape, DType::kFloat32, spec_);
    fill(dx, 0.f);
    return dx;
  }
  if (conv_as_gemm(w.shape(), p) && x_shape.numel() > 0) {  // dx = dy w^T
    const int64_t cin = w.shape()[2], cout = w.shape()[3];
    Tensor rows =
        matmul(dy.view(Shape{dy.numel() / cout, cout}), w.view(Shape{cin, cout}), false, true);
    if (p.stride_h == 1 && p.stride_w == 1) return rows.view(x_shape);
    // Strided: the rows are dx[:, ::sh, ::sw, :]; the positions between them read nothing.
    Tensor dx = Tensor::empty(x_shape, DType::kFloat32, spec_);
    fill(dx, 0.f);
    sampled_rows_copy(x_shape, s.dst[2], s.dst[3], p.stride_h, p.stride_w, sizeof(float),
                      static_cast<char*>(dx.raw_data()), static_cast<char*>(rows.raw_data()),
                      /*gather=*/false, state_->threads);
    return dx;
  }
  if (own_winograd(s) && x_shape.numel() > 0)
    return winograd_conv2d_backward_input(*state_, winograd_operand(*this, dy),
                                          winograd_operand(*this, w), x_shape, winograd_conv(p, s));
  Tensor dx = Tensor::empty(x_shape, DType::kFloat32, spec_);
  if (dx.numel() == 0) return dx;
  try {
    auto e = conv_bwd_data_prim(*state_, s);
    Tensor holder, dy_holder, dx_holder;
    memory wm = filter_in(*state_, e->user_w, e->pd.weights_desc(), w, &holder);
    memory dym = filter_in(*state_, memory::desc(s.dst, dnnl_type(dy.dtype()), tag::nhwc),
                           e->pd.diff_dst_desc(), dy, &dy_holder);
    const memory::desc dx_user(s.src, dt::f32, tag::nhwc);
    const memory dxm = out_memory(*state_, dx_user, e->pd.diff_src_desc(), dx, &dx_holder);
    e->prim.execute(state_->stream(),
                    {{DNNL_ARG_DIFF_DST, dym}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DIFF_SRC, dxm}});
    finish_out(*state_, dx_user, dxm, dx);
  } catch (const dnnl::error& err) {
    rethrow_dnnl("conv2d_backward_input", err);
  }
  return dx;
}

Tensor CpuKernels::conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Shape& w_shape,
                                          const Conv2dParams& p, bool want_bias, Tensor* db) {
  require_f32_or_kept_bf16(x, "conv2d_backward_filter", "x");
  require_f32_or_kept_bf16(dy, "conv2d_backward_filter", "dy");
  const ConvShapes s = conv_shapes(x.shape(), w_shape, p);
  require_dy_shape("conv2d_backward_filter", dy, s, x.shape());
  if (conv_as_gemm(w_shape, p) && x.numel() > 0 && dy.numel() > 0) {  // dw = x^T dy, db = sum dy
    const int64_t cin = w_shape[2], cout = w_shape[3];
    const Tensor rows = dy.view(Shape{dy.numel() / cout, cout});
    if (want_bias)
      *db = mixed_bf16() ? rounded_column_sums(rows, spec_)
                         : reduce(ReductionKind::kSum, rows, {0}, false);
    if (p.stride_h == 1 && p.stride_w == 1)
      return matmul(x.view(Shape{x.numel() / cin, cin}), rows, true, false).view(w_shape);
    // Strided: the rows it reads, x[:, ::sh, ::sw, :], gathered (in x's type: float32, or the
    // bfloat16 copy the op kept).
    Tensor xs = Tensor::empty(Shape{dy.numel() / cout, cin}, x.dtype(), spec_);
    sampled_rows_copy(x.shape(), s.dst[2], s.dst[3], p.stride_h, p.stride_w, dtype_size(x.dtype()),
                      static_cast<char*>(x.raw_data()), static_cast<char*>(xs.raw_data()),
                      /*gather=*/true, state_->threads);
    return matmul(xs, rows, true, false).view(w_shape);
  }
  if (own_winograd(s) && x.numel() > 0 && dy.numel() > 0) {
    const int64_t cout = w_shape[3];
    const Tensor dyw = winograd_operand(*this, dy);  // (the bias's gradient sums it too)
    if (want_bias)
      *db = reduce(ReductionKind::kSum, dyw.view(Shape{dyw.numel() / cout, cout}), {0}, false);
    return winograd_conv2d_backward_filter(*state_, winograd_operand(*this, x), dyw,
                                           winograd_conv(p, s));
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
        {DNNL_ARG_SRC, filter_in(*state_, memory::desc(s.src, dnnl_type(x.dtype()), tag::nhwc),
                                 e->pd.src_desc(), x, &x_holder)},
        {DNNL_ARG_DIFF_DST,
         filter_in(*state_, memory::desc(s.dst, dnnl_type(dy.dtype()), tag::nhwc),
                   e->pd.diff_dst_desc(), dy, &dy_holder)},
        {DNNL_ARG_DIFF_WEIGHTS, dwm}};
    if (want_bias)
      args.emplace(DNNL_ARG_DIFF_BIAS, mem(e->pd.diff_bias_desc(), state_->engine, *db));
    e->prim.execute(state_->stream(), args);
    if (!direct) {
      memory out(e->user_w, state_->engine, dw.raw_data());
      dnnl::stream& stream = state_->stream();  // first: the reorder fixes its threads when made
      dnnl::reorder(dwm, out).execute(stream, dwm, out);
    }
  } catch (const dnnl::error& err) {
    rethrow_dnnl("conv2d_backward_filter", err);
  }
  return dw;
}

Tensor CpuKernels::max_pool2d(const Tensor& x, const Pool2dParams& p, Tensor* workspace) {
  require_f32(x, "max_pool2d", "input");
  const PoolGeometry g = pool_geometry(x.shape(), p);
  Tensor y = Tensor::empty(Shape{g.n, g.oh, g.ow, g.c}, DType::kFloat32, spec_);
  *workspace = scratch(max_pool_workspace_bytes(g), spec_);
  if (y.numel() == 0) return y;
  max_pool_forward(g, static_cast<const float*>(x.raw_data()), static_cast<float*>(y.raw_data()),
                   workspace->raw_data(), state_->threads);
  return y;
}

Tensor CpuKernels::max_pool2d_backward(const Tensor& dy, const Tensor& x, const Tensor& workspace,
                                       const Pool2dParams& p) {
  require_f32(dy, "max_pool2d_backward", "dy");
  const PoolGeometry g = pool_geometry(x.shape(), p);
  if (dy.shape() != Shape{g.n, g.oh, g.ow, g.c})
    throw InvalidArgument("max_pool2d_backward: dy is " + dy.shape().to_string() +
                          ", but pooling " + x.shape().to_string() + " gives " +
                          Shape{g.n, g.oh, g.ow, g.c}.to_string());
  if (static_cast<size_t>(workspace.numel()) * 4 < max_pool_workspace_bytes(g))
    throw InvalidArgument("max_pool2d_backward: the workspace (" +
                          std::to_string(workspace.numel() * 4) + " bytes) is not the one " +
                          "max_pool2d made for this input (" +
                          std::to_string(max_pool_workspace_bytes(g)) + " bytes)");
  Tensor dx = Tensor::empty(x.shape(), DType::kFloat32, spec_);
  if (dy.numel() == 0) {
    fill(dx, 0.f);
    return dx;
  }
  max_pool_backward(g, static_cast<const float*>(dy.raw_data()), workspace.raw_data(),
                    static_cast<float*>(dx.raw_data()), state_->threads);
  return dx;
}

}  // namespace dtrain::cpu
