// Batch normalization on oneDNN (training, with ReLU fused or not, inference, and their backward
// passes), over channels-last data seen as rows x channels; training on a bfloat16 input (the copy
// ops keep under mixed_bfloat16) goes to loops of our own (cpu_batch_norm_bf16.cc).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "devices/cpu/cpu_kernels.h"
#include "devices/cpu/dnnl_util.h"

namespace dtrain::cpu {

std::pair<int64_t, int64_t> batch_norm_rows(const Shape& s) {
  if (s.rank() < 2) throw InvalidArgument("batch norm needs rank >= 2, got " + s.to_string());
  int64_t m = 1;
  for (int i = 0; i + 1 < s.rank(); ++i) m *= s[i];
  return {m, s[-1]};
}

namespace {

struct BnFwd {
  dnnl::batch_normalization_forward::primitive_desc pd;
  dnnl::batch_normalization_forward prim;
};
struct BnBwd {
  dnnl::batch_normalization_backward::primitive_desc pd;
  dnnl::batch_normalization_backward prim;
};

memory::dims bn_dims(const Shape& s) {
  const auto [m, c] = batch_norm_rows(s);
  return {m, c};
}

// Batch norm's per-channel operands (gamma, beta, mean, variance): float32 [C] for x's C channels.
void require_channels(const char* op, int64_t c,
                      std::initializer_list<std::pair<const char*, const Tensor*>> operands) {
  for (const auto& [what, t] : operands) {
    require_f32(*t, op, what);
    if (t->shape() != Shape{c})
      throw InvalidArgument(std::string(op) + ": " + what + " must be [" + std::to_string(c) +
                            "] for x's " + std::to_string(c) + " channels, got " +
                            t->shape().to_string());
  }
}

// The rows x channels of bn_dims() as channels-last 4-D data (N = rows, 1 x 1 spatial): the same
// bytes as a 2-D "nc" tensor, but oneDNN 2.x gives "nc" only its plain ncsp_bnorm loop (2.3x a
// ResNet-50 step's convolution time at batch 16), and nhwc its vectorised jit kernel.
memory::desc bn_desc(const memory::dims& d) {
  return memory::desc({d[0], d[1], 1, 1}, dt::f32, tag::nhwc);
}

}  // namespace

BatchNormForward CpuKernels::batch_norm_training(const Tensor& x, const Tensor& gamma,
                                                 const Tensor& beta, float eps) {
  return batch_norm_forward(x, gamma, beta, eps, nullptr);
}

BatchNormForward CpuKernels::batch_norm_relu_training(const Tensor& x, const Tensor& gamma,
                                                      const Tensor& beta, float eps,
                                                      Tensor* relu_mask, DType y_dtype) {
  return batch_norm_forward(x, gamma, beta, eps, relu_mask, y_dtype);
}

// Training-mode batch norm; with `relu_mask`, ReLU fused in (fuse_norm_relu) and its bitmask
// workspace written there.
BatchNormForward CpuKernels::batch_norm_forward(const Tensor& x, const Tensor& gamma,
                                                const Tensor& beta, float eps, Tensor* relu_mask,
                                                DType y_dtype) {
  require_f32_or_kept_bf16(x, "batch_norm", "x");
  require_channels("batch_norm", bn_dims(x.shape())[1], {{"gamma", &gamma}, {"beta", &beta}});
  if (y_dtype != DType::kFloat32 && y_dtype != DType::kBFloat16)
    throw InvalidArgument(std::string("batch_norm: y_dtype must be float32 or bfloat16, got ") +
                          dtype_name(y_dtype));
  if (x.dtype() == DType::kBFloat16)
    return batch_norm_forward_bf16(x, gamma, beta, eps, relu_mask, y_dtype);
  if (y_dtype == DType::kBFloat16) {  // oneDNN's float32 kernel, then rounded: the same values
    BatchNormForward f = batch_norm_forward(x, gamma, beta, eps, relu_mask);
    f.y = cast(f.y, DType::kBFloat16);
    return f;
  }
  const memory::dims d = bn_dims(x.shape());
  BatchNormForward out{Tensor::empty(x.shape(), DType::kFloat32, spec_),
                       Tensor::empty(Shape{d[1]}, DType::kFloat32, spec_),
                       Tensor::empty(Shape{d[1]}, DType::kFloat32, spec_)};
  if (d[0] == 0 || d[1] == 0) {
    fill(out.mean, 0.f);
    fill(out.var, 0.f);
    if (relu_mask) *relu_mask = Tensor::empty(Shape{0}, DType::kFloat32, spec_);
    return out;
  }
  auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
  if (relu_mask) flags = flags | dnnl::normalization_flags::fuse_norm_relu;
  const memory::desc md = bn_desc(d);
  try {
    std::string key = (relu_mask ? "bnfr" : "bnf") + std::to_string(eps) + ":";
    key_dims(key, d);
    auto e = state_->get<BnFwd>(
        key,
        [&] {
          dnnl::batch_normalization_forward::primitive_desc pd(
              {prop_kind::forward_training, md, eps, flags}, state_->engine);
          return std::make_shared<BnFwd>(BnFwd{pd, dnnl::batch_normalization_forward(pd)});
        },
        x.numel());
    const memory::desc cmd({d[1]}, dt::f32, tag::a);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, mem(md, state_->engine, x)},
                                         {DNNL_ARG_DST, mem(md, state_->engine, out.y)},
                                         {DNNL_ARG_SCALE, mem(cmd, state_->engine, gamma)},
                                         {DNNL_ARG_SHIFT, mem(cmd, state_->engine, beta)},
                                         {DNNL_ARG_MEAN, mem(cmd, state_->engine, out.mean)},
                                         {DNNL_ARG_VARIANCE, mem(cmd, state_->engine, out.var)}};
    if (relu_mask) {
      *relu_mask = scratch(e->pd.workspace_desc().get_size(), spec_);
      args.emplace(DNNL_ARG_WORKSPACE, mem(e->pd.workspace_desc(), state_->engine, *relu_mask));
    }
    e->prim.execute(state_->stream(x.numel()), args);
  } catch (const dnnl::error& err) {
    rethrow_dnnl("batch_norm_training", err);
  }
  return out;
}

