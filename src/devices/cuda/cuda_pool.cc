// CudaKernels: NHWC max pooling with cuDNN.
//
// Padded positions never win the max (TensorFlow and oneDNN semantics). Rather than rely on how
// cuDNN treats its own padding, any padding is applied explicitly with -inf and cuDNN pools the
// padded tensor without padding; the input gradient is cropped back. The backward pass needs the
// forward output y, which is therefore the "workspace" this device returns from max_pool2d.
#include <cmath>
#include <mutex>

#include "devices/cuda/cuda_check.h"
#include "devices/cuda/cuda_cudnn.h"
#include "devices/cuda/cuda_guard.h"
#include "devices/cuda/cuda_kernels.h"
#include "devices/cuda/cuda_launch.h"
#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain::cuda {
namespace {

struct PoolGeometry {
  int64_t n, h, w, c, oh, ow;
  bool padded;
  int64_t hp, wp;  // input height/width after explicit padding
};

PoolGeometry pool_geometry(const char* op, const Shape& x, const Pool2dParams& p) {
  if (x.rank() != 4)
    throw InvalidArgument(detail::str_cat(op, ": x must be [N, H, W, C], got ", x.to_string()));
  if (p.window_h < 1 || p.window_w < 1 || p.stride_h < 1 || p.stride_w < 1 || p.pad_top < 0 ||
      p.pad_bottom < 0 || p.pad_left < 0 || p.pad_right < 0)
    throw InvalidArgument(detail::str_cat(op, ": window and strides must be >= 1 and padding >= 0",
                                          ", got window ", p.window_h, "x", p.window_w, " stride ",
                                          p.stride_h, "x", p.stride_w, " padding ", p.pad_top, ",",
                                          p.pad_bottom, ",", p.pad_left, ",", p.pad_right));
  PoolGeometry g{};
  g.n = x[0];
  g.h = x[1];
  g.w = x[2];
  g.c = x[3];
  g.oh = conv_output_size(g.h, p.window_h, p.stride_h, p.pad_top, p.pad_bottom);
  g.ow = conv_output_size(g.w, p.window_w, p.stride_w, p.pad_left, p.pad_right);
  g.padded = p.pad_top || p.pad_bottom || p.pad_left || p.pad_right;
  g.hp = g.h + p.pad_top + p.pad_bottom;
  g.wp = g.w + p.pad_left + p.pad_right;
  if ((g.hp - p.window_h) / p.stride_h + 1 != g.oh || (g.wp - p.window_w) / p.stride_w + 1 != g.ow)
    throw Internal(detail::str_cat(op, ": output size ", g.oh, "x", g.ow,
                                   " disagrees with cuDNN's for x ", x.to_string()));
  return g;
}

// Runs a cuDNN pooling call with deterministic max pooling, falling back to plain max pooling
// (same forward result; the backward may sum overlapping windows in another order) where this
// cuDNN does not support the deterministic mode.
template <typename Fn>
void run_pooling(PoolDesc& pd, const Pool2dParams& p, const char* call, Fn fn) {
  pd.set_max(CUDNN_POOLING_MAX_DETERMINISTIC, p.window_h, p.window_w, p.stride_h, p.stride_w);
  cudnnStatus_t st = fn();
  if (st == CUDNN_STATUS_SUCCESS) return;
  if (CUDNN_STATUS_CATEGORY(st) == CUDNN_STATUS_NOT_SUPPORTED) {
    static std::once_flag logged;
    std::call_once(logged, [&] {
      DTRAIN_LOG(WARNING) << call << ": cuDNN does not support CUDNN_POOLING_MAX_DETERMINISTIC ("
                          << cudnnGetErrorString(st) << "); using CUDNN_POOLING_MAX";
    });
    pd.set_max(CUDNN_POOLING_MAX, p.window_h, p.window_w, p.stride_h, p.stride_w);
    st = fn();
    if (st == CUDNN_STATUS_SUCCESS) return;
  }
  throw_cudnn_error(st, call, __FILE__, __LINE__);
}

}  // namespace

