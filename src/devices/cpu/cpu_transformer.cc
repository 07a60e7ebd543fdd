// CpuKernels: the transformer ops. oneDNN primitives for batched matmul (3-D matmul), permute (a
// reorder reading permuted strides), softmax / log-softmax and layer normalisation; plain loops for
// the embedding gather and its scatter-add, whose sums run in index order (bitwise repeatable).
#include <cstring>

#include "devices/batch_matmul_dims.h"
#include "devices/cpu/dnnl_util.h"

namespace dtrain::cpu {
namespace {

struct Softmax {
  dnnl::primitive fwd;
  dnnl::primitive bwd;
  // oneDNN chose its reference kernel for the backward pass (its vector one is for AVX-512 only):
  // softmax_backward_rows runs instead (log-softmax's keeps oneDNN's: the same scalar exp either
  // way).
  bool bwd_reference = false;
};
struct LayerNorm {
  dnnl::layer_normalization_forward fwd;
  dnnl::layer_normalization_backward bwd;
};

int64_t rows_of(const Tensor& x) { return x.shape()[-1] == 0 ? 0 : x.numel() / x.shape()[-1]; }

}  // namespace

Tensor CpuKernels::batch_matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  require_f32_or_kept_bf16(a, "batch_matmul", "a");
  require_f32_or_kept_bf16(b, "batch_matmul", "b");
  const auto [batch, m, k, n] = detail::batch_matmul_dims(a, b, ta, tb);
  Tensor c = Tensor::empty(Shape{batch, m, n}, DType::kFloat32, spec_);
  if (c.numel() == 0) return c;
  if (k == 0) {
    fill(c, 0.f);
    return c;
  }
  // bfloat16 operands, float32 accumulation, as matmul (dnnl_util.h): on bfloat16 kernels the
  // primitive reads bfloat16 copies (in the operands' own layout; a transpose stays a stride), or
  // a bfloat16 operand (a copy the op keeps) as it is; emulated, float32 copies rounded to
  // bfloat16.
  const bool bf16 = mixed_bf16();
  const bool native = bf16 && bf16_kernels_native();
  const auto operand = [&](const Tensor& t) -> Tensor {
    if (native) return t.dtype() == DType::kBFloat16 ? t : cast(t, DType::kBFloat16);
    if (t.dtype() == DType::kBFloat16) return cast(t, DType::kFloat32);  // exact
    if (!bf16) return t;
    Tensor r = t.clone();
    round_to_bf16(static_cast<float*>(r.raw_data()), static_cast<size_t>(r.numel()));
    return r;
  };
  const Tensor ar = operand(a), br = operand(b);
  const dt in_dt = native ? dt::bf16 : dt::f32;
  // Transposes are strides: a stored [B, K, M] read as [B, M, K] with strides {K M, 1, M}.
  const memory::desc amd({batch, m, k}, in_dt,
                         ta ? memory::dims{m * k, 1, m} : memory::dims{m * k, k, 1});
  const memory::desc bmd({batch, k, n}, in_dt,
                         tb ? memory::dims{k * n, 1, k} : memory::dims{k * n, n, 1});
  const memory::desc cmd({batch, m, n}, dt::f32, memory::dims{m * n, n, 1});
  try {
    std::string key = native ? "bmm@bf16" : "bmm";
    key_dims(key, {batch, m, k, n, ta, tb});
    auto e = state_->get<MatmulPrimitive>(
        key,
        [&] {
          dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(amd, bmd, cmd), state_->engine);
          return std::make_shared<MatmulPrimitive>(MatmulPrimitive{dnnl::matmul(pd)});
        },
        batch * m * n * k / 8);
    e->prim.execute(state_->stream(batch * m * n * k / 8),
                    {{DNNL_ARG_SRC, mem(amd, state_->engine, ar)},
                     {DNNL_ARG_WEIGHTS, mem(bmd, state_->engine, br)},
                     {DNNL_ARG_DST, mem(cmd, state_->engine, c)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("batch_matmul", err);
  }
  return c;
}

Tensor CpuKernels::permute(const Tensor& x, const std::vector<int>& perm) {
  if (!x.defined() || (x.dtype() != DType::kFloat32 && x.dtype() != DType::kInt32))
    throw InvalidArgument("permute: x must be float32 or int32, got " +
                          (x.defined() ? std::string(dtype_name(x.dtype())) : "undefined"));
  const int r = x.rank();
  if (static_cast<int>(perm.size()) != r)
    throw InvalidArgument("permute: " + std::to_string(perm.size()) + " axes for " +
                          x.shape().to_string());
  memory::dims in_strides(static_cast<size_t>(r)), out_dims(static_cast<size_t>(r)),
      src_strides(static_cast<size_t>(r));
  for (int i = r - 1, s = 1; i >= 0; --i) {
    in_strides[static_cast<size_t>(i)] = s;
    s *= static_cast<int>(x.shape()[i]);
  }
  for (int i = 0; i < r; ++i) {
    out_dims[static_cast<size_t>(i)] = x.shape()[perm[static_cast<size_t>(i)]];
    src_strides[static_cast<size_t>(i)] =
        in_strides[static_cast<size_t>(perm[static_cast<size_t>(i)])];
  }
  Tensor y = Tensor::empty(Shape(std::vector<int64_t>(out_dims.begin(), out_dims.end())), x.dtype(),
                           spec_);
  if (y.numel() == 0) return y;
  if (r == 0) {
    std::memcpy(y.raw_data(), x.raw_data(), x.nbytes());
    return y;
  }
  const dt type = x.dtype() == DType::kFloat32 ? dt::f32 : dt::s32;
  const memory::desc src(out_dims, type, src_strides), dst = plain_md(out_dims, type);
  try {
    memory sm = mem(src, state_->engine, x), dm = mem(dst, state_->engine, y);
    dnnl::stream& stream = state_->stream(x.numel());  // first: the reorder fixes its threads
    dnnl::reorder(sm, dm).execute(stream, sm, dm);
  } catch (const dnnl::error& err) {
    rethrow_dnnl("permute", err);
  }
  return y;
}

Tensor CpuKernels::gather_rows(const Tensor& table, const Tensor& indices) {
  require_f32(table, "gather_rows", "table");
  if (table.rank() != 2 || !indices.defined() || indices.dtype() != DType::kInt32)
    throw InvalidArgument("gather_rows: table [V, D] float32 and int32 indices, got " +
                          table.to_string() + " and " + indices.to_string());
  const int64_t v = table.shape()[0], d = table.shape()[1], n = indices.numel();
  std::vector<int64_t> dims = indices.shape().dims();
  dims.push_back(d);
  Tensor y = Tensor::empty(Shape(dims), DType::kFloat32, spec_);
  const int32_t* idx = indices.data<int32_t>();
  const float* t = table.data<float>();
  float* out = y.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int32_t r = idx[i];
    if (r < 0 || r >= v)
      throw InvalidArgument("gather_rows: index " + std::to_string(r) + " at position " +
                            std::to_string(i) + " is outside [0, " + std::to_string(v) +
                            ") (the table's rows)");
    std::memcpy(out + i * d, t + static_cast<int64_t>(r) * d, static_cast<size_t>(d) * 4);
  }
  return y;
}

Tensor CpuKernels::scatter_add_rows(const Tensor& dy, const Tensor& indices, int64_t rows) {
  require_f32(dy, "scatter_add_rows", "dy");
  const int64_t n = indices.defined() ? indices.numel() : -1;
  if (n < 0 || indices.dtype() != DType::kInt32 || dy.rank() < 1 ||
      dy.numel() != n * dy.shape()[-1])
    throw InvalidArgument("scatter_add_rows: dy [indices..., D] for int32 indices, got " +
                          dy.to_string() + " and " + indices.to_string());
  const int64_t d = dy.shape()[-1];
  Tensor out = Tensor::zeros(Shape{rows, d}, DType::kFloat32, spec_);
  const int32_t* idx = indices.data<int32_t>();
  const float* g = dy.data<float>();
  float* o = out.data<float>();
  for (int64_t i = 0; i < n; ++i) {  // index order: the same sums on every run
    const int32_t r = idx[i];
    if (r < 0 || r >= rows)
      throw InvalidArgument("scatter_add_rows: index " + std::to_string(r) + " outside [0, " +
                            std::to_string(rows) + ")");
    float* dst = o + static_cast<int64_t>(r) * d;
    const float* src = g + i * d;
    for (int64_t j = 0; j < d; ++j) dst[j] += src[j];
  }
  return out;
}

namespace {

// The forward and backward softmax (or log-softmax) primitives for [rows, c].
std::shared_ptr<Softmax> softmax_prims(CpuKernels::State& st, int64_t rows, int64_t c, bool log) {
  std::string key = log ? "logsoftmax" : "softmax";
  key_dims(key, {rows, c});
  return st.get<Softmax>(
      key,
      [&] {
        const memory::desc md = plain_md({rows, c});
        if (log) {
          dnnl::logsoftmax_forward::primitive_desc f({prop_kind::forward_training, md, 1},
                                                     st.engine);
          dnnl::logsoftmax_backward::primitive_desc b({md, md, 1}, st.engine, f);
          return std::make_shared<Softmax>(
              Softmax{dnnl::logsoftmax_forward(f), dnnl::logsoftmax_backward(b)});
        }
        dnnl::softmax_forward::primitive_desc f({prop_kind::forward_training, md, 1}, st.engine);
        dnnl::softmax_backward::primitive_desc b({md, md, 1}, st.engine, f);
        const bool reference = std::string(b.impl_info_str()).rfind("ref", 0) == 0;
        return std::make_shared<Softmax>(
            Softmax{dnnl::softmax_forward(f), dnnl::softmax_backward(b), reference});
      },
      rows * c);
}

std::shared_ptr<LayerNorm> layer_norm_prims(CpuKernels::State& st, int64_t rows, int64_t c,
                                            float eps) {
  std::string key = "ln" + std::to_string(eps) + ":";
  key_dims(key, {rows, c});
  return st.get<LayerNorm>(
      key,
      [&] {
        const memory::desc md = plain_md({rows, c}), stat = plain_md({rows});
        const auto flags =
            dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
        dnnl::layer_normalization_forward::primitive_desc f(
            {prop_kind::forward_training, md, stat, eps, flags}, st.engine);
        dnnl::layer_normalization_backward::primitive_desc b(
            {prop_kind::backward, md, md, stat, eps, flags}, st.engine, f);
        return std::make_shared<LayerNorm>(
            LayerNorm{dnnl::layer_normalization_forward(f), dnnl::layer_normalization_backward(b)});
      },
      rows * c);
}

}  // namespace

Tensor CpuKernels::softmax(const Tensor& x, bool log) {
  require_f32(x, "softmax", "x");
  if (x.rank() < 1) throw InvalidArgument("softmax: x must have rank >= 1, got a scalar");
  Tensor y = Tensor::empty(x.shape(), DType::kFloat32, spec_);
  const int64_t rows = rows_of(x), c = x.shape()[-1];
  if (y.numel() == 0) return y;
  try {
    auto p = softmax_prims(*state_, rows, c, log);
    const memory::desc md = plain_md({rows, c});
    p->fwd.execute(state_->stream(x.numel()), {{DNNL_ARG_SRC, mem(md, state_->engine, x)},
                                               {DNNL_ARG_DST, mem(md, state_->engine, y)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("softmax", err);
  }
  return y;
}

Tensor CpuKernels::softmax_backward(const Tensor& y, const Tensor& dy, bool log) {
  require_f32(y, "softmax_backward", "y");
  require_f32(dy, "softmax_backward", "dy");
  if (y.shape() != dy.shape() || y.rank() < 1)
    throw InvalidArgument("softmax_backward: y " + y.shape().to_string() + " vs dy " +
                          dy.shape().to_string());
  Tensor dx = Tensor::empty(y.shape(), DType::kFloat32, spec_);
  const int64_t rows = rows_of(y), c = y.shape()[-1];
  if (dx.numel() == 0) return dx;
  try {
    auto p = softmax_prims(*state_, rows, c, log);
    if (p->bwd_reference) {
      softmax_backward_rows(y.data<float>(), dy.data<float>(), dx.data<float>(), rows, c,
                            state_->threads);
      return dx;
    }
    const memory::desc md = plain_md({rows, c});
    p->bwd.execute(state_->stream(y.numel()), {{DNNL_ARG_DST, mem(md, state_->engine, y)},
                                               {DNNL_ARG_DIFF_DST, mem(md, state_->engine, dy)},
                                               {DNNL_ARG_DIFF_SRC, mem(md, state_->engine, dx)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("softmax_backward", err);
  }
  return dx;
}

LayerNormForward CpuKernels::layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                        float epsilon) {
  require_f32(x, "layer_norm", "x");
  require_f32(gamma, "layer_norm", "gamma");
  require_f32(beta, "layer_norm", "beta");
  if (x.rank() < 1 || gamma.shape() != Shape{x.shape()[-1]} || beta.shape() != gamma.shape())
    throw InvalidArgument("layer_norm: gamma and beta must be [C] for x [..., C], got " +
                          gamma.shape().to_string() + ", " + beta.shape().to_string() + " for " +
                          x.shape().to_string());
  const int64_t rows = rows_of(x), c = x.shape()[-1];
  LayerNormForward f{Tensor::empty(x.shape(), DType::kFloat32, spec_),
                     Tensor::empty(Shape{rows}, DType::kFloat32, spec_),
                     Tensor::empty(Shape{rows}, DType::kFloat32, spec_)};
  if (x.numel() == 0) return f;
  try {
    auto p = layer_norm_prims(*state_, rows, c, epsilon);
    const memory::desc md = plain_md({rows, c}), stat = plain_md({rows}), ch = plain_md({c});
    const dnnl::engine& eng = state_->engine;
    p->fwd.execute(state_->stream(x.numel()), {{DNNL_ARG_SRC, mem(md, eng, x)},
                                               {DNNL_ARG_DST, mem(md, eng, f.y)},
                                               {DNNL_ARG_SCALE, mem(ch, eng, gamma)},
                                               {DNNL_ARG_SHIFT, mem(ch, eng, beta)},
                                               {DNNL_ARG_MEAN, mem(stat, eng, f.mean)},
                                               {DNNL_ARG_VARIANCE, mem(stat, eng, f.var)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("layer_norm", err);
  }
  return f;
}

LayerNormBackward CpuKernels::layer_norm_backward(const Tensor& dy, const Tensor& x,
                                                  const Tensor& gamma, const Tensor& mean,
                                                  const Tensor& var, float epsilon) {
  require_f32(dy, "layer_norm_backward", "dy");
  require_f32(x, "layer_norm_backward", "x");
  if (dy.shape() != x.shape() || x.rank() < 1)
    throw InvalidArgument("layer_norm_backward: dy " + dy.shape().to_string() + " vs x " +
                          x.shape().to_string());
  const int64_t rows = rows_of(x), c = x.shape()[-1];
  LayerNormBackward b{Tensor::empty(x.shape(), DType::kFloat32, spec_),
                      Tensor::zeros(Shape{c}, DType::kFloat32, spec_),
                      Tensor::zeros(Shape{c}, DType::kFloat32, spec_)};
  if (x.numel() == 0) return b;
  try {
    auto p = layer_norm_prims(*state_, rows, c, epsilon);
    const memory::desc md = plain_md({rows, c}), stat = plain_md({rows}), ch = plain_md({c});
    const dnnl::engine& eng = state_->engine;
    p->bwd.execute(state_->stream(x.numel()),
                   {{DNNL_ARG_SRC, mem(md, eng, x)},
                    {DNNL_ARG_DIFF_DST, mem(md, eng, dy)},
                    {DNNL_ARG_SCALE, mem(ch, eng, gamma)},
                    // oneDNN 2.x asks for the shift here too, though the gradients do not read it.
                    {DNNL_ARG_SHIFT, mem(ch, eng, b.dbeta)},
                    {DNNL_ARG_MEAN, mem(stat, eng, mean)},
                    {DNNL_ARG_VARIANCE, mem(stat, eng, var)},
                    {DNNL_ARG_DIFF_SRC, mem(md, eng, b.dx)},
                    {DNNL_ARG_DIFF_SCALE, mem(ch, eng, b.dgamma)},
                    {DNNL_ARG_DIFF_SHIFT, mem(ch, eng, b.dbeta)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("layer_norm_backward", err);
  }
  return b;
}

}  // namespace dtrain::cpu
