// Sum / mean / max over arbitrary axes, and the column sum used for bias gradients, on top of the
// engine in cuda_reduce.cuh. The common layouts (reduce the trailing or the leading dimensions of
// a matrix) get direct loads; anything else decodes up to kMaxDims coordinates per element.
#include "devices/cuda/cuda_launch.h"
#include "devices/cuda/cuda_reduce.cuh"
#include "dtrain/core/error.h"

namespace dtrain::cuda {
namespace {

struct StridedLoad {
  const float* x;
  ReduceGeometry g;
  __device__ float operator()(int64_t r, int64_t c) const {
    int64_t off = 0;
    for (int i = g.kept_rank - 1; i >= 0; --i) {
      off += (c % g.kept_dims[i]) * g.kept_strides[i];
      c /= g.kept_dims[i];
    }
    for (int i = g.red_rank - 1; i >= 0; --i) {
      off += (r % g.red_dims[i]) * g.red_strides[i];
      r /= g.red_dims[i];
    }
    return x[off];
  }
};

template <typename Op, typename Finish>
void reduce_with(const float* x, const ReduceGeometry& g, const Finish& fin, CudaContext& ctx) {
  const int64_t rows = g.num_red, cols = g.num_out;
  if (g.red_rank == 1 && g.red_strides[0] == 1 &&
      (g.kept_rank == 0 || (g.kept_rank == 1 && g.kept_strides[0] == g.red_dims[0]))) {
    run_row_reduce<Op>(MatrixRowLoad{x, rows}, fin, rows, cols, ctx);  // [cols, rows]
  } else if (g.red_rank == 1 && g.kept_rank == 1 && g.kept_strides[0] == 1 &&
             g.red_strides[0] == g.kept_dims[0]) {
    run_column_reduce<Op>(MatrixColumnLoad{x, cols}, fin, rows, cols, ctx);  // [rows, cols]
  } else if (g.red_rank > 0 && g.red_strides[g.red_rank - 1] == 1) {
    run_row_reduce<Op>(StridedLoad{x, g}, fin, rows, cols, ctx);
  } else {
    run_column_reduce<Op>(StridedLoad{x, g}, fin, rows, cols, ctx);
  }
}

}  // namespace

void launch_reduce(ReductionKind kind, const float* x, float* out, const ReduceGeometry& g,
                   CudaContext& ctx) {
  if (g.num_out == 0) return;
  if (g.red_rank == 0) {
    // Only size-1 dimensions are reduced: the data is unchanged (a mean divides by 1).
    DTRAIN_CUDA_CALL(cudaMemcpyAsync(out, x, static_cast<size_t>(g.num_out) * sizeof(float),
                                     cudaMemcpyDeviceToDevice, ctx.stream()));
    return;
  }
  switch (kind) {
    case ReductionKind::kSum:
      return reduce_with<SumOp>(x, g, Store{out}, ctx);
    case ReductionKind::kMean:
      return reduce_with<SumOp>(x, g, StoreDivided{out, static_cast<float>(g.num_red)}, ctx);
    case ReductionKind::kMax:
      return reduce_with<MaxOp>(x, g, Store{out}, ctx);
  }
  throw InvalidArgument(detail::str_cat("reduce: unknown kind ", static_cast<int>(kind)));
}

void launch_column_sum(const float* x, float* out, int64_t rows, int64_t cols, CudaContext& ctx) {
  run_column_reduce<SumOp>(MatrixColumnLoad{x, cols}, Store{out}, rows, cols, ctx);
}

}  // namespace dtrain::cuda
