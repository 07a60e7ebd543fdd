// The geometry of Kernels::copy_slab, shared by the generic copy (one copy per row, through the
// allocators) and devices that do it in one strided copy (the CUDA device's cudaMemcpy2DAsync).
#pragma once

#include <cstddef>
#include <cstdint>

#include "dtrain/core/tensor.h"

namespace dtrain::detail {

// `rows` rows of `row_bytes` each, from `from` every `src_pitch` bytes to `to` every `dst_pitch`.
struct SlabCopy {
  int64_t rows = 0;
  size_t row_bytes = 0, src_pitch = 0, dst_pitch = 0;
  const char* from = nullptr;
  char* to = nullptr;
  bool empty() const { return rows == 0 || row_bytes == 0; }
};

// src's indices [src_begin, src_begin + count) along `axis` -> dst's [dst_begin, dst_begin +
// count).
inline SlabCopy slab_copy(const Tensor& src, int axis, int64_t src_begin, Tensor& dst,
                          int64_t dst_begin, int64_t count) {
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= src.shape()[i];
  for (int i = axis + 1; i < src.shape().rank(); ++i) inner *= src.shape()[i];
  const size_t elem = dtype_size(src.dtype());
  SlabCopy c;
  c.rows = outer;
  c.row_bytes = static_cast<size_t>(count * inner) * elem;
  c.src_pitch = static_cast<size_t>(src.shape()[axis] * inner) * elem;
  c.dst_pitch = static_cast<size_t>(dst.shape()[axis] * inner) * elem;
  c.from =
      static_cast<const char*>(src.raw_data()) + src_begin * inner * static_cast<int64_t>(elem);
  c.to = static_cast<char*>(dst.raw_data()) + dst_begin * inner * static_cast<int64_t>(elem);
  return c;
}

}  // namespace dtrain::detail
