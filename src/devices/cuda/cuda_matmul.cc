// CudaKernels::matmul with cuBLAS SGEMM. cuBLAS is column-major; a row-major [r, c] matrix is the
// same memory as a column-major [c, r] one, i.e. its transpose. So row-major C = op(A) op(B) is
// computed as column-major C^T = op(B)^T op(A)^T: swap the operands, keep each one's op, and use
// each stored matrix's row length as its leading dimension.
#include <climits>

#include "devices/cuda/cuda_check.h"
#include "devices/cuda/cuda_guard.h"
#include "devices/cuda/cuda_kernels.h"
#include "dtrain/core/error.h"

namespace dtrain::cuda {

Tensor CudaKernels::matmul(const Tensor& a, const Tensor& b, bool transpose_a, bool transpose_b) {
  DeviceGuard guard(ctx_.index());
  require_float32_policy("matmul");
  check_f32(a, "matmul", "a");
  check_f32(b, "matmul", "b");
  if (a.rank() != 2 || b.rank() != 2)
    throw InvalidArgument("matmul: operands must be 2-D, got " + a.shape().to_string() + " and " +
                          b.shape().to_string());
  const int64_t m = transpose_a ? a.shape()[1] : a.shape()[0];
  const int64_t k = transpose_a ? a.shape()[0] : a.shape()[1];
  const int64_t kb = transpose_b ? b.shape()[1] : b.shape()[0];
  const int64_t n = transpose_b ? b.shape()[0] : b.shape()[1];
  if (k != kb)
    throw InvalidArgument(detail::str_cat(
        "matmul: inner dimensions differ: ", a.shape().to_string(), transpose_a ? "^T" : "", " @ ",
        b.shape().to_string(), transpose_b ? "^T" : "", " (", k, " vs ", kb, ")"));
  for (int64_t d : {m, n, k})
    if (d > INT_MAX)
      throw InvalidArgument(detail::str_cat("matmul: dimension ", d,
                                            " exceeds cuBLAS's 32-bit limit; split the matrix"));
  Tensor c = empty(Shape{m, n});
  if (m == 0 || n == 0) return c;
  if (k == 0) {  // an empty sum: C = 0
    DTRAIN_CUDA_CALL(cudaMemsetAsync(c.raw_data(), 0, c.nbytes(), ctx_.stream()));
    return c;
  }
  const float alpha = 1.f, beta = 0.f;
  const int lda = static_cast<int>(a.shape()[1]);  // stored row lengths
  const int ldb = static_cast<int>(b.shape()[1]);
  auto lock = ctx_.lock_cublas();
  DTRAIN_CUBLAS_CALL(cublasSgemm(ctx_.cublas(), transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                 transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
                                 static_cast<int>(m), static_cast<int>(k), &alpha,
                                 static_cast<const float*>(b.raw_data()), ldb,
                                 static_cast<const float*>(a.raw_data()), lda, &beta,
                                 static_cast<float*>(c.raw_data()), static_cast<int>(n)));
  return c;
}

}  // namespace dtrain::cuda
