// Batch normalization on oneDNN (training, with ReLU fused or not, inference, and their backward
// passes), over channels-last data seen as rows x channels.
#include <string>

#include "devices/cpu/dnnl_util.h"

namespace dtrain::cpu {
namespace {

struct BnFwd {
  dnnl::batch_normalization_forward::primitive_desc pd;
  dnnl::batch_normalization_forward prim;
};
struct BnBwd {
  dnnl::batch_normalization_backward::primitive_desc pd;
  dnnl::batch_normalization_backward prim;
};

// Views a channels-last tensor as [M, C] for batch norm.
memory::dims bn_dims(const Shape& s) {
  if (s.rank() < 2) throw InvalidArgument("batch norm needs rank >= 2, got " + s.to_string());
  const int64_t c = s[-1];
  return {s.numel() / c, c};
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
                                                      Tensor* relu_mask) {
  return batch_norm_forward(x, gamma, beta, eps, relu_mask);
}

// Training-mode batch norm; with `relu_mask`, ReLU fused in (fuse_norm_relu) and its bitmask
// workspace written there.
BatchNormForward CpuKernels::batch_norm_forward(const Tensor& x, const Tensor& gamma,
                                                const Tensor& beta, float eps, Tensor* relu_mask) {
  require_f32(x, "batch_norm", "x");
  const memory::dims d = bn_dims(x.shape());
  BatchNormForward out{Tensor::empty(x.shape(), DType::kFloat32, spec_),
                       Tensor::empty(Shape{d[1]}, DType::kFloat32, spec_),
                       Tensor::empty(Shape{d[1]}, DType::kFloat32, spec_)};
  if (d[0] == 0) {
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
    auto e = state_->get<BnFwd>(key, [&] {
      dnnl::batch_normalization_forward::primitive_desc pd(
          {prop_kind::forward_training, md, eps, flags}, state_->engine);
      return std::make_shared<BnFwd>(BnFwd{pd, dnnl::batch_normalization_forward(pd)});
    });
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
  Tensor y = Tensor::empty(x.shape(), DType::kFloat32, spec_);
  if (d[0] == 0) return y;
  const auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift |
                     dnnl::normalization_flags::use_global_stats;
  const memory::desc md = bn_desc(d);
  try {
    std::string key = "bni" + std::to_string(eps) + ":";
    key_dims(key, d);
    auto e = state_->get<BnFwd>(key, [&] {
      dnnl::batch_normalization_forward::primitive_desc pd(
          {prop_kind::forward_inference, md, eps, flags}, state_->engine);
      return std::make_shared<BnFwd>(BnFwd{pd, dnnl::batch_normalization_forward(pd)});
    });
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
                                                  const Tensor& var, float eps) {
  return batch_norm_backward_impl(dy, x, gamma, mean, var, eps, nullptr);
}

BatchNormBackward CpuKernels::batch_norm_relu_backward(const Tensor& dy, const Tensor& x,
                                                       const Tensor& gamma, const Tensor& mean,
                                                       const Tensor& var, float eps,
                                                       const Tensor& relu_mask) {
  return batch_norm_backward_impl(dy, x, gamma, mean, var, eps, &relu_mask);
}

BatchNormBackward CpuKernels::batch_norm_backward_impl(const Tensor& dy, const Tensor& x,
                                                       const Tensor& gamma, const Tensor& mean,
                                                       const Tensor& var, float eps,
                                                       const Tensor* relu_mask) {
  require_f32(dy, "batch_norm_backward", "dy");
  const memory::dims d = bn_dims(x.shape());
  BatchNormBackward out{Tensor::empty(x.shape(), DType::kFloat32, spec_),
                        Tensor::empty(Shape{d[1]}, DType::kFloat32, spec_),
                        Tensor::empty(Shape{d[1]}, DType::kFloat32, spec_)};
  if (d[0] == 0) {
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
    auto e = state_->get<BnBwd>(key, [&] {
      dnnl::batch_normalization_forward::primitive_desc hint(
          {prop_kind::forward_training, md, eps, flags}, state_->engine);
      dnnl::batch_normalization_backward::primitive_desc pd(
          {prop_kind::backward, md, md, eps, flags}, state_->engine, hint);
      return std::make_shared<BnBwd>(BnBwd{pd, dnnl::batch_normalization_backward(pd)});
    });
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
      if (relu_mask->nbytes() < e->pd.workspace_desc().get_size())
        throw InvalidArgument("batch_norm_relu_backward: the ReLU mask has " +
                              std::to_string(relu_mask->nbytes()) + " bytes, the kernel needs " +
                              std::to_string(e->pd.workspace_desc().get_size()) +
                              " (pass the mask batch_norm_relu_training wrote for this x)");
      args.emplace(DNNL_ARG_WORKSPACE, mem(e->pd.workspace_desc(), state_->engine, *relu_mask));
    }
    e->prim.execute(state_->stream(x.numel()), args);
  } catch (const dnnl::error& err) {
    rethrow_dnnl("batch_norm_backward", err);
  }
  return out;
}

}  // namespace dtrain::cpu