Tensor CpuKernels::batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                        const Tensor& mean, const Tensor& var, float eps) {
  require_f32(x, "batch_norm", "x");
  const memory::dims d = bn_dims(x.shape());
  require_channels("batch_norm", d[1],
                   {{"gamma", &gamma}, {"beta", &beta}, {"mean", &mean}, {"var", &var}});
  Tensor y = Tensor::empty(x.shape(), DType::kFloat32, spec_);
  if (d[0] == 0 || d[1] == 0) return y;
  const auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift |
                     dnnl::normalization_flags::use_global_stats;
  const memory::desc md = bn_desc(d);
  try {
    std::string key = "bni" + std::to_string(eps) + ":";
    key_dims(key, d);
    auto e = state_->get<BnFwd>(
        key,
        [&] {
          dnnl::batch_normalization_forward::primitive_desc pd(
              {prop_kind::forward_inference, md, eps, flags}, state_->engine);
          return std::make_shared<BnFwd>(BnFwd{pd, dnnl::batch_normalization_forward(pd)});
        },
        x.numel());
    const memory::desc cmd({d[1]}, dt::f32, tag::a);
    e->prim.execute(state_->stream(x.numel()),
                    {{DNNL_ARG_SRC, mem(md, state_->engine, x)},
                     {DNNL_ARG_DST, mem(md, state_->engine, y)},
                     {DNNL_ARG_SCALE, mem(cmd, state_->engine, gamma)},
                     {DNNL_ARG_SHIFT, mem(cmd, state_->engine, beta)},
                     {DNNL_ARG_MEAN, mem(cmd, state_->engine, mean)},
                     {DNNL_ARG_VARIANCE, mem(cmd, state_->engine, var)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("batch_norm_inference", err);
  }
  return y;
}

BatchNormBackward CpuKernels::batch_norm_backward(const Tensor& dy, const Tensor& x,
                                                  const Tensor& gamma, const Tensor& mean,
                                                  const Tensor& var, float eps, DType dx_dtype) {
  return batch_norm_backward_impl(dy, x, gamma, mean, var, eps, nullptr, dx_dtype);
}

BatchNormBackward CpuKernels::batch_norm_relu_backward(const Tensor& dy, const Tensor& x,
                                                       const Tensor& gamma, const Tensor& mean,
                                                       const Tensor& var, float eps,
                                                       const Tensor& relu_mask, DType dx_dtype) {
  return batch_norm_backward_impl(dy, x, gamma, mean, var, eps, &relu_mask, dx_dtype);
}

BatchNormBackward CpuKernels::batch_norm_backward_impl(const Tensor& dy_in, const Tensor& x,
                                                       const Tensor& gamma, const Tensor& mean,
                                                       const Tensor& var, float eps,
                                                       const Tensor* relu_mask, DType dx_dtype) {
  // A bfloat16 dy (the gradient of a bfloat16 output: a batch norm after this one that was handed
  // this one's bfloat16 output) is read widened.
  const Tensor dy = dy_in.dtype() == DType::kBFloat16 ? cast(dy_in, DType::kFloat32) : dy_in;
  if (dx_dtype != DType::kFloat32 && dx_dtype != DType::kBFloat16)
    throw InvalidArgument(std::string("batch_norm_backward: dx_dtype must be float32 or bfloat16, "
                                      "got ") +
                          dtype_name(dx_dtype));
  require_f32(dy, "batch_norm_backward", "dy");
  require_f32_or_kept_bf16(x, "batch_norm_backward", "x");
  require_channels("batch_norm_backward", bn_dims(x.shape())[1],
                   {{"gamma", &gamma}, {"mean", &mean}, {"var", &var}});
  if (dy.shape() != x.shape())  // (both paths: oneDNN would read x's size from a shorter dy)
    throw InvalidArgument("batch_norm_backward: dy is " + dy.shape().to_string() + ", x is " +
                          x.shape().to_string() + "; dy must have x's shape");
  if (x.dtype() == DType::kBFloat16)
    return batch_norm_backward_bf16(dy, x, gamma, mean, var, eps, relu_mask, dx_dtype);
  if (dx_dtype == DType::kBFloat16) {  // oneDNN's float32 kernel, then rounded: the same values
    BatchNormBackward b =
        batch_norm_backward_impl(dy, x, gamma, mean, var, eps, relu_mask, DType::kFloat32);
    b.dx = cast(b.dx, DType::kBFloat16);
    return b;
  }
  const memory::dims d = bn_dims(x.shape());
  BatchNormBackward out{Tensor::empty(x.shape(), DType::kFloat32, spec_),
                        Tensor::empty(Shape{d[1]}, DType::kFloat32, spec_),
                        Tensor::empty(Shape{d[1]}, DType::kFloat32, spec_)};
  if (d[0] == 0 || d[1] == 0) {
    fill(out.dgamma, 0.f);
    fill(out.dbeta, 0.f);
    return out;
  }
  auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
  if (relu_mask) flags = flags | dnnl::normalization_flags::fuse_norm_relu;
  const memory::desc md = bn_desc(d);
  try {
    std::string key = (relu_mask ? "bnbr" : "bnb") + std::to_string(eps) + ":";
    key_dims(key, d);
    auto e = state_->get<BnBwd>(
        key,
        [&] {
          dnnl::batch_normalization_forward::primitive_desc hint(
              {prop_kind::forward_training, md, eps, flags}, state_->engine);
          dnnl::batch_normalization_backward::primitive_desc pd(
              {prop_kind::backward, md, md, eps, flags}, state_->engine, hint);
          return std::make_shared<BnBwd>(BnBwd{pd, dnnl::batch_normalization_backward(pd)});
        },
        x.numel());
    const memory::desc cmd({d[1]}, dt::f32, tag::a);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, mem(md, state_->engine, x)},
        {DNNL_ARG_DIFF_DST, mem(md, state_->engine, dy)},
        {DNNL_ARG_MEAN, mem(cmd, state_->engine, mean)},
        {DNNL_ARG_VARIANCE, mem(cmd, state_->engine, var)},
        {DNNL_ARG_SCALE, mem(cmd, state_->engine, gamma)},
        // oneDNN 2.6 validates that SHIFT is passed although the backward pass does not read it.
        {DNNL_ARG_SHIFT, mem(cmd, state_->engine, out.dbeta)},
        {DNNL_ARG_DIFF_SRC, mem(md, state_->engine, out.dx)},
        {DNNL_ARG_DIFF_SCALE, mem(cmd, state_->engine, out.dgamma)},
        {DNNL_ARG_DIFF_SHIFT, mem(cmd, state_->engine, out.dbeta)}};
    if (relu_mask) {
      // The forward pass wrote oneDNN's bitmask as a float32 vector ([2, C] is the bfloat16
      // path's scale and shift: not a bitmask, though it may have as many bytes).
      if (relu_mask->dtype() != DType::kFloat32 || relu_mask->shape().rank() != 1 ||
          relu_mask->nbytes() < e->pd.workspace_desc().get_size())
        throw InvalidArgument(
            "batch_norm_relu_backward: the ReLU mask is " + relu_mask->shape().to_string() + " " +
            dtype_name(relu_mask->dtype()) + " (" + std::to_string(relu_mask->nbytes()) +
            " bytes); for this float32 x "
            "the kernel needs the float32 vector of at least " +
            std::to_string(e->pd.workspace_desc().get_size()) +
            " bytes, the mask batch_norm_relu_training wrote for this x");
      args.emplace(DNNL_ARG_WORKSPACE, mem(e->pd.workspace_desc(), state_->engine, *relu_mask));
    }
    e->prim.execute(state_->stream(x.numel()), args);
  } catch (const dnnl::error& err) {
    rethrow_dnnl("batch_norm_backward", err);
  }
  return out;
}

}  // namespace dtrain::cpu