Tensor CudaKernels::max_pool2d(const Tensor& x, const Pool2dParams& p, Tensor* workspace) {
  DeviceGuard guard(ctx_.index());
  check_f32(x, "max_pool2d", "x");
  if (p.relu)
    throw InvalidArgument(
        "max_pool2d: this device does not fuse a ReLU into its pooling (fuses_pool_relu() is "
        "false); apply ops::relu to the pooled output");
  const PoolGeometry g = pool_geometry("max_pool2d", x.shape(), p);
  Tensor y = empty(Shape{g.n, g.oh, g.ow, g.c});
  if (y.numel() > 0) {
    const Tensor xin =
        g.padded ? pad_nhwc(x, p.pad_top, p.pad_bottom, p.pad_left, p.pad_right, -INFINITY) : x;
    TensorDesc xd, yd;
    PoolDesc pd;
    xd.set_nhwc(g.n, g.hp, g.wp, g.c, "max_pool2d");
    yd.set_nhwc(g.n, g.oh, g.ow, g.c, "max_pool2d");
    const float alpha = 1.f, beta = 0.f;
    auto lock = ctx_.lock_cudnn();
    run_pooling(pd, p, "cudnnPoolingForward", [&] {
      return cudnnPoolingForward(ctx_.cudnn(), pd.get(), &alpha, xd.get(), xin.raw_data(), &beta,
                                 yd.get(), y.raw_data());
    });
  }
  if (workspace) *workspace = y;
  return y;
}

Tensor CudaKernels::max_pool2d_backward(const Tensor& dy, const Tensor& x, const Tensor& workspace,
                                        const Pool2dParams& p) {
  DeviceGuard guard(ctx_.index());
  check_f32(dy, "max_pool2d_backward", "dy");
  check_f32(x, "max_pool2d_backward", "x");
  const PoolGeometry g = pool_geometry("max_pool2d_backward", x.shape(), p);
  const Shape y_shape{g.n, g.oh, g.ow, g.c};
  if (dy.shape() != y_shape)
    throw InvalidArgument(detail::str_cat("max_pool2d_backward: dy ", dy.shape().to_string(),
                                          " does not match the pooled shape ", y_shape.to_string(),
                                          " of x ", x.shape().to_string()));
  // The workspace is the forward output; recompute it when the caller did not keep it.
  Tensor y;
  if (workspace.defined()) {
    check_f32(workspace, "max_pool2d_backward", "workspace");
    if (workspace.shape() != y_shape)
      throw InvalidArgument(detail::str_cat(
          "max_pool2d_backward: workspace ", workspace.shape().to_string(),
          " is not this device's max_pool2d workspace for x ", x.shape().to_string(),
          " (expected the forward output ", y_shape.to_string(), ")"));
    y = workspace;
  } else {
    y = max_pool2d(x, p, nullptr);
  }
  Tensor dx = empty(x.shape());
  if (dx.numel() == 0) return dx;
  if (dy.numel() == 0) {
    launch_fill(dx.raw_data(), DType::kFloat32, dx.numel(), 0.f, ctx_.stream());
    return dx;
  }
  const Tensor xin =
      g.padded ? pad_nhwc(x, p.pad_top, p.pad_bottom, p.pad_left, p.pad_right, -INFINITY) : x;
  const Tensor dxp = g.padded ? empty(Shape{g.n, g.hp, g.wp, g.c}) : dx;
  TensorDesc xd, yd;
  PoolDesc pd;
  xd.set_nhwc(g.n, g.hp, g.wp, g.c, "max_pool2d_backward");
  yd.set_nhwc(g.n, g.oh, g.ow, g.c, "max_pool2d_backward");
  const float alpha = 1.f, beta = 0.f;
  {
    auto lock = ctx_.lock_cudnn();
    run_pooling(pd, p, "cudnnPoolingBackward", [&] {
      return cudnnPoolingBackward(ctx_.cudnn(), pd.get(), &alpha, yd.get(), y.raw_data(), yd.get(),
                                  dy.raw_data(), xd.get(), xin.raw_data(), &beta, xd.get(),
                                  dxp.raw_data());
    });
  }
  if (g.padded)
    launch_crop_nhwc(static_cast<const float*>(dxp.raw_data()), static_cast<float*>(dx.raw_data()),
                     g.n, g.h, g.w, g.c, p.pad_top, p.pad_left, g.hp, g.wp, ctx_.stream());
  return dx;
}

}  // namespace dtrain::cuda
