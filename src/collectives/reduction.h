// Elementwise reductions used by every collective algorithm: dst = op(dst, src) over n elements
// of a dtype, vectorised by the compiler (restrict pointers, no aliasing).
#pragma once

#include <cstddef>

#include "dtrain/collectives/communicator.h"

namespace dtrain::collectives {

// dst[i] = op(dst[i], src[i]); MEAN accumulates as SUM (callers scale once at the end).
void reduce_into(void* dst, const void* src, size_t n, DType dtype, ReduceOp op);
// dst[i] = op(a[i], b[i]).
void reduce_pair(void* dst, const void* a, const void* b, size_t n, DType dtype, ReduceOp op);
// dst[i] /= divisor (for MEAN); integer types divide (truncating toward zero).
void scale_for_mean(void* dst, size_t n, DType dtype, int divisor);

}  // namespace dtrain::collectives
