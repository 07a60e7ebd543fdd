// Joining and slicing: concat, slice, split, zero_pad2d. Each backward is made of the others, so
// they differentiate to any order.
#include <numeric>

#include "dtrain/devices/device.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"
#include "model/op_util.h"

namespace dtrain::ops {
namespace {

int normalize_axis(int axis, int rank, const char* op) {
  const int a = axis < 0 ? axis + rank : axis;
  if (a < 0 || a >= rank)
    throw InvalidArgument(std::string(op) + ": axis " + std::to_string(axis) +
                          " is out of range for rank " + std::to_string(rank));
  return a;
}

Tensor zeros_along(const Tensor& like, int axis, int64_t size) {
  std::vector<int64_t> d = like.shape().dims();
  d[static_cast<size_t>(axis)] = size;
  Tensor z = Tensor::empty(Shape(d), like.dtype(), like.device());
  kernels_for(like).fill(z, 0.f);
  return z;
}

}  // namespace

Tensor concat(const std::vector<Tensor>& xs, int axis) {
  if (xs.empty()) throw InvalidArgument("concat: no tensors");
  const Shape& first = xs[0].shape();
  const int a = normalize_axis(axis, first.rank(), "concat");
  std::vector<int64_t> d = first.dims();
  d[static_cast<size_t>(a)] = 0;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < xs.size(); ++i) {
    const Shape& s = xs[i].shape();
    bool fits = s.rank() == first.rank() && xs[i].dtype() == xs[0].dtype();
    for (int k = 0; fits && k < s.rank(); ++k) fits = k == a || s[k] == first[k];
    if (!fits)
      throw InvalidArgument("concat on axis " + std::to_string(axis) + ": tensor " +
                            std::to_string(i) + " is " + xs[i].to_string() +
                            ", which does not fit tensor 0, " + xs[0].to_string() +
                            " (all dimensions but the axis must be equal)");
    same_device("concat", xs[0], xs[i]);
    sizes.push_back(s[a]);
    d[static_cast<size_t>(a)] += s[a];
  }
  Tensor y = Tensor::empty(Shape(d), xs[0].dtype(), xs[0].device());
  Kernels& k = kernels_for(xs[0]);
  int64_t at = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    k.copy_slab(xs[i], a, 0, y, at, sizes[i]);
    at += sizes[i];
  }
  if (tape::should_record(xs)) {
    tape::record("concat", xs, {y}, [a, sizes](const std::vector<Tensor>& g) {
      std::vector<Tensor> out;
      int64_t begin = 0;
      for (size_t i = 0; i < sizes.size(); ++i) {
        out.push_back(tape::needs_gradient(static_cast<int>(i)) ? slice(g[0], a, begin, sizes[i])
                                                                : Tensor());
        begin += sizes[i];
      }
      return out;
    });
  }
  return y;
}

Tensor slice(const Tensor& x, int axis, int64_t begin, int64_t size) {
  const int a = normalize_axis(axis, x.shape().rank(), "slice");
  const int64_t n = x.shape()[a];
  if (begin < 0 || size < 0 || begin + size > n)
    throw InvalidArgument("slice of " + x.to_string() + " on axis " + std::to_string(axis) + ": [" +
                          std::to_string(begin) + ", " + std::to_string(begin + size) +
                          ") is outside [0, " + std::to_string(n) + ")");
  std::vector<int64_t> d = x.shape().dims();
  d[static_cast<size_t>(a)] = size;
  Tensor y = Tensor::empty(Shape(d), x.dtype(), x.device());
  kernels_for(x).copy_slab(x, a, begin, y, 0, size);
  if (tape::should_record({&x})) {
    tape::record("slice", {x}, {y}, [a, begin, size, n](const std::vector<Tensor>& g) {
      std::vector<Tensor> parts;
      if (begin > 0) parts.push_back(zeros_along(g[0], a, begin));
      parts.push_back(g[0]);
      if (begin + size < n) parts.push_back(zeros_along(g[0], a, n - begin - size));
      return std::vector<Tensor>{parts.size() == 1 ? parts[0] : concat(parts, a)};
    });
  }
  return y;
}

std::vector<Tensor> split(const Tensor& x, int axis, const std::vector<int64_t>& sizes) {
  const int a = normalize_axis(axis, x.shape().rank(), "split");
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  if (total != x.shape()[a])
    throw InvalidArgument("split of " + x.to_string() + " on axis " + std::to_string(axis) +
                          ": the sizes add up to " + std::to_string(total) + ", not " +
                          std::to_string(x.shape()[a]));
  std::vector<Tensor> out;
  int64_t begin = 0;
  for (int64_t s : sizes) {
    out.push_back(slice(x, a, begin, s));
    begin += s;
  }
  return out;
}

Tensor zero_pad2d(const Tensor& x, int top, int bottom, int left, int right) {
  if (x.shape().rank() != 4)
    throw InvalidArgument("zero_pad2d expects NHWC input [N, H, W, C], got " + x.to_string());
  if (top < 0 || bottom < 0 || left < 0 || right < 0)
    throw InvalidArgument("zero_pad2d: padding must be >= 0");
  Tensor y = x;
  if (top || bottom) {
    std::vector<Tensor> parts;
    if (top) parts.push_back(zeros_along(y, 1, top));
    parts.push_back(y);
    if (bottom) parts.push_back(zeros_along(y, 1, bottom));
    y = concat(parts, 1);
  }
  if (left || right) {
    std::vector<Tensor> parts;
    if (left) parts.push_back(zeros_along(y, 2, left));
    parts.push_back(y);
    if (right) parts.push_back(zeros_along(y, 2, right));
    y = concat(parts, 2);
  }
  return y;
}

Tensor avg_pool2d(const Tensor& x, int wh, int ww, int sh, int sw, Padding padding) {
  if (x.shape().rank() != 4)
    throw InvalidArgument("avg_pool2d expects NHWC input [N, H, W, C], got " + x.to_string());
  if (wh < 1 || ww < 1 || sh < 1 || sw < 1)
    throw InvalidArgument("avg_pool2d: window and stride must be >= 1");
  const int64_t n = x.shape()[0], h = x.shape()[1], w = x.shape()[2], c = x.shape()[3];
  // The pooling as a convolution of one channel with a [wh, ww, 1, 1] filter of ones, every
  // channel of every image a batch entry of its own: wh * ww products an output, as pooling. (A
  // [wh, ww, C, C] diagonal filter on x, before, cost C times that and wh * ww * C^2 floats: 822 MB
  // and 2,048 times the work for AveragePooling2D(7) on 2,048 channels.)
  const Tensor filter = Tensor::full(Shape{wh, ww, 1, 1}, 1.f, x.device());
  const Tensor planes = c == 1 ? x : reshape(transpose(x, {0, 3, 1, 2}), Shape{n * c, h, w, 1});
  const Tensor sums = conv2d(planes, filter, Tensor(), sh, sw, padding);  // [N * C, OH, OW, 1]
  const int64_t oh = sums.shape()[1], ow = sums.shape()[2];
  const Tensor pooled = c == 1 ? sums : transpose(reshape(sums, Shape{n, c, oh, ow}), {0, 2, 3, 1});
  if (padding == Padding::kValid) return scale(pooled, 1.f / static_cast<float>(wh * ww));
  // kSame: divide by how many real elements each window covered (one plane's count map).
  Tensor ones = Tensor::empty(Shape{1, h, w, 1}, planes.dtype(), x.device());
  kernels_for(x).fill(ones, 1.f);
  return div(pooled, conv2d(ones, filter, Tensor(), sh, sw, padding));
}

}  // namespace dtrain::ops
