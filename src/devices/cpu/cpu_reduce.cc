// CpuKernels::reduce: sum, mean and max over any set of axes. Adjacent axes that are both reduced
// or both kept are merged first; a leading or middle axis ([A, R, B] -> [A, 1, B]) is summed in a
// row loop here, everything else (innermost axes) by oneDNN's reduction primitive.
#include <algorithm>
#include <limits>

#include "devices/cpu/dnnl_util.h"

namespace dtrain::cpu {
namespace {

struct Reduction {
  dnnl::reduction prim;
};

}  // namespace

Tensor CpuKernels::reduce(ReductionKind kind, const Tensor& x, const std::vector<int>& axes,
                          bool keepdims) {
  require_f32(x, "reduce", "x");
  const Shape& s = x.shape();
  std::vector<int64_t> kept = s.dims(), squeezed;
  std::vector<bool> reduced(static_cast<size_t>(s.rank()), false);
  for (int ax : axes) {
    if (ax < 0 || ax >= s.rank())
      throw InvalidArgument("reduce: axis " + std::to_string(ax) + " out of range for " +
                            s.to_string());
    reduced[static_cast<size_t>(ax)] = true;
    kept[static_cast<size_t>(ax)] = 1;
  }
  for (int i = 0; i < s.rank(); ++i)
    if (!reduced[static_cast<size_t>(i)]) squeezed.push_back(s.dims()[static_cast<size_t>(i)]);
  const Shape out_shape = keepdims ? Shape(kept) : Shape(squeezed);
  Tensor y = Tensor::empty(out_shape, DType::kFloat32, spec_);
  if (y.numel() == 0) return y;
  if (x.numel() == 0) {
    fill(y, kind == ReductionKind::kSum    ? 0.f
            : kind == ReductionKind::kMean ? std::numeric_limits<float>::quiet_NaN()
                                           : -std::numeric_limits<float>::infinity());
    return y;
  }
  if (Shape(kept) == s) {  // nothing to reduce (only size-1 axes)
    y.copy_from(x.view(out_shape));
    return y;
  }
  // Adjacent dimensions that are both reduced or both kept merge (size-1 ones drop): the same
  // reduction on fewer dimensions. oneDNN runs [4, 256, 768] -> [1, 1, 768] on its reference
  // implementation (8 ms, the bias gradients of GPT-2's Dense layers: 1.4 s a step) and the
  // merged [1024, 768] -> [1, 768] on a JIT kernel.
  memory::dims sd, dd;
  int last = -1;  // status of the previous merged dimension: 1 reduced, 0 kept
  for (int i = 0; i < s.rank(); ++i) {
    const int64_t d = s.dims()[static_cast<size_t>(i)];
    if (d == 1) continue;
    const int r = reduced[static_cast<size_t>(i)] ? 1 : 0;
    if (r == last) {
      sd.back() *= d;
      if (!r) dd.back() *= d;
    } else {
      sd.push_back(d);
      dd.push_back(r ? 1 : d);
      last = r;
    }
  }
  // A reduction over a middle (or the leading) dimension, [A, R, B] -> [A, 1, B] with B kept
  // innermost: oneDNN 2.x has JIT reductions for innermost dimensions only, and its reference
  // implementation took 8 ms for [1024, 768] -> [1, 768] (the bias gradients of GPT-2's Dense
  // layers: 1.2 s of a 9.5 s step). Rows are accumulated in order, vectorised along B.
  if (dd.back() == sd.back() && (sd.size() == 2 || sd.size() == 3)) {
    const int64_t A = sd.size() == 3 ? sd[0] : 1, R = sd[sd.size() - 2], B = sd.back();
    const float* px = x.data<float>();
    float* py = y.data<float>();
    const bool is_max = kind == ReductionKind::kMax;
    for (int64_t a = 0; a < A; ++a) {
      const float* xa = px + a * R * B;
      float* ya = py + a * B;
      std::copy(xa, xa + B, ya);
      for (int64_t r = 1; r < R; ++r) {
        const float* row = xa + r * B;
        if (is_max)
          for (int64_t b = 0; b < B; ++b) ya[b] = std::max(ya[b], row[b]);
        else
          for (int64_t b = 0; b < B; ++b) ya[b] += row[b];
      }
      if (kind == ReductionKind::kMean) {
        const float n = static_cast<float>(R);
        for (int64_t b = 0; b < B; ++b) ya[b] /= n;
      }
    }
    return y;
  }
  const algorithm alg = kind == ReductionKind::kSum    ? algorithm::reduction_sum
                        : kind == ReductionKind::kMean ? algorithm::reduction_mean
                                                       : algorithm::reduction_max;
  try {
    std::string key = "red" + std::to_string(static_cast<int>(kind)) + ":";
    key_dims(key, sd);
    key_dims(key, dd);
    auto e = state_->get<Reduction>(
        key,
        [&] {
          dnnl::reduction::primitive_desc pd({alg, plain_md(sd), plain_md(dd), 0.f, 0.f},
                                             state_->engine);
          return std::make_shared<Reduction>(Reduction{dnnl::reduction(pd)});
        },
        x.numel());
    e->prim.execute(state_->stream(x.numel()),
                    {{DNNL_ARG_SRC, mem(plain_md(sd), state_->engine, x)},
                     {DNNL_ARG_DST, mem(plain_md(dd), state_->engine, y)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("reduce", err);
  }
  return y;
}

}  // namespace dtrain::cpu
