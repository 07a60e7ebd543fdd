#include "collectives/reduction.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace dtrain::collectives {
namespace {

// MAX and MIN give the same bits whatever the order of their operands, so that every rank of a
// recursive-doubling exchange (each reducing its own value with its partner's) ends with the same
// result: a NaN wins (as in tf.maximum, torch.maximum, np.maximum), as one quiet NaN; +0 is the
// larger zero. std::max(x, NaN) is x but std::max(NaN, x) is NaN, and std::max(-0, +0) is -0: the
// two ranks of a pair ended with different values.
template <typename T>
inline T max_of(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
    if (a == b) return std::signbit(a) ? b : a;
  }
  return a < b ? b : a;
}

template <typename T>
inline T min_of(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
    if (a == b) return std::signbit(a) ? a : b;
  }
  return b < a ? b : a;
}

template <typename T>
void pair_loop(T* __restrict d, const T* __restrict a, const T* __restrict b, size_t n,
               ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      for (size_t i = 0; i < n; ++i) d[i] = a[i] + b[i];
      break;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) d[i] = max_of(a[i], b[i]);
      break;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) d[i] = min_of(a[i], b[i]);
      break;
  }
}

template <typename T>
void into_loop(T* __restrict d, const T* __restrict s, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      for (size_t i = 0; i < n; ++i) d[i] += s[i];
      break;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) d[i] = max_of(d[i], s[i]);
      break;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) d[i] = min_of(d[i], s[i]);
      break;
  }
}

// 16-bit floats are widened to float, reduced, and rounded once.
void half_pair(uint16_t* d, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op,
               bool bf16) {
  constexpr size_t kChunk = 1024;
  float fa[kChunk], fb[kChunk];
  for (size_t base = 0; base < n; base += kChunk) {
    const size_t m = std::min(kChunk, n - base);
    if (bf16) {
      for (size_t i = 0; i < m; ++i) {
        fa[i] = bf16_to_float(a[base + i]);
        fb[i] = bf16_to_float(b[base + i]);
      }
    } else {
      f16_to_floats(a + base, fa, m);
      f16_to_floats(b + base, fb, m);
    }
    into_loop(fa, fb, m, op);
    if (bf16) {
      for (size_t i = 0; i < m; ++i) d[base + i] = float_to_bf16(fa[i]);
    } else {
      floats_to_f16(fa, d + base, m);
    }
  }
}

}  // namespace

void reduce_pair(void* dst, const void* a, const void* b, size_t n, DType t, ReduceOp op) {
  switch (t) {
    case DType::kFloat32:
      return pair_loop(static_cast<float*>(dst), static_cast<const float*>(a),
                       static_cast<const float*>(b), n, op);
    case DType::kFloat64:
      return pair_loop(static_cast<double*>(dst), static_cast<const double*>(a),
                       static_cast<const double*>(b), n, op);
    case DType::kInt32:
      return pair_loop(static_cast<int32_t*>(dst), static_cast<const int32_t*>(a),
                       static_cast<const int32_t*>(b), n, op);
    case DType::kInt64:
      return pair_loop(static_cast<int64_t*>(dst), static_cast<const int64_t*>(a),
                       static_cast<const int64_t*>(b), n, op);
    case DType::kFloat16:
      return half_pair(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
                       static_cast<const uint16_t*>(b), n, op, false);
    case DType::kBFloat16:
      return half_pair(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
                       static_cast<const uint16_t*>(b), n, op, true);
  }
}

void reduce_into(void* dst, const void* src, size_t n, DType t, ReduceOp op) {
  switch (t) {
    case DType::kFloat32:
      return into_loop(static_cast<float*>(dst), static_cast<const float*>(src), n, op);
    case DType::kFloat64:
      return into_loop(static_cast<double*>(dst), static_cast<const double*>(src), n, op);
    case DType::kInt32:
      return into_loop(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n, op);
    case DType::kInt64:
      return into_loop(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n, op);
    default:
      return reduce_pair(dst, dst, src, n, t, op);
  }
}

void scale_for_mean(void* dst, size_t n, DType t, int divisor) {
  switch (t) {
    case DType::kFloat32: {
      auto* d = static_cast<float*>(dst);  // divide (not multiply by 1/n): exact when representable
      const float s = static_cast<float>(divisor);
      for (size_t i = 0; i < n; ++i) d[i] /= s;
      break;
    }
    case DType::kFloat64: {
      auto* d = static_cast<double*>(dst);
      const double s = divisor;
      for (size_t i = 0; i < n; ++i) d[i] /= s;
      break;
    }
    case DType::kInt32: {
      auto* d = static_cast<int32_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] /= divisor;
      break;
    }
    case DType::kInt64: {
      auto* d = static_cast<int64_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] /= divisor;
      break;
    }
    case DType::kFloat16:
    case DType::kBFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      const bool bf = t == DType::kBFloat16;
      for (size_t i = 0; i < n; ++i) {
        const float v =
            (bf ? bf16_to_float(d[i]) : f16_to_float(d[i])) / static_cast<float>(divisor);
        d[i] = bf ? float_to_bf16(v) : float_to_f16(v);
      }
      break;
    }
  }
}

}  // namespace dtrain::collectives
