// conv2d + max_pool2d as one kernel on the CPU: the batch in chunks small enough that each chunk's
// convolution output is pooled while it is still in the core's cache (Kernels::conv2d_max_pool2d).
#include <algorithm>
#include <string>
#include <vector>

#include "devices/cpu/cpu_conv_prims.h"
#include "dtrain/core/precision.h"

namespace dtrain::cpu {
namespace {

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
  PoolGeometry ps;
  std::shared_ptr<ConvFwd> fwd;
  std::shared_ptr<ConvBwdData> bwd_data;
  std::shared_ptr<ConvBwdWeights> bwd_weights;
};

ChunkPrims chunk_prims(CpuKernels::State& st, const Shape& x, const Shape& w,
                       const Conv2dParams& cp, const Pool2dParams& pp, bool bias, bool forward,
                       bool want_dx, bool want_dw) {
  ChunkPrims c;
  c.cs = conv_shapes(x, w, cp);
  c.ps = pool_geometry(Shape{c.cs.dst[0], c.cs.dst[2], c.cs.dst[3], c.cs.dst[1]}, pp);
  if (forward) {
    c.fwd = conv_fwd_prim(st, c.cs, bias);
  } else {
    if (want_dx) c.bwd_data = conv_bwd_data_prim(st, c.cs);
    if (want_dw) c.bwd_weights = conv_bwd_weights_prim(st, c.cs, bias);
  }
  return c;
}

}  // namespace

// The pair a chunk of images at a time: each chunk's convolution output goes to one buffer, reused
// by every chunk (so it stays in cache), and is pooled from there into its rows of the output. The
// pooling's workspace is kept whole (chunk k's at k times a full chunk's size); the convolution's
// output is not kept at all: the backward pass needs only the pooling's arg-max.
Tensor CpuKernels::conv2d_max_pool2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                                     const Conv2dParams& cp, const Pool2dParams& pp,
                                     ConvPoolSaved* saved) {
  const DirectConvolutionsOnly direct;  // the same algorithm in both paths, whatever the batch
  const ConvShapes full = checked_conv_shapes("conv2d_max_pool2d", x, w, bias, cp);
  const bool has_bias = bias.defined();
  const Shape conv_shape{full.dst[0], full.dst[2], full.dst[3], full.dst[1]};
  const int64_t n = x.shape()[0];
  const int64_t chunk = conv_pool_chunk(conv_shape, state_->threads);
  if (chunk >= n) return Kernels::conv2d_max_pool2d(x, w, bias, cp, pp, saved);
  const PoolGeometry pfull = pool_geometry(conv_shape, pp);
  Tensor y = Tensor::empty(Shape{n, pfull.oh, pfull.ow, pfull.c}, DType::kFloat32, spec_);
  if (y.numel() == 0) return Kernels::conv2d_max_pool2d(x, w, bias, cp, pp, saved);
  try {
    const int64_t tail = n % chunk;
    const ChunkPrims body = chunk_prims(*state_, with_rows(x.shape(), chunk), w.shape(), cp, pp,
                                        has_bias, true, false, false);
    ChunkPrims last;
    if (tail)
      last = chunk_prims(*state_, with_rows(x.shape(), tail), w.shape(), cp, pp, has_bias, true,
                         false, false);
    // The pooling loops read the convolution's output as NHWC: what a direct convolution writes.
    if (body.fwd->pd.dst_desc() != memory::desc(body.cs.dst, dt::f32, tag::nhwc))
      throw Internal("conv2d_max_pool2d: the convolution's output is not NHWC");
    const size_t ws_chunk = max_pool_workspace_bytes(body.ps);
    Tensor workspace = scratch(
        ws_chunk * static_cast<size_t>(n / chunk) + (tail ? max_pool_workspace_bytes(last.ps) : 0),
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
      max_pool_forward(c.ps, static_cast<const float*>(conv_buf.raw_data()),
                       static_cast<float*>(y.slice_rows(off, off + m).raw_data()),
                       static_cast<char*>(workspace.raw_data()) + ws_chunk * static_cast<size_t>(k),
                       state_->threads);
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
  const DirectConvolutionsOnly direct;
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
    const size_t ws_chunk = max_pool_workspace_bytes(body.ps);
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
      // Under mixed bfloat16, float32 kernels read the gradient rounded to bfloat16 (a rounded
      // copy, filter_in): where every kernel here reads it so, the pooling's backward pass writes
      // it rounded instead, and they read it in place.
      const memory::desc dconv_user(c.cs.dst, dt::f32, tag::nhwc);
      PoolGeometry pool = c.ps;
      pool.round_dx = mixed_bf16() &&
                      (!want_dw || c.bwd_weights->pd.diff_dst_desc() == dconv_user) &&
                      (!want_dx || c.bwd_data->pd.diff_dst_desc() == dconv_user);
      max_pool_backward(
          pool, static_cast<const float*>(dy.slice_rows(off, off + m).raw_data()),
          static_cast<const char*>(saved.workspace.raw_data()) + ws_chunk * static_cast<size_t>(k),
          static_cast<float*>(dconv_m.raw_data()), state_->threads);
      memory dconv_w;  // the chunk's gradient as the filter's backward pass reads it (bfloat16
                       // under bf16)
      Tensor dconv_holder;
      if (want_dw) {
        const bool first = off == 0;
        const bool direct = c.bwd_weights->pd.diff_weights_desc() == acc_desc;
        Tensor& out = first && direct ? acc : direct ? part : last_part;
        memory dwm(c.bwd_weights->pd.diff_weights_desc(), state_->engine, out.raw_data());
        Tensor x_holder;
        dconv_w = pool.round_dx ? mem(dconv_user, state_->engine, dconv_m)
                                : filter_in(*state_, dconv_user, c.bwd_weights->pd.diff_dst_desc(),
                                            dconv_m, &dconv_holder);
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
            want_dw && c.bwd_data->pd.diff_dst_desc() == c.bwd_weights->pd.diff_dst_desc() ? dconv_w
            : pool.round_dx ? mem(dconv_user, state_->engine, dconv_m)
                            : filter_in(*state_, dconv_user, c.bwd_data->pd.diff_dst_desc(),
                                        dconv_m, &dy_holder);
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
