#include "dtrain/devices/kernels.h"

#include <algorithm>
#include <vector>

#include "devices/slab_copy.h"
#include "dtrain/core/allocator.h"

namespace dtrain {

int64_t conv_output_size(int64_t in, int window, int stride, int pad_before, int pad_after) {
  if (window <= 0 || stride <= 0)
    throw InvalidArgument("window and stride must be positive, got window " +
                          std::to_string(window) + " stride " + std::to_string(stride));
  const int64_t span = in + pad_before + pad_after - window;
  if (span < 0)
    throw InvalidArgument("window " + std::to_string(window) + " is larger than the padded input " +
                          std::to_string(in + pad_before + pad_after) +
                          "; use 'same' padding or a smaller kernel");
  return span / stride + 1;
}

void Kernels::copy_slab(const Tensor& src, int axis, int64_t src_begin, Tensor& dst,
                        int64_t dst_begin, int64_t count) {
  const detail::SlabCopy c = detail::slab_copy(src, axis, src_begin, dst, dst_begin, count);
  if (c.empty()) return;
  Allocator& a = allocator_for(dst.device().host_accessible() ? src.device() : dst.device());
  for (int64_t o = 0; o < c.rows; ++o)
    a.copy(c.to + o * c.dst_pitch, dst.device(), c.from + o * c.src_pitch, src.device(),
           c.row_bytes);
}

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  const int r = std::max(a.rank(), b.rank());
  std::vector<int64_t> out(static_cast<size_t>(r));
  for (int i = 0; i < r; ++i) {
    const int ia = a.rank() - r + i, ib = b.rank() - r + i;
    const int64_t da = ia >= 0 ? a.dims()[static_cast<size_t>(ia)] : 1;
    const int64_t db = ib >= 0 ? b.dims()[static_cast<size_t>(ib)] : 1;
    if (da != db && da != 1 && db != 1)
      throw InvalidArgument("shapes " + a.to_string() + " and " + b.to_string() +
                            " cannot be broadcast together (dimension " + std::to_string(i) + ")");
    out[static_cast<size_t>(i)] = da == 1 ? db : da;
  }
  return Shape(out);
}

Tensor Kernels::conv2d_max_pool2d(const Tensor& x, const Tensor& w, const Tensor& bias,
                                  const Conv2dParams& cp, const Pool2dParams& pp,
                                  ConvPoolSaved* saved) {
  saved->conv_out = conv2d(x, w, bias, cp);
  saved->conv_shape = saved->conv_out.shape();
  saved->chunk = 0;
  return max_pool2d(saved->conv_out, pp, &saved->workspace);
}

ConvPoolGrads Kernels::conv2d_max_pool2d_backward(const Tensor& dy, const Tensor& x,
                                                  const Tensor& w, bool has_bias,
                                                  const ConvPoolSaved& saved,
                                                  const Conv2dParams& cp, const Pool2dParams& pp,
                                                  bool want_dx, bool want_dw) {
  ConvPoolGrads g;
  const Tensor dconv = max_pool2d_backward(dy, saved.conv_out, saved.workspace, pp);
  if (want_dx) g.dx = conv2d_backward_input(dconv, w, x.shape(), cp);
  if (want_dw) g.dw = conv2d_backward_filter(x, dconv, w.shape(), cp, has_bias, &g.db);
  return g;
}

Tensor Kernels::causal_softmax(const Tensor& x, float mask_value) {
  if (x.rank() < 2)
    throw InvalidArgument("causal_softmax: x must be [..., T, S], got " + x.shape().to_string());
  const int64_t t = x.shape()[-2], s = x.shape()[-1];
  std::vector<float> m(static_cast<size_t>(t * s), 0.f);
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = i + 1; j < s; ++j)  // ops::causal_mask's: key j > query i masked
      m[static_cast<size_t>(i * s + j)] = mask_value;
  return softmax(binary(BinaryOp::kAdd, x, Tensor::from_vector(m, Shape{t, s}).to(x.device())),
                 false);
}

BatchNormForward Kernels::batch_norm_relu_training(const Tensor& x, const Tensor& gamma,
                                                   const Tensor& beta, float epsilon,
                                                   Tensor* relu_mask, DType y_dtype) {
  BatchNormForward f = batch_norm_training(x, gamma, beta, epsilon);
  f.y = unary(UnaryOp::kRelu, f.y);
  *relu_mask = f.y;  // y > 0 exactly where the normalised value was
  if (y_dtype != DType::kFloat32) f.y = cast(f.y, y_dtype);
  return f;
}

BatchNormBackward Kernels::batch_norm_relu_backward(const Tensor& dy, const Tensor& x,
                                                    const Tensor& gamma, const Tensor& mean,
                                                    const Tensor& var, float epsilon,
                                                    const Tensor& relu_mask, DType dx_dtype) {
  return batch_norm_backward(activation_backward(UnaryOp::kRelu, relu_mask, dy), x, gamma, mean,
                             var, epsilon, dx_dtype);
}

}  // namespace dtrain
