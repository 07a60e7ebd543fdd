// Private to src/devices: the shape rule of Kernels::batch_matmul, shared by every device.
#pragma once

#include <cstdint>

#include "dtrain/core/error.h"
#include "dtrain/core/tensor.h"

namespace dtrain::detail {

struct BatchMatmulDims {
  int64_t batch, m, k, n;
};

// op(a) [B, M, K] @ op(b) [B, K, N]; throws InvalidArgument naming both shapes when they do not
// fit.
inline BatchMatmulDims batch_matmul_dims(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  if (a.rank() != 3 || b.rank() != 3 || a.shape()[0] != b.shape()[0])
    throw InvalidArgument("batch_matmul: operands must be [B, ., .] with equal B, got " +
                          a.shape().to_string() + " and " + b.shape().to_string());
  const int64_t m = ta ? a.shape()[2] : a.shape()[1], k = ta ? a.shape()[1] : a.shape()[2];
  const int64_t kb = tb ? b.shape()[2] : b.shape()[1], n = tb ? b.shape()[1] : b.shape()[2];
  if (k != kb)
    throw InvalidArgument("batch_matmul: inner dimensions differ: " + a.shape().to_string() +
                          (ta ? "^T" : "") + " @ " + b.shape().to_string() + (tb ? "^T" : ""));
  return {a.shape()[0], m, k, n};
}

}  // namespace dtrain::detail
