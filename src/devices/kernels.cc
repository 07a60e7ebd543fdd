#include "dtrain/devices/kernels.h"

#include <algorithm>

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
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= src.shape()[i];
  for (int i = axis + 1; i < src.shape().rank(); ++i) inner *= src.shape()[i];
  const size_t elem = dtype_size(src.dtype());
  const size_t row = static_cast<size_t>(count * inner) * elem;
  if (row == 0 || outer == 0) return;
  const size_t src_pitch = static_cast<size_t>(src.shape()[axis] * inner) * elem;
  const size_t dst_pitch = static_cast<size_t>(dst.shape()[axis] * inner) * elem;
  const char* from = static_cast<const char*>(src.raw_data()) + src_begin * inner * elem;
  char* to = static_cast<char*>(dst.raw_data()) + dst_begin * inner * elem;
  Allocator& a = allocator_for(dst.device().host_accessible() ? src.device() : dst.device());
  for (int64_t o = 0; o < outer; ++o)
    a.copy(to + o * dst_pitch, dst.device(), from + o * src_pitch, src.device(), row);
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

}  // namespace dtrain
